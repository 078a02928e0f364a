// Tests BlockPool (block_pool.h): the size policy, best fit, splitting,
// coalescing, pending blocks, stats and the invariant walk.
//
// The pool is pure mechanism over addresses, so these tests hand it segments
// at made-up addresses (no backend) and drive allocate_from / mark_freed /
// return_to_pool the way the Allocator does. Every scenario calls
// check_invariants() after each step, and the last test corrupts the
// structure through its public fields to show the walk notices.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "block_pool.h"
#include "check.h"
#include "config.h"

namespace {

using namespace dtralloc;

constexpr std::uintptr_t kBase = std::uintptr_t{1} << 40;  // made-up segment addresses

Config divisions(std::size_t n) {
  Config c;
  c.roundup_power2_divisions = n;
  return c;
}

// The user frees a block and nothing else holds it (no record_stream).
Block* release(BlockPool& pool, Block* b, std::uint64_t tick = 1) {
  pool.mark_freed(b);
  return pool.return_to_pool(b, tick);
}

// Takes the best fit for `bytes` on `stream`; the check fails if there is none.
Block* take(BlockPool& pool, std::size_t bytes, Stream stream = 0) {
  PoolKind kind = BlockPool::pool_for(bytes);
  Block* b = pool.find_free(kind, stream, bytes);
  CHECK(b != nullptr);
  return pool.allocate_from(b, bytes, bytes);
}

std::int64_t cur(const StatArray& a, int idx = kStatAll) { return a[idx].current; }

// ---- size policy -------------------------------------------------------------

void test_round_size() {
  const Config plain;
  CHECK_EQ(BlockPool::round_size(0, plain), 512u);
  CHECK_EQ(BlockPool::round_size(1, plain), 512u);
  CHECK_EQ(BlockPool::round_size(512, plain), 512u);
  CHECK_EQ(BlockPool::round_size(513, plain), 1024u);
  CHECK_EQ(BlockPool::round_size(1000, plain), 1024u);
  CHECK_EQ(BlockPool::round_size(kMiB + 1, plain), kMiB + 512);
  CHECK_EQ(BlockPool::round_size(1200 * kMiB + 1, plain), 1200 * kMiB + 512);

  // Divisions 0 and 1 both mean "512 B only".
  CHECK_EQ(BlockPool::round_size(1200 * kMiB + 1, divisions(1)), 1200 * kMiB + 512);
  CHECK_EQ(BlockPool::round_size(1200 * kMiB + 1, divisions(0)), 1200 * kMiB + 512);

  // Four divisions: steps of 256 MiB between 1 GiB and 2 GiB.
  const Config four = divisions(4);
  CHECK_EQ(BlockPool::round_size(1200 * kMiB, four), 1280 * kMiB);
  CHECK_EQ(BlockPool::round_size(1024 * kMiB + 1, four), 1280 * kMiB);
  CHECK_EQ(BlockPool::round_size(1280 * kMiB, four), 1280 * kMiB);  // on a step
  CHECK_EQ(BlockPool::round_size(1280 * kMiB + 1, four), 1536 * kMiB);
  CHECK_EQ(BlockPool::round_size(1793 * kMiB, four), 2048 * kMiB);
  CHECK_EQ(BlockPool::round_size(1024 * kMiB, four), 1024 * kMiB);  // a power of two
  CHECK_EQ(BlockPool::round_size(3 * kMiB, four), 3 * kMiB);        // 2 MiB + 2 steps
  CHECK_EQ(BlockPool::round_size(5 * kMiB + 1, four), 6 * kMiB);
  // Sizes up to 512 * divisions keep the 512 B rounding.
  CHECK_EQ(BlockPool::round_size(1500, four), 1536u);
  CHECK_EQ(BlockPool::round_size(2048, four), 2048u);
  CHECK_EQ(BlockPool::round_size(2049, four), 2560u);  // 2 KiB + one 512 B step

  const Config eight = divisions(8);
  CHECK_EQ(BlockPool::round_size(1100 * kMiB, eight), 1152 * kMiB);
  CHECK_EQ(BlockPool::round_size(1200 * kMiB, eight), 1280 * kMiB);
  CHECK_EQ(BlockPool::round_size(4096, eight), 4096u);
  CHECK_EQ(BlockPool::round_size(4097, eight), 4608u);

  const Config two = divisions(2);
  CHECK_EQ(BlockPool::round_size(3 * kMiB, two), 3 * kMiB);
  CHECK_EQ(BlockPool::round_size(3 * kMiB + 1, two), 4 * kMiB);
  CHECK_EQ(BlockPool::round_size(2 * kMiB + 1, two), 3 * kMiB);

  const Config sixteen = divisions(16);
  CHECK_EQ(BlockPool::round_size(5000, sixteen), 5120u);  // <= 8 KiB: 512 B steps
  CHECK_EQ(BlockPool::round_size(9000, sixteen), 9216u);  // 8 KiB + 512 B steps

  // Every result is a multiple of 512 and not below the request.
  for (std::size_t div : {0, 2, 4, 8, 16, 32, 64}) {
    const Config c = divisions(div);
    for (std::size_t s = 1; s < 64 * kMiB; s = s * 3 / 2 + 77) {
      std::size_t r = BlockPool::round_size(s, c);
      if (r % 512 != 0 || r < s) CHECK_EQ(r, s);  // prints the offender
    }
  }
}

void test_segment_size_and_pool() {
  const Config torch_sizes;  // segment_fit:auto, which a bare pool takes as off
  const BlockPool pool(torch_sizes);
  CHECK_EQ(pool.segment_size(512), 2 * kMiB);
  CHECK_EQ(pool.segment_size(kMiB), 2 * kMiB);
  CHECK_EQ(pool.segment_size(kMiB + 512), 20 * kMiB);
  CHECK_EQ(pool.segment_size(9 * kMiB), 20 * kMiB);
  CHECK_EQ(pool.segment_size(10 * kMiB - 512), 20 * kMiB);
  CHECK_EQ(pool.segment_size(10 * kMiB), 10 * kMiB);
  CHECK_EQ(pool.segment_size(10 * kMiB + 512), 12 * kMiB);
  CHECK_EQ(pool.segment_size(21 * kMiB), 22 * kMiB);
  CHECK_EQ(pool.segment_size(22 * kMiB), 22 * kMiB);
  // segment_fit:on: whole copies of a 1-10 MiB request, 2 MiB-rounded, <= 20.
  Config fit_config;
  fit_config.segment_fit = Switch::kOn;
  const BlockPool fit(fit_config);
  CHECK_EQ(fit.segment_size(kMiB), 2 * kMiB);              // small pool: unchanged
  CHECK_EQ(fit.segment_size(9 * kMiB), 18 * kMiB);         // 2 x 9, no tail
  CHECK_EQ(fit.segment_size(2304 * 1024), 18 * kMiB);      // 8 x 2.25
  CHECK_EQ(fit.segment_size(6912 * 1024), 14 * kMiB);      // 2 x 6.75 = 13.5
  CHECK_EQ(fit.segment_size(kMiB + 512), 20 * kMiB);       // 19 copies, rounded up
  CHECK_EQ(fit.segment_size(7 * kMiB), 14 * kMiB);
  CHECK_EQ(fit.segment_size(10 * kMiB - 512), 20 * kMiB);  // 2 copies, rounded up
  CHECK_EQ(fit.segment_size(10 * kMiB), 10 * kMiB);        // own size: unchanged
  for (std::size_t r = kMiB + 512; r < 10 * kMiB; r += 7 * 4096) {
    const std::size_t seg = fit.segment_size(r);
    if (seg % (2 * kMiB) != 0 || seg > 20 * kMiB || seg < 2 * r || seg % r >= 2 * kMiB)
      CHECK_EQ(seg, r);  // prints the offender
  }
  CHECK_EQ(BlockPool::pool_for(512), kSmallPool);
  CHECK_EQ(BlockPool::pool_for(kMiB), kSmallPool);
  CHECK_EQ(BlockPool::pool_for(kMiB + 512), kLargePool);
  CHECK_EQ(BlockPool::pool_for(100 * kMiB), kLargePool);
}

// ---- best fit ---------------------------------------------------------------

void test_best_fit_same_stream_only() {
  const Config config;
  BlockPool pool(config);
  // Stream 1: 8, 4, 6 MiB (added out of order); stream 2: 5 and 20 MiB.
  Block* s1_8 = pool.add_segment(kBase, 8 * kMiB, 1, kLargePool);
  Block* s1_4 = pool.add_segment(kBase + 100 * kMiB, 4 * kMiB, 1, kLargePool);
  Block* s1_6 = pool.add_segment(kBase + 200 * kMiB, 6 * kMiB, 1, kLargePool);
  Block* s2_5 = pool.add_segment(kBase + 300 * kMiB, 5 * kMiB, 2, kLargePool);
  Block* s2_20 = pool.add_segment(kBase + 400 * kMiB, 20 * kMiB, 2, kLargePool);
  pool.check_invariants();

  CHECK(pool.find_free(kLargePool, 1, 5 * kMiB) == s1_6);  // smallest that fits
  CHECK(pool.find_free(kLargePool, 1, 4 * kMiB) == s1_4);  // exact
  CHECK(pool.find_free(kLargePool, 1, 2 * kMiB) == s1_4);
  CHECK(pool.find_free(kLargePool, 1, 6 * kMiB + 512) == s1_8);
  // Nothing on stream 1 is large enough; stream 2's 20 MiB must not be used.
  CHECK(pool.find_free(kLargePool, 1, 9 * kMiB) == nullptr);
  CHECK(pool.find_free(kLargePool, 2, 5 * kMiB) == s2_5);
  CHECK(pool.find_free(kLargePool, 2, 6 * kMiB) == s2_20);  // not stream 1's 6 MiB
  CHECK(pool.find_free(kLargePool, 0, 512) == nullptr);     // stream 0 has nothing
  CHECK(pool.find_free(kLargePool, 3, 512) == nullptr);     // nor stream 3
  CHECK(pool.find_free(kSmallPool, 1, 512) == nullptr);     // nor the small pool

  // Equal sizes: the lowest address wins (deterministic reuse).
  Block* low = pool.add_segment(kBase + 500 * kMiB, 2 * kMiB, 3, kSmallPool);
  Block* high = pool.add_segment(kBase + 502 * kMiB, 2 * kMiB, 3, kSmallPool);
  CHECK(pool.find_free(kSmallPool, 3, 4096) == low);
  Block* a = pool.allocate_from(low, 4096, 4000);
  CHECK(a == low);
  // The rest of `low` (2 MiB - 4 KiB) is now the best fit, not `high`.
  CHECK(pool.find_free(kSmallPool, 3, 4096) == a->next);
  CHECK(a->next != high && a->next->size == 2 * kMiB - 4096);
  pool.check_invariants();
  release(pool, a);
  pool.check_invariants();
  CHECK(pool.find_free(kSmallPool, 3, 2 * kMiB) == low);
  (void)s2_20;
}

// ---- splitting --------------------------------------------------------------

void test_split_small_pool() {
  const Config config;
  BlockPool pool(config);
  Block* seg = pool.add_segment(kBase, 2 * kMiB, 0, kSmallPool);
  // Rest of 512 B: still split (small pool keeps rests >= 512 B).
  Block* a = pool.allocate_from(seg, 2 * kMiB - 512, 2 * kMiB - 600);
  CHECK_EQ(a->size, 2 * kMiB - 512);
  CHECK(a->next != nullptr);
  CHECK_EQ(a->next->size, 512u);
  CHECK_EQ(a->next->addr, kBase + 2 * kMiB - 512);
  CHECK(a->next->in_free_set);
  CHECK_EQ(cur(pool.stats().inactive_split), 1);
  CHECK_EQ(cur(pool.stats().inactive_split_bytes), 512);
  CHECK_EQ(cur(pool.stats().requested_bytes, kStatSmallPool), static_cast<std::int64_t>(2 * kMiB - 600));
  pool.check_invariants();
  Block* b = take(pool, 512);
  CHECK_EQ(b->addr, kBase + 2 * kMiB - 512);
  CHECK(b->next == nullptr);
  CHECK_EQ(cur(pool.stats().inactive_split), 0);
  pool.check_invariants();
  release(pool, b);
  release(pool, a);
  CHECK(pool.segments().at(kBase)->whole_free());
  pool.check_invariants();

  // Exact fit: no split at all.
  Block* whole = pool.allocate_from(pool.find_free(kSmallPool, 0, 2 * kMiB), 2 * kMiB, 2 * kMiB);
  CHECK(whole->next == nullptr && whole->prev == nullptr);
  CHECK_EQ(whole->size, 2 * kMiB);
  pool.check_invariants();
  release(pool, whole);
}

void test_split_large_pool() {
  const Config config;
  BlockPool pool(config);
  pool.add_segment(kBase, 20 * kMiB, 0, kLargePool);
  // Rest of exactly 1 MiB: not split (large pool keeps rests > 1 MiB only),
  // the user gets the whole 20 MiB block.
  Block* a = take(pool, 19 * kMiB);
  CHECK_EQ(a->size, 20 * kMiB);
  CHECK(a->next == nullptr);
  CHECK_EQ(cur(pool.stats().allocated_bytes, kStatLargePool), static_cast<std::int64_t>(20 * kMiB));
  CHECK_EQ(cur(pool.stats().requested_bytes, kStatLargePool), static_cast<std::int64_t>(19 * kMiB));
  pool.check_invariants();
  release(pool, a);
  // Rest of 1 MiB + 512: split.
  Block* b = take(pool, 19 * kMiB - 512);
  CHECK_EQ(b->size, 19 * kMiB - 512);
  CHECK(b->next != nullptr);
  CHECK_EQ(b->next->size, kMiB + 512);
  pool.check_invariants();
  release(pool, b);
  pool.check_invariants();
}

void test_oversize_never_split() {
  Config config;
  config.max_split_size_mb = 64 * kMiB;
  BlockPool pool(config);
  Block* seg = pool.add_segment(kBase, 100 * kMiB, 0, kLargePool);
  CHECK_EQ(pool.stats().oversize_segments.current, 1);
  // An oversize request keeps the whole block, even with 36 MiB left over.
  Block* a = pool.allocate_from(seg, 64 * kMiB, 64 * kMiB);
  CHECK_EQ(a->size, 100 * kMiB);
  CHECK(a->next == nullptr);
  CHECK_EQ(pool.stats().oversize_allocations.current, 1);
  pool.check_invariants();
  release(pool, a);
  CHECK_EQ(pool.stats().oversize_allocations.current, 0);
  CHECK_EQ(pool.stats().oversize_allocations.allocated, 1);
  pool.check_invariants();
}

// ---- max_split_size_mb / max_non_split_rounding_mb in find_free --------------

void test_oversize_rules_in_find_free() {
  Config config;
  config.max_split_size_mb = 64 * kMiB;  // max_non_split_rounding_mb: 20 MiB default
  BlockPool pool(config);
  Block* big = pool.add_segment(kBase, 100 * kMiB, 0, kLargePool);
  pool.check_invariants();
  // A request below the split limit never takes an oversize block.
  CHECK(pool.find_free(kLargePool, 0, 30 * kMiB) == nullptr);
  CHECK(pool.find_free(kLargePool, 0, 64 * kMiB - 512) == nullptr);
  // An oversize request takes it only when less than 20 MiB is wasted.
  CHECK(pool.find_free(kLargePool, 0, 64 * kMiB) == nullptr);  // 36 MiB waste
  CHECK(pool.find_free(kLargePool, 0, 80 * kMiB) == nullptr);  // exactly 20 MiB
  CHECK(pool.find_free(kLargePool, 0, 80 * kMiB + 512) == big);
  CHECK(pool.find_free(kLargePool, 0, 100 * kMiB) == big);
  // A normal block is still found for normal requests, the oversize one skipped.
  Block* normal = pool.add_segment(kBase + kMiB * 1024, 40 * kMiB, 0, kLargePool);
  CHECK(pool.find_free(kLargePool, 0, 30 * kMiB) == normal);
  CHECK(pool.find_free(kLargePool, 0, 41 * kMiB) == nullptr);  // only `big` fits

  Config rounding = config;
  rounding.max_non_split_rounding_mb = 40 * kMiB;
  BlockPool loose(rounding);
  Block* b = loose.add_segment(kBase, 100 * kMiB, 0, kLargePool);
  CHECK(loose.find_free(kLargePool, 0, 64 * kMiB) == b);  // 36 < 40 MiB waste
  CHECK(loose.find_free(kLargePool, 0, 60 * kMiB) == nullptr);  // below the limit

  // Without a split limit, any block fits any request.
  const Config unlimited;
  BlockPool any(unlimited);
  Block* c = any.add_segment(kBase, 100 * kMiB, 0, kLargePool);
  CHECK(any.find_free(kLargePool, 0, 2 * kMiB) == c);
  CHECK_EQ(any.stats().oversize_segments.current, 0);
}

// ---- coalescing -------------------------------------------------------------

void test_coalesce_both_neighbours() {
  const Config config;
  BlockPool pool(config);
  pool.add_segment(kBase, 20 * kMiB, 0, kLargePool);
  Block* a = take(pool, 2 * kMiB);
  Block* b = take(pool, 2 * kMiB);
  Block* c = take(pool, 2 * kMiB);
  CHECK_EQ(a->addr, kBase);
  CHECK_EQ(b->addr, kBase + 2 * kMiB);
  CHECK_EQ(c->addr, kBase + 4 * kMiB);
  CHECK(c->next != nullptr && c->next->in_free_set);
  CHECK_EQ(c->next->size, 14 * kMiB);
  CHECK_EQ(cur(pool.stats().allocation), 3);
  CHECK_EQ(cur(pool.stats().inactive_split_bytes), static_cast<std::int64_t>(14 * kMiB));
  pool.check_invariants();

  // b between two allocated blocks: freed alone.
  Block* fb = release(pool, b, 1);
  CHECK(fb == b);
  CHECK_EQ(fb->size, 2 * kMiB);
  CHECK(a->next == b && b->next == c);
  CHECK_EQ(cur(pool.stats().inactive_split), 2);
  CHECK_EQ(cur(pool.stats().inactive_split_bytes), static_cast<std::int64_t>(16 * kMiB));
  pool.check_invariants();

  // a merges with the free block above it.
  Block* fa = release(pool, a, 2);
  CHECK_EQ(fa->addr, kBase);
  CHECK_EQ(fa->size, 4 * kMiB);
  CHECK(fa->next == c && c->prev == fa);
  CHECK(pool.find_free(kLargePool, 0, 3 * kMiB) == fa);
  CHECK_EQ(cur(pool.stats().inactive_split), 2);
  pool.check_invariants();

  // c merges with both neighbours: the segment is one free block again.
  Block* fc = release(pool, c, 3);
  CHECK_EQ(fc->addr, kBase);
  CHECK_EQ(fc->size, 20 * kMiB);
  CHECK(fc->prev == nullptr && fc->next == nullptr);
  Segment* seg = pool.segments().at(kBase);
  CHECK(seg->head == fc);
  CHECK(seg->whole_free());
  CHECK_EQ(seg->last_free_tick, 3u);
  CHECK_EQ(cur(pool.stats().inactive_split), 0);  // not split any more
  CHECK_EQ(cur(pool.stats().active), 0);
  CHECK_EQ(cur(pool.stats().allocated_bytes), 0);
  CHECK_EQ(pool.free_bytes(), 20 * kMiB);
  CHECK_EQ(pool.largest_free_block(), 20 * kMiB);
  std::vector<Segment*> whole = pool.whole_free_segments();
  CHECK_EQ(whole.size(), 1u);
  pool.check_invariants();
}

// Blocks only merge within their segment, even with adjacent addresses.
void test_no_merge_across_segments() {
  const Config config;
  BlockPool pool(config);
  pool.add_segment(kBase, 20 * kMiB, 0, kLargePool);
  pool.add_segment(kBase + 20 * kMiB, 20 * kMiB, 0, kLargePool);
  Block* a = take(pool, 20 * kMiB);
  Block* b = take(pool, 20 * kMiB);
  CHECK(a->segment != b->segment);
  release(pool, a);
  release(pool, b);
  CHECK_EQ(pool.whole_free_segments().size(), 2u);
  CHECK_EQ(pool.largest_free_block(), 20 * kMiB);
  CHECK_EQ(pool.segment_at(kBase + 20 * kMiB - 1), pool.segments().at(kBase));
  CHECK_EQ(pool.segment_at(kBase + 20 * kMiB), pool.segments().at(kBase + 20 * kMiB));
  CHECK(pool.segment_at(kBase + 40 * kMiB) == nullptr);
  CHECK(pool.segment_at(kBase - 1) == nullptr);
  pool.check_invariants();
}

// A pending block (freed by the user, record_stream event outstanding) is not
// merged with its free neighbours until it returns to the pool.
void test_pending_not_merged() {
  const Config config;
  BlockPool pool(config);
  pool.add_segment(kBase, 2 * kMiB, 5, kSmallPool);
  Block* a = take(pool, 4096, 5);
  Block* b = take(pool, 4096, 5);
  Block* c = take(pool, 4096, 5);
  pool.mark_freed(b);  // pending: the Allocator waits on its events
  CHECK(b->pending());
  CHECK(pool.lookup_allocated(b->addr) == nullptr);
  CHECK_EQ(cur(pool.stats().allocation), 2);
  CHECK_EQ(cur(pool.stats().active), 3);  // pending blocks stay active
  CHECK_EQ(cur(pool.stats().active_bytes), 3 * 4096);
  pool.check_invariants();

  release(pool, a);  // free next to a pending block: stays separate
  CHECK(a->in_free_set && a->size == 4096 && a->next == b);
  release(pool, c);  // merges with the free rest above, not with b below
  CHECK(c->in_free_set && c->prev == b);
  CHECK_EQ(c->size, 2 * kMiB - 2 * 4096);
  CHECK(pool.find_free(kSmallPool, 5, 2 * kMiB) == nullptr);
  CHECK(!pool.segments().at(kBase)->whole_free());
  CHECK(pool.whole_free_segments().empty());
  pool.check_invariants();

  // The event completed: b returns and joins both neighbours.
  Block* merged = pool.return_to_pool(b, 9);
  CHECK_EQ(merged->addr, kBase);
  CHECK_EQ(merged->size, 2 * kMiB);
  CHECK(pool.segments().at(kBase)->whole_free());
  CHECK_EQ(cur(pool.stats().active), 0);
  pool.check_invariants();
  pool.remove_segment(pool.segments().at(kBase));
  CHECK(pool.segments().empty());
  CHECK_EQ(cur(pool.stats().reserved_bytes), 0);
  CHECK_EQ(cur(pool.stats().segment, kStatSmallPool), 0);
  pool.check_invariants();
}

void test_remove_segment() {
  const Config config;
  BlockPool pool(config);
  pool.add_segment(kBase, 2 * kMiB, 0, kSmallPool);
  pool.add_segment(kBase + 10 * kMiB, 20 * kMiB, 0, kLargePool);
  CHECK_EQ(cur(pool.stats().reserved_bytes), static_cast<std::int64_t>(22 * kMiB));
  CHECK_EQ(cur(pool.stats().reserved_bytes, kStatSmallPool), static_cast<std::int64_t>(2 * kMiB));
  CHECK_EQ(cur(pool.stats().segment, kStatLargePool), 1);
  Block* a = take(pool, 4096);
  // A segment that still holds a block cannot be removed; nothing changes.
  CHECK_CONTAINS(thrown_message<std::logic_error>([&] { pool.remove_segment(a->segment); }),
                 "not entirely free");
  pool.check_invariants();
  std::vector<Segment*> whole = pool.whole_free_segments();
  CHECK_EQ(whole.size(), 1u);
  CHECK_EQ(whole[0]->addr, kBase + 10 * kMiB);
  pool.remove_segment(whole[0]);
  CHECK_EQ(cur(pool.stats().reserved_bytes), static_cast<std::int64_t>(2 * kMiB));
  CHECK_EQ(pool.stats().reserved_bytes[kStatLargePool].freed, static_cast<std::int64_t>(20 * kMiB));
  pool.check_invariants();
  release(pool, a);
  pool.check_invariants();
}

// ---- the invariant walk catches corruption ---------------------------------

// check_invariants must throw a logic_error naming `invariant`.
void expect_broken(const BlockPool& pool, const char* invariant) {
  std::string message = thrown_message<std::logic_error>([&] { pool.check_invariants(); });
  CHECK_CONTAINS(message, invariant);
}

void test_corruption_is_caught() {
  const Config config;
  BlockPool pool(config);
  pool.add_segment(kBase, 2 * kMiB, 0, kSmallPool);
  Block* a = take(pool, 4096);
  Block* b = take(pool, 4096);
  Block* rest = b->next;
  pool.check_invariants();

  a->size += 512;  // overlaps b
  expect_broken(pool, "I1");
  a->size -= 512;
  pool.check_invariants();

  rest->size -= 512;  // the segment is no longer covered
  expect_broken(pool, "I1");
  rest->size += 512;

  b->in_free_set = true;  // flag set, but b is in no free set (and allocated)
  expect_broken(pool, "I3");
  b->in_free_set = false;

  b->allocated = false;  // still in the allocated map
  expect_broken(pool, "I3");
  b->allocated = true;

  b->requested_size += 1;  // stats no longer match the walk
  expect_broken(pool, "I5");
  b->requested_size -= 1;

  pool.stats().allocated_bytes[kStatSmallPool].current += 512;
  expect_broken(pool, "I5");
  pool.stats().allocated_bytes[kStatSmallPool].current -= 512;

  pool.stats().reserved_bytes[kStatAll].current -= 512;
  expect_broken(pool, "I4");
  pool.stats().reserved_bytes[kStatAll].current += 512;
  pool.check_invariants();

  // Two free neighbours: b pending between free a and the free rest, then
  // b claims to be free without going through return_to_pool.
  release(pool, a);
  pool.mark_freed(b);
  pool.check_invariants();
  b->in_free_set = true;
  expect_broken(pool, "I2");
  b->in_free_set = false;
  pool.check_invariants();
  pool.return_to_pool(b, 2);
  CHECK(pool.segments().at(kBase)->whole_free());
  pool.check_invariants();
}

// unmap_pages: cutting a free block's whole pages out splits its segment.
void test_cut_free_pages() {
  const Config config;
  BlockPool pool(config);
  pool.add_segment(kBase, 20 * kMiB, 0, kLargePool);
  Block* a = take(pool, 3 * kMiB);                // [0, 3)
  Block* b = take(pool, 4 * kMiB);                // [3, 7)
  Block* c = take(pool, 2 * kMiB + 512 * 1024);   // [7, 9.5)
  Block* free_top = c->next;                      // [9.5, 20)
  Block* fb = release(pool, b);
  // [3, 7) holds the pages [4, 6); [9.5, 20) holds [10, 20).
  CHECK_EQ(BlockPool::free_pages(fb, 2 * kMiB).addr, kBase + 4 * kMiB);
  CHECK_EQ(BlockPool::free_pages(fb, 2 * kMiB).size, 2 * kMiB);
  CHECK_EQ(BlockPool::free_pages(free_top, 2 * kMiB).size, 10 * kMiB);
  CHECK_EQ(BlockPool::free_pages(a, 2 * kMiB).size, 2 * kMiB);  // the arithmetic only; a is not free

  // A cut in the middle: the segment becomes [0, 4) and [6, 20).
  BlockPool::Range cut = pool.cut_free_pages(fb, 2 * kMiB);
  CHECK_EQ(cut.addr, kBase + 4 * kMiB);
  CHECK_EQ(cut.size, 2 * kMiB);
  CHECK_EQ(pool.segments().size(), 2u);
  Segment* low = pool.segments().at(kBase);
  Segment* high = pool.segments().at(kBase + 6 * kMiB);
  CHECK_EQ(low->size, 4 * kMiB);
  CHECK_EQ(high->size, 14 * kMiB);
  CHECK(low->head == a && a->next != nullptr && a->next->in_free_set && a->next->next == nullptr);
  CHECK_EQ(a->next->size, kMiB);                  // [3, 4): b's part below the cut
  CHECK(high->head->in_free_set && high->head->size == kMiB && high->head->next == c);
  CHECK(c->segment == high && c->prev == high->head);
  CHECK_EQ(cur(pool.stats().reserved_bytes), static_cast<std::int64_t>(18 * kMiB));
  CHECK_EQ(cur(pool.stats().segment), 2);
  pool.check_invariants();

  // A cut at a segment's end: the part above is empty, the segment shrinks.
  cut = pool.cut_free_pages(c->next, 2 * kMiB);
  CHECK_EQ(cut.addr, kBase + 10 * kMiB);
  CHECK_EQ(cut.size, 10 * kMiB);
  CHECK_EQ(high->size, 4 * kMiB);
  CHECK(c->next != nullptr && c->next->size == 512 * 1024 && c->next->next == nullptr);
  CHECK_EQ(cur(pool.stats().segment), 2);
  CHECK_EQ(cur(pool.stats().reserved_bytes), static_cast<std::int64_t>(8 * kMiB));
  pool.check_invariants();

  // No whole page: nothing is cut.
  cut = pool.cut_free_pages(c->next, 2 * kMiB);
  CHECK_EQ(cut.size, 0u);
  pool.check_invariants();

  // The parts live on as segments: freeing merges inside each, never across.
  Block* fa = release(pool, a, 2);
  CHECK(fa->addr == kBase && fa->size == 4 * kMiB && low->whole_free());
  Block* fc = release(pool, c, 3);
  CHECK(fc->addr == kBase + 6 * kMiB && fc->size == 4 * kMiB && high->whole_free());
  CHECK_EQ(pool.whole_free_segments().size(), 2u);
  pool.check_invariants();

  // A cut at a segment's start drops the segment below; a whole-free
  // segment's pages are all of it: the segment goes.
  cut = pool.cut_free_pages(fa, 2 * kMiB);
  CHECK_EQ(cut.addr, kBase);
  CHECK_EQ(cut.size, 4 * kMiB);
  CHECK_EQ(pool.segments().size(), 1u);
  CHECK_EQ(cur(pool.stats().segment), 1);
  pool.remove_segment(high);
  CHECK_EQ(cur(pool.stats().reserved_bytes), 0);
  pool.check_invariants();

  // A cut at the start of a segment with a block above.
  pool.add_segment(kBase, 20 * kMiB, 0, kLargePool);
  Block* x = take(pool, 6 * kMiB);
  Block* y = take(pool, 6 * kMiB);
  release(pool, x);
  cut = pool.cut_free_pages(pool.segments().at(kBase)->head, 2 * kMiB);
  CHECK_EQ(cut.addr, kBase);
  CHECK_EQ(cut.size, 6 * kMiB);
  CHECK(pool.segments().count(kBase) == 0 && pool.segments().at(kBase + 6 * kMiB)->head == y);
  CHECK(y->prev == nullptr && y->segment->size == 14 * kMiB);
  pool.check_invariants();
}

}  // namespace

int main() {
  test_round_size();
  test_segment_size_and_pool();
  test_best_fit_same_stream_only();
  test_split_small_pool();
  test_split_large_pool();
  test_oversize_never_split();
  test_oversize_rules_in_find_free();
  test_coalesce_both_neighbours();
  test_no_merge_across_segments();
  test_pending_not_merged();
  test_remove_segment();
  test_corruption_is_caught();
  test_cut_free_pages();
  return check_summary("test_block_pool");
}
