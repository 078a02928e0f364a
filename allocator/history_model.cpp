// HistoryModel (history_model.h): events -> lifetimes and largest free block.
#include "history_model.h"

#include "allocator.h"

#include <algorithm>
#include <iterator>
#include <map>
#include <unordered_map>

namespace dtralloc {

// The allocator's own actions keep their codes and names (allocator.h).
static_assert(static_cast<int>(HistoryAction::kAlloc) == static_cast<int>(TraceAction::kAlloc) &&
                  static_cast<int>(HistoryAction::kFreeRequested) == static_cast<int>(TraceAction::kFreeRequested) &&
                  static_cast<int>(HistoryAction::kFreeCompleted) == static_cast<int>(TraceAction::kFreeCompleted) &&
                  static_cast<int>(HistoryAction::kSegmentAlloc) == static_cast<int>(TraceAction::kSegmentAlloc) &&
                  static_cast<int>(HistoryAction::kSegmentFree) == static_cast<int>(TraceAction::kSegmentFree) &&
                  static_cast<int>(HistoryAction::kOom) == static_cast<int>(TraceAction::kOom) &&
                  static_cast<int>(HistoryAction::kSegmentUnmap) == static_cast<int>(TraceAction::kSegmentUnmap),
              "history_model.h's action codes 0-5 and 7 are TraceAction's");

const char* history_action_name(int code) {
  if (code >= 0 && code <= static_cast<int>(HistoryAction::kOom))
    return trace_action_name(static_cast<TraceAction>(code));
  static const char* const torch_only[] = {"segment_map", "segment_unmap", "free", "snapshot", "other"};
  const int k = code - static_cast<int>(HistoryAction::kSegmentMap);
  return k >= 0 && k < static_cast<int>(sizeof torch_only / sizeof *torch_only) ? torch_only[k] : "other";
}

namespace {

// Free gaps inside segments, with the multiset of their sizes for the max.
class FreeSpace {
 public:
  std::int64_t largest() const { return sizes_.empty() ? 0 : sizes_.rbegin()->first; }

  void add_segment(std::uint64_t lo, std::uint64_t hi) {
    segments_[lo] = hi;
    release(lo, hi);
  }
  // Cuts [lo, hi) out of the segment that holds it, which becomes the parts
  // below and above; false when the range was not free or in no segment.
  bool unmap(std::uint64_t lo, std::uint64_t hi) {
    auto seg = segments_.upper_bound(lo);
    if (seg == segments_.begin()) return false;
    --seg;
    const std::uint64_t seg_lo = seg->first, seg_hi = seg->second;
    if (hi > seg_hi) return false;
    auto gap = gap_at(lo);
    const bool free = gap != gaps_.end() && hi <= gap->second;
    carve(lo, hi);
    segments_.erase(seg);
    if (seg_lo < lo) segments_[seg_lo] = lo;
    if (hi < seg_hi) segments_[hi] = seg_hi;
    return free;
  }
  // Forgets the segment at `lo`; false when blocks were still inside it.
  bool remove_segment(std::uint64_t lo) {
    auto seg = segments_.find(lo);
    if (seg == segments_.end()) return false;
    const std::uint64_t hi = seg->second;
    const bool whole = gap_is(lo, hi);
    carve(lo, hi);
    segments_.erase(seg);
    return whole;
  }
  // An allocated block takes [lo, hi); false when it was not inside one gap.
  bool occupy(std::uint64_t lo, std::uint64_t hi) {
    auto it = gap_at(lo);
    const bool inside = it != gaps_.end() && hi <= it->second;
    carve(lo, hi);
    return inside;
  }
  // A block's bytes become free again, merged with free neighbours of the
  // same segment; false when [lo, hi) is not inside a known segment.
  bool release(std::uint64_t lo, std::uint64_t hi) {
    auto seg = segments_.upper_bound(lo);
    if (seg == segments_.begin()) return false;
    --seg;
    if (hi > seg->second) return false;
    carve(lo, hi);  // a no-op when the history is consistent
    auto right = gaps_.lower_bound(lo);
    if (right != gaps_.begin()) {
      auto left = std::prev(right);
      if (left->second == lo && left->first >= seg->first) {
        lo = left->first;
        erase(left);
      }
    }
    if (right != gaps_.end() && right->first == hi && right->second <= seg->second) {
      hi = right->second;
      erase(right);
    }
    insert(lo, hi);
    return true;
  }

 private:
  using Gaps = std::map<std::uint64_t, std::uint64_t>;
  Gaps::iterator gap_at(std::uint64_t addr) {
    auto it = gaps_.upper_bound(addr);
    if (it == gaps_.begin()) return gaps_.end();
    --it;
    return addr < it->second ? it : gaps_.end();
  }
  bool gap_is(std::uint64_t lo, std::uint64_t hi) {
    auto it = gaps_.find(lo);
    return it != gaps_.end() && it->second == hi;
  }
  void insert(std::uint64_t lo, std::uint64_t hi) {
    if (hi <= lo) return;
    gaps_[lo] = hi;
    ++sizes_[static_cast<std::int64_t>(hi - lo)];
  }
  Gaps::iterator erase(Gaps::iterator it) {
    auto s = sizes_.find(static_cast<std::int64_t>(it->second - it->first));
    if (--s->second == 0) sizes_.erase(s);
    return gaps_.erase(it);
  }
  // Removes [lo, hi) from every gap it touches.
  void carve(std::uint64_t lo, std::uint64_t hi) {
    auto it = gaps_.upper_bound(lo);
    if (it != gaps_.begin()) --it;
    while (it != gaps_.end() && it->first < hi) {
      const std::uint64_t a = it->first, b = it->second;
      if (b <= lo) {
        ++it;
        continue;
      }
      it = erase(it);
      if (a < lo) insert(a, lo);  // the rest left of [lo, hi)
      if (b > hi) insert(hi, b);  // the rest right of it
    }
  }

  Gaps gaps_;
  std::map<std::uint64_t, std::uint64_t> segments_;
  std::map<std::int64_t, std::int64_t> sizes_;  // gap size -> count
};

}  // namespace

HistoryModel build_history_model(const HistoryInput& in) {
  HistoryModel m;
  FreeSpace space;
  std::unordered_map<std::uint64_t, std::size_t> open_blocks;    // addr -> lifetime
  std::map<std::uint64_t, std::size_t> open_segments;  // addr -> lifetime
  const auto n = static_cast<std::int64_t>(in.n);
  std::int64_t allocated = 0, pending = 0, reserved = 0;

  auto round_up = [&](std::int64_t bytes) {
    const std::int64_t r = std::max<std::int64_t>(in.round_bytes, 1);
    return std::max<std::int64_t>(r, (bytes + r - 1) / r * r);
  };
  auto open_segment = [&](std::int64_t start, std::uint64_t addr, std::int64_t size, std::uint64_t stream) {
    if (open_segments.count(addr)) ++m.anomalies;
    open_segments[addr] = m.segment_start.size();
    m.segment_start.push_back(start);
    m.segment_end.push_back(n);
    m.segment_addr.push_back(addr);
    m.segment_size.push_back(size);
    m.segment_stream.push_back(stream);
    space.add_segment(addr, addr + static_cast<std::uint64_t>(size));
    reserved += size;
  };
  auto open_block = [&](std::int64_t start, std::uint64_t addr, std::int64_t size, std::int64_t requested,
                        std::uint64_t stream) {
    auto old = open_blocks.find(addr);
    if (old != open_blocks.end()) {  // never freed: close it here
      ++m.anomalies;
      const std::size_t i = old->second;
      if (m.block_free_requested[i] == n) allocated -= m.block_size[i]; else pending -= m.block_size[i];
      m.block_free_requested[i] = std::min(m.block_free_requested[i], start);
      m.block_free_completed[i] = start;
      open_blocks.erase(old);
    }
    open_blocks[addr] = m.block_start.size();
    m.block_start.push_back(start);
    m.block_free_requested.push_back(n);
    m.block_free_completed.push_back(n);
    m.block_addr.push_back(addr);
    m.block_size.push_back(size);
    m.block_requested.push_back(requested);
    m.block_stream.push_back(stream);
    if (!space.occupy(addr, addr + static_cast<std::uint64_t>(size))) ++m.anomalies;
    allocated += size;
  };
  auto request_free = [&](std::int64_t at, std::uint64_t addr) -> bool {
    auto it = open_blocks.find(addr);
    if (it == open_blocks.end()) return false;
    const std::size_t i = it->second;
    if (m.block_free_requested[i] == n) {
      m.block_free_requested[i] = at;
      allocated -= m.block_size[i];
      pending += m.block_size[i];
    }
    return true;
  };
  auto complete_free = [&](std::int64_t at, std::uint64_t addr) -> bool {
    if (!request_free(at, addr)) return false;
    auto it = open_blocks.find(addr);
    const std::size_t i = it->second;
    m.block_free_completed[i] = at;
    pending -= m.block_size[i];
    if (!space.release(addr, addr + static_cast<std::uint64_t>(m.block_size[i]))) ++m.anomalies;
    open_blocks.erase(it);
    return true;
  };

  // An unmap of part of a segment (dtralloc's unmap_pages, or a range inside
  // one of torch's expandable segments): the segment's lifetime ends and
  // the parts below and above begin, their blocks untouched. Returns true
  // when the range is a whole segment (the caller frees it as such).
  auto unmap_part = [&](std::int64_t at, std::uint64_t addr, std::int64_t size) -> bool {
    auto it = open_segments.upper_bound(addr);
    if (it == open_segments.begin()) return true;
    --it;
    const std::size_t s = it->second;
    const std::uint64_t lo = m.segment_addr[s], hi = lo + static_cast<std::uint64_t>(m.segment_size[s]);
    const std::uint64_t stream = m.segment_stream[s];  // a copy: the pushes below may reallocate
    const std::uint64_t cut_hi = addr + static_cast<std::uint64_t>(size);
    if (size <= 0 || cut_hi > hi || (addr == lo && cut_hi == hi)) return true;
    if (!space.unmap(addr, cut_hi)) ++m.anomalies;
    m.segment_end[s] = at;
    open_segments.erase(it);
    reserved -= size;
    auto part = [&](std::uint64_t a, std::uint64_t b) {
      if (a >= b) return;
      open_segments[a] = m.segment_start.size();
      m.segment_start.push_back(at);
      m.segment_end.push_back(n);
      m.segment_addr.push_back(a);
      m.segment_size.push_back(static_cast<std::int64_t>(b - a));
      m.segment_stream.push_back(stream);
    };
    part(lo, addr);
    part(cut_hi, hi);
    return false;
  };

  for (std::size_t i = 0; i < in.initial_segment_addr.size(); ++i)
    open_segment(-1, in.initial_segment_addr[i], in.initial_segment_size[i], in.initial_segment_stream[i]);
  for (std::size_t i = 0; i < in.initial_block_addr.size(); ++i) {
    const std::uint64_t addr = in.initial_block_addr[i];
    open_block(-1, addr, in.initial_block_size[i], in.initial_block_requested[i], 0);
    if (in.initial_block_pending[i]) request_free(-1, addr);
  }
  m.initial_largest_free = space.largest();
  m.peak_allocated = allocated;
  m.peak_reserved = reserved;

  m.largest_free.resize(in.n);
  if (in.per_event_totals) {
    m.allocated.resize(in.n);
    m.pending.resize(in.n);
    m.reserved.resize(in.n);
  }
  for (std::int64_t e = 0; e < n; ++e) {
    const std::uint64_t addr = in.addr[e];
    const std::int64_t size = in.size[e];
    switch (static_cast<HistoryAction>(in.action[e])) {
      case HistoryAction::kAlloc: {
        const std::int64_t placed = in.block_size && in.block_size[e] > 0 ? in.block_size[e] : round_up(size);
        open_block(e, addr, placed, size, in.stream[e]);
        break;
      }
      case HistoryAction::kFreeRequested:
        if (!request_free(e, addr)) ++m.anomalies;
        break;
      case HistoryAction::kFree:
      case HistoryAction::kFreeCompleted:
        if (!complete_free(e, addr)) ++m.anomalies;
        break;
      case HistoryAction::kSegmentAlloc:
      case HistoryAction::kSegmentMap:
        open_segment(e, addr, size, in.stream[e]);
        break;
      case HistoryAction::kSegmentUnmap:
        if (!unmap_part(e, addr, size)) break;  // else the whole segment, as a free
        [[fallthrough]];
      case HistoryAction::kSegmentFree: {
        auto it = open_segments.find(addr);
        if (it == open_segments.end()) {
          ++m.anomalies;
          break;
        }
        m.segment_end[it->second] = e;
        reserved -= m.segment_size[it->second];
        if (!space.remove_segment(addr)) ++m.anomalies;
        open_segments.erase(it);
        break;
      }
      case HistoryAction::kOom:
      case HistoryAction::kSnapshot:
        break;
      default:
        ++m.anomalies;
    }
    m.largest_free[e] = space.largest();
    m.peak_allocated = std::max(m.peak_allocated, allocated);
    m.peak_reserved = std::max(m.peak_reserved, reserved);
    if (in.per_event_totals) {
      m.allocated[e] = allocated;
      m.pending[e] = pending;
      m.reserved[e] = reserved;
    }
  }
  return m;
}

}  // namespace dtralloc
