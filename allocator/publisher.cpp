// Publisher (publisher.h): counters of one allocator in a shared-memory file.
#include "publisher.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <set>
#include <stdexcept>

#include "allocator.h"

namespace dtralloc {
namespace {

constexpr char kMagic[8] = {'D', 'T', 'R', 'A', 'L', 'L', 'O', 'C'};
constexpr std::size_t kSeqOffset = 16;     // after magic, version, header_bytes
constexpr std::size_t kLabelOffset = 24;

enum HeaderField : int {
#define DTRALLOC_FIELD_ENUM(name, doc) kField_##name,
  DTRALLOC_PUBLISHED_FIELDS(DTRALLOC_FIELD_ENUM)
#undef DTRALLOC_FIELD_ENUM
  kNumHeaderFields
};
enum SampleField : int {
#define DTRALLOC_SAMPLE_ENUM(name) kSample_##name,
  DTRALLOC_PUBLISHED_SAMPLE(DTRALLOC_SAMPLE_ENUM)
#undef DTRALLOC_SAMPLE_ENUM
  kNumSampleFields
};
enum SegmentField : int {
#define DTRALLOC_SEGMENT_ENUM(name) kSegment_##name,
  DTRALLOC_PUBLISHED_SEGMENT(DTRALLOC_SEGMENT_ENUM)
#undef DTRALLOC_SEGMENT_ENUM
  kNumSegmentFields
};

std::int64_t clock_us(clockid_t clock) {
  timespec ts;
  clock_gettime(clock, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000 + ts.tv_nsec / 1000;
}

// Files of live publishers, removed at exit: the process-wide allocators are
// never destroyed (torch may free after static destructors ran), so their
// publishers' destructors never run. Leaked on purpose for the same reason.
struct Registry {
  std::mutex mutex;
  std::set<std::string> paths;
  int pid = 0;  // the process that created them (a forked child must not remove them)
};
Registry& registry() {
  static Registry* r = [] {
    auto* created = new Registry;
    created->pid = static_cast<int>(getpid());
    std::atexit([] {
      Registry& reg = registry();
      std::lock_guard<std::mutex> lock(reg.mutex);
      if (static_cast<int>(getpid()) != reg.pid) return;
      for (const std::string& p : reg.paths) unlink(p.c_str());
      reg.paths.clear();
    });
    return created;
  }();
  return *r;
}

std::string shm_dir() {
  struct stat st;
  if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0)
    return "/dev/shm";
  return "/tmp";
}

}  // namespace

PublishedLayout published_layout() {
  PublishedLayout l;
#define DTRALLOC_FIELD_NAME(name, doc) l.header_fields.push_back(#name);
  DTRALLOC_PUBLISHED_FIELDS(DTRALLOC_FIELD_NAME)
#undef DTRALLOC_FIELD_NAME
#define DTRALLOC_LIST_NAME(name) l.sample_fields.push_back(#name);
  DTRALLOC_PUBLISHED_SAMPLE(DTRALLOC_LIST_NAME)
#undef DTRALLOC_LIST_NAME
#define DTRALLOC_LIST_NAME(name) l.segment_fields.push_back(#name);
  DTRALLOC_PUBLISHED_SEGMENT(DTRALLOC_LIST_NAME)
#undef DTRALLOC_LIST_NAME
  l.header_fields_offset = kLabelOffset + kPublishedLabelBytes;
  l.samples_offset = l.header_fields_offset + 8 * kNumHeaderFields;
  l.segments_offset = l.samples_offset + 8 * kNumSampleFields * kPublishedSamples;
  l.file_bytes = l.segments_offset + 8 * kNumSegmentFields * kPublishedSegments;
  return l;
}

Publisher::Publisher(Allocator& allocator, std::int64_t period_us, const std::string& label)
    : allocator_(allocator), period_us_(std::max<std::int64_t>(period_us, 100)) {
  const PublishedLayout layout = published_layout();
  pid_ = static_cast<int>(getpid());
  const std::string base = shm_dir() + "/dtralloc-" + std::to_string(pid_) + "-" +
                           std::to_string(allocator.device());
  int fd = -1;
  for (int n = 0; n < 1000 && fd < 0; ++n) {
    path_ = n == 0 ? base : base + "-" + std::to_string(n);
    fd = open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0)
    throw std::runtime_error("dtralloc: cannot create the publisher file " + path_ + ": " +
                             std::strerror(errno) + " (dtralloc top reads it; check that " +
                             shm_dir() + " is writable)");
  map_bytes_ = layout.file_bytes;
  if (ftruncate(fd, static_cast<off_t>(map_bytes_)) != 0) {
    const int err = errno;
    close(fd);
    unlink(path_.c_str());
    throw std::runtime_error("dtralloc: cannot size " + path_ + ": " + std::strerror(err));
  }
  void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    const int err = errno;
    unlink(path_.c_str());
    throw std::runtime_error("dtralloc: cannot map " + path_ + ": " + std::strerror(err));
  }
  map_ = static_cast<unsigned char*>(p);
  std::memcpy(map_, kMagic, sizeof kMagic);
  const std::uint32_t version = kPublishedVersion;
  const auto header_bytes = static_cast<std::uint32_t>(layout.samples_offset);
  std::memcpy(map_ + 8, &version, 4);
  std::memcpy(map_ + 12, &header_bytes, 4);
  std::strncpy(reinterpret_cast<char*>(map_ + kLabelOffset), label.c_str(), kPublishedLabelBytes - 1);
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    reg.paths.insert(path_);
  }
  publish_now();
  thread_ = std::make_unique<std::thread>([this] { run(); });
}

Publisher::~Publisher() {
  if (static_cast<int>(getpid()) != pid_) {
    // A forked child: the thread is the parent's. Its objects are left as
    // they are (a few bytes), and the file is the parent's to remove.
    (void)thread_.release();
    (void)stopper_.release();
    munmap(map_, map_bytes_);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(stopper_->mutex);
    stop_ = true;
  }
  stopper_->cv.notify_all();
  if (thread_ && thread_->joinable()) thread_->join();
  {
    Registry& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mutex);
    reg.paths.erase(path_);
  }
  munmap(map_, map_bytes_);
  if (static_cast<int>(getpid()) == pid_) unlink(path_.c_str());
}

void Publisher::run() {
  std::unique_lock<std::mutex> lock(stopper_->mutex);
  while (!stopper_->cv.wait_for(lock, std::chrono::microseconds(period_us_), [this] { return stop_; })) {
    lock.unlock();
    publish_now();
    lock.lock();
  }
}

void Publisher::publish_now() {
  std::lock_guard<std::mutex> lock(publish_mutex_);
  publish();
}

void Publisher::publish() {
  std::int64_t h[kNumHeaderFields] = {};
  struct SegmentRow {
    std::int64_t v[kNumSegmentFields];
  };
  std::vector<SegmentRow> rows;
  std::size_t segments_total = 0;
  const std::int64_t start_us = clock_us(CLOCK_MONOTONIC);
  const bool walk = frame_ == 0 || (start_us - last_walk_us_ >= period_us_ &&
                                    double(walk_cost_us_) <= kWalkShare * double(start_us - last_walk_us_));
  allocator_.inspect_pool([&](const BlockPool& pool) {
    const Stats& s = pool.stats();
    h[kField_reserved_bytes] = s.reserved_bytes[kStatAll].current;
    h[kField_allocated_bytes] = s.allocated_bytes[kStatAll].current;
    h[kField_active_bytes] = s.active_bytes[kStatAll].current;
    h[kField_requested_bytes] = s.requested_bytes[kStatAll].current;
    h[kField_peak_reserved_bytes] = s.reserved_bytes[kStatAll].peak;
    h[kField_peak_allocated_bytes] = s.allocated_bytes[kStatAll].peak;
    h[kField_segments] = s.segment[kStatAll].current;
    h[kField_allocations] = s.allocation[kStatAll].current;
    h[kField_num_ooms] = s.num_ooms;
    h[kField_num_alloc_retries] = s.num_alloc_retries;
    h[kField_num_device_alloc] = s.num_device_alloc;
    h[kField_num_device_free] = s.num_device_free;
    h[kField_num_eviction_calls] = s.num_eviction_calls;
    h[kField_largest_free_bytes] = static_cast<std::int64_t>(pool.largest_free_block());
    h[kField_free_bytes] = static_cast<std::int64_t>(pool.free_bytes());
    if (!walk) return;
    segments_total = pool.segments().size();
    rows.reserve(segments_total);
    for (const auto& [addr, seg] : pool.segments()) {
      SegmentRow r{};
      r.v[kSegment_addr] = static_cast<std::int64_t>(seg->addr);
      r.v[kSegment_size] = static_cast<std::int64_t>(seg->size);
      r.v[kSegment_stream] = static_cast<std::int64_t>(seg->stream);
      r.v[kSegment_small_pool] = seg->pool == kSmallPool;
      for (const Block* b = seg->head; b; b = b->next) {
        ++r.v[kSegment_blocks];
        if (b->allocated) r.v[kSegment_allocated_bytes] += static_cast<std::int64_t>(b->size);
        if (b->in_free_set) {
          r.v[kSegment_free_bytes] += static_cast<std::int64_t>(b->size);
          r.v[kSegment_largest_free_bytes] =
              std::max(r.v[kSegment_largest_free_bytes], static_cast<std::int64_t>(b->size));
        }
      }
      rows.push_back(r);
    }
  });
  if (walk) {
    const std::int64_t end_us = clock_us(CLOCK_MONOTONIC);
    walk_cost_us_ = end_us - start_us;
    last_walk_us_ = end_us;
    if (rows.size() > kPublishedSegments) {
      std::nth_element(rows.begin(), rows.begin() + kPublishedSegments, rows.end(),
                       [](const SegmentRow& a, const SegmentRow& b) {
                         return a.v[kSegment_size] > b.v[kSegment_size];
                       });
      rows.resize(kPublishedSegments);
      std::sort(rows.begin(), rows.end(), [](const SegmentRow& a, const SegmentRow& b) {
        return a.v[kSegment_addr] < b.v[kSegment_addr];
      });
    }
  }
  const PublishedLayout layout = published_layout();
  const std::int64_t now = clock_us(CLOCK_REALTIME);
  h[kField_pid] = pid_;
  h[kField_device] = allocator_.device();
  h[kField_period_us] = period_us_;
  h[kField_frame] = ++frame_;
  h[kField_time_us] = now;
  h[kField_budget_bytes] = static_cast<std::int64_t>(allocator_.budget_bytes());
  h[kField_capacity_bytes] = static_cast<std::int64_t>(allocator_.capacity_bytes());
  h[kField_evictions] = evictions_.load(std::memory_order_relaxed);
  h[kField_remats] = remats_.load(std::memory_order_relaxed);
  std::int64_t old_segments[2];
  std::memcpy(old_segments, map_ + layout.header_fields_offset + 8 * kField_segment_count, 16);
  h[kField_segment_count] = walk ? static_cast<std::int64_t>(rows.size()) : old_segments[0];
  h[kField_segments_time_us] = walk ? now : old_segments[1];
  const std::int64_t slot = sample_next_;
  sample_next_ = (sample_next_ + 1) % static_cast<std::int64_t>(kPublishedSamples);
  h[kField_sample_next] = sample_next_;
  std::int64_t sample[kNumSampleFields];
  sample[kSample_time_us] = now;
  sample[kSample_reserved_bytes] = h[kField_reserved_bytes];
  sample[kSample_allocated_bytes] = h[kField_allocated_bytes];
  sample[kSample_largest_free_bytes] = h[kField_largest_free_bytes];
  sample[kSample_free_bytes] = h[kField_free_bytes];
  sample[kSample_evictions] = h[kField_evictions];
  sample[kSample_remats] = h[kField_remats];
  sample[kSample_num_ooms] = h[kField_num_ooms];

  // The seqlock: odd while writing; readers retry on a change.
  auto* seq = reinterpret_cast<std::uint64_t*>(map_ + kSeqOffset);
  const std::uint64_t s0 = __atomic_load_n(seq, __ATOMIC_RELAXED);
  __atomic_store_n(seq, s0 + 1, __ATOMIC_RELAXED);
  __atomic_thread_fence(__ATOMIC_RELEASE);
  std::memcpy(map_ + layout.header_fields_offset, h, sizeof h);
  std::memcpy(map_ + layout.samples_offset + sizeof sample * static_cast<std::size_t>(slot), sample,
              sizeof sample);
  if (walk && !rows.empty())
    std::memcpy(map_ + layout.segments_offset, rows.data(), rows.size() * sizeof(SegmentRow));
  __atomic_store_n(seq, s0 + 2, __ATOMIC_RELEASE);
}

}  // namespace dtralloc
