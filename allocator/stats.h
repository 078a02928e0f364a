// Stats: declared once (X-macros), reported under torch's key names.
//
// Per-pool stats are arrays indexed by StatIndex, exactly like torch's
// DeviceStats: "allocated_bytes.all.current", "allocated_bytes.small_pool.peak",
// ... Counters are plain integers ("num_ooms"). memory_stats() walks these
// lists; nothing else spells the names out.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

namespace dtralloc {

struct Stat {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;  // total ever added
  std::int64_t freed = 0;      // total ever removed

  void increase(std::int64_t n) {
    current += n;
    allocated += n;
    peak = std::max(peak, current);
  }
  void decrease(std::int64_t n) {
    current -= n;
    freed += n;
  }
  void reset_accumulated() { allocated = freed = 0; }
  void reset_peak() { peak = current; }
};

// Index 0 aggregates both pools (torch's StatType::AGGREGATE).
enum StatIndex : int { kStatAll = 0, kStatSmallPool = 1, kStatLargePool = 2, kNumStatIndices = 3 };
constexpr const char* kStatIndexNames[kNumStatIndices] = {"all", "small_pool", "large_pool"};
using StatArray = std::array<Stat, kNumStatIndices>;

// Stats kept per pool, as torch names them:
//   allocation / allocated_bytes   blocks handed to users and not yet freed
//   active / active_bytes          allocated, or freed but waiting on a
//                                  record_stream event
//   inactive_split / _bytes        free blocks inside a segment that is split
//   segment / reserved_bytes       segments obtained from the backend
//   requested_bytes                sizes asked for, before rounding
#define DTRALLOC_POOL_STATS(X) \
  X(allocation)                \
  X(segment)                   \
  X(active)                    \
  X(inactive_split)            \
  X(allocated_bytes)           \
  X(reserved_bytes)            \
  X(active_bytes)              \
  X(inactive_split_bytes)      \
  X(requested_bytes)

// Stats without a pool split (sizes at or above max_split_size_mb).
#define DTRALLOC_PLAIN_STATS(X) \
  X(oversize_allocations)       \
  X(oversize_segments)

// Monotonic counters.
//   num_alloc_retries    cached segments were released and the malloc retried
//   num_ooms             mallocs that failed after every fallback
//   num_sync_all_streams all record_stream events were waited for
//   num_device_alloc     backend allocations (cudaMalloc calls that succeeded)
//   num_device_free      backend releases (cudaFree calls)
//   num_invalid_frees    double frees and frees of unknown pointers (rejected)
//   num_eviction_calls   times the eviction hook was asked for room
//   num_oom_rejections   torch's key: allocations an OOM-rejection observer
//                        turned down. dtralloc has no such observers, so it
//                        stays 0; it is reported so torch's tools find it.
//   num_page_releases    unmap_pages: ranges of whole free pages given back
//                        to the backend from segments that stay in use
//   num_long_lived       long_lived: requests served as announced to outlive
//                        the step (at the high end of the block they split)
//   num_split_limit_overrides  requests that split a block max_split_size_mb
//                        kept from them, where the alternative was an OOM
//                        (Allocator::split_any_block)
//   num_device_pool_waits  async_segments: times the driver's pool, having
//                        grown past the budget rather than reuse what the
//                        pool gave back, was made to give that back (a
//                        device synchronize: Allocator::new_segment)
//   device_alloc_ns      host time inside the backend's allocations, failed
//                        ones included (cudaMalloc; VMM: create and map)
//   device_free_ns       host time inside the backend's releases, segments
//                        and unmap_pages' page ranges. cudaFree waits for
//                        the device first (and dtralloc synchronizes before
//                        a VMM unmap), so this includes the wait: where the
//                        GPU ran behind the host, time it then sat idle
#define DTRALLOC_COUNTERS(X) \
  X(num_alloc_retries)       \
  X(num_ooms)                \
  X(num_sync_all_streams)    \
  X(num_device_alloc)        \
  X(num_device_free)         \
  X(num_invalid_frees)       \
  X(num_eviction_calls)      \
  X(num_oom_rejections)      \
  X(num_page_releases)       \
  X(num_long_lived)          \
  X(num_split_limit_overrides) \
  X(num_device_pool_waits)     \
  X(device_alloc_ns)           \
  X(device_free_ns)

struct Stats {
#define DTRALLOC_POOL_FIELD(name) StatArray name;
  DTRALLOC_POOL_STATS(DTRALLOC_POOL_FIELD)
#undef DTRALLOC_POOL_FIELD
#define DTRALLOC_PLAIN_FIELD(name) Stat name;
  DTRALLOC_PLAIN_STATS(DTRALLOC_PLAIN_FIELD)
#undef DTRALLOC_PLAIN_FIELD
#define DTRALLOC_COUNTER_FIELD(name) std::int64_t name = 0;
  DTRALLOC_COUNTERS(DTRALLOC_COUNTER_FIELD)
#undef DTRALLOC_COUNTER_FIELD

  // Apply `fn(Stat&)` to every Stat (not the counters).
  template <typename Fn>
  void for_each_stat(Fn fn) {
#define DTRALLOC_POOL_VISIT(name) for (auto& s : name) fn(s);
    DTRALLOC_POOL_STATS(DTRALLOC_POOL_VISIT)
#undef DTRALLOC_POOL_VISIT
#define DTRALLOC_PLAIN_VISIT(name) fn(name);
    DTRALLOC_PLAIN_STATS(DTRALLOC_PLAIN_VISIT)
#undef DTRALLOC_PLAIN_VISIT
  }
};

// Update the aggregate and the pool entry together.
inline void stat_increase(StatArray& a, int pool, std::int64_t n) {
  a[kStatAll].increase(n);
  a[pool].increase(n);
}
inline void stat_decrease(StatArray& a, int pool, std::int64_t n) {
  a[kStatAll].decrease(n);
  a[pool].decrease(n);
}

}  // namespace dtralloc
