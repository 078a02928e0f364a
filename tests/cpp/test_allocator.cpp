// Tests Allocator (allocator.h): the fallback ladder, the budget, garbage
// collection, empty_cache, record_stream, invalid frees, the history ring
// buffer, snapshots, and long random sequences with real bytes.
//
// Every scenario calls check_invariants() after each step. The virtual
// backend gives deterministic addresses (first fit from 1 TiB), so traces can
// be compared entry by entry; the host backend gives real memory, so the
// random test writes a pattern into every block and verifies it before free.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "allocator.h"
#include "check.h"
#include "config.h"
#include "wrapped_backend.h"

namespace {

using namespace dtralloc;

constexpr std::size_t kGiB = 1024 * kMiB;

// The history is off by default (as in torch); these tests read it, so they
// turn it on unless the conf says otherwise.
Config with_history(const std::string& conf) {
  if (conf.find("history_entries") != std::string::npos) return parse_config(conf);
  return parse_config(conf.empty() ? "history_entries:4096" : "history_entries:4096," + conf);
}
std::unique_ptr<Allocator> make_virtual(const std::string& conf, std::size_t capacity = kGiB) {
  return std::make_unique<Allocator>(make_virtual_backend(capacity), with_history(conf));
}
std::unique_ptr<Allocator> make_host(const std::string& conf, std::size_t capacity) {
  return std::make_unique<Allocator>(make_host_backend(capacity), with_history(conf));
}

std::uintptr_t addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }
void* offset(void* p, std::size_t n) { return static_cast<char*>(p) + n; }

std::int64_t cur(const StatArray& a, int idx = kStatAll) { return a[idx].current; }
Stats stats(Allocator& a) { return a.stats_report().stats; }
std::int64_t reserved(Allocator& a) { return cur(stats(a).reserved_bytes); }
std::int64_t allocated(Allocator& a) { return cur(stats(a).allocated_bytes); }
std::int64_t mib(std::size_t n) { return static_cast<std::int64_t>(n * kMiB); }

// Every difference between two Stats, "" when equal. `skip` names one
// counter allowed to differ.
std::string stats_diff(const Stats& a, const Stats& b, const std::string& skip = "") {
  std::ostringstream out;
  auto cmp = [&](const std::string& name, const Stat& x, const Stat& y) {
    if (x.current != y.current || x.peak != y.peak || x.allocated != y.allocated || x.freed != y.freed)
      out << name << " ";
  };
#define DTRALLOC_CMP_POOL(name) \
  for (int i = 0; i < kNumStatIndices; ++i) cmp(std::string(#name ".") + kStatIndexNames[i], a.name[i], b.name[i]);
  DTRALLOC_POOL_STATS(DTRALLOC_CMP_POOL)
#undef DTRALLOC_CMP_POOL
#define DTRALLOC_CMP_PLAIN(name) cmp(#name, a.name, b.name);
  DTRALLOC_PLAIN_STATS(DTRALLOC_CMP_PLAIN)
#undef DTRALLOC_CMP_PLAIN
#define DTRALLOC_CMP_COUNTER(name) \
  if (a.name != b.name && skip != #name) out << #name << " ";
  DTRALLOC_COUNTERS(DTRALLOC_CMP_COUNTER)
#undef DTRALLOC_CMP_COUNTER
  return out.str();
}

// A trace as text, one "action@addr+size/stream" per entry, so a mismatch
// prints both sequences. Addresses are relative to `base`.
std::string trace_text(const std::vector<TraceEntry>& trace, std::uintptr_t base) {
  std::ostringstream out;
  for (const TraceEntry& e : trace) {
    out << trace_action_name(e.action) << "@" << (e.addr ? e.addr - base : 0) << "+" << e.size
        << "/" << e.stream << " ";
  }
  return out.str();
}

// The virtual backend's first address (its address range starts there).
constexpr std::uintptr_t kVirtualBase = std::uintptr_t{1} << 40;

// Segments as "offset:size" text in address order (offsets in MiB from
// kVirtualBase), so a mismatch prints both lists.
std::string list_of(std::vector<std::pair<void*, std::size_t>> segments) {
  std::sort(segments.begin(), segments.end());
  std::ostringstream out;
  for (const auto& [at, size] : segments)
    out << (addr(at) - kVirtualBase) / kMiB << "M:" << size / kMiB << "M ";
  return out.str();
}
std::string segment_list(Allocator& a) {
  std::vector<std::pair<void*, std::size_t>> segments;
  for (const SegmentInfo& s : a.snapshot().segments)
    segments.push_back({reinterpret_cast<void*>(s.addr), s.total_size});
  return list_of(segments);
}

// The newest trace entry with `action` (the check fails when there is none).
TraceEntry last_entry(Allocator& a, TraceAction action) {
  Snapshot snap = a.snapshot();
  for (auto it = snap.trace.rbegin(); it != snap.trace.rend(); ++it)
    if (it->action == action) return *it;
  CHECK(!"no such trace entry");
  return {};
}

// ---- basics ------------------------------------------------------------------

void test_basics() {
  auto a = make_virtual("");
  CHECK_EQ(a->budget_bytes(), kGiB);  // no budget: the whole device
  CHECK_EQ(a->capacity_bytes(), kGiB);
  CHECK(a->malloc(0) == nullptr);
  a->free(nullptr);  // no-op
  a->check_invariants();

  void* p = a->malloc(1);
  CHECK(p != nullptr);
  CHECK_EQ(addr(p) % 512, 0u);
  CHECK(a->owns(p));
  Stats s = stats(*a);
  CHECK_EQ(cur(s.allocation), 1);
  CHECK_EQ(cur(s.allocated_bytes), 512);
  CHECK_EQ(cur(s.requested_bytes), 1);
  CHECK_EQ(cur(s.active_bytes), 512);
  CHECK_EQ(cur(s.reserved_bytes), mib(2));
  CHECK_EQ(cur(s.reserved_bytes, kStatSmallPool), mib(2));
  CHECK_EQ(cur(s.reserved_bytes, kStatLargePool), 0);
  CHECK_EQ(cur(s.segment), 1);
  CHECK_EQ(s.num_device_alloc, 1);
  std::size_t seg_size = 0;
  CHECK(a->base_allocation(offset(p, 100), &seg_size) == p);  // first block: segment base
  CHECK_EQ(seg_size, 2 * kMiB);
  int on_stack = 0;
  CHECK(a->base_allocation(&on_stack, &seg_size) == &on_stack);
  CHECK_EQ(seg_size, 0u);
  a->check_invariants();

  a->free(p);
  CHECK(!a->owns(p));
  CHECK_EQ(allocated(*a), 0);
  CHECK_EQ(reserved(*a), mib(2));  // cached, not released
  a->check_invariants();
  void* q = a->malloc(1000);
  CHECK(q == p);  // step 1: the cached block, no new segment
  CHECK_EQ(stats(*a).num_device_alloc, 1);

  void* r = a->malloc(2 * kMiB);  // large pool, 20 MiB segment
  CHECK_EQ(cur(stats(*a).reserved_bytes, kStatLargePool), mib(20));
  void* t = a->malloc(12 * kMiB + 1);  // fits the 18 MiB rest: no new segment
  CHECK_EQ(addr(t), addr(r) + 2 * kMiB);
  CHECK_EQ(stats(*a).num_device_alloc, 2);
  void* u = a->malloc(21 * kMiB + 1);  // own-size segment, rounded to 2 MiB
  CHECK_EQ(cur(stats(*a).reserved_bytes, kStatLargePool), mib(20 + 22));
  // The 1 MiB - 512 B rest is not worth a split: u holds the whole segment.
  CHECK_EQ(cur(stats(*a).allocated_bytes),
           static_cast<std::int64_t>(1024 + 2 * kMiB + 12 * kMiB + 512 + 22 * kMiB));
  CHECK_EQ(cur(stats(*a).requested_bytes),
           static_cast<std::int64_t>(1000 + 2 * kMiB + 12 * kMiB + 1 + 21 * kMiB + 1));
  a->check_invariants();
  for (void* x : {q, r, t, u}) a->free(x);
  a->check_invariants();
  a->empty_cache();
  CHECK_EQ(reserved(*a), 0);
  CHECK_EQ(stats(*a).num_device_free, 3);
  CHECK_EQ(a->backend().free_bytes(), kGiB);
  a->check_invariants();
}

// ---- the fallback ladder ---------------------------------------------------

// Step 2 within the budget, then step 6: the OOM and its message.
void test_budget_and_oom_message() {
  auto a = make_virtual("budget:64M");
  CHECK_EQ(a->budget_bytes(), 64 * kMiB);
  void* p1 = a->malloc(30 * kMiB);
  void* p2 = a->malloc(30 * kMiB);
  CHECK_EQ(reserved(*a), mib(60));
  a->check_invariants();
  const Stats before = stats(*a);
  std::string message = thrown_message<OutOfMemoryError>([&] { a->malloc(30 * kMiB, 3); });
  // torch's words, which batch-size finders (accelerate, Lightning) look for.
  CHECK_CONTAINS(message, "CUDA out of memory.");
  CHECK_CONTAINS(message, "Tried to allocate 30 MiB");
  CHECK_CONTAINS(message, "on device 0, stream 0x3");
  CHECK_CONTAINS(message, "Budget 64 MiB, reserved 60 MiB, allocated 60 MiB");
  CHECK_CONTAINS(message, "device capacity 1 GiB");
  CHECK_CONTAINS(message, "raise DTRALLOC_CONF=budget");
  CHECK(message.find("fragmented") == std::string::npos);  // it is not
  CHECK_EQ(stats(*a).num_ooms, 1);
  CHECK_EQ(stats_diff(before, stats(*a), "num_ooms"), "");  // nothing else moved
  Snapshot snap = a->snapshot();
  CHECK(!snap.trace.empty());
  const TraceEntry& oom = snap.trace.back();
  CHECK_EQ(oom.action, TraceAction::kOom);
  CHECK_EQ(oom.size, 30 * kMiB);
  CHECK_EQ(oom.stream, Stream{3});
  CHECK_EQ(oom.detail, 4 * kMiB);  // what the budget still allowed
  a->check_invariants();
  // The pool still serves what fits.
  void* small = a->malloc(512);
  CHECK_EQ(reserved(*a), mib(62));
  for (void* x : {p1, p2, small}) a->free(x);
  a->check_invariants();
}

// The OOM message recognizes fragmentation and says what to try.
void test_oom_message_fragmented() {
  auto a = make_virtual("budget:20M");
  std::vector<void*> blocks;
  for (int i = 0; i < 4; ++i) blocks.push_back(a->malloc(4 * kMiB));  // one 20 MiB segment
  CHECK_EQ(reserved(*a), mib(20));
  a->free(blocks[0]);
  a->free(blocks[2]);  // free: 4 + 4 + 4 (the rest), none adjacent
  a->check_invariants();
  std::string message = thrown_message<OutOfMemoryError>([&] { a->malloc(8 * kMiB); });
  CHECK_CONTAINS(message, "largest free block 4 MiB of 12 MiB free in cache");
  CHECK_CONTAINS(message, "external fragmentation 0.67");
  CHECK_CONTAINS(message, "fragmented: try DTRALLOC_CONF=max_split_size_mb:");
  CHECK_EQ(stats(*a).num_alloc_retries, 0);  // nothing cached was whole-free
  a->free(blocks[1]);
  a->free(blocks[3]);
  a->check_invariants();
  // Now it fits in the cache without a new segment.
  void* p = a->malloc(8 * kMiB);
  CHECK_EQ(stats(*a).num_device_alloc, 1);
  a->free(p);
}

// small_in_large: a small request the budget leaves no 2 MiB segment for
// takes a free large-pool block (on), or fails (off, torch's pools apart).
void test_small_in_large() {
  for (const char* mode : {"on", "off"}) {
    auto a = make_virtual(std::string("budget:21M,segment_fit:off,small_in_large:") + mode);
    void* big = a->malloc(4 * kMiB);  // a 20 MiB large segment, 16 MiB of it free
    CHECK_EQ(reserved(*a), mib(20));
    if (std::string(mode) == "on") {
      void* small = a->malloc(512 * 1024);
      CHECK_EQ(addr(small), addr(big) + 4 * kMiB);  // beside it, in the large segment
      CHECK_EQ(reserved(*a), mib(20));
      CHECK_EQ(cur(stats(*a).segment), 1);
      a->check_invariants();
      a->free(small);
    } else {
      CHECK_CONTAINS(thrown_message<OutOfMemoryError>([&] { a->malloc(512 * 1024); }), "out of memory");
    }
    a->check_invariants();
    // With room for a small segment, small requests go there as always.
    auto b = make_virtual(std::string("budget:40M,segment_fit:off,small_in_large:") + mode);
    void* big2 = b->malloc(4 * kMiB);
    void* small2 = b->malloc(512 * 1024);
    CHECK_EQ(reserved(*b), mib(22));
    b->free(small2);
    b->free(big2);
    a->free(big);
  }
  // auto: on under the dtralloc policy with a budget, else off.
  CHECK(make_virtual("policy:dtralloc,budget:1G")->config().small_in_large == Switch::kOn);
  CHECK(make_virtual("policy:dtralloc")->config().small_in_large == Switch::kOff);
  CHECK(make_virtual("policy:dtr,budget:1G")->config().small_in_large == Switch::kOff);
  CHECK(make_virtual("policy:dtralloc,budget:1G,small_in_large:off")->config().small_in_large == Switch::kOff);
}

// spare_evicted: a block where an evicted value sat (its home, until the
// engine drops it) is passed over while another cached block fits, taken when
// none does; homes are per owner and only over 1 MiB.
void test_spare_evicted() {
  for (const char* mode : {"on", "off"}) {
    auto a = make_virtual(std::string("budget:1G,segment_fit:off,spare_evicted:") + mode);
    const bool on = std::string(mode) == "on";
    void* p1 = a->malloc(6 * kMiB);  // one 20 MiB segment: 6 + 6 + 8
    void* p2 = a->malloc(6 * kMiB);
    void* p3 = a->malloc(8 * kMiB);
    int owner = 0, other = 0;
    a->free(p1);
    CHECK_EQ(a->keep_home(&owner, 7, addr(p1), 6 * kMiB), on);
    CHECK(!a->keep_home(&owner, 8, addr(p2) + 2 * kMiB, 512 * 1024));  // 1 MiB or less: not kept
    CHECK_EQ(a->homes(), on ? 1u : 0u);
    a->free(p3);
    // Best fit is p1's 6 MiB; with the home spared, p3's 8 MiB.
    void* r = a->malloc(3 * kMiB);
    CHECK_EQ(addr(r), on ? addr(p3) : addr(p1));
    a->free(r);
    // With p3's block taken, only the home has room: it serves the request.
    void* fill = a->malloc(8 * kMiB);
    CHECK_EQ(addr(fill), addr(p3));
    void* only = a->malloc(5 * kMiB);  // no other free block: the home serves it
    CHECK_EQ(addr(only), addr(p1));
    a->free(only);
    a->free(fill);
    // Homes of another owner stay when one owner's go; a dropped home is free game.
    a->keep_home(&other, 7, addr(p3), 8 * kMiB);
    CHECK_EQ(a->homes(), on ? 2u : 0u);
    a->drop_home(&owner, 7);
    CHECK_EQ(a->homes(), on ? 1u : 0u);
    void* s1 = a->malloc(3 * kMiB);
    CHECK_EQ(addr(s1), addr(p1));  // p1's block is the best fit and no home now
    a->drop_homes(&other);
    CHECK_EQ(a->homes(), 0u);
    a->drop_home(&owner, 7);  // dropping twice is nothing
    a->free(s1);
    a->free(p2);
    a->check_invariants();
  }
  CHECK(make_virtual("policy:dtralloc,budget:1G")->config().spare_evicted == Switch::kOn);
  CHECK(make_virtual("policy:dtralloc")->config().spare_evicted == Switch::kOff);
  CHECK(make_virtual("policy:dtr,budget:1G")->config().spare_evicted == Switch::kOff);
  CHECK(make_virtual("policy:dtralloc,budget:1G,spare_evicted:off")->config().spare_evicted == Switch::kOff);
}

// A hook that frees nothing, counting its calls.
class EmptyHook : public EvictionHook {
 public:
  bool make_room(std::size_t, Stream) override {
    ++calls;
    return false;
  }
  int calls = 0;
};

// unmap_pages gives whole free pages back before the evictor is asked, but
// not the pages of a room spared for an evicted value; those go back only
// once the evictor has found nothing (docs/allocator.md, Note [unmap_pages]).
void test_pages_before_eviction() {
  for (bool both_homes : {false, true}) {
    auto a = make_virtual("budget:44M,segment_fit:off,unmap_pages:on,spare_evicted:on");
    void* left = a->malloc(8 * kMiB);  // one 20 MiB segment: 8 + 2 + 10
    void* pin = a->malloc(2 * kMiB);
    void* right = a->malloc(10 * kMiB);
    void* other = a->malloc(20 * kMiB);  // a second segment: 40 of 44 MiB reserved
    CHECK_EQ(addr(pin), addr(left) + 8 * kMiB);
    CHECK_EQ(addr(right), addr(left) + 10 * kMiB);
    CHECK_EQ(reserved(*a), mib(40));
    auto hook = std::make_shared<EmptyHook>();
    a->set_eviction_hook(hook);
    int owner = 0;
    a->free(left);
    CHECK(a->keep_home(&owner, 1, addr(left), 8 * kMiB));
    a->free(right);
    if (both_homes) CHECK(a->keep_home(&owner, 2, addr(right), 10 * kMiB));
    // 12 MiB: no free block holds it and 4 MiB of headroom is no segment.
    void* big = a->malloc(12 * kMiB);
    CHECK(big != nullptr);
    a->check_invariants();
    CHECK_EQ(stats(*a).num_page_releases, 1);
    TraceEntry cut = last_entry(*a, TraceAction::kSegmentUnmap);
    if (!both_homes) {
      // The unspared block's 10 MiB went back; the evictor was not asked.
      CHECK_EQ(hook->calls, 0);
      CHECK_EQ(cut.addr, addr(right));
      CHECK_EQ(cut.size, 10 * kMiB);
      CHECK_EQ(reserved(*a), mib(42));
    } else {
      // Only spared rooms had pages: the evictor first, then the largest
      // spared block's pages.
      CHECK_EQ(hook->calls, 1);
      CHECK_EQ(cut.addr, addr(right));
      CHECK_EQ(cut.size, 10 * kMiB);
    }
    // The left room is whole: once no longer spared it is the best fit again.
    a->drop_homes(&owner);
    void* back = a->malloc(8 * kMiB);
    CHECK_EQ(addr(back), addr(left));
    for (void* p : {back, pin, other, big}) a->free(p);
    CHECK_EQ(allocated(*a), 0);
    a->check_invariants();
  }
  // Off: the evictor is asked first and, finding nothing, the step fails.
  auto a = make_virtual("budget:44M,segment_fit:off,unmap_pages:off");
  void* left = a->malloc(8 * kMiB);
  void* pin = a->malloc(2 * kMiB);
  void* right = a->malloc(10 * kMiB);
  void* other = a->malloc(20 * kMiB);
  auto hook = std::make_shared<EmptyHook>();
  a->set_eviction_hook(hook);
  a->free(right);
  CHECK_THROWS(OutOfMemoryError, a->malloc(12 * kMiB));
  CHECK_EQ(hook->calls, 1);
  CHECK_EQ(stats(*a).num_page_releases, 0);
  for (void* p : {left, pin, other}) a->free(p);
  a->check_invariants();
}

// Step 1 before step 2: a cached block is used even when the budget would
// allow a new segment.
void test_cache_hit_before_new_segment() {
  auto a = make_virtual("");
  void* p = a->malloc(5 * kMiB);
  a->free(p);
  void* q = a->malloc(3 * kMiB);
  CHECK(q == p);
  CHECK_EQ(stats(*a).num_device_alloc, 1);
  CHECK_EQ(stats(*a).num_alloc_retries, 0);
  a->free(q);
  a->check_invariants();
}

// Step 3: cached oversize segments go first, other cached segments stay.
void test_release_oversize_first() {
  auto a = make_virtual("budget:150M,max_split_size_mb:64");
  void* normal = a->malloc(2 * kMiB);  // a 20 MiB large segment
  void* big = a->malloc(100 * kMiB);   // oversize, its own 100 MiB segment
  const std::uintptr_t normal_seg = addr(normal), big_seg = addr(big);
  a->free(normal);
  a->free(big);
  CHECK_EQ(reserved(*a), mib(120));
  CHECK_EQ(stats(*a).oversize_segments.current, 1);
  a->check_invariants();
  // 50 MiB is below the split limit: the cached 100 MiB block may not serve
  // it, and 120 + 50 passes the budget.
  void* p = a->malloc(50 * kMiB);
  CHECK_EQ(reserved(*a), mib(70));
  CHECK_EQ(stats(*a).num_device_free, 1);
  CHECK_EQ(stats(*a).num_alloc_retries, 0);  // step 4 was not needed
  CHECK_EQ(stats(*a).oversize_segments.current, 0);
  Snapshot snap = a->snapshot();
  CHECK_EQ(snap.segments.size(), 2u);
  bool kept_normal = false, kept_big = false;
  for (const SegmentInfo& s : snap.segments) {
    kept_normal |= s.addr == normal_seg;
    kept_big |= s.addr == big_seg && s.total_size == 100 * kMiB;
  }
  CHECK(kept_normal);
  CHECK(!kept_big);
  a->check_invariants();

  // With several oversize segments cached, the smallest one large enough goes.
  void* o1 = a->malloc(70 * kMiB);  // 140 MiB reserved now
  a->free(o1);
  a->free(p);
  a->empty_cache();
  void* o2 = a->malloc(66 * kMiB);
  void* o3 = a->malloc(80 * kMiB);
  a->free(o2);
  a->free(o3);
  CHECK_EQ(reserved(*a), mib(146));
  const std::size_t frees = static_cast<std::size_t>(stats(*a).num_device_free);
  void* q = a->malloc(30 * kMiB);  // 146 + 30 > 150: release 66 (not 80)
  CHECK_EQ(reserved(*a), mib(80 + 30));
  CHECK_EQ(static_cast<std::size_t>(stats(*a).num_device_free), frees + 1);
  const TraceEntry freed = last_entry(*a, TraceAction::kSegmentFree);
  CHECK_EQ(freed.action, TraceAction::kSegmentFree);
  CHECK_EQ(freed.addr, addr(o2));
  CHECK_EQ(freed.size, 66 * kMiB);
  a->free(q);
  a->check_invariants();
}

// Step 4: every cached segment is released (and pending events waited for),
// counted in num_alloc_retries.
void test_release_all_cached_and_retry() {
  auto a = make_virtual("budget:64M");
  void* p = a->malloc(30 * kMiB);
  void* pending = a->malloc(4 * kMiB);  // in a 20 MiB segment
  a->record_stream(pending, 9);
  a->free(p);
  a->free(pending);  // pending on stream 9's event
  CHECK_EQ(reserved(*a), mib(50));
  CHECK_EQ(cur(stats(*a).active_bytes), mib(4));
  a->check_invariants();
  void* q = a->malloc(40 * kMiB);  // 50 + 40 > 64
  CHECK(q != nullptr);
  Stats s = stats(*a);
  CHECK_EQ(s.num_alloc_retries, 1);
  CHECK_EQ(s.num_sync_all_streams, 1);  // the pending block was waited for
  CHECK_EQ(s.num_device_free, 2);       // both cached segments released
  CHECK_EQ(cur(s.reserved_bytes), mib(40));
  CHECK_EQ(cur(s.active_bytes), mib(40));
  CHECK_EQ(s.num_ooms, 0);
  a->check_invariants();
  a->free(q);
  a->check_invariants();
}

// A hook that frees one victim per call and, before that, re-enters the
// allocator: stats_report, malloc, free, snapshot, check_invariants. Any of
// those would deadlock if make_room were called with the pool lock held.
class ReentrantHook : public EvictionHook {
 public:
  explicit ReentrantHook(Allocator* allocator) : allocator_(allocator) {}
  bool make_room(std::size_t bytes, Stream stream) override {
    ++calls;
    bytes_seen.push_back(bytes);
    streams_seen.push_back(stream);
    StatsReport report = allocator_->stats_report();
    reserved_seen.push_back(cur(report.stats.reserved_bytes));
    void* scratch = allocator_->malloc(512);  // from the kept small segment
    allocator_->free(scratch);
    allocator_->snapshot();
    allocator_->check_invariants();
    if (victims.empty()) return false;
    allocator_->free(victims.back());
    victims.pop_back();
    return true;
  }

  std::vector<void*> victims;
  int calls = 0;
  std::vector<std::size_t> bytes_seen;
  std::vector<Stream> streams_seen;
  std::vector<std::int64_t> reserved_seen;

 private:
  Allocator* allocator_;
};

// Runs `fn` on its own thread and fails if it does not finish in time: a
// deadlock (the hook called under the lock) fails the test instead of
// hanging it.
void run_with_deadline(const char* what, const std::function<void()>& fn) {
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> finished = done->get_future();
  std::thread worker([fn, done] {
    fn();
    done->set_value();
  });
  if (finished.wait_for(std::chrono::seconds(60)) != std::future_status::ready)
    check::fail(__FILE__, __LINE__, std::string(what) + ": no progress in 60 s (deadlock?)");
  worker.join();
}

// Step 5: the hook runs without the lock and is retried while it reports
// progress; step 4 runs again between its calls.
void test_eviction_hook() {
  run_with_deadline("eviction hook", [] {
    auto a = make_virtual("budget:64M");
    auto hook = std::make_shared<ReentrantHook>(a.get());
    void* keeper = a->malloc(512);  // keeps a 2 MiB small segment for the hook
    for (int i = 0; i < 3; ++i) hook->victims.push_back(a->malloc(20 * kMiB));
    CHECK_EQ(reserved(*a), mib(62));
    a->set_eviction_hook(hook);
    a->check_invariants();

    void* big = a->malloc(40 * kMiB, 4);  // needs two victims released
    CHECK(big != nullptr);
    CHECK_EQ(hook->calls, 2);
    CHECK_EQ(hook->victims.size(), 1u);
    CHECK_EQ(hook->bytes_seen, (std::vector<std::size_t>{40 * kMiB, 40 * kMiB}));
    CHECK_EQ(hook->streams_seen, (std::vector<Stream>{4, 4}));
    // The second call saw the first victim's segment already released (step 4).
    CHECK_EQ(hook->reserved_seen, (std::vector<std::int64_t>{mib(62), mib(42)}));
    Stats s = stats(*a);
    CHECK_EQ(s.num_eviction_calls, 2);
    CHECK_EQ(s.num_alloc_retries, 2);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(cur(s.reserved_bytes), mib(62));
    a->check_invariants();

    // The hook is not asked while earlier steps can serve: a cached segment.
    a->free(big);
    void* again = a->malloc(40 * kMiB, 4);
    CHECK_EQ(stats(*a).num_eviction_calls, 2);
    a->free(again);

    // A hook that finds nothing: one call, then the OOM.
    void* other = a->malloc(40 * kMiB, 4);
    std::vector<void*> last_victims;
    last_victims.swap(hook->victims);
    std::string message = thrown_message<OutOfMemoryError>([&] { a->malloc(30 * kMiB, 4); });
    CHECK_CONTAINS(message, "out of memory");
    CHECK_EQ(hook->calls, 3);
    CHECK_EQ(stats(*a).num_eviction_calls, 3);
    CHECK_EQ(stats(*a).num_ooms, 1);
    a->check_invariants();

    // Without a hook, no calls.
    a->set_eviction_hook(nullptr);
    CHECK_THROWS(OutOfMemoryError, a->malloc(30 * kMiB, 4));
    CHECK_EQ(stats(*a).num_eviction_calls, 3);
    CHECK_EQ(hook->calls, 3);
    a->free(other);
    a->free(keeper);
    for (void* v : last_victims) a->free(v);
    CHECK_EQ(allocated(*a), 0);
    a->check_invariants();
  });
}

// Many threads OOM at once through the hook; the hook frees from a shared
// list under its own mutex while other threads hold and release the pool lock.
class SharedListHook : public EvictionHook {
 public:
  explicit SharedListHook(Allocator* allocator) : allocator_(allocator) {}
  bool make_room(std::size_t, Stream) override {
    void* victim = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (victims.empty()) return false;
      victim = victims.back();
      victims.pop_back();
    }
    allocator_->free(victim);
    return true;
  }
  std::mutex mutex;
  std::vector<void*> victims;

 private:
  Allocator* allocator_;
};

void test_eviction_hook_concurrent() {
  run_with_deadline("concurrent eviction hook", [] {
    auto a = make_virtual("budget:100M");
    auto hook = std::make_shared<SharedListHook>(a.get());
    a->set_eviction_hook(hook);
    std::vector<std::thread> threads;
    std::vector<std::vector<void*>> kept(4);
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        std::mt19937 rng(t);
        for (int i = 0; i < 300; ++i) {
          std::size_t size = (1 + rng() % 12) * kMiB;
          void* p = nullptr;
          try {
            p = a->malloc(size, static_cast<Stream>(t % 2));
          } catch (const OutOfMemoryError&) {
            continue;
          }
          if (rng() % 2) {
            std::lock_guard<std::mutex> lock(hook->mutex);
            hook->victims.push_back(p);
          } else if (rng() % 3) {
            a->free(p);
          } else {
            kept[t].push_back(p);
          }
          if (kept[t].size() > 3) {
            a->free(kept[t].front());
            kept[t].erase(kept[t].begin());
          }
        }
      });
    }
    for (auto& th : threads) th.join();
    a->check_invariants();
    CHECK(stats(*a).num_eviction_calls > 0);
    for (auto& list : kept)
      for (void* p : list) a->free(p);
    for (void* p : hook->victims) a->free(p);
    CHECK_EQ(allocated(*a), 0);
    a->check_invariants();
  });
}

// ---- budget ----------------------------------------------------------------

void test_budget_forms() {
  CHECK_EQ(make_virtual("budget:64M")->budget_bytes(), 64 * kMiB);
  CHECK_EQ(make_virtual("budget:0.25")->budget_bytes(), kGiB / 4);
  CHECK_EQ(make_virtual("budget:25%")->budget_bytes(), kGiB / 4);
  CHECK_EQ(make_virtual("budget:100%")->budget_bytes(), kGiB);
  CHECK_EQ(make_virtual("budget:none")->budget_bytes(), kGiB);
  CHECK_EQ(make_virtual("budget:0.5", 100 * kMiB)->budget_bytes(), 50 * kMiB);
  CHECK_EQ(make_virtual("budget:4096B")->budget_bytes(), 4096u);
  // A bare number is a fraction only below 1: `budget:1` (the whole device?)
  // and `budget:2` (2 bytes?) are errors naming both forms.
  for (const char* bare : {"budget:1", "budget:2", "budget:1.0", "budget:1073741824"}) {
    const std::string message = thrown_message<ConfigError>([&] { make_virtual(bare); });
    CHECK_CONTAINS(message, "0.5 or 50%");
    CHECK_CONTAINS(message, "6G");
  }

  // A budget above the device: the device runs out first, and says so.
  auto a = make_virtual("budget:2G");
  CHECK_EQ(a->budget_bytes(), 2 * kGiB);
  void* p = a->malloc(400 * kMiB);
  void* q = a->malloc(400 * kMiB);
  std::string message = thrown_message<OutOfMemoryError>([&] { a->malloc(400 * kMiB); });
  CHECK_CONTAINS(message, "reserved 800 MiB");
  CHECK_EQ(reserved(*a), mib(800));
  a->check_invariants();
  a->free(p);
  a->free(q);
}

void test_set_memory_fraction() {
  auto a = make_virtual("");
  a->set_memory_fraction(0.5);
  CHECK_EQ(a->budget_bytes(), kGiB / 2);
  a->set_memory_fraction(1.0);
  CHECK_EQ(a->budget_bytes(), kGiB);
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    std::string message = thrown_message<std::invalid_argument>([&] { a->set_memory_fraction(bad); });
    CHECK_CONTAINS(message, "memory fraction must be in [0, 1]");
  }
  CHECK_EQ(a->budget_bytes(), kGiB);  // unchanged by the bad calls
  a->set_memory_fraction(0.0);  // torch accepts 0: nothing may be reserved
  CHECK_EQ(a->budget_bytes(), std::size_t{0});
  CHECK_THROWS(OutOfMemoryError, a->malloc(512));
  a->set_memory_fraction(1.0);

  // The configured budget stays the upper bound.
  auto b = make_virtual("budget:256M");
  b->set_memory_fraction(0.5);
  CHECK_EQ(b->budget_bytes(), 256 * kMiB);
  b->set_memory_fraction(0.125);
  CHECK_EQ(b->budget_bytes(), 128 * kMiB);

  // Lowered below what is reserved: cached blocks still serve, new
  // segments are refused, and check_invariants accepts the state.
  void* p = b->malloc(100 * kMiB);
  void* q = b->malloc(20 * kMiB);
  b->free(q);
  b->set_memory_fraction(0.0625);  // 64 MiB < 120 MiB reserved
  b->check_invariants();
  void* again = b->malloc(20 * kMiB);
  CHECK(again == q);
  CHECK_THROWS(OutOfMemoryError, b->malloc(30 * kMiB));
  b->set_memory_fraction(1.0);
  CHECK_EQ(b->budget_bytes(), 256 * kMiB);
  void* r = b->malloc(30 * kMiB);
  for (void* x : {p, again, r}) b->free(x);
  b->check_invariants();
}

// Step 4 of the ladder under a session's dtralloc policy on a pool installed
// with torch's (dtralloc.install(), then dtr(budget=...)): only what makes
// room for the request's segment is given back, as under a pool configured
// with the dtralloc policy; after the session, everything whole, as torch.
void test_session_policy_decides_step_4() {
  for (bool session : {true, false}) {
    auto a = make_virtual("unmap_pages:off");
    if (session) a->override_session(100 * kMiB, Policy::kDtralloc);
    else a->set_memory_fraction(100.0 / 1024);  // torch's policy under the same cap
    CHECK(session == (a->config().policy == Policy::kDtralloc));
    std::vector<void*> held;
    for (std::size_t n : {30, 20, 12, 24}) held.push_back(a->malloc(n * kMiB));
    for (int i = 0; i < 3; ++i) a->free(held[i]);
    void* big = a->malloc(32 * kMiB);  // 86 + 32 > 100: 18 MiB must go; 20 alone does
    CHECK_EQ(a->stats_report().stats.num_device_free, session ? 1 : 3);
    a->free(big);
    a->free(held[3]);
    a->check_invariants();
    if (session) {
      a->end_override();
      CHECK(a->config().policy == Policy::kNone);
    }
  }
}

// A live session's budget (override_session) and torch's memory fraction:
// the fraction caps whichever budget is in force, whichever came first, and
// outlives the session.
void test_memory_fraction_and_session_budget() {
  auto a = make_virtual("budget:512M");
  a->set_memory_fraction(0.25);  // 256 MiB
  a->override_session(0, Policy::kDtralloc);  // a session without a budget keeps the cap
  CHECK_EQ(a->budget_bytes(), 256 * kMiB);
  a->override_session(384 * kMiB, Policy::kDtralloc);  // over the cap: capped
  CHECK_EQ(a->budget_bytes(), 256 * kMiB);
  a->override_session(128 * kMiB, Policy::kDtralloc);
  CHECK_EQ(a->budget_bytes(), 128 * kMiB);
  // The OOM message names the cap in force and how to raise it.
  std::string message = thrown_message<OutOfMemoryError>([&] { a->malloc(200 * kMiB); });
  CHECK_CONTAINS(message, "The dtr() session's budget caps reserved memory");
  CHECK_CONTAINS(message, "dtralloc.dtr(budget=...) (now 128 MiB)");
  a->set_memory_fraction(0.0625);  // during the session: 64 MiB
  CHECK_EQ(a->budget_bytes(), 64 * kMiB);
  message = thrown_message<OutOfMemoryError>([&] { a->malloc(100 * kMiB); });
  CHECK_CONTAINS(message, "torch.cuda.set_per_process_memory_fraction caps reserved memory at 64 MiB");
  a->set_memory_fraction(1.0);
  CHECK_EQ(a->budget_bytes(), 128 * kMiB);  // the session's again
  a->set_memory_fraction(0.25);
  a->end_override();
  CHECK_EQ(a->budget_bytes(), 256 * kMiB);  // the cap stays after the session
  a->set_memory_fraction(1.0);
  CHECK_EQ(a->budget_bytes(), 512 * kMiB);

  // A session's budget above the configured one, ended while its memory is
  // still reserved: over the configured budget, nothing more is reserved,
  // and the invariants hold until what is reserved falls under it.
  a->override_session(768 * kMiB, Policy::kDtralloc);
  void* p = a->malloc(400 * kMiB);
  void* q = a->malloc(200 * kMiB);
  a->check_invariants();
  a->end_override();
  CHECK_EQ(a->budget_bytes(), 512 * kMiB);
  CHECK_EQ(reserved(*a), mib(600));
  a->check_invariants();
  CHECK_THROWS(OutOfMemoryError, a->malloc(100 * kMiB));
  a->free(q);
  a->empty_cache();
  CHECK_EQ(reserved(*a), mib(400));
  a->check_invariants();
  void* r = a->malloc(100 * kMiB);  // room under the budget again
  CHECK_EQ(reserved(*a), mib(500));
  a->check_invariants();
  for (void* x : {p, r}) a->free(x);
  a->check_invariants();
}

// ---- garbage collection ----------------------------------------------------

void test_garbage_collection_threshold() {
  // threshold * budget = 50 MiB
  auto a = make_virtual("budget:100M,garbage_collection_threshold:0.5");
  void* x = a->malloc(12 * kMiB);
  void* y = a->malloc(12 * kMiB);
  void* z = a->malloc(12 * kMiB);
  CHECK_EQ(reserved(*a), mib(36));
  CHECK_EQ(stats(*a).num_device_free, 0);
  a->free(y);  // least recently freed first: y, x, z
  a->free(x);
  a->free(z);
  a->check_invariants();

  void* p = a->malloc(16 * kMiB);  // 36 + 16 > 50: release y only
  CHECK_EQ(reserved(*a), mib(40));
  CHECK_EQ(segment_list(*a), list_of({{x, 12 * kMiB}, {z, 12 * kMiB}, {p, 16 * kMiB}}));
  CHECK_EQ(last_entry(*a, TraceAction::kSegmentFree).addr, addr(y));
  a->check_invariants();

  void* q = a->malloc(16 * kMiB);  // 40 + 16 > 50: release x next
  CHECK_EQ(reserved(*a), mib(44));
  CHECK_EQ(stats(*a).num_device_free, 2);
  CHECK_EQ(segment_list(*a), list_of({{z, 12 * kMiB}, {p, 16 * kMiB}, {q, 16 * kMiB}}));
  void* z2 = a->malloc(12 * kMiB);  // served from z's cached segment
  CHECK(z2 == z);
  CHECK_EQ(stats(*a).num_device_free, 2);
  for (void* v : {p, q, z2}) a->free(v);
  a->check_invariants();

  // Below the threshold nothing is collected; with no threshold never.
  auto b = make_virtual("budget:100M");
  void* b1 = b->malloc(12 * kMiB);
  void* b2 = b->malloc(12 * kMiB);
  void* b3 = b->malloc(12 * kMiB);
  for (void* v : {b1, b2, b3}) b->free(v);
  void* b4 = b->malloc(16 * kMiB);
  void* b5 = b->malloc(16 * kMiB);
  CHECK_EQ(stats(*b).num_device_free, 0);
  CHECK_EQ(reserved(*b), mib(68));
  b->free(b4);
  b->free(b5);
}

// ---- empty_cache -----------------------------------------------------------

void test_empty_cache() {
  auto a = make_virtual("");
  void* keep = a->malloc(512);          // small segment stays (in use)
  void* gone = a->malloc(30 * kMiB);    // released
  void* pending = a->malloc(5 * kMiB);  // 20 MiB segment, pending at empty_cache
  a->free(gone);
  a->record_stream(pending, 3);
  a->free(pending);
  CHECK_EQ(reserved(*a), mib(52));
  a->empty_cache();
  Stats s = stats(*a);
  CHECK_EQ(cur(s.reserved_bytes), mib(2));
  CHECK_EQ(s.num_sync_all_streams, 1);
  CHECK_EQ(s.num_device_free, 2);
  CHECK_EQ(cur(s.active_bytes), 512);
  CHECK(a->owns(keep));
  a->check_invariants();
  a->empty_cache();  // idempotent
  CHECK_EQ(stats(*a).num_device_free, 2);
  CHECK_EQ(stats(*a).num_sync_all_streams, 1);  // nothing was pending
  a->free(keep);
  a->empty_cache();
  CHECK_EQ(reserved(*a), 0);
  CHECK(a->snapshot().segments.empty());
  a->check_invariants();
}

// ---- record_stream ---------------------------------------------------------

// A stand-in for async segments (backend_cuda.cpp) that mirrors what the
// Allocator reads of the driver's pool: release() only hands a segment to
// the "driver", which reuses it for a later allocation that fits (whole, as
// the fake runtime does) and gives it back at trim(); device_pool_bytes()
// says what it holds, plus a fixed overhead (its own granularity), which no
// trim gives back.
class HeldFreesBackend final : public WrappedBackend {
 public:
  HeldFreesBackend(std::size_t capacity, std::size_t overhead)
      : WrappedBackend(make_virtual_backend(capacity)), overhead_(overhead) {}
  const char* name() const override { return "held-frees"; }
  void* allocate(std::size_t bytes, Stream stream) override {
    for (auto it = held_.begin(); it != held_.end(); ++it)
      if (it->second >= bytes) {  // reused whole: the rest stays with it
        void* ptr = it->first;
        live_[ptr] = it->second;
        held_.erase(it);
        return ptr;
      }
    void* ptr = inner().allocate(bytes, stream);
    if (ptr) live_[ptr] = bytes;
    peak_ = std::max(peak_, held_bytes() + live_bytes() + overhead_);
    return ptr;
  }
  void release(void* ptr, std::size_t, Stream) override {
    held_[ptr] = live_.at(ptr);
    live_.erase(ptr);
  }
  bool device_pool_bytes(DevicePoolBytes& out) override {
    out.reserved = held_bytes() + live_bytes() + overhead_;
    out.peak = peak_;
    return true;
  }
  void trim() override {
    ++trims;
    for (auto& [ptr, bytes] : held_) inner().release(ptr, bytes, 0);
    held_.clear();
  }

  int trims = 0;

 private:
  std::size_t held_bytes() const {
    std::size_t n = 0;
    for (const auto& [ptr, bytes] : held_) n += bytes;
    return n;
  }
  std::size_t live_bytes() const {
    std::size_t n = 0;
    for (const auto& [ptr, bytes] : live_) n += bytes;
    return n;
  }
  std::size_t overhead_;
  std::size_t peak_ = 0;
  std::map<void*, std::size_t> held_, live_;
};

// settle_device_pool (Note [async segments]): a new segment after which the
// driver holds more than the budget makes the pool wait once (trim); where
// the driver reused what was given back, nothing waits; and what a trim
// cannot give back (the driver's own overhead) makes no later segment wait.
void test_async_segments_settle() {
  {
    auto owned = std::make_unique<HeldFreesBackend>(kGiB, 0);
    HeldFreesBackend& backend = *owned;
    Allocator a(std::move(owned), parse_config("policy:dtralloc,budget:64M"));
    void* big = a.malloc(40 * kMiB);
    a.free(big);
    void* small = a.malloc(30 * kMiB);  // the cached 40 MiB goes back, the driver reuses it
    CHECK_EQ(stats(a).num_device_free, 1);
    CHECK_EQ(backend.trims, 0);
    a.free(small);
    void* bigger = a.malloc(50 * kMiB);  // 40 MiB held beside the new 50: over 64 MiB
    CHECK_EQ(backend.trims, 1);
    CHECK_EQ(stats(a).num_device_pool_waits, 1);
    Backend::DevicePoolBytes held;
    CHECK(backend.device_pool_bytes(held) && held.reserved == 50 * kMiB);
    void* more = a.malloc(12 * kMiB);  // 62 MiB of segments, the driver holds no more
    void* tiny = a.malloc(kMiB / 2);   // a small segment: 64 MiB
    CHECK_EQ(backend.trims, 1);
    a.free(tiny);
    a.free(more);
    a.free(bigger);
    a.check_invariants();
    a.empty_cache();  // trims whatever is held
    CHECK_EQ(backend.trims, 2);
    CHECK(backend.device_pool_bytes(held) && held.reserved == 0);
  }
  {
    // The driver keeps 6 MiB beyond the pool's segments that no wait gives
    // back: the first segment that takes it past the budget waits once (it
    // cannot know), no later one does.
    auto owned = std::make_unique<HeldFreesBackend>(kGiB, 6 * kMiB);
    HeldFreesBackend& backend = *owned;
    Allocator a(std::move(owned), parse_config("policy:dtralloc,budget:64M"));
    void* one = a.malloc(30 * kMiB);
    CHECK_EQ(backend.trims, 0);
    void* two = a.malloc(30 * kMiB);  // 60 MiB of segments, 66 in the driver
    CHECK_EQ(backend.trims, 1);
    void* tiny = a.malloc(kMiB / 2);  // 62 MiB, 68 in the driver: nothing a wait would give back
    CHECK_EQ(backend.trims, 1);
    CHECK_EQ(stats(a).num_device_pool_waits, 1);
    a.free(tiny);
    a.free(two);
    a.free(one);
    a.check_invariants();
  }
  // Without a budget nothing is asked of the driver.
  auto owned = std::make_unique<HeldFreesBackend>(kGiB, 0);
  HeldFreesBackend& backend = *owned;
  Allocator a(std::move(owned), parse_config(""));
  a.free(a.malloc(40 * kMiB));
  a.free(a.malloc(90 * kMiB));
  CHECK_EQ(backend.trims, 0);
}

void test_record_stream() {
  auto a = make_host("", 64 * kMiB);
  const Stream s1 = 1, s2 = 2;
  void* p = a->malloc(4096, s1);
  std::memset(p, 0x5A, 4096);
  a->record_stream(p, s2);
  a->record_stream(p, s2);  // the same stream twice: one event
  a->record_stream(p, s1);  // its own stream: nothing to wait for
  a->free(p);
  Stats s = stats(*a);
  CHECK_EQ(cur(s.allocated_bytes), 0);
  CHECK_EQ(cur(s.active_bytes), 4096);  // pending
  Snapshot snap = a->snapshot();
  CHECK_EQ(snap.segments.size(), 1u);
  CHECK_EQ(std::string(snap.segments[0].blocks[0].state), "active_pending_free");
  CHECK_EQ(snap.segments[0].active_size, 4096u);
  CHECK_EQ(snap.trace.back().action, TraceAction::kFreeRequested);
  a->check_invariants();

  // Not reused while the event is pending, even by a request that would fit.
  void* q = a->malloc(4096, s1);
  CHECK(q != p);
  CHECK_EQ(addr(q), addr(p) + 4096);
  a->free(q);  // q merges with the rest, not with pending p
  CHECK(a->snapshot().segments[0].blocks.size() == 2);
  CHECK_THROWS(InvalidPointerError, a->free(p));  // pending is not allocated
  a->check_invariants();
  void* r = a->malloc(8192, s1);  // malloc polls events; still pending
  CHECK(r != p);
  a->free(r);
  a->check_invariants();

  a->complete_events();
  s = stats(*a);
  CHECK_EQ(cur(s.active_bytes), 0);
  snap = a->snapshot();
  CHECK_EQ(snap.segments[0].blocks.size(), 1u);  // merged back into one block
  CHECK_EQ(std::string(snap.segments[0].blocks[0].state), "inactive");
  const TraceEntry& done = snap.trace.back();
  CHECK_EQ(done.action, TraceAction::kFreeCompleted);
  CHECK_EQ(done.addr, addr(p));
  CHECK_EQ(done.size, 4096u);
  a->check_invariants();
  void* reused = a->malloc(4096, s1);
  CHECK(reused == p);  // now it is reused
  a->free(reused);

  // Events on two streams: back only when both completed.
  void* m = a->malloc(4096, s1);
  a->record_stream(m, 7);
  a->record_stream(m, 8);
  a->free(m);
  CHECK_EQ(cur(stats(*a).active_bytes), 4096);
  a->check_invariants();
  a->complete_events();
  CHECK_EQ(cur(stats(*a).active_bytes), 0);
  a->check_invariants();

  // Events that complete on their own (here: the backend's, as a GPU's
  // would) are noticed by the next malloc, which then reuses the block.
  void* e = a->malloc(4096, s1);
  a->record_stream(e, 7);
  a->free(e);
  a->backend().complete_events();
  CHECK_EQ(cur(stats(*a).active_bytes), 4096);  // nobody looked yet
  void* e2 = a->malloc(4096, s1);
  CHECK(e2 == e);
  CHECK_EQ(cur(stats(*a).active_bytes), 4096);  // e2 itself
  a->free(e2);
  a->check_invariants();

  // A block never moves to another stream: stream 2 gets a new segment.
  void* on1 = a->malloc(4096, s1);
  a->free(on1);
  const std::int64_t segments = stats(*a).num_device_alloc;
  void* on2 = a->malloc(4096, s2);
  CHECK_EQ(stats(*a).num_device_alloc, segments + 1);
  std::size_t seg1 = 0, seg2 = 0;
  CHECK(a->base_allocation(on1, &seg1) != a->base_allocation(on2, &seg2));
  a->free(on2);

  // record_stream of something not allocated.
  std::string message = thrown_message<InvalidPointerError>([&] { a->record_stream(on2, s1); });
  CHECK_CONTAINS(message, "record_stream");
  a->check_invariants();
}

// ---- invalid frees ---------------------------------------------------------

void test_invalid_free_changes_nothing() {
  auto a = make_host("", 64 * kMiB);
  void* p = a->malloc(4096);
  void* q = a->malloc(100);
  a->free(p);
  a->check_invariants();
  const Stats before = stats(*a);
  const Snapshot snap_before = a->snapshot();
  int on_stack = 0;
  void* inside = offset(q, 256);  // inside a live block, not its start
  std::int64_t invalid = before.num_invalid_frees;
  for (void* bad : {p, inside, static_cast<void*>(&on_stack)}) {
    std::string message = thrown_message<InvalidPointerError>([&] { a->free(bad); });
    char hex[32];
    std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(addr(bad)));
    CHECK_CONTAINS(message, hex);
    CHECK_CONTAINS(message, "double free");
    CHECK_CONTAINS(message, "Nothing was changed");
    CHECK_EQ(stats(*a).num_invalid_frees, ++invalid);
    CHECK_EQ(stats_diff(before, stats(*a), "num_invalid_frees"), "");
    a->check_invariants();
  }
  const Snapshot snap_after = a->snapshot();
  CHECK_EQ(trace_text(snap_after.trace, 0), trace_text(snap_before.trace, 0));
  CHECK_EQ(snap_after.segments.size(), snap_before.segments.size());
  CHECK_EQ(snap_after.segments[0].blocks.size(), snap_before.segments[0].blocks.size());
  CHECK(a->owns(q));
  a->free(q);  // q is still fine
  CHECK_THROWS(InvalidPointerError, a->free(q));
  a->check_invariants();
}

// ---- history ---------------------------------------------------------------

// The same script under ring buffers of several sizes; returns its trace.
std::vector<TraceEntry> run_history_script(const std::string& conf, std::string* expected) {
  auto a = make_virtual("budget:64M," + conf);
  void* p = a->malloc(512);
  void* q = a->malloc(1024);
  a->free(p);
  void* r = a->malloc(3 * kMiB);
  a->free(q);
  a->free(r);
  a->empty_cache();
  CHECK_THROWS(OutOfMemoryError, a->malloc(100 * kMiB, 5));
  const std::uintptr_t small = addr(p), large = addr(r);
  std::ostringstream e;
  auto entry = [&](const char* action, std::uintptr_t at, std::size_t size, Stream stream) {
    e << action << "@" << (at ? at - kVirtualBase : 0) << "+" << size << "/" << stream << " ";
  };
  entry("segment_alloc", small, 2 * kMiB, 0);
  entry("alloc", small, 512, 0);
  entry("alloc", small + 512, 1024, 0);
  entry("free_requested", small, 512, 0);
  entry("free_completed", small, 512, 0);
  entry("segment_alloc", large, 20 * kMiB, 0);
  entry("alloc", large, 3 * kMiB, 0);
  entry("free_requested", small + 512, 1024, 0);
  entry("free_completed", small + 512, 1024, 0);
  entry("free_requested", large, 3 * kMiB, 0);
  entry("free_completed", large, 3 * kMiB, 0);
  entry("segment_free", small, 2 * kMiB, 0);
  entry("segment_free", large, 20 * kMiB, 0);
  entry("oom", 0, 100 * kMiB, 5);
  *expected = e.str();
  Snapshot snap = a->snapshot();
  for (std::size_t i = 1; i < snap.trace.size(); ++i) CHECK(snap.trace[i - 1].time_us <= snap.trace[i].time_us);
  if (!snap.trace.empty()) CHECK_EQ(snap.trace.back().detail, 64 * kMiB);
  return snap.trace;
}

// The last n entries of a trace text.
std::string last_entries(const std::string& text, std::size_t n) {
  std::vector<std::string> words;
  std::istringstream in(text);
  for (std::string w; in >> w;) words.push_back(w);
  std::string out;
  for (std::size_t i = words.size() > n ? words.size() - n : 0; i < words.size(); ++i) out += words[i] + " ";
  return out;
}

void test_history_ring_buffer() {
  std::string expected;
  // Room for everything: the full script in order.
  std::vector<TraceEntry> full = run_history_script("history_entries:100", &expected);
  CHECK_EQ(full.size(), 14u);
  CHECK_EQ(trace_text(full, kVirtualBase), expected);
  // Wrapped: exactly the newest entries, oldest first.
  for (std::size_t n : {1, 5, 8, 13, 14, 15}) {
    std::vector<TraceEntry> ring = run_history_script("history_entries:" + std::to_string(n), &expected);
    CHECK_EQ(ring.size(), std::min<std::size_t>(n, 14));
    CHECK_EQ(trace_text(ring, kVirtualBase), last_entries(expected, n));
  }
  // Off.
  std::vector<TraceEntry> none = run_history_script("history_entries:0", &expected);
  CHECK(none.empty());
  // Default size is on.
  auto a = make_virtual("");
  a->free(a->malloc(512));
  CHECK_EQ(a->snapshot().trace.size(), 4u);
  for (TraceAction action : {TraceAction::kAlloc, TraceAction::kFreeRequested, TraceAction::kFreeCompleted,
                             TraceAction::kSegmentAlloc, TraceAction::kSegmentFree, TraceAction::kOom})
    CHECK(std::string(trace_action_name(action)) != "unknown");
}

// ---- snapshot and stats report ---------------------------------------------

void test_snapshot_and_report() {
  auto a = make_virtual("budget:512M,max_split_size_mb:64");
  void* p = a->malloc(1000, 2);
  void* q = a->malloc(3 * kMiB);
  void* r = a->malloc(3 * kMiB);
  a->free(q);
  Snapshot snap = a->snapshot();
  CHECK_EQ(snap.segments.size(), 2u);
  const SegmentInfo& large = snap.segments[0].small_pool ? snap.segments[1] : snap.segments[0];
  const SegmentInfo& small = snap.segments[0].small_pool ? snap.segments[0] : snap.segments[1];
  CHECK_EQ(small.stream, Stream{2});
  CHECK_EQ(small.total_size, 2 * kMiB);
  CHECK_EQ(small.allocated_size, 1024u);
  CHECK_EQ(small.requested_size, 1000u);
  CHECK_EQ(small.blocks.size(), 2u);
  CHECK_EQ(std::string(small.blocks[0].state), "active_allocated");
  CHECK_EQ(small.blocks[0].requested_size, 1000u);
  CHECK_EQ(std::string(small.blocks[1].state), "inactive");
  CHECK_EQ(large.total_size, 20 * kMiB);
  CHECK_EQ(large.allocated_size, 3 * kMiB);
  CHECK_EQ(large.active_size, 3 * kMiB);
  CHECK_EQ(large.blocks.size(), 3u);  // free q, allocated r, free rest
  CHECK_EQ(large.blocks[0].addr, addr(q));
  CHECK_EQ(std::string(large.blocks[0].state), "inactive");
  CHECK_EQ(large.blocks[1].addr, addr(r));

  StatsReport report = a->stats_report();
  CHECK_EQ(report.budget_bytes, 512 * kMiB);
  CHECK_EQ(report.capacity_bytes, kGiB);
  CHECK_EQ(report.max_split_size, 64 * kMiB);
  CHECK_EQ(report.largest_free_bytes, 14 * kMiB);
  CHECK_EQ(report.free_cached_bytes, 2 * kMiB - 1024 + 3 * kMiB + 14 * kMiB);
  CHECK_EQ(cur(report.stats.inactive_split), 3);

  // Peaks and accumulated counts reset on request.
  a->free(r);
  CHECK_EQ(report.stats.allocated_bytes[kStatAll].peak, static_cast<std::int64_t>(1024 + 6 * kMiB));
  a->reset_peak_stats();
  Stats s = stats(*a);
  CHECK_EQ(s.allocated_bytes[kStatAll].peak, 1024);
  CHECK_EQ(s.reserved_bytes[kStatAll].peak, mib(22));
  CHECK(s.allocated_bytes[kStatAll].allocated > 0);
  a->reset_accumulated_stats();
  s = stats(*a);
  CHECK_EQ(s.allocated_bytes[kStatAll].allocated, 0);
  CHECK_EQ(s.allocated_bytes[kStatAll].freed, 0);
  CHECK_EQ(s.num_device_alloc, 0);
  CHECK_EQ(cur(s.allocated_bytes), 1024);  // currents survive
  a->check_invariants();
  a->free(p);
}

// ---- random sequences ------------------------------------------------------

struct Live {
  std::size_t size;
  std::uint8_t seed;
};

void fill(void* p, std::size_t size, std::uint8_t seed) {
  auto* bytes = static_cast<std::uint8_t*>(p);
  std::size_t head = std::min<std::size_t>(size, 64);
  for (std::size_t i = 0; i < head; ++i) bytes[i] = static_cast<std::uint8_t>(seed + i);
  for (std::size_t i = 4096; i < size; i += 4096) bytes[i] = static_cast<std::uint8_t>(seed ^ (i >> 12));
  bytes[size - 1] = static_cast<std::uint8_t>(~seed);
}

bool intact(const void* p, std::size_t size, std::uint8_t seed) {
  const auto* bytes = static_cast<const std::uint8_t*>(p);
  std::size_t head = std::min<std::size_t>(size, 64);
  for (std::size_t i = 0; i < head; ++i)
    if (size - 1 != i && bytes[i] != static_cast<std::uint8_t>(seed + i)) return false;
  for (std::size_t i = 4096; i < size - 1; i += 4096)
    if (bytes[i] != static_cast<std::uint8_t>(seed ^ (i >> 12))) return false;
  return bytes[size - 1] == static_cast<std::uint8_t>(~seed);
}

std::size_t random_size(std::mt19937_64& rng) {
  std::uint64_t kind = rng() % 100;
  if (kind < 55) return 1 + rng() % 8192;
  if (kind < 80) return 1 + rng() % kMiB;
  if (kind < 96) return kMiB + rng() % (11 * kMiB);
  return 12 * kMiB + rng() % (18 * kMiB);
}

// Random malloc / free / record_stream / complete_events / empty_cache /
// invalid free / set_memory_fraction with check_invariants after every step;
// live blocks never overlap and keep their bytes; stats match the model.
void random_sequence(const std::string& conf, std::uint64_t seed, int steps) {
  auto a = make_host(conf, 64 * kMiB);
  std::mt19937_64 rng(seed);
  std::map<std::uintptr_t, Live> live;
  std::vector<std::uintptr_t> freed_recently;
  int ooms = 0, mallocs = 0;
  std::int64_t invalid = 0;
  for (int step = 0; step < steps; ++step) {
    std::uint64_t op = rng() % 100;
    if (op < 45 || live.empty()) {
      std::size_t size = random_size(rng);
      Stream stream = rng() % 3;
      void* p = nullptr;
      try {
        p = a->malloc(size, stream);
      } catch (const OutOfMemoryError&) {
        ++ooms;
      }
      if (p) {
        ++mallocs;
        std::uintptr_t at = addr(p);
        CHECK_EQ(at % 512, 0u);
        auto next = live.lower_bound(at);
        if (next != live.end()) CHECK(at + size <= next->first);
        if (next != live.begin()) {
          auto prev = std::prev(next);
          CHECK(prev->first + prev->second.size <= at);
        }
        auto seed8 = static_cast<std::uint8_t>(rng());
        fill(p, size, seed8);
        live[at] = {size, seed8};
      }
    } else if (op < 80) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      CHECK(intact(reinterpret_cast<void*>(it->first), it->second.size, it->second.seed));
      a->free(reinterpret_cast<void*>(it->first));
      freed_recently.push_back(it->first);
      live.erase(it);
    } else if (op < 88) {
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      a->record_stream(reinterpret_cast<void*>(it->first), rng() % 4);
    } else if (op < 93) {
      a->complete_events();
    } else if (op < 95) {
      a->empty_cache();
    } else if (op < 98) {
      if (!freed_recently.empty()) {
        std::uintptr_t at = freed_recently[rng() % freed_recently.size()];
        if (live.count(at) == 0) {
          const Stats before = stats(*a);
          CHECK_THROWS(InvalidPointerError, a->free(reinterpret_cast<void*>(at)));
          ++invalid;
          CHECK_EQ(stats_diff(before, stats(*a), "num_invalid_frees"), "");
        }
      }
    } else {
      a->set_memory_fraction(0.5 + 0.5 * static_cast<double>(rng() % 100) / 100.0);
    }
    if (freed_recently.size() > 64) freed_recently.erase(freed_recently.begin());
    a->check_invariants();
    Stats s = stats(*a);
    std::int64_t requested = 0, rounded = 0;
    for (const auto& [at, l] : live) {
      requested += static_cast<std::int64_t>(l.size);
      rounded += static_cast<std::int64_t>(BlockPool::round_size(l.size, a->config()));
    }
    CHECK_EQ(cur(s.allocation), static_cast<std::int64_t>(live.size()));
    CHECK_EQ(cur(s.requested_bytes), requested);
    CHECK(cur(s.allocated_bytes) >= rounded);
    CHECK(cur(s.reserved_bytes) <= static_cast<std::int64_t>(64 * kMiB));
    CHECK_EQ(s.num_invalid_frees, invalid);
  }
  for (const auto& [at, l] : live) {
    CHECK(intact(reinterpret_cast<void*>(at), l.size, l.seed));
    a->free(reinterpret_cast<void*>(at));
  }
  a->complete_events();
  a->check_invariants();
  Stats s = stats(*a);
  CHECK_EQ(cur(s.allocated_bytes), 0);
  CHECK_EQ(cur(s.active_bytes), 0);
  a->empty_cache();
  CHECK_EQ(reserved(*a), 0);
  CHECK_EQ(a->backend().free_bytes(), 64 * kMiB);
  CHECK(mallocs > steps / 4);
  std::printf("  random [%s]: %d mallocs, %d OOMs\n", conf.c_str(), mallocs, ooms);
}

void test_random_sequences() {
  random_sequence("", 1, 3000);
  random_sequence("budget:40M,max_split_size_mb:24", 2, 3000);
  random_sequence("roundup_power2_divisions:4,garbage_collection_threshold:0.6,history_entries:64", 3, 3000);
  random_sequence("budget:0.5,max_split_size_mb:21,max_non_split_rounding_mb:4,roundup_power2_divisions:2", 4, 3000);
}

}  // namespace

// long_lived: an announced size takes the high end of the free block best
// fit gives it, once per announcement, and only from the announcing thread;
// what the others leave free then joins into one block. Off, it is ignored.
void test_long_lived_takes_the_high_end() {
  auto a = make_virtual("segment_fit:off,long_lived:on");
  void* first = a->malloc(4 * kMiB);  // a 20 MiB segment: 4 used, 16 free
  const std::uintptr_t base = addr(first);
  a->expect_long_lived({2 * kMiB, 2 * kMiB});
  void* kept = a->malloc(2 * kMiB);
  CHECK_EQ(addr(kept), base + 18 * kMiB);
  void* next = a->malloc(3 * kMiB);  // not announced: the low end
  CHECK_EQ(addr(next), base + 4 * kMiB);
  void* other = nullptr;  // another thread's request of that size was not announced
  std::thread([&] { other = a->malloc(2 * kMiB); }).join();
  CHECK_EQ(addr(other), base + 7 * kMiB);
  void* second = a->malloc(2 * kMiB);
  CHECK_EQ(addr(second), base + 16 * kMiB);
  void* third = a->malloc(2 * kMiB);  // both announcements were taken
  CHECK_EQ(addr(third), base + 9 * kMiB);
  CHECK_EQ(stats(*a).num_long_lived, 2);
  a->check_invariants();
  a->expect_long_lived({1536 * 1024});
  a->clear_long_lived();
  void* cleared = a->malloc(1536 * 1024);
  CHECK_EQ(addr(cleared), base + 11 * kMiB);
  for (void* p : {first, next, other, third, cleared}) a->free(p);
  void* joined = a->malloc(16 * kMiB);  // everything below the kept blocks is one free block
  CHECK_EQ(addr(joined), base);
  for (void* p : {joined, kept, second}) a->free(p);
  CHECK_EQ(allocated(*a), 0);
  a->check_invariants();

  // An announced request that fills its free block exactly has no end to
  // take: it is not counted (long_lived counts the requests placed high).
  void* head = a->malloc(4 * kMiB);
  void* hole = a->malloc(2 * kMiB);
  void* tail = a->malloc(14 * kMiB);  // the segment is full
  a->free(hole);
  a->expect_long_lived({2 * kMiB});
  void* exact = a->malloc(2 * kMiB);
  CHECK_EQ(addr(exact), base + 4 * kMiB);
  CHECK_EQ(stats(*a).num_long_lived, 2);
  for (void* p : {head, exact, tail}) a->free(p);
  a->check_invariants();

  auto b = make_virtual("segment_fit:off,long_lived:off");
  void* low = b->malloc(4 * kMiB);
  b->expect_long_lived({2 * kMiB});
  void* k = b->malloc(2 * kMiB);
  CHECK_EQ(addr(k), addr(low) + 4 * kMiB);
  CHECK_EQ(stats(*b).num_long_lived, 0);
  b->free(k);
  b->free(low);
}

// A live session on a pool configured with neither a budget nor a policy
// (dtralloc.install(), then dtr(budget=...)) resolves the auto settings as
// under its policy and budget, as the CPU mirror's and the replay's pools
// do; ending the override puts back the configured budget and settings.
void test_session_override_resolves_placement() {
  auto a = make_virtual("");
  auto placement = [&] {
    const Config& c = a->config();
    return std::vector<int>{c.segment_fit == Switch::kOn, c.small_in_large == Switch::kOn,
                            c.spare_evicted == Switch::kOn, c.long_lived == Switch::kOn,
                            c.unmap_pages == Switch::kOn};
  };
  const std::vector<int> off{0, 0, 0, 0, 0}, on{1, 1, 1, 1, 1};
  CHECK(placement() == off);
  CHECK_EQ(a->config().max_split_size_mb, kNoLimit);
  void* big = a->malloc(64 * kMiB);  // its own segment; not oversize without a limit
  void* three = a->malloc(3 * kMiB);  // a 20 MiB segment (segment_fit off)
  CHECK_EQ(reserved(*a), mib(84));
  CHECK_EQ(stats(*a).oversize_allocations.current, 0);

  a->override_session(256 * kMiB, Policy::kDtralloc);
  CHECK_EQ(a->budget_bytes(), 256 * kMiB);
  CHECK(placement() == on);
  CHECK_EQ(a->config().max_split_size_mb, kDtrallocMaxSplit);
  // The 64 MiB block and its segment are oversize under the new limit.
  CHECK_EQ(stats(*a).oversize_allocations.current, 1);
  CHECK_EQ(stats(*a).oversize_segments.current, 1);
  a->check_invariants();
  // segment_fit in force: a 3 MiB request now gets a segment of six copies.
  void* threes[6] = {};
  for (void*& p : threes) p = a->malloc(3 * kMiB);  // five fill the first segment, the sixth a new one
  CHECK_EQ(reserved(*a), mib(84 + 18));
  a->check_invariants();

  // The dtr policy under a budget resolves auto off, as its replay does.
  a->override_session(256 * kMiB, Policy::kDtr);
  CHECK(placement() == off);
  CHECK_EQ(a->config().max_split_size_mb, kNoLimit);
  CHECK_EQ(stats(*a).oversize_allocations.current, 0);
  a->check_invariants();

  a->override_session(128 * kMiB, Policy::kDtralloc);
  a->end_override();
  CHECK_EQ(a->budget_bytes(), kGiB);
  CHECK(placement() == off);
  CHECK_EQ(stats(*a).oversize_segments.current, 0);
  CHECK_EQ(stats(*a).oversize_segments.peak, 1);
  a->check_invariants();
  for (void* p : threes) a->free(p);
  for (void* p : {big, three}) a->free(p);
  CHECK_EQ(allocated(*a), 0);
  a->check_invariants();

  // What the configuration gives explicitly stays; 0 keeps its budget.
  auto b = make_virtual("budget:512M,long_lived:off,max_split_size_mb:64");
  b->override_session(0, Policy::kDtralloc);
  CHECK_EQ(b->budget_bytes(), 512 * kMiB);
  CHECK(b->config().long_lived == Switch::kOff && b->config().segment_fit == Switch::kOn);
  CHECK_EQ(b->config().max_split_size_mb, 64 * kMiB);
  b->end_override();
  CHECK(b->config().segment_fit == Switch::kOff);
  CHECK_EQ(b->budget_bytes(), 512 * kMiB);
}

int main() {
  test_basics();
  test_budget_and_oom_message();
  test_oom_message_fragmented();
  test_small_in_large();
  test_spare_evicted();
  test_pages_before_eviction();
  test_long_lived_takes_the_high_end();
  test_session_override_resolves_placement();
  test_cache_hit_before_new_segment();
  test_release_oversize_first();
  test_release_all_cached_and_retry();
  test_eviction_hook();
  test_eviction_hook_concurrent();
  test_budget_forms();
  test_set_memory_fraction();
  test_memory_fraction_and_session_budget();
  test_session_policy_decides_step_4();
  test_garbage_collection_threshold();
  test_empty_cache();
  test_async_segments_settle();
  test_record_stream();
  test_invalid_free_changes_nothing();
  test_history_ring_buffer();
  test_snapshot_and_report();
  test_random_sequences();
  return check_summary("test_allocator");
}
