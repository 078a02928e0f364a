// BlockPool: the mechanism of the caching allocator. Knows segments, blocks
// and their address neighbours; knows nothing about tensors, budgets or
// backends (the Allocator in allocator.h does the policy and talks to the
// backend; the Evictor walks neighbours through the accessors here).
//
// Map of the structures
// ---------------------
//   segments_   address -> Segment, every segment obtained from the backend
//   Segment     one backend allocation; its blocks form a doubly linked list
//               in address order (Block::prev / Block::next)
//   Block       a piece of a segment: allocated, pending (freed, waiting on a
//               record_stream event) or free
//   free_[pool] the free blocks of each pool, ordered (stream, size, address)
//               so that lower_bound gives the best fit on a stream
//   allocated_  address -> Block for blocks currently handed to users
//
// Policy kept from torch's CUDACachingAllocator (what users already know):
//   * sizes round up to 512 B (or to power-of-two divisions, if configured)
//   * requests <= 1 MiB come from the small pool, in 2 MiB segments
//   * requests < 10 MiB come from the large pool, in 20 MiB segments
//   * larger requests get a segment of their own size rounded to 2 MiB
//     (so do smaller large-pool requests when a 20 MiB segment would pass
//     the budget: Allocator::allocate_segment)
//   * a block is split when the rest is worth keeping (>= 512 B in the small
//     pool, > 1 MiB in the large pool; >= 512 B there too under
//     small_in_large:on, whose small requests can use such a rest: Note
//     [large tails]) and never when it is oversize
//     (>= max_split_size_mb); oversize blocks serve only requests within
//     max_non_split_rounding_mb of their size
//   * a freed block merges with free neighbours at once; blocks never cross
//     streams (a segment belongs to the stream that first asked for it)
//
// Invariants (check_invariants() verifies all of them by a full walk):
//   I1  blocks of a segment tile it: addr ascends, no gap, no overlap
//   I2  no two address neighbours are both in a free set
//   I3  in_free_set <=> the block is in free_[its pool]; allocated blocks are
//       in no free set and in allocated_; pending blocks in neither
//   I4  reserved_bytes == sum of segment sizes
//   I5  every Stat's current equals what the walk counts
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <vector>

#include "address_map.h"
#include "backend.h"
#include "config.h"
#include "pooled_allocator.h"
#include "stats.h"

namespace dtralloc {

constexpr std::size_t kMinBlockSize = 512;          // alignment and minimum block
constexpr std::size_t kSmallSize = 1 * kMiB;        // largest small-pool request
constexpr std::size_t kSmallBuffer = 2 * kMiB;      // small-pool segment size
constexpr std::size_t kLargeBuffer = 20 * kMiB;     // segment for 1..10 MiB requests
constexpr std::size_t kMinLargeAlloc = 10 * kMiB;   // from here, own-size segments
constexpr std::size_t kRoundLarge = 2 * kMiB;       // rounding of own-size segments

enum PoolKind : int { kSmallPool = 0, kLargePool = 1 };

struct Segment;
struct Block;

// Free-set order: (stream, size, address), so lower_bound is best fit.
struct FreeOrder {
  bool operator()(const Block* a, const Block* b) const;
};
using FreeSet = std::set<Block*, FreeOrder, PooledAllocator<Block*>>;

struct Block {
  std::uintptr_t addr = 0;
  std::size_t size = 0;            // rounded size the block spans
  std::size_t requested_size = 0;  // what the user asked for; 0 unless allocated
  Stream stream = 0;               // stream of the segment; never changes
  Segment* segment = nullptr;
  Block* prev = nullptr;           // address neighbour below, same segment
  Block* next = nullptr;           // address neighbour above, same segment
  bool allocated = false;
  bool in_free_set = false;
  bool counted_inactive_split = false;  // what insert_free added to the stat
  FreeSet::iterator free_it;       // valid while in_free_set (O(1) erase)
  int event_count = 0;             // record_stream events still outstanding
  std::int32_t owner = -1;         // caller's tag while allocated (Allocator::malloc)
  std::vector<Stream> stream_uses; // other streams that used it (record_stream)

  bool is_split() const { return prev != nullptr || next != nullptr; }
  bool pending() const { return !allocated && !in_free_set; }
};

inline bool FreeOrder::operator()(const Block* a, const Block* b) const {
  if (a->stream != b->stream) return a->stream < b->stream;
  if (a->size != b->size) return a->size < b->size;
  return a->addr < b->addr;
}

struct Segment {
  std::uintptr_t addr = 0;
  std::size_t size = 0;
  Stream stream = 0;
  PoolKind pool = kLargePool;
  Block* head = nullptr;          // lowest-address block
  std::uint64_t last_free_tick = 0;  // when a block last returned; for GC age
  bool arena = false;             // the budget's arena (Allocator::make_arena): kept whole at the budget

  bool whole_free() const { return head->in_free_set && head->next == nullptr; }
};

class BlockPool {
 public:
  explicit BlockPool(const Config& config) : config_(config) {}
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // Size arithmetic (torch's policy; see the header comment).
  static std::size_t round_size(std::size_t size, const Config& config);
  // The segment a new `rounded` request gets (segment_fit, once resolved,
  // changes it for 1-10 MiB requests).
  std::size_t segment_size(std::size_t rounded) const;
  // The smallest segment that serves `rounded`: its own size rounded to
  // 2 MiB (a small-pool request's is the 2 MiB small segment). What a large
  // request gets under a tight budget (Allocator::allocate_segment).
  static std::size_t own_segment_size(std::size_t rounded) {
    return kRoundLarge * ((rounded + kRoundLarge - 1) / kRoundLarge);
  }
  static PoolKind pool_for(std::size_t rounded) {
    return rounded <= kSmallSize ? kSmallPool : kLargePool;
  }

  // Best-fit free block on `stream` for `rounded` bytes, or nullptr.
  Block* find_free(PoolKind pool, Stream stream, std::size_t rounded) const;
  // find_free's block, or, when `avoid` refuses it, the next one up (by size,
  // then address) that find_free's rules would also take and `avoid` does
  // not refuse, among the `limit` next; else find_free's.
  Block* find_free_sparing(PoolKind pool, Stream stream, std::size_t rounded,
                           const std::function<bool(const Block*)>& avoid, int limit) const;
  // Best fit on `stream` for `rounded` bytes whatever max_split_size_mb
  // says (a request may split an oversize block, or take one with more
  // than max_non_split_rounding_mb to spare): the last resort before an
  // out-of-memory error (Allocator::split_any_block).
  Block* find_free_any(PoolKind pool, Stream stream, std::size_t rounded) const;
  // The free block at the highest address on `stream` that find_free's
  // rules let serve `rounded`, or nullptr. Walks every free block of that
  // size and up: for the arena's few, rarer requests (Note [arena]).
  Block* find_free_highest(PoolKind pool, Stream stream, std::size_t rounded) const;
  // Takes `block` out of its free set, splits off the rest when worth it
  // (the request takes the low end, or the high end when `high`), marks it
  // allocated. Returns the allocated block.
  // `split`: split off the rest even where should_split would not (an
  // oversize request from an oversize block, Allocator::split_oversize_segment).
  Block* allocate_from(Block* block, std::size_t rounded, std::size_t requested, bool high = false,
                       bool split = false);
  // Registers a new backend segment as one free block; returns that block.
  Block* add_segment(std::uintptr_t addr, std::size_t size, Stream stream, PoolKind pool);
  // unmap_pages: the whole pages (`page` bytes, counted from the segment's
  // start) inside free block `b`, and cutting them out. The cut splits the
  // segment into the part below the range and the part above (each a
  // segment of its own, either may be empty) and returns the range, which
  // the caller gives back to the backend; {0, 0} when `b` holds no whole page.
  struct Range {
    std::uintptr_t addr = 0;
    std::size_t size = 0;
  };
  static Range free_pages(const Block* b, std::size_t page);
  Range cut_free_pages(Block* b, std::size_t page);
  // Forgets a whole-free segment (the caller releases its memory).
  void remove_segment(Segment* segment);

  Block* lookup_allocated(std::uintptr_t addr) const { return allocated_.find(addr); }
  // The user freed `block`: it stops being allocated (allocation stats drop)
  // but stays active until return_to_pool (record_stream events).
  void mark_freed(Block* block);
  // Puts a freed block back: merges free neighbours, inserts the result into
  // its free set. Returns the merged block.
  Block* return_to_pool(Block* block, std::uint64_t tick);

  // Whole-free segments, in address order.
  std::vector<Segment*> whole_free_segments() const;
  const std::map<std::uintptr_t, Segment*>& segments() const { return segments_; }
  // Segment containing `addr`, or nullptr.
  Segment* segment_at(std::uintptr_t addr) const;

  Stats& stats() { return stats_; }
  const Stats& stats() const { return stats_; }
  std::size_t largest_free_block() const;
  std::size_t free_bytes() const;  // sum of blocks in free sets

  // Throws std::logic_error naming the broken invariant (I1..I5).
  void check_invariants() const;
  // After max_split_size_mb changed (Allocator::override_session): the
  // oversize counters brought to what the new size makes of the blocks and
  // segments there are. Blocks split under the old size stay split.
  void recount_oversize();

 private:
  Block* new_block();
  void delete_block(Block* block);
  void insert_free(Block* block);
  void insert_free(Block* block, FreeSet::iterator hint);
  FreeSet::iterator erase_free(Block* block);  // returns the successor
  bool should_split(const Block* block, std::size_t rounded) const;
  bool oversize(std::size_t size) const { return size >= config_.max_split_size_mb; }
  // find_free's size rules for `b` (at least `rounded`): max_split_size_mb's.
  bool may_serve(const Block* b, std::size_t rounded) const;
  // The first free block of `pool` at or after (stream, rounded): the best
  // fit where it is on `stream`; the walk up from it visits every block of
  // that stream and size and larger.
  FreeSet::const_iterator first_fit(PoolKind pool, Stream stream, std::size_t rounded) const;

  const Config& config_;
  NodeCache free_nodes_;  // declared before the sets that allocate from it
  FreeSet free_[2] = {FreeSet(FreeOrder{}, PooledAllocator<Block*>(&free_nodes_)),
                      FreeSet(FreeOrder{}, PooledAllocator<Block*>(&free_nodes_))};
  std::map<std::uintptr_t, Segment*> segments_;
  AddressMap allocated_;
  std::vector<Block*> spare_blocks_;  // recycled Block objects (hot path)
  Stats stats_;
};

}  // namespace dtralloc
