// Multithreaded stress test of Allocator on the host backend (real bytes).
//
// Workers malloc, free and record_stream at random on their own stream and on
// streams shared with the others, write a pattern owned by (thread, block)
// into every block and verify it before the block is freed: two live blocks
// that overlap, or a block handed out twice, show up as a broken pattern.
// A maintenance thread meanwhile calls empty_cache, stats_report, snapshot,
// complete_events, set_memory_fraction and check_invariants. In the variants
// with an eviction hook, workers give some blocks to a shared "evictable"
// list and the hook frees them from there (verifying them first) when a
// malloc runs out of budget, the way the DTR evictor does.
//
// Run it under ThreadSanitizer too (-DDTRALLOC_SANITIZE=thread): the
// allocator claims one mutex guards everything and the hook runs without it.
//
//   test_stress_threads [fake-runtime-path-ignored] [iterations-per-thread]
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "allocator.h"
#include "check.h"
#include "config.h"

namespace {

using namespace dtralloc;

constexpr std::size_t kCapacity = 128 * kMiB;
constexpr Stream kSharedStreams[] = {0, 1, 2};

// A block some thread (or the evictable list) owns, and its pattern seed.
struct Owned {
  void* ptr;
  std::size_t size;
  std::uint32_t seed;
};

std::uint8_t pattern_byte(std::uint32_t seed, std::size_t i) {
  return static_cast<std::uint8_t>((seed >> (8 * (i & 3))) ^ (i * 0x9d) ^ (i >> 9));
}

// The first 64 bytes, one byte every 512 B and the last byte. Blocks are
// 512-aligned, so a block overlapping this one starts at one of these
// offsets and its own first byte breaks the pattern there.
template <typename Fn>
void for_pattern_offsets(std::size_t size, Fn fn) {
  for (std::size_t i = 0; i < std::min<std::size_t>(size, 64); ++i) fn(i);
  for (std::size_t i = 512; i < size; i += 512) fn(i);
  fn(size - 1);
}

void fill(const Owned& o) {
  auto* bytes = static_cast<std::uint8_t*>(o.ptr);
  for_pattern_offsets(o.size, [&](std::size_t i) { bytes[i] = pattern_byte(o.seed, i); });
}

void verify(const Owned& o) {
  const auto* bytes = static_cast<const std::uint8_t*>(o.ptr);
  bool ok = true;
  for_pattern_offsets(o.size, [&](std::size_t i) { ok &= bytes[i] == pattern_byte(o.seed, i); });
  CHECK(ok);  // someone else wrote into this block
}

struct Counters {
  std::atomic<long> mallocs{0}, frees{0}, ooms{0}, records{0}, hook_frees{0}, hook_empty{0};
  std::atomic<long> maintenance_rounds{0};
};

// The evictable list the hook frees from; its own mutex, never the pool's.
class EvictableHook : public EvictionHook {
 public:
  EvictableHook(Allocator* allocator, Counters* counters) : allocator_(allocator), counters_(counters) {}

  bool make_room(std::size_t bytes, Stream) override {
    CHECK(bytes % 512 == 0);
    Owned victim{};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (evictable_.empty()) {
        ++counters_->hook_empty;
        return false;
      }
      // The largest first, like an evictor that wants room fast.
      auto it = std::max_element(evictable_.begin(), evictable_.end(),
                                 [](const Owned& a, const Owned& b) { return a.size < b.size; });
      victim = *it;
      *it = evictable_.back();
      evictable_.pop_back();
    }
    verify(victim);
    allocator_->free(victim.ptr);
    ++counters_->hook_frees;
    return true;
  }

  void give(const Owned& o) {
    std::lock_guard<std::mutex> lock(mutex_);
    evictable_.push_back(o);
  }
  // Takes one back (the owner frees it itself); false when the list is empty.
  bool take(std::mt19937_64& rng, Owned* out) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (evictable_.empty()) return false;
    std::size_t i = rng() % evictable_.size();
    *out = evictable_[i];
    evictable_[i] = evictable_.back();
    evictable_.pop_back();
    return true;
  }
  std::vector<Owned> drain() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::move(evictable_);
  }

 private:
  Allocator* allocator_;
  Counters* counters_;
  std::mutex mutex_;
  std::vector<Owned> evictable_;
};

std::size_t random_size(std::mt19937_64& rng) {
  std::uint64_t kind = rng() % 100;
  if (kind < 70) return 1 + rng() % (64 * 1024);
  if (kind < 95) return 64 * 1024 + rng() % (2 * kMiB);
  return 2 * kMiB + rng() % (10 * kMiB);
}

void worker(int id, int threads, int iterations, Allocator& a, EvictableHook* hook, Counters& c) {
  std::mt19937_64 rng(1000 + id);
  const Stream own_stream = 100 + id;
  std::vector<Owned> owned;
  std::uint32_t serial = 0;
  auto release = [&](std::size_t i) {
    Owned o = owned[i];
    owned[i] = owned.back();
    owned.pop_back();
    verify(o);
    a.free(o.ptr);
    ++c.frees;
  };
  for (int step = 0; step < iterations; ++step) {
    std::uint64_t op = rng() % 100;
    if (op < 45 || owned.empty()) {
      std::size_t size = random_size(rng);
      Stream stream = rng() % 2 ? own_stream : kSharedStreams[rng() % 3];
      void* p = nullptr;
      try {
        p = a.malloc(size, stream);
      } catch (const OutOfMemoryError&) {
        ++c.ooms;
        continue;
      }
      ++c.mallocs;
      // (thread, serial) makes every block's pattern distinct.
      Owned o{p, size, (static_cast<std::uint32_t>(id) << 24) ^ (++serial * 2654435761u)};
      fill(o);
      if (hook && rng() % 3 == 0) {
        hook->give(o);  // the hook (or a later take) frees it
      } else {
        owned.push_back(o);
      }
    } else if (op < 80) {
      release(rng() % owned.size());
    } else if (op < 90) {
      // Used on another stream: ours, a shared one, or another thread's.
      Stream s;
      std::uint64_t which = rng() % 3;
      if (which == 0) s = own_stream;
      else if (which == 1) s = kSharedStreams[rng() % 3];
      else s = 100 + static_cast<Stream>(rng() % threads);
      a.record_stream(owned[rng() % owned.size()].ptr, s);
      ++c.records;
    } else if (op < 95 && hook) {
      Owned o{};
      if (hook->take(rng, &o)) {
        verify(o);
        a.free(o.ptr);
        ++c.frees;
      }
    } else {
      const Owned& o = owned[rng() % owned.size()];
      CHECK(a.owns(o.ptr));
      std::size_t segment = 0;
      void* base = a.base_allocation(o.ptr, &segment);
      CHECK(base <= o.ptr);
      CHECK(static_cast<char*>(o.ptr) + o.size <= static_cast<char*>(base) + segment);
      CHECK(a.budget_bytes() <= kCapacity);
    }
    while (owned.size() > 48) release(rng() % owned.size());
  }
  while (!owned.empty()) release(owned.size() - 1);
}

// What a snapshot says must hang together on its own.
void check_snapshot(const Snapshot& snap) {
  for (const SegmentInfo& s : snap.segments) {
    std::uintptr_t at = s.addr;
    std::size_t allocated = 0;
    for (const BlockInfo& b : s.blocks) {
      CHECK(b.addr == at);
      at += b.size;
      if (std::string(b.state) == "active_allocated") allocated += b.size;
    }
    CHECK(at == s.addr + s.total_size);
    CHECK(allocated == s.allocated_size);
    CHECK(s.allocated_size <= s.active_size && s.active_size <= s.total_size);
  }
}

void maintenance(Allocator& a, std::atomic<int>& running, Counters& c) {
  std::mt19937_64 rng(99);
  while (running.load() > 0) {
    switch (rng() % 8) {
      case 0: a.empty_cache(); break;
      case 1: a.complete_events(); break;
      case 2: check_snapshot(a.snapshot()); break;
      case 3: a.set_memory_fraction(0.4 + 0.6 * static_cast<double>(rng() % 5) / 4.0); break;
      default: {
        StatsReport r = a.stats_report();
        const Stats& s = r.stats;
        CHECK(s.allocated_bytes[kStatAll].current <= s.active_bytes[kStatAll].current);
        CHECK(s.active_bytes[kStatAll].current <= s.reserved_bytes[kStatAll].current);
        CHECK(s.reserved_bytes[kStatAll].current <= static_cast<std::int64_t>(kCapacity));
        CHECK(r.free_cached_bytes + static_cast<std::size_t>(s.active_bytes[kStatAll].current) ==
              static_cast<std::size_t>(s.reserved_bytes[kStatAll].current));
        a.check_invariants();
      }
    }
    ++c.maintenance_rounds;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

// Fails the test if `done` is not set within the deadline: a deadlock must
// fail, not hang.
class Watchdog {
 public:
  Watchdog(const std::string& what, std::chrono::seconds limit)
      : thread_([this, what, limit] {
          std::unique_lock<std::mutex> lock(mutex_);
          if (!cv_.wait_for(lock, limit, [this] { return done_; }))
            check::fail(__FILE__, __LINE__, what + ": not finished in time (deadlock?)");
        }) {}
  ~Watchdog() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::thread thread_;
};

void run_variant(const char* name, const std::string& conf, int threads, int iterations, bool with_hook) {
  Watchdog watchdog(name, std::chrono::seconds(240));
  Allocator a(make_host_backend(kCapacity), parse_config(conf));
  Counters c;
  std::shared_ptr<EvictableHook> hook;
  if (with_hook) {
    hook = std::make_shared<EvictableHook>(&a, &c);
    a.set_eviction_hook(hook);
  }
  std::atomic<int> running{threads};
  std::thread maint(maintenance, std::ref(a), std::ref(running), std::ref(c));
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      worker(t, threads, iterations, a, hook.get(), c);
      --running;
    });
  }
  for (auto& w : workers) w.join();
  maint.join();

  if (hook) {
    for (const Owned& o : hook->drain()) {
      verify(o);
      a.free(o.ptr);
    }
  }
  a.check_invariants();
  a.complete_events();
  Stats s = a.stats_report().stats;
  CHECK_EQ(s.allocation[kStatAll].current, 0);
  CHECK_EQ(s.allocated_bytes[kStatAll].current, 0);
  CHECK_EQ(s.active_bytes[kStatAll].current, 0);
  CHECK_EQ(s.requested_bytes[kStatAll].current, 0);
  CHECK_EQ(s.num_invalid_frees, 0);
  CHECK(c.mallocs.load() > threads * iterations / 8);  // OOMs are frequent by design
  CHECK(c.maintenance_rounds.load() > 0);
  if (with_hook) {
    CHECK(s.num_eviction_calls > 0);
    CHECK(c.hook_frees.load() > 0);
  }
  a.empty_cache();
  CHECK_EQ(a.stats_report().stats.reserved_bytes[kStatAll].current, 0);
  CHECK_EQ(a.backend().free_bytes(), kCapacity);
  a.check_invariants();
  std::printf("  %s: %ld mallocs, %ld frees, %ld OOMs, %ld record_streams, %lld eviction calls "
              "(%ld freed, %ld found nothing), %lld retries, %ld maintenance rounds\n",
              name, c.mallocs.load(), c.frees.load(), c.ooms.load(), c.records.load(),
              static_cast<long long>(s.num_eviction_calls), c.hook_frees.load(), c.hook_empty.load(),
              static_cast<long long>(s.num_alloc_retries), c.maintenance_rounds.load());
}

// budget_bytes() is read without the caller holding anything while another
// thread calls set_memory_fraction (torch's per-process fraction can change
// at any time): every read must see one of the budgets that were set, and
// ThreadSanitizer must see no data race.
void test_budget_read_while_set() {
  Allocator a(make_virtual_backend(kCapacity), parse_config(""));
  const double fractions[] = {0.25, 0.5, 1.0};
  std::atomic<bool> reading{false}, stop{false};
  std::thread setter([&] {
    while (!reading.load()) std::this_thread::yield();
    for (int i = 0; i < 20000; ++i) a.set_memory_fraction(fractions[i % 3]);
    stop = true;
  });
  long reads = 0, bad = 0;
  reading = true;
  while (!stop.load() || reads < 1000) {
    std::size_t b = a.budget_bytes();
    bad += b != kCapacity / 4 && b != kCapacity / 2 && b != kCapacity;
    ++reads;
  }
  setter.join();
  CHECK_EQ(bad, 0);
}

}  // namespace

int main(int argc, char** argv) {
  int iterations = argc >= 3 ? std::atoi(argv[2]) : 3000;
  test_budget_read_while_set();
  run_variant("plain", "budget:96M", 6, iterations, false);
  run_variant("eviction hook", "budget:48M,max_split_size_mb:24", 6, iterations, true);
  run_variant("hook+gc+divisions", "budget:64M,roundup_power2_divisions:4,garbage_collection_threshold:0.7,history_entries:256",
              8, iterations, true);
  return check_summary("test_stress_threads");
}
