// BlockPool: best fit, split, coalesce and the invariant walk (block_pool.h).
#include "block_pool.h"

#include <stdexcept>
#include <string>

namespace dtralloc {
namespace {

int stat_index(PoolKind pool) { return pool == kSmallPool ? kStatSmallPool : kStatLargePool; }

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

std::size_t power_of_two_floor(std::size_t v) {
  std::size_t p = 1;
  while (p <= v / 2) p <<= 1;
  return p;
}

// Rounds up to the next of `divisions` equal steps between the powers of two
// around `size` (torch's roundup_power2_divisions): fewer distinct sizes, so
// freed blocks are reused more often, at the price of some padding.
std::size_t round_to_division(std::size_t size, std::size_t divisions) {
  if (is_power_of_two(size)) return size;
  std::size_t floor = power_of_two_floor(size);
  std::size_t step = floor / divisions;
  if (step == 0) return floor << 1;
  std::size_t down = size & ~(step - 1);
  return down == size ? size : down + step;
}

[[noreturn]] void broken(const std::string& what) {
  throw std::logic_error("dtralloc invariant violated: " + what);
}

}  // namespace

BlockPool::~BlockPool() {
  for (auto& [addr, seg] : segments_) {
    Block* b = seg->head;
    while (b) {
      Block* next = b->next;
      delete b;
      b = next;
    }
    delete seg;
  }
  for (Block* b : spare_blocks_) delete b;
}

Block* BlockPool::new_block() {
  if (spare_blocks_.empty()) return new Block;
  Block* b = spare_blocks_.back();
  spare_blocks_.pop_back();
  return b;
}

void BlockPool::delete_block(Block* b) {
  // Bounded so a burst of splits does not pin memory forever.
  if (spare_blocks_.size() >= 4096) {
    delete b;
    return;
  }
  // Field by field rather than `*b = Block{}`: keeps stream_uses' capacity
  // and costs a few stores on the hot path (every split/merge recycles one).
  b->addr = 0;
  b->size = 0;
  b->requested_size = 0;
  b->stream = 0;
  b->segment = nullptr;
  b->prev = b->next = nullptr;
  b->allocated = b->in_free_set = b->counted_inactive_split = false;
  b->event_count = 0;
  b->stream_uses.clear();
  spare_blocks_.push_back(b);
}

std::size_t BlockPool::round_size(std::size_t size, const Config& config) {
  if (size < kMinBlockSize) return kMinBlockSize;
  std::size_t divisions = config.roundup_power2_divisions;
  if (divisions > 1 && size > kMinBlockSize * divisions)
    return round_to_division(size, divisions);
  return kMinBlockSize * ((size + kMinBlockSize - 1) / kMinBlockSize);
}

std::size_t BlockPool::segment_size(std::size_t rounded) const {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) {
    // The Allocator resolves auto; a pool built on a raw Config takes it as off.
    if (config_.segment_fit != Switch::kOn) return kLargeBuffer;
    // As many copies as fit in 20 MiB (at least two: rounded < 10 MiB), the
    // segment 2 MiB-rounded; never more than 20 MiB.
    const std::size_t copies = kLargeBuffer / rounded;
    return own_segment_size(copies * rounded);
  }
  return own_segment_size(rounded);
}

Block* BlockPool::find_free(PoolKind pool, Stream stream, std::size_t rounded) const {
  Block* b = find_free_any(pool, stream, rounded);
  return b && may_serve(b, rounded) ? b : nullptr;
}

FreeSet::const_iterator BlockPool::first_fit(PoolKind pool, Stream stream, std::size_t rounded) const {
  Block key;
  key.stream = stream;
  key.size = rounded;
  key.addr = 0;
  return free_[pool].lower_bound(&key);
}

Block* BlockPool::find_free_any(PoolKind pool, Stream stream, std::size_t rounded) const {
  auto it = first_fit(pool, stream, rounded);
  return it == free_[pool].end() || (*it)->stream != stream ? nullptr : *it;
}

Block* BlockPool::find_free_highest(PoolKind pool, Stream stream, std::size_t rounded) const {
  Block* top = nullptr;
  for (auto it = first_fit(pool, stream, rounded); it != free_[pool].end() && (*it)->stream == stream; ++it)
    if (may_serve(*it, rounded) && (!top || (*it)->addr > top->addr)) top = *it;
  return top;
}

bool BlockPool::may_serve(const Block* b, std::size_t rounded) const {
  if (config_.max_split_size_mb == kNoLimit) return true;
  // A small request must not consume an oversize block: it could never be
  // split back, and the big request it was cached for would miss.
  if (!oversize(rounded)) return !oversize(b->size);
  // An oversize request takes an unsplittable block only if little is wasted.
  // (b->size >= rounded here; subtracting avoids overflow when the rounding
  // limit is "none".)
  return b->size - rounded < config_.max_non_split_rounding_mb;
}

Block* BlockPool::find_free_sparing(PoolKind pool, Stream stream, std::size_t rounded,
                                    const std::function<bool(const Block*)>& avoid, int limit) const {
  Block* first = find_free(pool, stream, rounded);
  if (!first || !avoid(first)) return first;
  auto it = free_[pool].find(first);
  for (int k = 0; k < limit && ++it != free_[pool].end(); ++k) {
    Block* b = *it;
    // may_serve only tightens as blocks grow: past its limit, no block will do.
    if (b->stream != stream || !may_serve(b, rounded)) break;
    if (!avoid(b)) return b;
  }
  return first;
}

// Note [large tails]
// ~~~~~~~~~~~~~~~~~~
// torch splits a large-pool block only where more than 1 MiB would be left:
// a smaller rest could serve no large request, and small requests never
// take large blocks, so it stays inside the allocated block. Under
// small_in_large:on small requests do take large blocks, and such a rest is
// room for them: a 1.2 MB tensor given its own 2 MiB segment at the budget's
// edge held 0.86 MiB that nothing could use. So there every rest of 512 B
// or more is split off. Over the 48 recorded steps (3 recordings of 16
// models) the lowest budget dtralloc runs at fell on 10 and rose on 3 (by
// at most 0.03 of the peak: small values sat in tails and a request of a
// few MiB at the step's end found the free bytes in pieces); the summed
// excess over the floor, relative to dtr's, went 0.20 -> 0.17, and 0.26 ->
// 0.23 under a GPU's settings
// (bench/results/replay_recordings-2026-11-28-large-tails-cpu.md).
bool BlockPool::should_split(const Block* block, std::size_t rounded) const {
  std::size_t rest = block->size - rounded;
  if (block->segment->pool == kSmallPool) return rest >= kMinBlockSize;
  if (oversize(rounded)) return false;
  return rest > kSmallSize || (config_.small_in_large == Switch::kOn && rest >= kMinBlockSize);
}

Block* BlockPool::allocate_from(Block* block, std::size_t rounded, std::size_t requested, bool high, bool split) {
  // The rest of a split sorts just before the block's old successor (same
  // stream, smaller size) unless other sizes lie between: a good hint makes
  // its insertion O(1) instead of a tree descent.
  FreeSet::iterator hint = erase_free(block);
  if ((split && block->size > rounded) || should_split(block, rounded)) {
    Block* rest = new_block();
    rest->size = block->size - rounded;
    rest->stream = block->stream;
    rest->segment = block->segment;
    if (high) {  // the request takes the top, the rest stays below it
      ++stats_.num_long_lived;
      rest->addr = block->addr;
      rest->prev = block->prev;
      rest->next = block;
      if (rest->prev)
        rest->prev->next = rest;
      else
        block->segment->head = rest;
      block->prev = rest;
      block->addr += rest->size;
    } else {
      rest->addr = block->addr + rounded;
      rest->prev = block;
      rest->next = block->next;
      if (rest->next) rest->next->prev = rest;
      block->next = rest;
    }
    block->size = rounded;
    insert_free(rest, hint);
  }
  block->allocated = true;
  block->requested_size = requested;
  allocated_.insert(block->addr, block);

  int pool = stat_index(block->segment->pool);
  auto n = static_cast<std::int64_t>(block->size);
  stat_increase(stats_.allocation, pool, 1);
  stat_increase(stats_.allocated_bytes, pool, n);
  stat_increase(stats_.active, pool, 1);
  stat_increase(stats_.active_bytes, pool, n);
  stat_increase(stats_.requested_bytes, pool, static_cast<std::int64_t>(requested));
  if (oversize(block->size)) stats_.oversize_allocations.increase(1);
  return block;
}

Block* BlockPool::add_segment(std::uintptr_t addr, std::size_t size, Stream stream,
                              PoolKind pool) {
  auto* seg = new Segment;
  seg->addr = addr;
  seg->size = size;
  seg->stream = stream;
  seg->pool = pool;
  Block* b = new_block();
  b->addr = addr;
  b->size = size;
  b->stream = stream;
  b->segment = seg;
  seg->head = b;
  segments_.emplace(addr, seg);

  int idx = stat_index(pool);
  stat_increase(stats_.segment, idx, 1);
  stat_increase(stats_.reserved_bytes, idx, static_cast<std::int64_t>(size));
  if (oversize(size)) stats_.oversize_segments.increase(1);
  insert_free(b);
  return b;
}

void BlockPool::remove_segment(Segment* seg) {
  if (!seg->whole_free()) broken("remove_segment on a segment that is not entirely free");
  erase_free(seg->head);
  int idx = stat_index(seg->pool);
  stat_decrease(stats_.segment, idx, 1);
  stat_decrease(stats_.reserved_bytes, idx, static_cast<std::int64_t>(seg->size));
  if (oversize(seg->size)) stats_.oversize_segments.decrease(1);
  segments_.erase(seg->addr);
  delete_block(seg->head);
  delete seg;
}

BlockPool::Range BlockPool::free_pages(const Block* b, std::size_t page) {
  const std::uintptr_t base = b->segment->addr;
  const std::uintptr_t lo = base + (b->addr - base + page - 1) / page * page;
  const std::uintptr_t hi = base + (b->addr + b->size - base) / page * page;
  return hi > lo ? Range{lo, hi - lo} : Range{};
}

BlockPool::Range BlockPool::cut_free_pages(Block* b, std::size_t page) {
  const Range cut = free_pages(b, page);
  if (!cut.size || !b->in_free_set) return {};
  Segment* seg = b->segment;
  const std::uintptr_t lo = cut.addr, hi = cut.addr + cut.size;
  const std::uintptr_t seg_end = seg->addr + seg->size, end = b->addr + b->size;
  const bool below = lo > seg->addr, above = hi < seg_end;
  const int idx = stat_index(seg->pool);
  if (oversize(seg->size)) stats_.oversize_segments.decrease(1);
  stat_decrease(stats_.reserved_bytes, idx, static_cast<std::int64_t>(cut.size));
  erase_free(b);
  Block* prev = b->prev;
  Block* next = b->next;
  // What is left of b below the cut (it shares a page with prev) and above
  // it (a page with next); b itself serves as the first of them.
  Block* head = nullptr;
  Block* tail = nullptr;
  if (lo > b->addr) {
    head = b;
    head->size = lo - b->addr;
  }
  if (hi < end) {
    tail = head ? new_block() : b;
    tail->addr = hi;
    tail->size = end - hi;
    tail->stream = seg->stream;
  }
  if (!head && !tail) delete_block(b);
  if (head) head->next = nullptr;
  else if (prev) prev->next = nullptr;
  if (tail) {
    tail->prev = nullptr;
    tail->next = next;
    if (next) next->prev = tail;
  } else if (next) {
    next->prev = nullptr;
  }
  Block* first_above = tail ? tail : next;
  if (below) {
    seg->size = lo - seg->addr;  // seg keeps its head: it starts below lo
    if (oversize(seg->size)) stats_.oversize_segments.increase(1);
  }
  if (above) {
    auto* upper = new Segment;
    upper->addr = hi;
    upper->size = seg_end - hi;
    upper->stream = seg->stream;
    upper->pool = seg->pool;
    upper->head = first_above;
    upper->last_free_tick = seg->last_free_tick;
    for (Block* x = first_above; x; x = x->next) x->segment = upper;
    segments_.emplace(hi, upper);
    if (oversize(upper->size)) stats_.oversize_segments.increase(1);
  }
  if (below && above) stat_increase(stats_.segment, idx, 1);
  if (!below) {
    segments_.erase(seg->addr);
    delete seg;
    if (!above) stat_decrease(stats_.segment, idx, 1);
  }
  if (head) insert_free(head);
  if (tail) insert_free(tail);
  return cut;
}

void BlockPool::mark_freed(Block* block) {
  allocated_.erase(block->addr);
  block->allocated = false;
  int pool = stat_index(block->segment->pool);
  stat_decrease(stats_.allocation, pool, 1);
  stat_decrease(stats_.allocated_bytes, pool, static_cast<std::int64_t>(block->size));
  stat_decrease(stats_.requested_bytes, pool, static_cast<std::int64_t>(block->requested_size));
  if (oversize(block->size)) stats_.oversize_allocations.decrease(1);
  // requested_size stays while the block is pending (the history's
  // free_completed entry reports it); return_to_pool clears it.
}

Block* BlockPool::return_to_pool(Block* block, std::uint64_t tick) {
  int pool = stat_index(block->segment->pool);
  stat_decrease(stats_.active, pool, 1);
  stat_decrease(stats_.active_bytes, pool, static_cast<std::int64_t>(block->size));
  block->stream_uses.clear();
  block->requested_size = 0;

  // Coalesce with free neighbours (pending ones are not free yet: I2 allows
  // them next to a free block until their events complete). The merged
  // block usually sorts right before the last erased neighbour's successor
  // (it is larger than that neighbour): a hint that is right in the common
  // case and costs two comparisons when it is not.
  FreeSet::iterator hint = free_[block->segment->pool].end();
  if (block->prev && block->prev->in_free_set) {
    Block* p = block->prev;
    hint = erase_free(p);
    p->size += block->size;
    p->next = block->next;
    if (p->next) p->next->prev = p;
    delete_block(block);
    block = p;
  }
  if (block->next && block->next->in_free_set) {
    Block* n = block->next;
    hint = erase_free(n);
    block->size += n->size;
    block->next = n->next;
    if (block->next) block->next->prev = block;
    delete_block(n);
  }
  block->segment->last_free_tick = tick;
  insert_free(block, hint);
  return block;
}

void BlockPool::insert_free(Block* block) {
  insert_free(block, free_[block->segment->pool].end());
}

void BlockPool::insert_free(Block* block, FreeSet::iterator hint) {
  int pool = stat_index(block->segment->pool);
  block->free_it = free_[block->segment->pool].insert(hint, block);
  block->in_free_set = true;
  block->counted_inactive_split = block->is_split();
  if (block->counted_inactive_split) {
    stat_increase(stats_.inactive_split, pool, 1);
    stat_increase(stats_.inactive_split_bytes, pool, static_cast<std::int64_t>(block->size));
  }
}

FreeSet::iterator BlockPool::erase_free(Block* block) {
  int pool = stat_index(block->segment->pool);
  auto next = free_[block->segment->pool].erase(block->free_it);
  block->in_free_set = false;
  if (block->counted_inactive_split) {
    stat_decrease(stats_.inactive_split, pool, 1);
    stat_decrease(stats_.inactive_split_bytes, pool, static_cast<std::int64_t>(block->size));
    block->counted_inactive_split = false;
  }
  return next;
}

std::vector<Segment*> BlockPool::whole_free_segments() const {
  std::vector<Segment*> out;
  for (auto& [addr, seg] : segments_)
    if (seg->whole_free()) out.push_back(seg);
  return out;
}

Segment* BlockPool::segment_at(std::uintptr_t addr) const {
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) return nullptr;
  --it;
  Segment* seg = it->second;
  return addr < seg->addr + seg->size ? seg : nullptr;
}

// The free sets are ordered (stream, size, address): each stream's largest
// block is the last of its run. From the end, take it and jump below the
// run's start: O(streams x log blocks), not a walk of every free block (a
// live session samples this after every op).
std::size_t BlockPool::largest_free_block() const {
  std::size_t best = 0;
  for (const auto& set : free_) {
    auto it = set.end();
    while (it != set.begin()) {
      --it;
      best = std::max(best, (*it)->size);
      Block first_of_stream;
      first_of_stream.stream = (*it)->stream;  // size 0, address 0: before every block of the stream
      it = set.lower_bound(&first_of_stream);
    }
  }
  return best;
}

// Every block of a segment is allocated, pending (both counted as active) or
// in a free set (I1, I3), so the free bytes are what the segments hold beyond
// the active ones; I5 checks both counters against a walk.
std::size_t BlockPool::free_bytes() const {
  return static_cast<std::size_t>(stats_.reserved_bytes[kStatAll].current - stats_.active_bytes[kStatAll].current);
}

void BlockPool::recount_oversize() {
  std::int64_t allocations = 0, segments = 0;
  for (const auto& entry : segments_) {
    const Segment* seg = entry.second;
    segments += oversize(seg->size);
    for (const Block* b = seg->head; b; b = b->next) allocations += b->allocated && oversize(b->size);
  }
  auto set = [](Stat& stat, std::int64_t now) {
    if (now > stat.current) stat.increase(now - stat.current);
    if (now < stat.current) stat.decrease(stat.current - now);
  };
  set(stats_.oversize_allocations, allocations);
  set(stats_.oversize_segments, segments);
}

void BlockPool::check_invariants() const {
  // What a full walk counts, per stat index, to compare with stats_ (I5).
  struct Count {
    std::int64_t allocation = 0, allocated_bytes = 0, active = 0, active_bytes = 0;
    std::int64_t inactive_split = 0, inactive_split_bytes = 0, segment = 0;
    std::int64_t reserved_bytes = 0, requested_bytes = 0;
  } count[kNumStatIndices];
  std::size_t in_free_sets = 0, allocated_blocks = 0;
  std::int64_t oversize_allocations = 0, oversize_segments = 0;

  for (const auto& [addr, seg] : segments_) {
    if (addr != seg->addr) broken("I1: segment map key differs from its address");
    if (!seg->head || seg->head->prev) broken("I1: segment head is missing or has a prev");
    std::uintptr_t expect = seg->addr;
    const Block* last = nullptr;
    for (const Block* b = seg->head; b; b = b->next) {
      if (b->addr != expect) broken("I1: gap or overlap inside a segment");
      if (b->size == 0) broken("I1: empty block");
      if (b->segment != seg || b->stream != seg->stream) broken("I1: block points at the wrong segment");
      if (b->prev != last) broken("I1: prev link does not match");
      if (last && last->in_free_set && b->in_free_set) broken("I2: two free neighbours");
      if (b->in_free_set && b->allocated) broken("I3: allocated block in a free set");
      if (b->in_free_set != (free_[seg->pool].count(const_cast<Block*>(b)) == 1))
        broken("I3: in_free_set flag disagrees with the free set");
      if (free_[1 - seg->pool].count(const_cast<Block*>(b))) broken("I3: block in the other pool's free set");
      if (b->allocated != (lookup_allocated(b->addr) == b)) broken("I3: allocated map disagrees");
      if (b->in_free_set && b->requested_size != 0) broken("I5: free block keeps a requested size");
      for (int idx : {int(kStatAll), stat_index(seg->pool)}) {
        Count& c = count[idx];
        auto n = static_cast<std::int64_t>(b->size);
        if (b->allocated) {
          c.allocation += 1;
          c.allocated_bytes += n;
          c.requested_bytes += static_cast<std::int64_t>(b->requested_size);
        }
        if (!b->in_free_set) {  // allocated or pending
          c.active += 1;
          c.active_bytes += n;
        }
        if (b->in_free_set && b->is_split()) {
          c.inactive_split += 1;
          c.inactive_split_bytes += n;
        }
      }
      if (b->allocated && oversize(b->size)) ++oversize_allocations;
      in_free_sets += b->in_free_set;
      allocated_blocks += b->allocated;
      expect += b->size;
      last = b;
    }
    if (expect != seg->addr + seg->size) broken("I1: blocks do not cover their segment");
    for (int idx : {int(kStatAll), stat_index(seg->pool)}) {
      count[idx].segment += 1;
      count[idx].reserved_bytes += static_cast<std::int64_t>(seg->size);
    }
    if (oversize(seg->size)) ++oversize_segments;
  }
  if (in_free_sets != free_[0].size() + free_[1].size()) broken("I3: free set holds blocks of no segment");
  if (allocated_blocks != allocated_.size()) broken("I3: allocated map holds blocks of no segment");
  for (int idx = 0; idx < kNumStatIndices; ++idx) {
    const Count& c = count[idx];
    const std::string where = std::string(" (") + kStatIndexNames[idx] + ")";
    if (c.segment != stats_.segment[idx].current) broken("I5: segment count" + where);
    if (c.reserved_bytes != stats_.reserved_bytes[idx].current) broken("I4: reserved_bytes" + where);
    if (c.allocation != stats_.allocation[idx].current) broken("I5: allocation count" + where);
    if (c.allocated_bytes != stats_.allocated_bytes[idx].current) broken("I5: allocated_bytes" + where);
    if (c.requested_bytes != stats_.requested_bytes[idx].current) broken("I5: requested_bytes" + where);
    if (c.active != stats_.active[idx].current) broken("I5: active count" + where);
    if (c.active_bytes != stats_.active_bytes[idx].current) broken("I5: active_bytes" + where);
    if (c.inactive_split != stats_.inactive_split[idx].current) broken("I5: inactive_split" + where);
    if (c.inactive_split_bytes != stats_.inactive_split_bytes[idx].current)
      broken("I5: inactive_split_bytes" + where);
  }
  std::size_t largest = 0, free_total = 0;
  for (const auto& set : free_)
    for (const Block* b : set) {
      largest = std::max(largest, b->size);
      free_total += b->size;
    }
  if (largest != largest_free_block()) broken("I5: largest free block differs from a walk of the free sets");
  if (free_total != free_bytes()) broken("I5: free bytes differ from a walk of the free sets");
  if (oversize_allocations != stats_.oversize_allocations.current) broken("I5: oversize_allocations");
  if (oversize_segments != stats_.oversize_segments.current) broken("I5: oversize_segments");
}

}  // namespace dtralloc
