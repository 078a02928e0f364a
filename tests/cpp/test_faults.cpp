// Tests that a backend error (a CUDA call failing) leaves the Allocator
// consistent: no event is queried or destroyed after it was destroyed, no
// block's event count goes negative, no block stays pending for ever, and a
// block that may still be in use on another stream is never handed out.
//
// FaultyBackend wraps the host backend, fails chosen calls with
// std::runtime_error (the way the cuda backend reports a CUDA error), and
// keeps its own ledger of events so that any use of a destroyed event fails
// the test at once. The scenarios inject one failure at each point of the
// event paths (process_events, synchronize_and_free_events, free); the random
// sequence injects failures anywhere, with check_invariants after every step.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator.h"
#include "check.h"
#include "config.h"

namespace {

using namespace dtralloc;

enum Op { kAllocate, kRelease, kCreate, kRecord, kQuery, kSync, kDestroy, kSyncDevice, kSyncStream, kNumOps };
constexpr const char* kOpNames[kNumOps] = {"allocate", "release", "create_event", "record_event",
                                           "event_completed", "synchronize_event", "destroy_event",
                                           "synchronize_device", "synchronize_stream"};

class FaultyBackend final : public Backend {
 public:
  explicit FaultyBackend(std::size_t capacity) : inner_(make_host_backend(capacity)) {}

  // The next `n` calls of `op` throw (after `skip` calls that succeed).
  void fail(Op op, int n = 1, int skip = 0) {
    failures_[op] = n;
    skips_[op] = skip;
  }
  // Every call fails with probability `p` (0 turns random faults off).
  void fail_randomly(double p, std::uint64_t seed) {
    random_p_ = p;
    rng_.seed(seed);
  }
  long calls(Op op) const { return calls_[op]; }
  long failed(Op op) const { return failed_[op]; }
  std::size_t live_events() const { return live_.size(); }

  const char* name() const override { return "faulty-host"; }
  bool host_accessible() const override { return true; }
  void* allocate(std::size_t bytes, Stream stream) override {
    maybe_fail(kAllocate);
    return inner_->allocate(bytes, stream);
  }
  void release(void* ptr, std::size_t bytes, Stream stream) override {
    maybe_fail(kRelease);
    inner_->release(ptr, bytes, stream);
  }
  std::size_t total_bytes() override { return inner_->total_bytes(); }
  std::size_t free_bytes() override { return inner_->free_bytes(); }
  EventHandle create_event() override {
    maybe_fail(kCreate);
    EventHandle ev = inner_->create_event();
    live_.insert(ev);
    return ev;
  }
  void record_event(EventHandle ev, Stream stream) override {
    require_live(ev, kRecord);
    maybe_fail(kRecord);
    inner_->record_event(ev, stream);
  }
  bool event_completed(EventHandle ev) override {
    require_live(ev, kQuery);
    maybe_fail(kQuery);
    return inner_->event_completed(ev);
  }
  void synchronize_event(EventHandle ev) override {
    require_live(ev, kSync);
    maybe_fail(kSync);
    inner_->synchronize_event(ev);
  }
  void destroy_event(EventHandle ev) override {
    require_live(ev, kDestroy);
    maybe_fail(kDestroy);
    live_.erase(ev);
    inner_->destroy_event(ev);
  }
  void synchronize_device() override {
    maybe_fail(kSyncDevice);
    inner_->synchronize_device();
  }
  void synchronize_stream(Stream stream) override {
    maybe_fail(kSyncStream);
    streams_synchronized_.push_back(stream);
    inner_->synchronize_stream(stream);
  }
  const std::vector<Stream>& streams_synchronized() const { return streams_synchronized_; }
  void complete_events() override { inner_->complete_events(); }

 private:
  void require_live(EventHandle ev, Op op) {
    if (!live_.count(ev)) {
      std::fprintf(stderr, "%s on an event that was destroyed (or never created)\n", kOpNames[op]);
      CHECK(!"a destroyed event was used again");
    }
  }
  void maybe_fail(Op op) {
    ++calls_[op];
    bool fail = false;
    if (skips_[op] > 0) {
      --skips_[op];
    } else if (failures_[op] > 0) {
      --failures_[op];
      fail = true;
    }
    if (!fail && random_p_ > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < random_p_) fail = true;
    if (!fail) return;
    ++failed_[op];
    throw std::runtime_error(std::string("injected fault in ") + kOpNames[op]);
  }

  std::unique_ptr<Backend> inner_;
  std::set<EventHandle> live_;
  std::vector<Stream> streams_synchronized_;
  int failures_[kNumOps] = {};
  int skips_[kNumOps] = {};
  long calls_[kNumOps] = {};
  long failed_[kNumOps] = {};
  double random_p_ = 0;
  std::mt19937_64 rng_;
};

struct Fixture {
  FaultyBackend* backend;
  std::unique_ptr<Allocator> allocator;
};

Fixture make(const std::string& conf = "", std::size_t capacity = 256 * kMiB) {
  auto backend = std::make_unique<FaultyBackend>(capacity);
  FaultyBackend* raw = backend.get();
  return {raw, std::make_unique<Allocator>(std::move(backend), parse_config(conf))};
}

std::string block_state(Allocator& a, void* p) {
  for (const SegmentInfo& seg : a.snapshot().segments)
    for (const BlockInfo& b : seg.blocks)
      if (b.addr == reinterpret_cast<std::uintptr_t>(p)) return b.state;
  return "none";
}

std::int64_t active_bytes(Allocator& a) {
  return a.stats_report().stats.active_bytes[kStatAll].current;
}

// Everything is given back once the faults stop: no block pending, nothing
// reserved, and no event alive but those whose destroy failed (each such
// event is dropped, never touched again).
void drain(Fixture& f) {
  f.allocator->empty_cache();
  f.allocator->check_invariants();
  CHECK_EQ(active_bytes(*f.allocator), 0);
  CHECK_EQ(static_cast<long>(f.backend->live_events()), f.backend->failed(kDestroy));
  CHECK_EQ(f.allocator->stats_report().stats.reserved_bytes[kStatAll].current, 0);
}

// A block freed with events on streams 7 and 8, both completed on the device.
void* pending_block(Fixture& f) {
  void* p = f.allocator->malloc(4096, 1);
  f.allocator->record_stream(p, 7);
  f.allocator->record_stream(p, 8);
  f.allocator->free(p);
  CHECK_EQ(block_state(*f.allocator, p), "active_pending_free");
  return p;
}

// process_events: the query of the second event throws. The first event is
// gone, the second is still pending, and the next malloc finishes the job.
void test_query_fails_midway() {
  Fixture f = make();
  void* p = pending_block(f);
  f.backend->complete_events();
  f.backend->fail(kQuery, 1, /*skip=*/1);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { f.allocator->malloc(4096, 1); }),
                 "injected fault in event_completed");
  f.allocator->check_invariants();
  CHECK_EQ(f.backend->live_events(), 1u);
  CHECK_EQ(block_state(*f.allocator, p), "active_pending_free");  // one event still holds it
  void* q = f.allocator->malloc(4096, 1);  // polls again: the block comes back
  CHECK(q == p);
  f.allocator->check_invariants();
  CHECK_EQ(f.backend->live_events(), 0u);
  f.allocator->free(q);
  drain(f);
}

// process_events: destroying a completed event throws. The block still comes
// back exactly once (its event did complete); the handle is not touched again.
void test_destroy_fails() {
  Fixture f = make();
  void* p = pending_block(f);
  f.backend->complete_events();
  f.backend->fail(kDestroy, 1);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { f.allocator->malloc(4096, 1); }),
                 "injected fault in destroy_event");
  f.allocator->check_invariants();
  void* q = f.allocator->malloc(4096, 1);
  CHECK(q == p);
  f.allocator->check_invariants();
  CHECK_EQ(f.backend->live_events(), 1u);  // the one whose destroy failed: leaked, never reused
  f.allocator->free(q);
  drain(f);
}

// synchronize_and_free_events (empty_cache): the wait on the second event
// throws. The event is kept, not lost with the block stuck pending.
void test_synchronize_fails_midway() {
  Fixture f = make();
  void* p = pending_block(f);
  f.backend->fail(kSync, 1, /*skip=*/1);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { f.allocator->empty_cache(); }),
                 "injected fault in synchronize_event");
  f.allocator->check_invariants();
  CHECK_EQ(block_state(*f.allocator, p), "active_pending_free");
  CHECK_EQ(f.backend->live_events(), 1u);
  drain(f);
}

// free with record_stream: creating or recording the second event throws.
// The block must not come back while stream 8 may still use it: the free
// falls back to waiting for each stream that used it (7 and 8, which on a
// GPU may be another device's), and leaks no event.
void test_free_event_fails() {
  for (Op op : {kCreate, kRecord}) {
    Fixture f = make();
    void* p = f.allocator->malloc(4096, 1);
    std::memset(p, 0x3C, 4096);
    f.allocator->record_stream(p, 7);
    f.allocator->record_stream(p, 8);
    f.backend->fail(op, 1, /*skip=*/1);
    const long syncs = f.backend->calls(kSyncStream);
    f.allocator->free(p);
    CHECK_EQ(f.backend->calls(kSyncStream), syncs + 2);
    std::vector<Stream> waited = f.backend->streams_synchronized();
    std::sort(waited.begin(), waited.end());
    CHECK(waited == (std::vector<Stream>{7, 8}));
    CHECK_EQ(f.backend->live_events(), 0u);
    CHECK_EQ(block_state(*f.allocator, p), "inactive");
    f.allocator->check_invariants();
    drain(f);
  }
}

// The fallback wait itself fails: the free fails and changes nothing, so the
// caller still holds the block and may free it again.
void test_free_fallback_fails() {
  Fixture f = make();
  void* p = f.allocator->malloc(4096, 1);
  f.allocator->record_stream(p, 7);
  f.backend->fail(kCreate, 1);
  f.backend->fail(kSyncStream, 1);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { f.allocator->free(p); }),
                 "injected fault in create_event");
  f.allocator->check_invariants();
  CHECK_EQ(block_state(*f.allocator, p), "active_allocated");
  CHECK_EQ(f.backend->live_events(), 0u);
  f.allocator->free(p);  // now it works: one event on stream 7
  CHECK_EQ(block_state(*f.allocator, p), "active_pending_free");
  drain(f);
}

// Random malloc / free / record_stream / complete / empty_cache with every
// backend call failing now and then. After every step the invariants hold;
// blocks a test holds keep their bytes; at the end, with faults off, every
// byte and event is given back.
void test_random_faults(std::uint64_t seed, int steps) {
  Fixture f = make("budget:96M,max_split_size_mb:40", 512 * kMiB);
  Allocator& a = *f.allocator;
  std::mt19937_64 rng(seed);
  f.backend->fail_randomly(0.05, seed ^ 0x5eed);
  struct Held {
    std::size_t size;
    std::uint8_t tag;
  };
  std::map<void*, Held> held;
  auto pick = [&] {
    auto it = held.begin();
    std::advance(it, std::uniform_int_distribution<std::size_t>(0, held.size() - 1)(rng));
    return it;
  };
  long failures = 0;
  for (int step = 0; step < steps; ++step) {
    const int what = std::uniform_int_distribution<int>(0, 99)(rng);
    try {
      if (what < 45 || held.empty()) {
        std::size_t size = std::uniform_int_distribution<std::size_t>(1, 1 << 22)(rng);
        if (what % 7 == 0) size = std::uniform_int_distribution<std::size_t>(8 * kMiB, 30 * kMiB)(rng);
        const Stream stream = 1 + what % 3;
        void* p = a.malloc(size, stream);
        const auto tag = static_cast<std::uint8_t>(step);
        std::memset(p, tag, size);
        held[p] = {size, tag};
      } else if (what < 80) {
        auto it = pick();
        for (std::size_t i = 0; i < it->second.size; i += 4093)
          CHECK_EQ(static_cast<unsigned char*>(it->first)[i], it->second.tag);
        void* p = it->first;
        a.free(p);  // on failure the block is still ours (nothing changed)
        held.erase(p);
      } else if (what < 90) {
        a.record_stream(pick()->first, 4 + what % 4);
      } else if (what < 96) {
        f.backend->complete_events();
      } else {
        a.empty_cache();
      }
    } catch (const OutOfMemoryError&) {
    } catch (const std::runtime_error& e) {
      CHECK_CONTAINS(std::string(e.what()), "injected fault");
      ++failures;
    }
    a.check_invariants();
  }
  CHECK(failures > 0);
  f.backend->fail_randomly(0, 0);
  for (auto& [p, h] : held) a.free(p);
  f.backend->complete_events();
  drain(f);
}

}  // namespace

int main() {
  test_query_fails_midway();
  test_destroy_fails();
  test_synchronize_fails_midway();
  test_free_event_fails();
  test_free_fallback_fails();
  for (std::uint64_t seed = 1; seed <= 4; ++seed) test_random_faults(seed, 3000);
  return check_summary("test_faults");
}
