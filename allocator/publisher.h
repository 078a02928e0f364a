// Publisher: a layer around one Allocator that copies its counters into a
// small shared-memory file, for `dtralloc top` to read from another process.
//
//   /dev/shm/dtralloc-<pid>-<device>[-<n>]   (the suffix only when a second
//                                            pool of this process publishes
//                                            for the same device; /tmp when
//                                            there is no /dev/shm)
//
// Cost to the hot path: none. malloc and free contain no publisher code; a
// thread of the publisher's own wakes every period, takes the pool lock for
// the few loads of the counters (plus a walk of the free sets for the largest
// free block), and writes one frame. The per-segment summary needs a walk of
// every block, so it is refreshed only while walks take at most 1% of the
// time (kWalkShare), and at most every period.
//
// A frame is read without locks: `seq` is odd while the writer is inside a
// frame (a seqlock). Readers copy the file, and keep the copy when `seq` was
// even before the copy and unchanged after it.
//
// File layout (version 1, native byte order, all fields 8 bytes):
//   magic "DTRALLOC", version u32, header_bytes u32, seq u64
//   label: 32 bytes (backend, and "pool" for a dtralloc.Pool)
//   the header fields of DTRALLOC_PUBLISHED_FIELDS, int64 each
//   kPublishedSamples samples of DTRALLOC_PUBLISHED_SAMPLE (a ring: the
//     newest is at sample_next - 1), one per frame
//   kPublishedSegments segments of DTRALLOC_PUBLISHED_SEGMENT (segment_count
//     valid, the largest segments in address order)
// _core.publisher_layout() describes this for the Python reader; nothing else
// spells the offsets out.
#pragma once

#include <atomic>
#include <condition_variable>
#include <memory>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace dtralloc {

class Allocator;

// Header fields, in file order: X(name, doc).
#define DTRALLOC_PUBLISHED_FIELDS(X)                                              \
  X(pid, "process id of the publisher")                                         \
  X(device, "device index of the allocator")                                   \
  X(period_us, "target time between frames")                                   \
  X(frame, "frames written so far")                                            \
  X(time_us, "CLOCK_REALTIME of this frame, microseconds")                     \
  X(budget_bytes, "cap on reserved bytes in force")                            \
  X(capacity_bytes, "device capacity")                                         \
  X(reserved_bytes, "bytes in segments")                                       \
  X(allocated_bytes, "bytes in allocated blocks")                              \
  X(active_bytes, "allocated plus freed blocks waiting on record_stream events") \
  X(requested_bytes, "bytes the allocated blocks were asked for (before rounding)") \
  X(peak_reserved_bytes, "peak reserved since the last reset_peak_stats")      \
  X(peak_allocated_bytes, "peak allocated since the last reset_peak_stats")    \
  X(largest_free_bytes, "largest cached free block")                           \
  X(free_bytes, "all cached free blocks")                                      \
  X(segments, "segments held")                                                 \
  X(allocations, "blocks allocated now")                                       \
  X(num_ooms, "allocations that failed after every fallback")                  \
  X(num_alloc_retries, "times every cached segment was released and malloc retried") \
  X(num_device_alloc, "segments obtained from the backend")                    \
  X(num_device_free, "segments released to the backend")                       \
  X(num_eviction_calls, "times the eviction hook was asked for room")          \
  X(evictions, "values evicted, as counted by a DTR session (add_counts)")      \
  X(remats, "values rematerialized, as counted by a DTR session (add_counts)")  \
  X(segment_count, "segments in the per-segment table below")                  \
  X(segments_time_us, "CLOCK_REALTIME when the per-segment table was taken")   \
  X(sample_next, "ring slot the next sample goes to")

// One sample per frame, for sparklines and for the peak between two reads.
#define DTRALLOC_PUBLISHED_SAMPLE(X) \
  X(time_us)                         \
  X(reserved_bytes)                  \
  X(allocated_bytes)                 \
  X(largest_free_bytes)              \
  X(free_bytes)                      \
  X(evictions)                       \
  X(remats)                          \
  X(num_ooms)

// One row per segment (bars in `top`).
#define DTRALLOC_PUBLISHED_SEGMENT(X) \
  X(addr)                             \
  X(size)                             \
  X(allocated_bytes)                  \
  X(largest_free_bytes)               \
  X(free_bytes)                       \
  X(blocks)                           \
  X(stream)                           \
  X(small_pool)

// A 5 ms period: `top` redraws a few times a second, so each redraw sees
// tens of samples (its peak and sparkline miss little), while the thread
// costs ~200 short wakeups a second (well under 0.1% of a core).
constexpr std::int64_t kDefaultPublishPeriodUs = 5000;
// 512 samples at 5 ms: the last 2.5 s, more than any redraw interval.
constexpr std::size_t kPublishedSamples = 512;
// Bars for 1024 segments fill any terminal; beyond that the largest are kept.
constexpr std::size_t kPublishedSegments = 1024;
// Walking every block holds the pool lock; keep walks under 1% of the time.
constexpr double kWalkShare = 0.01;
constexpr std::uint32_t kPublishedVersion = 1;
constexpr std::size_t kPublishedLabelBytes = 32;

struct PublishedLayout {
  std::size_t header_fields_offset;
  std::size_t samples_offset;
  std::size_t segments_offset;
  std::size_t file_bytes;
  std::vector<std::string> header_fields, sample_fields, segment_fields;
};
PublishedLayout published_layout();

class Publisher {
 public:
  // Creates the file and starts the thread. Throws std::runtime_error naming
  // the path and the OS error when the file cannot be made.
  Publisher(Allocator& allocator, std::int64_t period_us, const std::string& label);
  ~Publisher();  // stops the thread, unmaps and removes the file
  Publisher(const Publisher&) = delete;
  Publisher& operator=(const Publisher&) = delete;

  const std::string& path() const { return path_; }
  // A live DTR session adds what it evicted and rematerialized; the next
  // frame carries the totals. Any thread, no lock.
  void add_counts(std::int64_t evictions, std::int64_t remats) {
    evictions_.fetch_add(evictions, std::memory_order_relaxed);
    remats_.fetch_add(remats, std::memory_order_relaxed);
  }
  // Writes one frame now (tests; the thread does this every period).
  void publish_now();

 private:
  void run();
  void publish();

  Allocator& allocator_;
  const std::int64_t period_us_;
  std::string path_;
  int pid_ = 0;
  unsigned char* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  std::atomic<std::int64_t> evictions_{0}, remats_{0};
  std::mutex publish_mutex_;     // publish_now() vs the thread: one writer at a time
  std::int64_t frame_ = 0;
  std::int64_t sample_next_ = 0;
  std::int64_t last_walk_us_ = 0;   // monotonic
  std::int64_t walk_cost_us_ = 0;
  // On the heap so that a forked child, which has no publishing thread, can
  // leave them alone: the condition variable still counts the parent's
  // waiting thread, and destroying it would wait for that thread for ever.
  struct Stopper {
    std::mutex mutex;
    std::condition_variable cv;
  };
  std::unique_ptr<Stopper> stopper_ = std::make_unique<Stopper>();
  bool stop_ = false;
  std::unique_ptr<std::thread> thread_;
};

}  // namespace dtralloc
