// Randomized differential test: the Allocator against a simple model of the
// pool, for at least a million operations per run.
//
//   test_pool_model [ignored]           fresh seed, 1,000,000 operations
//   DTRALLOC_STRESS_SEED=N              rerun the run that printed seed N
//   DTRALLOC_STRESS_OPS=M               M operations instead
//
// The model (class Model) restates the policy of block_pool.h and the malloc
// ladder of allocator.h in the plainest way: segments as vectors of blocks in
// address order, linear scans for the best fit, no free sets, no maps of
// blocks. After every operation the Allocator must have done exactly what
// the model predicts: the same address for a cache hit, a fresh segment of the
// predicted size (the backend chooses where) for a miss, the same OOMs, the
// same stats and counters; check_invariants() runs after every operation and
// the full block layout is compared every kCompareEvery operations and at the
// end of each epoch. A run is a sequence of epochs, each with a configuration
// drawn from the seed (budget, max_split_size_mb, max_non_split_rounding_mb,
// roundup_power2_divisions, garbage_collection_threshold, segment_fit), on
// the virtual backend (addresses only: the budget, not the device, binds).
//
// The seed is printed first, so a failure in CI can be replayed locally; the
// Python property test (tests/test_stress_property.py) shrinks failures that
// hypothesis finds to a minimal sequence.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "allocator.h"
#include "check.h"
#include "config.h"

namespace {

using namespace dtralloc;

constexpr std::size_t KiB = 1024, MiB = 1024 * KiB, GiB = 1024 * MiB;
constexpr std::size_t kNone = ~std::size_t{0};
constexpr std::size_t kCapacity = 64 * GiB;  // far above every budget below
constexpr int kCompareEvery = 16;             // full layout comparison period
constexpr int kEpochs = 8;
constexpr std::size_t kMaxHeld = 48;          // live blocks, so scans stay short

struct Cfg {
  std::size_t budget = 0;
  std::size_t max_split = kNone;
  std::size_t max_non_split = 20 * MiB;
  std::size_t divisions = 0;
  double gc = 0;
  bool segment_fit = false;

  std::string text() const {
    std::ostringstream out;
    out << "budget:" << budget / MiB << "M,max_split_size_mb:";
    if (max_split == kNone) out << "none"; else out << max_split / MiB;
    out << ",max_non_split_rounding_mb:";
    if (max_non_split == kNone) out << "none"; else out << max_non_split / MiB;
    out << ",roundup_power2_divisions:" << divisions << ",garbage_collection_threshold:" << gc
        << ",segment_fit:" << (segment_fit ? "on" : "off");
    return out.str();
  }
};

// ---- the model ---------------------------------------------------------------

class Model {
 public:
  enum State { kFree, kAllocated, kPending };
  struct Blk {
    std::uintptr_t addr;
    std::size_t size;
    State state;
    std::size_t requested;
    std::vector<Stream> uses;
    int events;
  };
  struct Seg {
    std::uintptr_t addr;
    std::size_t size;
    Stream stream;
    bool small;
    std::uint64_t tick;
    std::vector<Blk> blocks;
    bool whole_free() const { return blocks.size() == 1 && blocks[0].state == kFree; }
  };
  // What malloc is expected to do.
  struct Outcome {
    enum Kind { kNull, kHit, kNewSegment, kOom } kind = kNull;
    std::uintptr_t addr = 0;       // kHit: the block
    std::size_t segment_size = 0;  // kNewSegment
    Stream stream = 0;
    bool small = false;
  };

  explicit Model(const Cfg& cfg) : cfg_(cfg), budget_(cfg.budget) {}

  std::size_t round(std::size_t size) const {
    if (size < 512) return 512;
    if (cfg_.divisions > 1 && size > 512 * cfg_.divisions) {
      if ((size & (size - 1)) == 0) return size;
      std::size_t floor = 1;
      while (floor * 2 <= size) floor *= 2;
      const std::size_t step = floor / cfg_.divisions;
      const std::size_t down = size - size % step;
      return down == size ? size : down + step;
    }
    return (size + 511) / 512 * 512;
  }
  bool oversize(std::size_t n) const { return cfg_.max_split != kNone && n >= cfg_.max_split; }
  static bool small_pool(std::size_t rounded) { return rounded <= MiB; }
  std::size_t segment_size(std::size_t rounded) const {
    if (rounded <= MiB) return 2 * MiB;
    if (rounded < 10 * MiB) {
      if (!cfg_.segment_fit) return 20 * MiB;
      const std::size_t copies = 20 * MiB / rounded;
      return (copies * rounded + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
    }
    return (rounded + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
  }

  // Predicts malloc and applies it, except that a new segment's address is
  // the backend's choice: `place` (after the fact) puts it where the
  // allocator got it. Fallback steps that release segments are applied here.
  Outcome malloc(std::size_t size, Stream stream) {
    if (size == 0) return {Outcome::kNull};
    if (size > (std::size_t{1} << 62)) {
      ++ooms;
      return {Outcome::kOom};
    }
    const std::size_t rounded = round(size);
    Outcome out;
    if (take_cached(rounded, size, stream, out)) return out;
    if (cfg_.gc > 0) garbage_collect(segment_size(rounded));
    if (new_segment(rounded, stream, out)) return out;
    if (release_oversize(rounded, stream) && new_segment(rounded, stream, out)) return out;
    if (!events_.empty() || any_whole_free()) {
      ++retries;
      synchronize_events();
      release_all_cached();
      if (take_cached(rounded, size, stream, out)) return out;
      if (new_segment(rounded, stream, out)) return out;
    }
    ++ooms;
    return {Outcome::kOom};
  }

  // The allocator put the predicted new segment at `addr`.
  void place(const Outcome& o, std::uintptr_t addr, std::size_t requested) {
    CHECK(segment_at(addr) == segs_.end());
    Seg seg{addr, o.segment_size, o.stream, o.small, 0, {Blk{addr, o.segment_size, kFree, 0, {}, 0}}};
    auto it = segs_.emplace(addr, std::move(seg)).first;
    ++device_alloc;
    allocate_from(it->second, 0, round(requested), requested);
  }

  void free(std::uintptr_t addr) {
    auto [seg, i] = find(addr);
    Blk& b = seg->second.blocks[i];
    CHECK(b.state == kAllocated);
    if (b.uses.empty()) {
      return_to_pool(seg->second, i);
      return;
    }
    b.state = kPending;
    b.events = static_cast<int>(b.uses.size());
    for (std::size_t n = 0; n < b.uses.size(); ++n) events_.push_back(addr);
    b.uses.clear();
  }

  void record_stream(std::uintptr_t addr, Stream stream) {
    auto [seg, i] = find(addr);
    Blk& b = seg->second.blocks[i];
    if (stream == seg->second.stream) return;
    if (std::find(b.uses.begin(), b.uses.end(), stream) == b.uses.end()) b.uses.push_back(stream);
  }

  // complete_events(): every event completed; processed in order.
  void complete_events() { process_all_events(); }

  void empty_cache() {
    synchronize_events();
    release_all_cached();
  }

  void set_memory_fraction(double f) {
    budget_ = std::min(cfg_.budget, static_cast<std::size_t>(f * static_cast<double>(kCapacity)));
  }

  std::size_t reserved() const {
    std::size_t n = 0;
    for (const auto& [a, s] : segs_) n += s.size;
    return n;
  }
  std::size_t budget() const { return budget_; }

  // Everything the allocator's stats and snapshot must show.
  void check_against(Allocator& a, bool layout) const {
    const Stats st = a.stats_report().stats;
    std::int64_t allocated = 0, requested = 0, active = 0, allocations = 0, reserved_small = 0;
    for (const auto& [addr, s] : segs_) {
      if (s.small) reserved_small += static_cast<std::int64_t>(s.size);
      for (const Blk& b : s.blocks) {
        if (b.state == kAllocated) {
          allocated += static_cast<std::int64_t>(b.size);
          requested += static_cast<std::int64_t>(b.requested);
          ++allocations;
        }
        if (b.state != kFree) active += static_cast<std::int64_t>(b.size);
      }
    }
    CHECK_EQ(st.allocated_bytes[kStatAll].current, allocated);
    CHECK_EQ(st.requested_bytes[kStatAll].current, requested);
    CHECK_EQ(st.active_bytes[kStatAll].current, active);
    CHECK_EQ(st.allocation[kStatAll].current, allocations);
    CHECK_EQ(st.reserved_bytes[kStatAll].current, static_cast<std::int64_t>(reserved()));
    CHECK_EQ(st.reserved_bytes[kStatSmallPool].current, reserved_small);
    CHECK_EQ(st.segment[kStatAll].current, static_cast<std::int64_t>(segs_.size()));
    CHECK_EQ(st.num_alloc_retries, retries);
    CHECK_EQ(st.num_ooms, ooms);
    CHECK_EQ(st.num_device_alloc, device_alloc);
    CHECK_EQ(st.num_device_free, device_free);
    CHECK_EQ(st.num_sync_all_streams, sync_all);
    CHECK_EQ(st.num_invalid_frees, invalid_frees);
    CHECK_EQ(a.budget_bytes(), budget_);
    if (!layout) return;
    const Snapshot snap = a.snapshot();
    CHECK_EQ(snap.segments.size(), segs_.size());
    auto it = segs_.begin();
    for (const SegmentInfo& real : snap.segments) {
      const Seg& s = (it++)->second;
      CHECK_EQ(real.addr, s.addr);
      CHECK_EQ(real.total_size, s.size);
      CHECK_EQ(real.stream, s.stream);
      CHECK_EQ(real.small_pool, s.small);
      CHECK_EQ(real.blocks.size(), s.blocks.size());
      for (std::size_t i = 0; i < s.blocks.size(); ++i) {
        const BlockInfo& rb = real.blocks[i];
        const Blk& mb = s.blocks[i];
        CHECK_EQ(rb.addr, mb.addr);
        CHECK_EQ(rb.size, mb.size);
        const char* state = mb.state == kAllocated ? "active_allocated"
                            : mb.state == kPending ? "active_pending_free"
                                                   : "inactive";
        CHECK_EQ(std::string(rb.state), std::string(state));
        if (mb.state == kAllocated) CHECK_EQ(rb.requested_size, mb.requested);
      }
    }
  }

  bool is_allocated(std::uintptr_t addr) const {
    auto seg = segment_at(addr);
    if (seg == segs_.end()) return false;
    for (const Blk& b : seg->second.blocks)
      if (b.addr == addr) return b.state == kAllocated;
    return false;
  }

  std::int64_t retries = 0, ooms = 0, device_alloc = 0, device_free = 0, sync_all = 0, invalid_frees = 0;

 private:
  using SegIt = std::map<std::uintptr_t, Seg>::iterator;
  using ConstSegIt = std::map<std::uintptr_t, Seg>::const_iterator;

  ConstSegIt segment_at(std::uintptr_t addr) const {
    auto it = segs_.upper_bound(addr);
    if (it == segs_.begin()) return segs_.end();
    --it;
    return addr < it->first + it->second.size ? it : segs_.end();
  }
  std::pair<SegIt, std::size_t> find(std::uintptr_t addr) {
    auto it = segs_.upper_bound(addr);
    CHECK(it != segs_.begin());
    --it;
    for (std::size_t i = 0; i < it->second.blocks.size(); ++i)
      if (it->second.blocks[i].addr == addr) return {it, i};
    CHECK(!"no model block at that address");
    return {it, 0};
  }

  // Step 1: the smallest free block of the stream's pool that fits, lowest
  // address first, unless the oversize rules forbid it.
  bool take_cached(std::size_t rounded, std::size_t requested, Stream stream, Outcome& out) {
    Seg* best_seg = nullptr;
    std::size_t best_i = 0;
    for (auto& [addr, s] : segs_) {
      if (s.stream != stream || s.small != small_pool(rounded)) continue;
      for (std::size_t i = 0; i < s.blocks.size(); ++i) {
        const Blk& b = s.blocks[i];
        if (b.state != kFree || b.size < rounded) continue;
        if (best_seg == nullptr) {
          best_seg = &s;
          best_i = i;
          continue;
        }
        const Blk& best = best_seg->blocks[best_i];
        if (b.size < best.size || (b.size == best.size && b.addr < best.addr)) {
          best_seg = &s;
          best_i = i;
        }
      }
    }
    if (best_seg == nullptr) return false;
    const std::size_t found = best_seg->blocks[best_i].size;
    if (cfg_.max_split != kNone) {
      if (!oversize(rounded) && oversize(found)) return false;
      if (oversize(rounded) && found - rounded >= cfg_.max_non_split) return false;
    }
    out = {Outcome::kHit, best_seg->blocks[best_i].addr};
    allocate_from(*best_seg, best_i, rounded, requested);
    return true;
  }

  void allocate_from(Seg& s, std::size_t i, std::size_t rounded, std::size_t requested) {
    Blk& b = s.blocks[i];
    const std::size_t rest = b.size - rounded;
    const bool split = s.small ? rest >= 512 : (!oversize(rounded) && rest > MiB);
    b.state = kAllocated;
    b.requested = requested;
    if (split) {
      b.size = rounded;
      s.blocks.insert(s.blocks.begin() + static_cast<std::ptrdiff_t>(i) + 1,
                      Blk{b.addr + rounded, rest, kFree, 0, {}, 0});
    }
  }

  // Step 2 (without placing it: the backend picks the address).
  bool new_segment(std::size_t rounded, Stream stream, Outcome& out) {
    std::size_t bytes = segment_size(rounded);
    if (reserved() + bytes > budget_) {
      const std::size_t own = (rounded + 2 * MiB - 1) / (2 * MiB) * (2 * MiB);
      if (small_pool(rounded) || own >= bytes || reserved() + own > budget_) return false;
      bytes = own;
    }
    out = {Outcome::kNewSegment, 0, bytes, stream, small_pool(rounded)};
    return true;
  }

  void release(SegIt it) {
    CHECK(it->second.whole_free());
    segs_.erase(it);
    ++device_free;
  }
  bool any_whole_free() const {
    for (const auto& [a, s] : segs_)
      if (s.whole_free()) return true;
    return false;
  }
  void release_all_cached() {
    for (auto it = segs_.begin(); it != segs_.end();) {
      auto next = std::next(it);
      if (it->second.whole_free()) release(it);
      it = next;
    }
  }

  // Least recently freed whole-free segments go first, until the incoming
  // segment fits under threshold * budget.
  void garbage_collect(std::size_t incoming) {
    const auto limit = static_cast<std::size_t>(cfg_.gc * static_cast<double>(budget_));
    if (reserved() + incoming <= limit) return;
    std::vector<std::pair<std::uint64_t, std::uintptr_t>> order;
    for (const auto& [a, s] : segs_)
      if (s.whole_free()) order.push_back({s.tick, a});
    std::sort(order.begin(), order.end());
    for (const auto& [tick, addr] : order) {
      if (reserved() + incoming <= limit) break;
      release(segs_.find(addr));
    }
  }

  // Step 3: with a split limit, whole-free oversize segments of the stream:
  // the smallest that fits, else the largest ones until enough is released.
  bool release_oversize(std::size_t rounded, Stream stream) {
    if (cfg_.max_split == kNone) return false;
    std::vector<std::pair<std::size_t, std::uintptr_t>> over;
    for (const auto& [a, s] : segs_)
      if (s.whole_free() && s.stream == stream && s.size >= cfg_.max_split) over.push_back({s.size, a});
    if (over.empty()) return false;
    std::sort(over.begin(), over.end());
    for (const auto& [size, addr] : over) {
      if (size >= rounded) {
        release(segs_.find(addr));
        return true;
      }
    }
    std::size_t released = 0;
    while (!over.empty() && released < rounded) {
      released += over.back().first;
      release(segs_.find(over.back().second));
      over.pop_back();
    }
    return true;
  }

  void return_to_pool(Seg& s, std::size_t i) {
    Blk& b = s.blocks[i];
    b.state = kFree;
    b.requested = 0;
    b.uses.clear();
    b.events = 0;
    if (i + 1 < s.blocks.size() && s.blocks[i + 1].state == kFree) {
      b.size += s.blocks[i + 1].size;
      s.blocks.erase(s.blocks.begin() + static_cast<std::ptrdiff_t>(i) + 1);
    }
    if (i > 0 && s.blocks[i - 1].state == kFree) {
      s.blocks[i - 1].size += s.blocks[i].size;
      s.blocks.erase(s.blocks.begin() + static_cast<std::ptrdiff_t>(i));
    }
    s.tick = ++tick_;
  }

  void process_all_events() {
    for (std::uintptr_t addr : events_) {
      auto [seg, i] = find(addr);
      Blk& b = seg->second.blocks[i];
      CHECK(b.state == kPending && b.events > 0);
      if (--b.events == 0) return_to_pool(seg->second, i);
    }
    events_.clear();
  }
  void synchronize_events() {
    if (events_.empty()) return;
    ++sync_all;
    process_all_events();
  }

  const Cfg cfg_;
  std::size_t budget_;
  std::map<std::uintptr_t, Seg> segs_;
  std::vector<std::uintptr_t> events_;  // one per pending event, in record order
  std::uint64_t tick_ = 0;
};

// ---- the driver ----------------------------------------------------------------

Cfg draw_config(std::mt19937_64& rng) {
  auto pick = [&](std::initializer_list<std::size_t> options) {
    std::vector<std::size_t> v(options);
    return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
  };
  Cfg c;
  c.budget = pick({48, 96, 160, 320}) * MiB;
  c.max_split = pick({kNone, kNone, 24 * MiB, 40 * MiB, 64 * MiB});
  c.max_non_split = pick({20 * MiB, 20 * MiB, 0, 2 * MiB, kNone});
  c.divisions = pick({0, 0, 1, 2, 4, 8});
  c.gc = static_cast<double>(pick({0, 0, 5, 8})) / 10.0;
  c.segment_fit = pick({0, 1}) == 1;
  return c;
}

std::size_t draw_size(std::mt19937_64& rng) {
  static const std::size_t kBoundaries[] = {1, 511, 512, 513, MiB - 1, MiB, MiB + 1, 10 * MiB - 512,
                                            10 * MiB, 10 * MiB + 1, 20 * MiB, 21 * MiB, 40 * MiB};
  const int r = std::uniform_int_distribution<int>(0, 99)(rng);
  if (r < 5) return kBoundaries[std::uniform_int_distribution<std::size_t>(0, std::size(kBoundaries) - 1)(rng)];
  if (r < 60) return std::uniform_int_distribution<std::size_t>(1, 64 * KiB)(rng);
  if (r < 80) return std::uniform_int_distribution<std::size_t>(64 * KiB, MiB)(rng);
  if (r < 95) return std::uniform_int_distribution<std::size_t>(MiB, 12 * MiB)(rng);
  return std::uniform_int_distribution<std::size_t>(12 * MiB, 48 * MiB)(rng);
}

struct Held {
  std::uintptr_t addr;
  Stream stream;
};

long run_epoch(std::mt19937_64& rng, long ops) {
  const Cfg cfg = draw_config(rng);
  std::printf("  epoch: %ld ops, DTRALLOC_CONF=%s\n", ops, cfg.text().c_str());
  std::fflush(stdout);
  Allocator a(make_virtual_backend(kCapacity), parse_config(cfg.text()));
  Model m(cfg);
  std::vector<Held> held;
  long ooms = 0;
  for (long op = 0; op < ops; ++op) {
    const int what = std::uniform_int_distribution<int>(0, 999)(rng);
    if (what < 480 && held.size() < kMaxHeld) {
      const std::size_t size = what < 2 ? (std::size_t{1} << 62) + 1 : draw_size(rng);
      const Stream stream = static_cast<Stream>(what % 4);
      const Model::Outcome expected = m.malloc(size, stream);
      void* p = nullptr;
      bool oom = false;
      try {
        p = a.malloc(size, stream);
      } catch (const OutOfMemoryError&) {
        oom = true;
      }
      CHECK_EQ(oom, expected.kind == Model::Outcome::kOom);
      ooms += oom;
      const auto addr = reinterpret_cast<std::uintptr_t>(p);
      switch (expected.kind) {
        case Model::Outcome::kNull:
        case Model::Outcome::kOom:
          CHECK(p == nullptr);
          break;
        case Model::Outcome::kHit:
          CHECK_EQ(addr, expected.addr);
          break;
        case Model::Outcome::kNewSegment: {
          std::size_t segment = 0;
          CHECK_EQ(reinterpret_cast<std::uintptr_t>(a.base_allocation(p, &segment)), addr);
          CHECK_EQ(segment, expected.segment_size);
          m.place(expected, addr, size);
          break;
        }
      }
      if (p != nullptr) held.push_back({addr, stream});
    } else if (what < 840 && !held.empty()) {
      const std::size_t i = std::uniform_int_distribution<std::size_t>(0, held.size() - 1)(rng);
      m.free(held[i].addr);
      a.free(reinterpret_cast<void*>(held[i].addr));
      held[i] = held.back();
      held.pop_back();
    } else if (what < 920 && !held.empty()) {
      const std::size_t i = std::uniform_int_distribution<std::size_t>(0, held.size() - 1)(rng);
      const Stream s = static_cast<Stream>(what % 6);
      m.record_stream(held[i].addr, s);
      a.record_stream(reinterpret_cast<void*>(held[i].addr), s);
    } else if (what < 960) {
      m.complete_events();
      a.complete_events();
    } else if (what < 975) {
      m.empty_cache();
      a.empty_cache();
    } else if (what < 985) {
      const double f = what % 2 ? 1.0 : 0.002;  // 0.002 of 64 GiB: 131 MiB
      m.set_memory_fraction(f);
      a.set_memory_fraction(f);
    } else {
      // Frees of what is not an allocated block change nothing but a counter.
      const std::uintptr_t bad = held.empty() ? 0x7 : held.front().addr + 256;
      if (!m.is_allocated(bad)) {
        ++m.invalid_frees;
        CHECK_THROWS(InvalidPointerError, a.free(reinterpret_cast<void*>(bad)));
      }
    }
    a.check_invariants();
    m.check_against(a, op % kCompareEvery == 0);
  }
  for (const Held& h : held) {
    m.free(h.addr);
    a.free(reinterpret_cast<void*>(h.addr));
  }
  m.empty_cache();
  a.empty_cache();
  a.check_invariants();
  m.check_against(a, true);
  CHECK_EQ(a.stats_report().stats.reserved_bytes[kStatAll].current, 0);
  return ooms;
}

std::uint64_t env_number(const char* name, std::uint64_t fallback) {
  const char* text = std::getenv(name);
  return text && *text ? std::strtoull(text, nullptr, 10) : fallback;
}

}  // namespace

int main() {
  const std::uint64_t seed = env_number("DTRALLOC_STRESS_SEED", std::random_device{}() ^
      static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  const auto ops = static_cast<long>(env_number("DTRALLOC_STRESS_OPS", 1000000));
  std::printf("test_pool_model: seed %llu, %ld operations (rerun: DTRALLOC_STRESS_SEED=%llu)\n",
              static_cast<unsigned long long>(seed), ops, static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  std::mt19937_64 rng(seed);
  const auto start = std::chrono::steady_clock::now();
  long ooms = 0;
  for (int e = 0; e < kEpochs; ++e) ooms += run_epoch(rng, ops / kEpochs + (e < ops % kEpochs ? 1 : 0));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("test_pool_model: %ld operations (%ld OOMs) matched the model in %.1f s\n", ops, ooms, seconds);
  CHECK(ooms > 0);  // the budgets are tight enough to reach the fallback ladder
  return check_summary("test_pool_model");
}
