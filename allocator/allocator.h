// Allocator: one device's caching allocator. Policy around the BlockPool
// mechanism: the budget, the fallback ladder, record_stream events, the
// eviction hook, the event history and snapshots.
//
// malloc, in order (each step only when the previous one found nothing):
//   1. best fit from the cached free blocks of the stream
//   2. a new segment from the backend, if reserved stays within the budget
//      (first releasing least recently used cached segments when
//      garbage_collection_threshold is passed); when the standard segment
//      (block_pool.h) would pass the budget, or under tight placement
//      (set_tight_segments), a large-pool request gets a segment of its own
//      2 MiB-rounded size instead
//   3. release cached oversize segments (max_split_size_mb) and retry 2
//   4. wait for all record_stream events, release every cached segment that
//      is entirely free, and retry 2 (counted in num_alloc_retries); then,
//      with small_in_large on, a small request takes a large-pool free block
//   5. ask the eviction hook for room, *without* the lock held, and start
//      again from 1 for as long as the hook reports progress
//   6. fail: an OutOfMemoryError whose message names the request, budget,
//      reserved, allocated, largest free block, fragmentation and what to try
//
// While the request's stream captures a CUDA graph, only step 1 runs: record
// stream events are not polled (a query is illegal during capture) and a
// miss throws GraphCaptureError before any CUDA call, so the user's capture
// is not invalidated by the allocator.
//
// Thread safety: one plain std::mutex guards everything. Nothing outside the
// allocator (the eviction hook, Python) is ever called with it held: the hook
// frees blocks, which re-enters free().
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "backend.h"
#include "block_pool.h"
#include "config.h"
#include "stats.h"

namespace dtralloc {

class Publisher;

// Thrown when a request cannot be served after every fallback.
// How every OOM message of a device pool begins: "CUDA out of memory." as
// torch words it (batch-size finders, accelerate's and Lightning's, shrink
// the batch by matching that text). Through torch it reaches Python as a
// RuntimeError; this text tells the pool's OOM from others (the live session).
inline constexpr char kOutOfMemoryText[] = "dtralloc: CUDA out of memory.";

class OutOfMemoryError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown for a free (or record_stream) of a pointer this allocator does not
// hold: a double free, or memory from another allocator. Nothing is changed.
class InvalidPointerError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Thrown instead of serving a request that would need a CUDA call which a
// stream capture (CUDA graph) forbids: dtralloc keeps no private pool per
// graph, so it refuses capture (see docs/allocator.md, "CUDA graphs").
class GraphCaptureError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The message of GraphCaptureError and of the C ABI's capture hook: the cause
// and what to do instead.
std::string graph_capture_refusal(const std::string& what);

// The pool's last resort before OOM (step 5 above). The DTR evictor plugs in
// here. make_room is called without the pool lock; it frees blocks through
// Allocator::free and returns true if it freed anything worth retrying for.
class EvictionHook {
 public:
  virtual ~EvictionHook() = default;
  virtual bool make_room(std::size_t bytes, Stream stream) = 0;
};

// torch's snapshot trace actions, same spelling.
enum class TraceAction : std::uint8_t {
  kAlloc,
  kFreeRequested,
  kFreeCompleted,
  kSegmentAlloc,
  kSegmentFree,
  kOom,
  kSegmentUnmap = 7,  // unmap_pages: part of a segment given back (torch's name and code; 6 is its segment_map)
};
const char* trace_action_name(TraceAction action);

// One event of the history ring. 48 bytes: `op` sits in the padding after
// `action`, so the stamp costs no memory.
struct TraceEntry {
  TraceAction action;
  std::int32_t op;          // the driver's op stamp when it happened (set_op_stamp); -1 = none
  std::uintptr_t addr;
  std::size_t size;         // requested bytes (alloc, free_*), segment bytes, or the failed request (oom)
  Stream stream;
  std::int64_t time_us;
  // kOom: bytes the budget still allowed (torch's device_free); kAlloc: the
  // block's size as placed (rounded, maybe with an unsplit tail), so that
  // detail - size is the rounding waste; else 0.
  std::size_t detail;
};

struct BlockInfo {
  std::uintptr_t addr;
  std::size_t size;
  std::size_t requested_size;
  const char* state;  // "active_allocated", "active_pending_free", "inactive"
};

struct SegmentInfo {
  std::uintptr_t addr;
  std::size_t total_size;
  std::size_t allocated_size;
  std::size_t active_size;
  std::size_t requested_size;
  Stream stream;
  bool small_pool;
  std::vector<BlockInfo> blocks;
};

struct Snapshot {
  std::vector<SegmentInfo> segments;
  std::vector<TraceEntry> trace;  // oldest first
};

// Stats plus the values a full walk derives (fragmentation).
struct StatsReport {
  Stats stats;
  std::size_t budget_bytes;
  std::size_t capacity_bytes;
  std::size_t largest_free_bytes;
  std::size_t free_cached_bytes;   // bytes in free blocks (reserved, unallocated, not pending)
  std::size_t max_split_size;      // kNoLimit = none
  // Async segments (cuda, async_segments:on): what the driver's pool holds
  // for this allocator, live segments and freed ones not yet given back
  // (Backend::device_pool_bytes); has_device_pool false elsewhere.
  bool has_device_pool = false;
  Backend::DevicePoolBytes device_pool{};
};

class Allocator {
 public:
  Allocator(std::unique_ptr<Backend> backend, const Config& config, int device = 0);
  ~Allocator();  // releases every segment back to the backend
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // size 0 returns nullptr. Throws OutOfMemoryError. `owner` tags the block
  // for whoever asked (the remat engine's value id, read back by the
  // evictor's address walk without a lookup); the pool never reads it.
  void* malloc(std::size_t size, Stream stream = 0, std::int32_t owner = -1);
  // nullptr is a no-op. Throws InvalidPointerError (and counts it).
  void free(void* ptr);
  // `ptr` is used on `stream` too: it returns to the pool only once an event
  // recorded on `stream` at free time has completed.
  void record_stream(void* ptr, Stream stream);
  // True when `ptr` is an allocated block of this allocator.
  bool owns(void* ptr);
  // Segment base and size of an allocated pointer (torch's base_alloc hook).
  void* base_allocation(void* ptr, std::size_t* size);

  // Waits for record_stream events and releases every entirely free segment.
  void empty_cache();
  // Deferred-event backends: complete all events and process them.
  void complete_events();
  // torch's set_per_process_memory_fraction: the budget in force becomes
  // min(budget, f * capacity), where budget is a live session's when one
  // overrides it (override_session), the configured one otherwise; the cap
  // outlives sessions, as it does in torch.
  void set_memory_fraction(double fraction);

  void set_eviction_hook(std::shared_ptr<EvictionHook> hook);
  std::shared_ptr<EvictionHook> eviction_hook();
  // While on, every new large-pool segment is the request's own 2 MiB-rounded
  // size, as under a tight budget (step 2): the remat engine's last resort
  // before an OOM (RematDriver::tight_placement), so that a value it locks
  // strands no standard segment. Turning it on also releases the cached free
  // segments (empty_cache): best fit would otherwise hand out their
  // standard-size room before any new own-size segment. Called by the thread
  // that allocates, without the pool's lock held.
  void set_tight_segments(bool on) {
    tight_segments_ = on;
    if (on) empty_cache();
  }
  // Where an evicted value's block was (config spare_evicted): until the
  // value is recomputed or dies, a request that a cached block elsewhere can
  // serve is not placed there (try_allocate, step 1). `owner` tells apart the
  // engines sharing the pool (live sessions on CUDA); values are theirs.
  // Blocks of 1 MiB or less are not kept. Any thread, the pool's lock taken.
  // keep_home returns whether the home is kept (so its owner need not drop
  // one that is not).
  bool keep_home(const void* owner, int value, std::uintptr_t addr, std::size_t size);
  void drop_home(const void* owner, int value);
  void drop_homes(const void* owner);  // every home of `owner` (its engine ends)
  std::size_t homes();                 // how many are kept (tests)
  // Requests of these sizes, from the calling thread, until
  // clear_long_lived(), are expected to outlive the step (config
  // long_lived): each takes the high end of the free block best fit gives it
  // (try_allocate, steps 1 and 4), and one size serves one request. Drivers
  // call it around an op whose outputs a previous step kept (live) or the
  // trace marks kept (replay). A no-op with long_lived off. The pool's lock
  // taken; clear_long_lived takes it only when a hint is set.
  void expect_long_lived(const std::vector<std::size_t>& sizes);
  void clear_long_lived();
  // A live DTR session's budget and policy in place of the configured ones
  // while it runs: `bytes` (at most the capacity; 0 keeps the configured
  // budget), and the settings that auto resolves by policy and budget
  // (max_split_size_mb, segment_fit, small_in_large, spare_evicted,
  // long_lived, unmap_pages where the backend can give back pages) resolved
  // as for `policy` under that budget, so that a dtralloc session places as
  // its replay does on a pool installed without a budget or a policy; the
  // policy in config() is `policy` meanwhile.
  // Settings given on or off, or as a size, stay as given. end_override()
  // goes back to the configured budget and settings. A memory fraction
  // (set_memory_fraction) caps either budget.
  void override_session(std::size_t bytes, Policy policy);
  void end_override();
  // Resizes the event history ring (0 turns it off) and clears it, like
  // torch.cuda.memory._record_memory_history(max_entries=...).
  void set_history_entries(std::size_t entries);
  std::size_t history_entries();
  // The op the driver is running (a replay's op index, a live session's op
  // counter); every history entry recorded from now on carries it. -1 = none.
  // A relaxed atomic store: drivers call it once per op, from any thread,
  // without the pool lock.
  void set_op_stamp(std::int32_t op) { op_stamp_.store(op, std::memory_order_relaxed); }
  // Events recorded into the history since it was last resized (more than
  // the ring holds once it wrapped): a position in the event stream.
  std::uint64_t history_recorded();
  std::int32_t op_stamp() const { return op_stamp_.load(std::memory_order_relaxed); }
  // The history, oldest first, as the ring's two contiguous runs (`older`
  // then `newer`), handed over under the lock: exporters copy columns
  // straight out of the ring instead of building an entry list. It must not
  // call back into this allocator.
  using HistoryChunk = std::function<void(const TraceEntry* older, std::size_t older_count,
                                          const TraceEntry* newer, std::size_t newer_count)>;
  // Read-only look at the blocks under the lock (the Evictor walks address
  // neighbours). `fn` must not call back into this allocator.
  template <typename Fn>
  void inspect_pool(Fn&& fn) {
    std::lock_guard<std::mutex> lock(mutex_);
    fn(static_cast<const BlockPool&>(pool_));
  }

  // `dtralloc top`: a Publisher (publisher.h) writes this allocator's counters
  // to a shared-memory file every `period_us`, from a thread of its own (the
  // hot path has no publisher code). Returns the file's path; a running
  // publisher is replaced. period_us <= 0 stops publishing. Throws
  // std::runtime_error when the file cannot be created.
  std::string publish(std::int64_t period_us, const std::string& label);
  std::string published_path();
  // A live DTR session's evictions and remats, for the published frames
  // (dropped while nothing publishes).
  void add_published_counts(std::int64_t evictions, std::int64_t remats);

  StatsReport stats_report();
  // Reserved and allocated bytes now, without building a report.
  struct Usage {
    std::size_t reserved, allocated;
  };
  Usage usage();
  // What a per-op series samples (op_series.h), under one lock: cheaper than
  // stats_report(), which copies every counter.
  struct Sample {
    std::int64_t reserved, allocated, largest_free, free;
    std::uint64_t history_recorded;  // events recorded so far (history_recorded())
    bool history;                    // the pool keeps a history
  };
  Sample sample();
  Snapshot snapshot();
  // Segments only; the history (same moment, same lock) goes to `history`
  // instead of Snapshot::trace.
  Snapshot snapshot(const HistoryChunk& history);
  std::size_t history_size();
  void reset_peak_stats();
  void reset_accumulated_stats();
  // Throws std::logic_error on any broken invariant (block_pool.h I1..I5,
  // plus reserved <= budget).
  void check_invariants();

  std::size_t budget_bytes() const { return budget_bytes_; }
  std::size_t capacity_bytes() const { return capacity_bytes_; }
  // What the pool's reserved bytes can reach now: the budget, and, once the
  // device has refused a segment the budget allowed, no more than reserved
  // plus what the device has free (other memory shares a GPU: its CUDA
  // context, other processes; with no budget set, the budget is the device's
  // whole capacity). The evictor sizes its release plans and what it keeps
  // by it. Call it with the pool's lock held (inside inspect_pool): it may
  // ask the device (cudaMemGetInfo). Note [The device is the limit].
  std::size_t limit_locked();
  // Whether the device has refused a segment the budget allowed (then the
  // device, not the budget, is the limit), and what it has free now.
  bool device_limited() const { return device_limited_.load(std::memory_order_relaxed); }
  std::size_t device_free_bytes();
  // The settings in force, auto resolved. override_session changes the
  // resolved ones under the lock; a live session calls it with the GIL held,
  // so what reads them under the lock or the GIL sees one or the other.
  const Config& config() const { return config_; }
  // The smallest segment a new request of `rounded` bytes can get (config
  // only: no lock): the pool's segment for its size, or under a tight budget
  // a large request's own 2 MiB-rounded size (allocate_segment).
  std::size_t smallest_segment(std::size_t rounded) const {
    const std::size_t standard = pool_.segment_size(rounded);
    return BlockPool::pool_for(rounded) == kLargePool ? std::min(standard, BlockPool::own_segment_size(rounded))
                                                      : standard;
  }
  int device() const { return device_; }
  // unmap_pages on: gives back the whole free pages of segments still in
  // use, the rooms spared for evicted values' too, until the budget has room
  // for the segment a `rounded` request gets. False, and nothing given back,
  // when the budget has that room already or all of them would not make it
  // (the evictor's alternative to a ruinous victim: PolicyTraits::spare_ruinous).
  bool give_back_pages(std::size_t rounded);
  Backend& backend() { return *backend_; }

 private:
  Block* try_allocate(std::size_t rounded, std::size_t requested, Stream stream, bool spare_homes);
  [[noreturn]] void refuse_capture(std::size_t size, Stream stream);
  Block* allocate_segment(std::size_t rounded, std::size_t requested, Stream stream);
  // A segment of `bytes` from the backend, counted and recorded: its one
  // free block, or nullptr where the backend has no memory.
  Block* new_segment(std::size_t bytes, Stream stream, PoolKind pool);
  // The backend's allocate and release, timed into device_alloc_ns and
  // device_free_ns (stats.h). Under mutex_.
  void* backend_allocate(std::size_t bytes, Stream stream);
  void backend_release(std::uintptr_t addr, std::size_t bytes, Stream stream);
  // Async segments: after a new segment, waits for the device where the
  // driver's pool holds more than the budget (allocator.cpp). Under mutex_.
  void settle_device_pool();
  void release_segment(Segment* seg);
  void garbage_collect(std::size_t incoming_bytes);
  void apply_resolved(const Config& resolved);
  bool release_oversize_segments(std::size_t rounded, Stream stream);
  Block* split_oversize_segment(std::size_t rounded, std::size_t requested, Stream stream);
  // The last step before an out-of-memory error: a free block the split
  // limit keeps from this request (Note [split_any_block]).
  Block* split_any_block(std::size_t rounded, std::size_t requested, Stream stream);
  // Every whole free segment; but the arena where `keep_arena`.
  void release_cached_segments(bool keep_arena = false);
  void release_for_segment(std::size_t rounded, Stream stream);
  // arena:on (Note [arena]): the rest of the budget as one segment, for the
  // first large request the cache cannot serve; nullptr where it is not
  // made (off, no budget, made already, too small, refused by the device).
  Block* make_arena(std::size_t rounded, std::size_t requested, Stream stream, PoolKind pool);
  // A small request in an arena: at the top of the highest free block that serves it.
  Block* small_in_arena(std::size_t rounded, std::size_t requested, Stream stream);
  // In an arena, what outlives the step and small requests go to the top
  // (Note [arena]): `b` (step 1's choice), or the highest free block that
  // serves the request where that request is one of those.
  Block* arena_place(Block* b, PoolKind pool, Stream stream, std::size_t rounded, bool long_lived) const;
  struct PendingEvent {
    EventHandle event;
    Block* block;
  };
  std::vector<EventHandle> record_stream_events(Block* block);
  void process_events();
  void synchronize_and_free_events();
  void retire_event(const PendingEvent& p);
  void finish_free(Block* block);
  // unmap_pages, when steps 1-4 failed: cuts the whole free pages of
  // segments out (largest first) until the budget has room for the segment
  // `rounded` needs, then allocates. nullptr (and nothing given back) when
  // the budget has that room already or even all of them would not make it.
  // `spare_homes`: free blocks in a room spared for an evicted value
  // (spare_evicted) keep their pages.
  Block* release_free_pages(std::size_t rounded, std::size_t requested, Stream stream,
                            bool spare_homes);
  // What both do, under the lock: true when the budget now has the room.
  bool cut_pages_for(std::size_t rounded, bool spare_homes);
  std::string oom_message(std::size_t size, std::size_t rounded, Stream stream);
  [[noreturn]] void throw_oom(std::size_t size, std::size_t rounded, Stream stream);
  // Reads the clock once per public operation; record() stamps entries with it.
  void stamp();
  void record(TraceAction action, std::uintptr_t addr, std::size_t size, Stream stream,
              std::size_t detail = 0);
  Snapshot snapshot_locked(const HistoryChunk* history);
  std::size_t reserved_bytes() const;

  std::mutex mutex_;
  std::unique_ptr<Backend> backend_;
  const Config requested_;  // as given, auto unresolved (override_session)
  Config config_;            // in force: requested_ resolved, or a session's
  const int device_;
  BlockPool pool_;
  std::size_t capacity_bytes_;
  std::size_t config_budget_bytes_;   // from `budget`
  std::size_t session_bytes_ = 0;     // override_session's; 0: none (under mutex_)
  std::size_t fraction_cap_bytes_ = SIZE_MAX;  // set_memory_fraction's (under mutex_)
  // Effective: min(session's or config's, fraction cap) (refresh_budget).
  // Written under mutex_, but budget_bytes() reads it without the lock while
  // set_memory_fraction may run: atomic.
  std::atomic<std::size_t> budget_bytes_;
  // What was reserved when the budget last changed: a lower budget frees
  // nothing by itself, so until reserved falls under it, reserved may stay
  // above it but never grows (check_invariants, I4).
  std::size_t reserved_at_budget_change_ = 0;
  std::size_t own_budget() const;  // under mutex_
  void refresh_budget();            // under mutex_
  std::shared_ptr<EvictionHook> hook_;
  std::atomic<bool> tight_segments_{false};  // set_tight_segments
  // Async segments: what the driver's pool held beyond the pool's segments
  // even after a wait and a trim (settle_device_pool). Under mutex_.
  std::size_t device_pool_overhead_ = 0;
  Segment* arena_ = nullptr;      // arena:on, once made; nullptr again once given back
  bool arena_refused_ = false;    // the device refused it at this budget: not asked again until the budget changes
  std::atomic<bool> device_limited_{false};  // the device refused a segment the budget allowed (limit_locked)
  // expect_long_lived: rounded sizes still expected, and from which thread.
  std::vector<std::size_t> long_lived_;
  std::thread::id long_lived_thread_;
  std::atomic<bool> long_lived_set_{false};
  bool take_long_lived(std::size_t rounded);
  // keep_home: by address (homes may overlap: a value placed in another's
  // home and evicted too), and by (owner, value) to drop them.
  struct Home {
    std::size_t size;
    const void* owner;
    int value;
  };
  std::multimap<std::uintptr_t, Home> homes_;
  std::map<std::pair<const void*, int>, std::uintptr_t> home_of_;
  std::size_t largest_home_ = 0;      // the query window below a block's address
  bool in_home(const Block* block) const;
  std::uint64_t tick_ = 0;            // advances on every free; GC age

  std::vector<PendingEvent> pending_events_;

  std::vector<TraceEntry> history_;   // ring buffer of history_entries
  std::size_t history_next_ = 0;
  bool history_wrapped_ = false;
  std::uint64_t history_recorded_ = 0;  // events recorded since the ring was (re)sized
  std::int64_t op_time_us_ = 0;       // clock at the start of the current op
  std::atomic<std::int32_t> op_stamp_{-1};  // set_op_stamp; read by record()

  // Its thread takes mutex_ to sample, so publisher_mutex_ is never taken
  // with mutex_ held (stopping joins the thread).
  std::mutex publisher_mutex_;
  std::unique_ptr<Publisher> publisher_;
};

}  // namespace dtralloc
