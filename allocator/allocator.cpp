// Allocator: the fallback ladder, events and observability (allocator.h).
#include "allocator.h"

#include "publisher.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <sstream>

namespace dtralloc {
namespace {

// A hook that keeps reporting progress without room ever appearing is a bug
// in the hook; without a bound malloc would spin forever.
constexpr int kMaxEvictionRounds = 1 << 20;

// The coarse monotonic clock costs a few ns instead of ~20 (it reads the
// kernel's tick without a TSC conversion); its ~1-4 ms resolution is plenty
// for ordering a memory timeline, and entries keep their ring order anyway.
std::int64_t now_us() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

std::string hex(std::uintptr_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

const char* trace_action_name(TraceAction action) {
  switch (action) {
    case TraceAction::kAlloc: return "alloc";
    case TraceAction::kFreeRequested: return "free_requested";
    case TraceAction::kFreeCompleted: return "free_completed";
    case TraceAction::kSegmentAlloc: return "segment_alloc";
    case TraceAction::kSegmentFree: return "segment_free";
    case TraceAction::kOom: return "oom";
    case TraceAction::kSegmentUnmap: return "segment_unmap";
  }
  return "unknown";
}

Allocator::Allocator(std::unique_ptr<Backend> backend, const Config& config, int device)
    : backend_(std::move(backend)),
      requested_(config),
      config_(resolve_config(config, backend_->releases_ranges())),
      device_(device),
      pool_(config_) {
  check_backend_config(config_, backend_->name(), backend_->releases_ranges());
  capacity_bytes_ = backend_->total_bytes();
  config_budget_bytes_ = config_.budget.resolve(capacity_bytes_);
  budget_bytes_ = config_budget_bytes_;
  history_.resize(config_.history_entries);
}

Allocator::~Allocator() {
  publish(0, "");  // first: the publisher's thread reads this allocator
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    synchronize_and_free_events();
    release_cached_segments();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dtralloc: error while releasing memory at shutdown: %s\n", e.what());
  }
  // Segments still holding user allocations are leaked on purpose: freeing
  // them under a live tensor would be worse than the leak at exit.
}

// Larger requests cannot be rounded without overflow, and no device has that
// much memory anyway (2^62 bytes = 4 EiB).
constexpr std::size_t kMaxRequestBytes = std::size_t{1} << 62;

void* Allocator::malloc(std::size_t size, Stream stream, std::int32_t owner) {
  if (size == 0) return nullptr;
  if (size > kMaxRequestBytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    stamp();
    throw_oom(size, size, stream);
  }
  const std::size_t rounded = BlockPool::round_size(size, config_);
  // Hands `b` out (called under the lock).
  auto serve = [&](Block* b) {
    b->owner = owner;
    record(TraceAction::kAlloc, b->addr, size, stream, b->size);
    return reinterpret_cast<void*>(b->addr);
  };
  for (int round = 0;; ++round) {
    std::shared_ptr<EvictionHook> hook;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stamp();
      // Homes are spared on the first try only: the request an eviction made
      // room for may take the room its victims left.
      if (Block* b = try_allocate(rounded, size, stream, round == 0)) return serve(b);
      if (round < kMaxEvictionRounds) hook = hook_;
      if (!hook) {  // steps 1-4 failed; no step 5
        if (Block* b = release_free_pages(rounded, size, stream, false)) return serve(b);
        if (Block* b = split_any_block(rounded, size, stream)) return serve(b);
        throw_oom(size, rounded, stream);
      }
      // Step 5a: free pages before any eviction, where they make room
      // without the rooms spared for evicted values (Note [unmap_pages]).
      if (Block* b = release_free_pages(rounded, size, stream, true)) return serve(b);
      ++pool_.stats().num_eviction_calls;
    }
    // Step 5, outside the lock: the hook frees blocks through free().
    if (hook->make_room(rounded, stream)) continue;
    std::lock_guard<std::mutex> lock(mutex_);
    stamp();
    // Step 6: no eviction can make room (every run and segment that would
    // do holds a pinned or locked block); the spared rooms' pages may, and
    // then a block the split limit kept for other sizes.
    if (Block* b = release_free_pages(rounded, size, stream, false)) return serve(b);
    if (Block* b = split_any_block(rounded, size, stream)) return serve(b);
    throw_oom(size, rounded, stream);
  }
}

void Allocator::throw_oom(std::size_t size, std::size_t rounded, Stream stream) {
  ++pool_.stats().num_ooms;
  const std::size_t reserved = reserved_bytes();
  const std::size_t budget = budget_bytes_;
  record(TraceAction::kOom, 0, size, stream, budget > reserved ? budget - reserved : 0);
  throw OutOfMemoryError(oom_message(size, rounded, stream));
}

// Candidates past the best fit that step 1 looks at before taking it anyway.
constexpr int kSpareSearch = 16;

bool Allocator::in_home(const Block* block) const {
  const std::uintptr_t lo = block->addr > largest_home_ ? block->addr - largest_home_ : 0;
  for (auto it = homes_.upper_bound(lo); it != homes_.end() && it->first < block->addr + block->size; ++it)
    if (it->first + it->second.size > block->addr) return true;
  return false;
}

bool Allocator::keep_home(const void* owner, int value, std::uintptr_t addr, std::size_t size) {
  if (size <= kSmallSize || !addr) return false;
  std::lock_guard<std::mutex> lock(mutex_);
  if (config_.spare_evicted != Switch::kOn) return false;
  auto [it, fresh] = home_of_.try_emplace({owner, value}, addr);
  if (!fresh) return true;  // kept already (an engine drops a home before keeping another)
  homes_.emplace(addr, Home{size, owner, value});
  largest_home_ = std::max(largest_home_, size);
  return true;
}

void Allocator::drop_home(const void* owner, int value) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = home_of_.find({owner, value});
  if (it == home_of_.end()) return;
  auto range = homes_.equal_range(it->second);
  for (auto h = range.first; h != range.second; ++h)
    if (h->second.owner == owner && h->second.value == value) {
      homes_.erase(h);
      break;
    }
  home_of_.erase(it);
}

void Allocator::drop_homes(const void* owner) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = homes_.begin(); it != homes_.end();)
    it = it->second.owner == owner ? homes_.erase(it) : std::next(it);
  for (auto it = home_of_.begin(); it != home_of_.end();)
    it = it->first.first == owner ? home_of_.erase(it) : std::next(it);
}

std::size_t Allocator::homes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return homes_.size();
}

void Allocator::expect_long_lived(const std::vector<std::size_t>& sizes) {
  if (sizes.empty()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (config_.long_lived != Switch::kOn) return;
  long_lived_.clear();
  for (std::size_t size : sizes) long_lived_.push_back(BlockPool::round_size(size, config_));
  long_lived_thread_ = std::this_thread::get_id();
  long_lived_set_.store(true, std::memory_order_relaxed);
}

void Allocator::clear_long_lived() {
  if (!long_lived_set_.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(mutex_);
  long_lived_.clear();
  long_lived_set_.store(false, std::memory_order_relaxed);
}

// Under mutex_. Whether this request is one expect_long_lived announced; it
// is then no longer expected (and counted as long-lived only if it splits
// its block: BlockPool::allocate_from).
bool Allocator::take_long_lived(std::size_t rounded) {
  if (long_lived_.empty() || long_lived_thread_ != std::this_thread::get_id()) return false;
  auto it = std::find(long_lived_.begin(), long_lived_.end(), rounded);
  if (it == long_lived_.end()) return false;
  long_lived_.erase(it);
  return true;
}

Block* Allocator::try_allocate(std::size_t rounded, std::size_t requested, Stream stream, bool spare_homes) {
  // Events are polled unless the stream captures (a query would invalidate
  // the capture); their blocks then wait until after it, as in torch.
  int capturing = -1;  // unknown: asked of the backend at most once
  auto is_capturing = [&] {
    if (capturing < 0) capturing = backend_->stream_capturing(stream) ? 1 : 0;
    return capturing == 1;
  };
  if (!pending_events_.empty() && !is_capturing()) process_events();
  PoolKind pool = BlockPool::pool_for(rounded);
  // 1. cached block (one that no evicted value left, if one fits: spare_evicted),
  // at its high end for a request expected to outlive the step (long_lived)
  Block* cached = spare_homes && !homes_.empty()
                      ? pool_.find_free_sparing(pool, stream, rounded, [this](const Block* c) { return in_home(c); },
                                                kSpareSearch)
                      : pool_.find_free(pool, stream, rounded);
  if (cached) {
    const bool long_lived = take_long_lived(rounded);
    return pool_.allocate_from(arena_place(cached, pool, stream, rounded, long_lived), rounded, requested,
                               long_lived);
  }
  // Every step below may call cudaMalloc, cudaFree or wait on events.
  if (is_capturing()) refuse_capture(requested, stream);
  // In an arena (Note [arena]) a small request the small pool cannot serve
  // takes the arena's top before any new segment, with a budget or without:
  // a small segment made while none is in force (between dtr() sessions)
  // would sit beside an arena that holds the budget's every byte, and the
  // next session's budget would start exceeded.
  if (arena_ && pool == kSmallPool)
    if (Block* b = small_in_arena(rounded, requested, stream)) return b;
  // 2. new segment (after GC, if configured)
  if (config_.garbage_collection_threshold > 0) garbage_collect(pool_.segment_size(rounded));
  if (Block* b = make_arena(rounded, requested, stream, pool)) return b;
  if (Block* b = allocate_segment(rounded, requested, stream)) return b;
  // 3. oversize cached segments: split one (split_oversize), or give back and make
  if (Block* b = split_oversize_segment(rounded, requested, stream)) return b;
  if (release_oversize_segments(rounded, stream))
    if (Block* b = allocate_segment(rounded, requested, stream)) return b;
  // 4. everything cached (but the arena, which a new segment could not outgrow)
  const auto whole = pool_.whole_free_segments();
  if (!pending_events_.empty() || std::any_of(whole.begin(), whole.end(), [](const Segment* s) { return !s->arena; })) {
    ++pool_.stats().num_alloc_retries;
    synchronize_and_free_events();
    release_for_segment(rounded, stream);
    if (Block* b = pool_.find_free(pool, stream, rounded))
      return pool_.allocate_from(b, rounded, requested, take_long_lived(rounded));
    if (Block* b = allocate_segment(rounded, requested, stream)) return b;
  }
  // small_in_large (config.cpp): a small request takes a large-pool block;
  // in an arena, at the top of the highest one.
  if (pool == kSmallPool && config_.small_in_large == Switch::kOn) {
    if (arena_) return small_in_arena(rounded, requested, stream);
    if (Block* b = pool_.find_free(kLargePool, stream, rounded)) return pool_.allocate_from(b, rounded, requested);
  }
  return nullptr;
}

// arena:on implies small_in_large on (config.cpp): the top of the highest
// large-pool free block of the stream that serves the request.
Block* Allocator::small_in_arena(std::size_t rounded, std::size_t requested, Stream stream) {
  Block* b = pool_.find_free(kLargePool, stream, rounded);
  return b ? pool_.allocate_from(arena_place(b, kLargePool, stream, rounded, true), rounded, requested,
                                 /*high=*/true, /*split=*/true)
           : nullptr;
}

Block* Allocator::arena_place(Block* b, PoolKind pool, Stream stream, std::size_t rounded, bool long_lived) const {
  if (!arena_ || pool != kLargePool || !long_lived) return b;
  Block* top = pool_.find_free_highest(pool, stream, rounded);
  return top ? top : b;
}

std::string graph_capture_refusal(const std::string& what) {
  return "dtralloc: " + what +
         ", but dtralloc does not support CUDA graph capture (torch.cuda.graph, "
         "torch.cuda.make_graphed_callables, torch.compile(mode=\"reduce-overhead\"), "
         "torch.cuda.MemPool): it keeps no private memory pool per graph, so blocks freed "
         "during capture would be handed out again while replays still write to them, and a "
         "cache miss would need cudaMalloc, which capture forbids. Capture without dtralloc: "
         "run this program (or the part that captures) in a process that does not call "
         "dtralloc.install(), or use torch.compile without mode=\"reduce-overhead\".";
}

void Allocator::refuse_capture(std::size_t size, Stream stream) {
  throw GraphCaptureError(graph_capture_refusal(
      "stream " + hex(stream) + " on device " + std::to_string(device_) +
      " is capturing a CUDA graph and asked for " + format_bytes(size) +
      " that the cache cannot serve"));
}

Block* Allocator::allocate_segment(std::size_t rounded, std::size_t requested, Stream stream) {
  std::size_t bytes = pool_.segment_size(rounded);
  const std::size_t reserved = reserved_bytes();
  const std::size_t own = BlockPool::own_segment_size(rounded);
  const bool large = BlockPool::pool_for(rounded) == kLargePool;
  if (reserved + bytes > budget_bytes_ || (large && own < bytes && tight_segments_)) {
    // Under a tight budget a large-pool request gets a segment of its own
    // (2 MiB-rounded) size rather than failing for want of a whole 20 MiB
    // segment: the budget, not the segment granularity, should be the limit.
    // So does every one under tight placement (set_tight_segments).
    if (!large || own >= bytes || reserved + own > budget_bytes_) return nullptr;
    bytes = own;
  }
  Block* b = new_segment(bytes, stream, BlockPool::pool_for(rounded));
  // The device refused a standard segment the budget allowed: one of the
  // request's own size may still fit what it has left (smallest_segment,
  // which the evictor's release plans make room for).
  if (!b && large && own < bytes) b = new_segment(own, stream, kLargePool);
  return b ? pool_.allocate_from(b, rounded, requested) : nullptr;
}

std::size_t Allocator::limit_locked() {
  const std::size_t budget = budget_bytes_;
  if (!device_limited_.load(std::memory_order_relaxed)) return budget;
  const std::size_t reserved = reserved_bytes();
  if (reserved >= budget) return budget;
  return std::min(budget, reserved + backend_->free_bytes());
}

std::size_t Allocator::device_free_bytes() {
  std::lock_guard<std::mutex> lock(mutex_);
  return backend_->free_bytes();
}

namespace {
// Adds the time until it goes out of scope to a stats counter (device_alloc_ns,
// device_free_ns): a backend call that throws took its time too.
class CallTimer {
 public:
  explicit CallTimer(std::int64_t& into) : into_(into), start_(std::chrono::steady_clock::now()) {}
  ~CallTimer() {
    into_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_).count();
  }
  CallTimer(const CallTimer&) = delete;
  CallTimer& operator=(const CallTimer&) = delete;

 private:
  std::int64_t& into_;
  std::chrono::steady_clock::time_point start_;
};
}  // namespace

void* Allocator::backend_allocate(std::size_t bytes, Stream stream) {
  CallTimer timer(pool_.stats().device_alloc_ns);
  return backend_->allocate(bytes, stream);
}

void Allocator::backend_release(std::uintptr_t addr, std::size_t bytes, Stream stream) {
  CallTimer timer(pool_.stats().device_free_ns);
  backend_->release(reinterpret_cast<void*>(addr), bytes, stream);
}

Block* Allocator::new_segment(std::size_t bytes, Stream stream, PoolKind pool) {
  void* ptr = backend_allocate(bytes, stream);
  if (!ptr) {
    device_limited_.store(true, std::memory_order_relaxed);  // callers ask only for what the budget allows
    return nullptr;
  }
  ++pool_.stats().num_device_alloc;
  settle_device_pool();
  auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  record(TraceAction::kSegmentAlloc, addr, bytes, stream);
  return pool_.add_segment(addr, bytes, stream, pool);
}

// Async segments (Note [async segments]): the driver reuses what a free
// gave back for the next allocation on the stream when it fits; when it
// could not and grew past the budget instead, the device holds more than
// the budget until the next synchronize, and every segment made before that
// could add to it. Waiting for the device here (once: the frees then run
// and go back) keeps the excess to this one allocation, at the price of the
// wait cudaFree would have cost. What the driver still holds beyond the
// pool's segments after a wait (its own granularity: nothing a wait gives
// back) is remembered, so that it does not make every later segment wait.
void Allocator::settle_device_pool() {
  if (budget_bytes_ >= capacity_bytes_) return;  // no budget to hold
  Backend::DevicePoolBytes held;
  if (!backend_->device_pool_bytes(held)) return;
  const std::size_t ours = reserved_bytes();
  if (held.reserved <= std::max<std::size_t>(budget_bytes_, ours) + device_pool_overhead_) return;
  ++pool_.stats().num_device_pool_waits;
  CallTimer timer(pool_.stats().device_free_ns);
  backend_->trim();
  if (backend_->device_pool_bytes(held) && held.reserved > ours)
    device_pool_overhead_ = std::max(device_pool_overhead_, held.reserved - ours);
}

Block* Allocator::release_free_pages(std::size_t rounded, std::size_t requested, Stream stream,
                                     bool spare_homes) {
  if (!cut_pages_for(rounded, spare_homes)) return nullptr;
  return allocate_segment(rounded, requested, stream);
}

bool Allocator::give_back_pages(std::size_t rounded) {
  std::lock_guard<std::mutex> lock(mutex_);
  stamp();
  return cut_pages_for(rounded, false);
}

bool Allocator::cut_pages_for(std::size_t rounded, bool spare_homes) {
  if (config_.unmap_pages != Switch::kOn) return false;
  // The segment the request gets under a tight budget (allocate_segment).
  const std::size_t need = BlockPool::own_segment_size(rounded);
  const std::size_t reserved = reserved_bytes();
  std::size_t room = budget_bytes_ > reserved ? budget_bytes_ - reserved : 0;
  if (room >= need) return false;  // the budget is not what failed
  std::vector<std::pair<std::size_t, Block*>> pages;  // (bytes, block), every stream
  std::size_t total = 0;
  for (const auto& entry : pool_.segments())
    for (Block* b = entry.second->head; b; b = b->next)
      if (b->in_free_set && !(spare_homes && in_home(b)))
        if (const std::size_t n = BlockPool::free_pages(b, kRoundLarge).size) {
          pages.emplace_back(n, b);
          total += n;
        }
  if (room + total < need) return false;
  // Largest first (fewest cuts), then by address: the same state always
  // gives back the same pages.
  std::sort(pages.begin(), pages.end(), [](const auto& x, const auto& y) {
    return x.first != y.first ? x.first > y.first : x.second->addr < y.second->addr;
  });
  for (const auto& [n, b] : pages) {
    if (room >= need) break;
    const Stream s = b->stream;
    const BlockPool::Range cut = pool_.cut_free_pages(b, kRoundLarge);
    assert(cut.size == n);
    // The pool forgot the range first: were the backend to fail, the bytes
    // would be lost to the budget's count, never handed out twice.
    backend_release(cut.addr, cut.size, s);
    ++pool_.stats().num_page_releases;
    record(TraceAction::kSegmentUnmap, cut.addr, cut.size, s);
    room += cut.size;
  }
  return true;
}

void Allocator::release_segment(Segment* seg) {
  const std::uintptr_t addr = seg->addr;
  const std::size_t size = seg->size;
  const Stream stream = seg->stream;
  // Released first, forgotten second: when the backend fails, the segment
  // stays cached (whole and free) instead of leaking out of the pool's sight.
  backend_release(addr, size, stream);
  if (seg == arena_) arena_ = nullptr;
  pool_.remove_segment(seg);
  ++pool_.stats().num_device_free;
  record(TraceAction::kSegmentFree, addr, size, stream);
}

// Releases least recently used whole-free segments until reserved plus the
// incoming segment fits under threshold * budget (torch frees cached blocks
// by age the same way, so the pool does not creep up to the budget).
void Allocator::garbage_collect(std::size_t incoming_bytes) {
  const auto limit = static_cast<std::size_t>(config_.garbage_collection_threshold *
                                              static_cast<double>(budget_bytes_));
  if (reserved_bytes() + incoming_bytes <= limit) return;
  auto candidates = pool_.whole_free_segments();
  candidates.erase(std::remove(candidates.begin(), candidates.end(), arena_), candidates.end());  // the budget's own
  // Address breaks ties: the same calls release the same segments, always.
  std::sort(candidates.begin(), candidates.end(), [](const Segment* a, const Segment* b) {
    return a->last_free_tick != b->last_free_tick ? a->last_free_tick < b->last_free_tick
                                                  : a->addr < b->addr;
  });
  for (Segment* seg : candidates) {
    if (reserved_bytes() + incoming_bytes <= limit) break;
    release_segment(seg);
  }
}

// Step 3: with max_split_size_mb set, cached oversize segments cannot serve
// other sizes; release the smallest one that is large enough, or else the
// largest ones until enough is released.
bool Allocator::release_oversize_segments(std::size_t rounded, Stream stream) {
  if (config_.max_split_size_mb == kNoLimit) return false;
  std::vector<Segment*> oversize;
  for (Segment* seg : pool_.whole_free_segments())
    if (seg->stream == stream && seg->size >= config_.max_split_size_mb) oversize.push_back(seg);
  if (oversize.empty()) return false;
  // Address breaks ties between equal sizes: which one goes is determined.
  std::sort(oversize.begin(), oversize.end(), [](const Segment* a, const Segment* b) {
    return a->size != b->size ? a->size < b->size : a->addr < b->addr;
  });
  auto fit = std::find_if(oversize.begin(), oversize.end(),
                          [&](const Segment* s) { return s->size >= rounded; });
  if (fit != oversize.end()) {
    release_segment(*fit);
    return true;
  }
  std::size_t released = 0;
  while (!oversize.empty() && released < rounded) {
    released += oversize.back()->size;
    release_segment(oversize.back());
    oversize.pop_back();
  }
  return true;
}

// Step 3 under split_oversize: an oversize request the budget leaves no
// room for takes the low end of the smallest whole free oversize segment
// whose rest is oversize too, where release_oversize_segments would give
// that segment back and make one of the request's size (the same bytes
// reserved, one cudaFree and one cudaMalloc more, and the cudaFree waits for
// the device). The rest serves only oversize requests (may_serve), so no
// small block pins the segment; when the request's block is freed the two
// merge and the segment is whole again. Under a budget the steps of a
// training loop meet the same oversize sizes in a different order than
// their segments were made in (ResNet-50: 49, 98 and 196 MiB activations),
// so without it a step gave back and made segments every time
// (bench/segment_churn.py).
Block* Allocator::split_oversize_segment(std::size_t rounded, std::size_t requested, Stream stream) {
  if (config_.split_oversize != Switch::kOn || config_.max_split_size_mb == kNoLimit) return nullptr;
  if (rounded < config_.max_split_size_mb) return nullptr;
  Segment* best = nullptr;
  for (Segment* seg : pool_.whole_free_segments()) {
    if (seg->stream != stream || seg->size < rounded || seg->size - rounded < config_.max_split_size_mb) continue;
    // Address breaks ties between equal sizes: which one is split is determined.
    if (!best || seg->size < best->size || (seg->size == best->size && seg->addr < best->addr)) best = seg;
  }
  if (!best) return nullptr;
  return pool_.allocate_from(best->head, rounded, requested, false, true);
}

// Note [split_any_block]
// ~~~~~~~~~~~~~~~~~~~~~~
// max_split_size_mb keeps blocks of that size or more for requests of about
// their size: a smaller request may not split one, and a big one may take
// one only with at most max_non_split_rounding_mb to spare (may_serve). That
// keeps big tensors' rooms contiguous, but where nothing else is left it
// turned a request into an out-of-memory error beside a free block that
// could hold it: on cudaMalloc'd segments (no page to give back) Llama's
// step at 0.58-0.64 of its peak failed to allocate 4 to 125 MiB with a 375
// MiB block free in a segment that also held tensors. So, after every other
// step and after eviction, the request takes the best fit of any size,
// split. Only what would have been an OOM changes.
Block* Allocator::split_any_block(std::size_t rounded, std::size_t requested, Stream stream) {
  if (config_.max_split_size_mb == kNoLimit) return nullptr;  // find_free saw every block already
  const PoolKind pool = BlockPool::pool_for(rounded);
  Block* b = pool_.find_free_any(pool, stream, rounded);
  if (!b && pool == kSmallPool && config_.small_in_large == Switch::kOn)
    b = pool_.find_free_any(kLargePool, stream, rounded);
  if (!b) return nullptr;
  ++pool_.stats().num_split_limit_overrides;
  return pool_.allocate_from(b, rounded, requested, false, true);
}

// Step 4's release. Under the dtralloc policy, where the budget is what
// keeps a segment for `rounded` from being made, only what makes room for
// it goes: the smallest whole free segment that does alone, else the
// largest ones until there is room; the rest stay cached for the requests
// they fit (each cudaFree waits for the device, and what goes now is made
// again later in the step: under eviction a training loop's every step,
// bench/replay_device_calls.py); nothing goes where a block the events held
// serves the request now. Under other policies (torch's behaviour),
// where no budget is set or it had room (the device refused), or where all
// of them would not make room, every whole free segment goes, as torch
// does; so it does where unmap_pages gives pages back (there the replays
// found no gain: one recording of 48 gained a hole). The arena stays.
void Allocator::release_for_segment(std::size_t rounded, Stream stream) {
  std::vector<Segment*> whole;
  std::size_t total = 0;
  for (Segment* seg : pool_.whole_free_segments())
    if (!seg->arena) whole.push_back(seg), total += seg->size;
  const std::size_t bytes = smallest_segment(rounded);
  const std::size_t reserved = reserved_bytes();
  if (config_.policy != Policy::kDtralloc || config_.unmap_pages == Switch::kOn || budget_bytes_ >= capacity_bytes_ ||
      reserved + bytes <= budget_bytes_ || reserved + bytes - budget_bytes_ > total) {
    for (Segment* seg : whole) release_segment(seg);
    return;
  }
  if (pool_.find_free(BlockPool::pool_for(rounded), stream, rounded)) return;
  const std::size_t need = reserved + bytes - budget_bytes_;
  // Largest first; address breaks ties, so the same state releases the same.
  std::sort(whole.begin(), whole.end(), [](const Segment* a, const Segment* b) {
    return a->size != b->size ? a->size > b->size : a->addr < b->addr;
  });
  auto alone = std::find_if(whole.rbegin(), whole.rend(), [&](const Segment* s) { return s->size >= need; });
  if (alone != whole.rend()) {
    release_segment(*alone);
    return;
  }
  std::size_t released = 0;
  for (Segment* seg : whole) {
    if (released >= need) break;
    released += seg->size;
    release_segment(seg);
  }
}

void Allocator::release_cached_segments(bool keep_arena) {
  for (Segment* seg : pool_.whole_free_segments())
    if (!(keep_arena && seg->arena)) release_segment(seg);
}

// Note [arena] (docs/allocator.md has the figures)
// ~~~~~~~~~~~~
// With cudaMalloc'd segments a pool at its budget makes room for a request
// no cached block fits by giving whole segments back and making one of the
// request's size (steps 3 and 4, and the evictor's release plans, which
// evict a segment's tensors so that it can go), all through a step; each
// cudaFree waits for the device (bench/replay_device_calls.py counts them).
// With arena:on the first large request the cache cannot serve under a
// budget takes, in one segment, all the budget has left (cached whole free
// segments are given back first, once). From then on every request of that
// stream is served in it or by evicting a contiguous window of it; step 4
// and the evictor's release plans leave it alone, so the pool calls the
// device no more. Without segment boundaries a new segment no longer gathers
// memory from scattered places: the replays' lowest budgets rise and some
// traces recompute more; whether the device calls saved outweigh that is a
// GPU's question. empty_cache() gives the arena back; a budget lowered below
// the reserved bytes gives it back where it is empty, and the next miss
// makes one that fits the new budget. Another stream's requests get
// segments of their own in what the budget leaves.
//
// Placement in the arena is two-ended: large requests take the best fit
// (the low end of the smallest block that serves them), while small
// requests and what is announced to outlive the step (long_lived: the
// gradients) take the top of the highest free block that serves them
// (arena_place). Scattered through the arena, those blocks, which the
// evictor cannot free (pinned) or which free little (small), cut every
// window it could make for a large request; kept together at the top they
// leave the rest contiguous.
Block* Allocator::make_arena(std::size_t rounded, std::size_t requested, Stream stream, PoolKind pool) {
  if (config_.arena != Switch::kOn || arena_ || arena_refused_ || pool != kLargePool) return nullptr;
  if (budget_bytes_ >= capacity_bytes_) return nullptr;  // no budget: nothing to reserve
  release_cached_segments(false);  // what the cache holds whole would only sit beside it
  const std::size_t reserved = reserved_bytes();
  const std::size_t bytes = budget_bytes_ > reserved ? (budget_bytes_ - reserved) / kRoundLarge * kRoundLarge : 0;
  if (bytes < BlockPool::own_segment_size(rounded)) return nullptr;  // the request does not fit what is left
  Block* b = new_segment(bytes, stream, kLargePool);
  if (!b) {
    arena_refused_ = true;
    return nullptr;
  }
  arena_ = b->segment;
  arena_->arena = true;
  return pool_.allocate_from(b, rounded, requested, take_long_lived(rounded));
}

void Allocator::free(void* ptr) {
  if (!ptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  stamp();
  auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  Block* b = pool_.lookup_allocated(addr);
  if (!b) {
    ++pool_.stats().num_invalid_frees;
    throw InvalidPointerError(
        "dtralloc: free of " + hex(addr) + " on device " + std::to_string(device_) +
        ", which this pool has not allocated or has already freed (a double free, or "
        "memory from another allocator). Nothing was changed.");
  }
  // record_stream: the block may still be in use by kernels on other
  // streams. Its events are made before the block changes, so that a backend
  // error leaves either a block fully pending or one safely free.
  std::vector<EventHandle> events = record_stream_events(b);
  record(TraceAction::kFreeRequested, b->addr, b->requested_size, b->stream);
  pool_.mark_freed(b);
  b->stream_uses.clear();
  if (events.empty()) {
    finish_free(b);
    return;
  }
  for (EventHandle ev : events) pending_events_.push_back({ev, b});
  b->event_count = static_cast<int>(events.size());
}

// One event per stream in b->stream_uses, recorded there now. When the
// backend fails on any of them, waits for each of those streams instead
// (after which none can still use the block) and returns none; when that
// wait fails too, rethrows with nothing changed, so the caller still owns
// the block. Never leaves an event behind on failure. A stream of another
// device fails that way on a GPU ("event and stream must be on the same
// device", cudaEventRecord), so the wait is per stream: waiting for the
// block's own device would not cover it.
std::vector<EventHandle> Allocator::record_stream_events(Block* b) {
  std::vector<EventHandle> events;
  if (b->stream_uses.empty()) return events;
  events.reserve(b->stream_uses.size());
  try {
    for (Stream s : b->stream_uses) {
      events.push_back(backend_->create_event());
      backend_->record_event(events.back(), s);
    }
    return events;
  } catch (const std::exception& first) {
    for (EventHandle ev : events) {
      try {
        backend_->destroy_event(ev);
      } catch (const std::exception&) {
        // A handle the runtime refuses to destroy is dropped, never reused.
      }
    }
    try {
      for (Stream s : b->stream_uses) backend_->synchronize_stream(s);
    } catch (const std::exception& second) {
      throw std::runtime_error(std::string(first.what()) +
                               "; waiting for the streams that used the block instead failed too (" +
                               second.what() + "), so the block stays allocated");
    }
    return {};
  }
}

void Allocator::finish_free(Block* b) {
  const std::uintptr_t addr = b->addr;
  const std::size_t size = b->requested_size;  // kept while pending, for this entry
  const Stream stream = b->stream;
  pool_.return_to_pool(b, ++tick_);
  record(TraceAction::kFreeCompleted, addr, size, stream);
}

// Polls the pending events in order. Exception-safe: an entry leaves
// pending_events_ exactly when its event completed, before the event is
// destroyed, so a backend error (rethrown) never makes an event be queried or
// destroyed twice, nor a block's count be decremented twice.
void Allocator::process_events() {
  std::size_t kept = 0, next = 0;
  try {
    while (next < pending_events_.size()) {
      const PendingEvent p = pending_events_[next];
      bool done = false;
      try {
        done = backend_->event_completed(p.event);
      } catch (...) {
        pending_events_[kept++] = p;  // still pending; asked again next time
        ++next;
        throw;
      }
      ++next;
      if (!done) {
        pending_events_[kept++] = p;
        continue;
      }
      retire_event(p);
      backend_->destroy_event(p.event);
    }
  } catch (...) {
    pending_events_.erase(pending_events_.begin() + static_cast<std::ptrdiff_t>(kept),
                          pending_events_.begin() + static_cast<std::ptrdiff_t>(next));
    throw;
  }
  pending_events_.resize(kept);
}

// Waits for every pending event. On a backend error the events not yet
// waited for (the failing one included) stay pending, and the error is
// rethrown; the next call carries on from there.
void Allocator::synchronize_and_free_events() {
  if (pending_events_.empty()) return;
  ++pool_.stats().num_sync_all_streams;
  std::size_t consumed = 0;
  try {
    while (consumed < pending_events_.size()) {
      const PendingEvent p = pending_events_[consumed];
      backend_->synchronize_event(p.event);
      ++consumed;  // before the destroy, which may throw
      retire_event(p);
      backend_->destroy_event(p.event);
    }
  } catch (...) {
    pending_events_.erase(pending_events_.begin(),
                          pending_events_.begin() + static_cast<std::ptrdiff_t>(consumed));
    throw;
  }
  pending_events_.clear();
}

// One of the block's events completed: the block returns once all have.
void Allocator::retire_event(const PendingEvent& p) {
  assert(p.block->event_count > 0);
  if (--p.block->event_count == 0) finish_free(p.block);
}

void Allocator::record_stream(void* ptr, Stream stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto addr = reinterpret_cast<std::uintptr_t>(ptr);
  Block* b = pool_.lookup_allocated(addr);
  if (!b) {
    ++pool_.stats().num_invalid_frees;
    throw InvalidPointerError("dtralloc: record_stream on " + hex(addr) +
                              ", which this pool has not allocated (or already freed)");
  }
  if (stream == b->stream) return;  // its own stream orders itself
  if (std::find(b->stream_uses.begin(), b->stream_uses.end(), stream) == b->stream_uses.end())
    b->stream_uses.push_back(stream);
}

bool Allocator::owns(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  return pool_.lookup_allocated(reinterpret_cast<std::uintptr_t>(ptr)) != nullptr;
}

void* Allocator::base_allocation(void* ptr, std::size_t* size) {
  std::lock_guard<std::mutex> lock(mutex_);
  Segment* seg = pool_.segment_at(reinterpret_cast<std::uintptr_t>(ptr));
  if (!seg) {
    if (size) *size = 0;
    return ptr;
  }
  if (size) *size = seg->size;
  return reinterpret_cast<void*>(seg->addr);
}

void Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  stamp();
  synchronize_and_free_events();
  release_cached_segments();
  // Async segments: what the frees gave the driver's pool goes to the device
  // too, as a cudaFree'd segment's does.
  backend_->trim();
}

void Allocator::complete_events() {
  std::lock_guard<std::mutex> lock(mutex_);
  stamp();
  backend_->complete_events();
  process_events();
}

void Allocator::set_memory_fraction(double fraction) {
  if (!(fraction >= 0.0 && fraction <= 1.0))
    throw std::invalid_argument("dtralloc: memory fraction must be in [0, 1], got " +
                                std::to_string(fraction));
  std::lock_guard<std::mutex> lock(mutex_);
  fraction_cap_bytes_ = static_cast<std::size_t>(fraction * static_cast<double>(capacity_bytes_));
  refresh_budget();
}

// Under mutex_: a live session's budget while one sets it, the configured one otherwise.
std::size_t Allocator::own_budget() const {
  return session_bytes_ ? std::min(session_bytes_, capacity_bytes_) : config_budget_bytes_;
}

// Under mutex_.
void Allocator::refresh_budget() {
  const std::size_t before = budget_bytes_;
  budget_bytes_ = std::min(own_budget(), fraction_cap_bytes_);
  if (budget_bytes_ != before) arena_refused_ = false;
  // An empty arena sized for a larger budget goes; the next miss makes one
  // that fits (Note [arena]).
  if (arena_ && arena_->whole_free() && reserved_bytes() > budget_bytes_) release_segment(arena_);
  reserved_at_budget_change_ = reserved_bytes();
}

std::shared_ptr<EvictionHook> Allocator::eviction_hook() {
  std::lock_guard<std::mutex> lock(mutex_);
  return hook_;
}

void Allocator::override_session(std::size_t bytes, Policy policy) {
  Config want = requested_;
  want.policy = policy;
  if (bytes) {
    want.budget = Budget{};
    want.budget.bytes = bytes;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  session_bytes_ = bytes;
  refresh_budget();
  apply_resolved(resolve_config(want, backend_->releases_ranges()));
}

void Allocator::end_override() {
  std::lock_guard<std::mutex> lock(mutex_);
  session_bytes_ = 0;
  refresh_budget();
  apply_resolved(resolve_config(requested_, backend_->releases_ranges()));
}

// Under mutex_. Only what resolve_config settles changes; the oversize
// counters follow a new max_split_size_mb (BlockPool::recount_oversize).
void Allocator::apply_resolved(const Config& resolved) {
  config_.policy = resolved.policy;  // the session's while it runs (release_for_segment reads it)
  config_.segment_fit = resolved.segment_fit;
  config_.small_in_large = resolved.small_in_large;
  config_.spare_evicted = resolved.spare_evicted;
  config_.long_lived = resolved.long_lived;
  config_.unmap_pages = resolved.unmap_pages;
  config_.split_oversize = resolved.split_oversize;
  config_.arena = resolved.arena;
  if (config_.max_split_size_mb != resolved.max_split_size_mb) {
    config_.max_split_size_mb = resolved.max_split_size_mb;
    pool_.recount_oversize();
  }
  if (config_.spare_evicted != Switch::kOn) {  // no room is spared any more
    homes_.clear();
    home_of_.clear();
    largest_home_ = 0;
  }
  if (config_.long_lived != Switch::kOn) {
    long_lived_.clear();
    long_lived_set_.store(false, std::memory_order_relaxed);
  }
}

void Allocator::set_eviction_hook(std::shared_ptr<EvictionHook> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  hook_ = std::move(hook);
}

void Allocator::set_history_entries(std::size_t entries) {
  if (entries > kMaxHistoryEntries)
    throw std::invalid_argument("dtralloc: history entries must be at most " +
                                std::to_string(kMaxHistoryEntries) + ", got " + std::to_string(entries));
  std::lock_guard<std::mutex> lock(mutex_);
  history_.assign(entries, TraceEntry{});
  history_next_ = 0;
  history_wrapped_ = false;
  history_recorded_ = 0;
}

std::size_t Allocator::history_entries() {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_.size();
}

std::string Allocator::publish(std::int64_t period_us, const std::string& label) {
  std::lock_guard<std::mutex> lock(publisher_mutex_);
  publisher_.reset();  // its file goes before a new one takes the name
  if (period_us > 0) publisher_ = std::make_unique<Publisher>(*this, period_us, label);
  return publisher_ ? publisher_->path() : std::string();
}

std::string Allocator::published_path() {
  std::lock_guard<std::mutex> lock(publisher_mutex_);
  return publisher_ ? publisher_->path() : std::string();
}

void Allocator::add_published_counts(std::int64_t evictions, std::int64_t remats) {
  std::lock_guard<std::mutex> lock(publisher_mutex_);
  if (publisher_) publisher_->add_counts(evictions, remats);
}

std::size_t Allocator::reserved_bytes() const {
  return static_cast<std::size_t>(pool_.stats().reserved_bytes[kStatAll].current);
}

Allocator::Usage Allocator::usage() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {reserved_bytes(), static_cast<std::size_t>(pool_.stats().allocated_bytes[kStatAll].current)};
}

Allocator::Sample Allocator::sample() {
  std::lock_guard<std::mutex> lock(mutex_);
  const Stats& s = pool_.stats();
  return {s.reserved_bytes[kStatAll].current, s.allocated_bytes[kStatAll].current,
          static_cast<std::int64_t>(pool_.largest_free_block()), static_cast<std::int64_t>(pool_.free_bytes()),
          history_recorded_, !history_.empty()};
}

StatsReport Allocator::stats_report() {
  std::lock_guard<std::mutex> lock(mutex_);
  StatsReport r;
  r.stats = pool_.stats();
  r.budget_bytes = budget_bytes_;
  r.capacity_bytes = capacity_bytes_;
  r.largest_free_bytes = pool_.largest_free_block();
  r.free_cached_bytes = pool_.free_bytes();
  r.max_split_size = config_.max_split_size_mb;
  r.has_device_pool = backend_->device_pool_bytes(r.device_pool);
  return r;
}

void Allocator::reset_peak_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_.stats().for_each_stat([](Stat& s) { s.reset_peak(); });
  backend_->reset_device_pool_peak();
}

void Allocator::reset_accumulated_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  Stats& s = pool_.stats();
  s.for_each_stat([](Stat& st) { st.reset_accumulated(); });
#define DTRALLOC_ZERO(name) s.name = 0;
  DTRALLOC_COUNTERS(DTRALLOC_ZERO)
#undef DTRALLOC_ZERO
}

void Allocator::check_invariants() {
  std::lock_guard<std::mutex> lock(mutex_);
  pool_.check_invariants();
  // I4: no segment takes reserved past the budget; a budget lowered under
  // what was reserved then frees nothing by itself (refresh_budget).
  if (reserved_bytes() > std::max<std::size_t>(budget_bytes_, reserved_at_budget_change_))
    throw std::logic_error("dtralloc invariant violated: I4: reserved exceeds the budget");
  std::size_t pending_blocks = 0;
  for (const auto& [addr, seg] : pool_.segments())
    for (const Block* b = seg->head; b; b = b->next)
      if (b->pending()) {
        ++pending_blocks;
        if (b->event_count <= 0) throw std::logic_error("dtralloc invariant violated: pending block without events");
      }
  std::size_t counted = 0;
  for (const auto& p : pending_events_) counted += p.block->event_count > 0;
  if (pending_blocks > 0 && counted == 0)
    throw std::logic_error("dtralloc invariant violated: pending blocks but no events");
}

Snapshot Allocator::snapshot() {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshot_locked(nullptr);
}

Snapshot Allocator::snapshot(const HistoryChunk& history) {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshot_locked(&history);
}

std::size_t Allocator::history_size() {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_wrapped_ ? history_.size() : history_next_;
}

Snapshot Allocator::snapshot_locked(const HistoryChunk* history) {
  Snapshot snap;
  for (const auto& [addr, seg] : pool_.segments()) {
    SegmentInfo info{seg->addr, seg->size, 0, 0, 0, seg->stream, seg->pool == kSmallPool, {}};
    for (const Block* b = seg->head; b; b = b->next) {
      const char* state = b->allocated ? "active_allocated"
                          : b->pending() ? "active_pending_free"
                                         : "inactive";
      info.blocks.push_back({b->addr, b->size, b->allocated ? b->requested_size : b->size, state});
      if (b->allocated) {
        info.allocated_size += b->size;
        info.requested_size += b->requested_size;
      }
      if (!b->in_free_set) info.active_size += b->size;
    }
    snap.segments.push_back(std::move(info));
  }
  // The ring holds [history_next_, end) then [0, history_next_) once wrapped.
  const TraceEntry* ring = history_.data();
  const std::size_t older = history_wrapped_ ? history_.size() - history_next_ : 0;
  if (history) {
    (*history)(ring + history_next_, older, ring, history_next_);
    return snap;
  }
  snap.trace.reserve(older + history_next_);
  snap.trace.insert(snap.trace.end(), ring + history_next_, ring + history_next_ + older);
  snap.trace.insert(snap.trace.end(), ring, ring + history_next_);
  return snap;
}

void Allocator::stamp() {
  if (!history_.empty()) op_time_us_ = now_us();
}

void Allocator::record(TraceAction action, std::uintptr_t addr, std::size_t size, Stream stream,
                       std::size_t detail) {
  if (history_.empty()) return;
  history_[history_next_] = {action, op_stamp_.load(std::memory_order_relaxed), addr, size, stream,
                             op_time_us_, detail};
  ++history_recorded_;
  if (++history_next_ == history_.size()) {
    history_next_ = 0;
    history_wrapped_ = true;
  }
}

std::uint64_t Allocator::history_recorded() {
  std::lock_guard<std::mutex> lock(mutex_);
  return history_recorded_;
}

std::string Allocator::oom_message(std::size_t size, std::size_t rounded, Stream stream) {
  const Stats& s = pool_.stats();
  const std::size_t reserved = reserved_bytes();
  const auto allocated = static_cast<std::size_t>(s.allocated_bytes[kStatAll].current);
  const std::size_t largest = pool_.largest_free_block();
  const std::size_t free_cached = pool_.free_bytes();
  const double frag = free_cached ? 1.0 - double(largest) / double(free_cached) : 0.0;
  std::ostringstream m;
  m << kOutOfMemoryText << " Tried to allocate " << format_bytes(size) << " ("
    << format_bytes(rounded) << " rounded) on device " << device_ << ", stream "
    << hex(stream) << ". Budget " << format_bytes(budget_bytes_) << ", reserved "
    << format_bytes(reserved) << ", allocated " << format_bytes(allocated)
    << ", largest free block " << format_bytes(largest) << " of "
    << format_bytes(free_cached) << " free in cache (external fragmentation ";
  char frag_text[16];
  std::snprintf(frag_text, sizeof frag_text, "%.2f", frag);
  const std::size_t device_free = backend_->free_bytes();
  m << frag_text << "), device capacity " << format_bytes(capacity_bytes_) << " with "
    << format_bytes(device_free) << " free. ";
  if (rounded <= kMaxRequestBytes && reserved + pool_.segment_size(rounded) <= budget_bytes_ &&
      device_free < rounded)
    m << "The device itself is full: other processes or allocators hold its memory. ";
  if (free_cached >= rounded && largest < rounded) {
    // In an arena max_split_size_mb must stay none (config.cpp): the way out is the arena itself.
    if (config_.arena == Switch::kOn)
      m << "Enough memory is free but fragmented in the arena: with arena:off the pool places by segment "
           "and fits lower budgets, at the price of a cudaMalloc and cudaFree wherever it gives a segment "
           "back to make another (docs/allocator.md, Note [arena]). ";
    else
      m << "Enough memory is free but fragmented: try DTRALLOC_CONF=max_split_size_mb:"
        << std::max<std::size_t>(21, rounded / kMiB) << " or roundup_power2_divisions:4. ";
  }
  if (budget_bytes_ < capacity_bytes_) {
    // Which cap is in force: torch's memory fraction, a dtr() session's budget, or the configured one.
    if (fraction_cap_bytes_ < own_budget())
      m << "torch.cuda.set_per_process_memory_fraction caps reserved memory at " << format_bytes(budget_bytes_)
        << ": raise the fraction if the device has room. ";
    else if (session_bytes_)
      m << "The dtr() session's budget caps reserved memory: pass a larger dtralloc.dtr(budget=...) (now "
        << format_bytes(budget_bytes_) << ") if the device has room. ";
    else
      m << "The budget caps reserved memory: raise DTRALLOC_CONF=budget (now "
        << format_bytes(budget_bytes_) << ") if the device has room. ";
  }
  m << "To fit, reduce the batch size or free tensors you no longer need.";
  return m.str();
}

}  // namespace dtralloc
