// The host and virtual backends (backend.h): simulated devices of a fixed
// capacity, with deferred events.
#include <cstdlib>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "backend.h"
#include "range_ledger.h"

namespace dtralloc {
namespace {

// Deferred events: pending from record until synchronized or completed.
// Shared by both simulated backends.
class DeferredEvents {
 public:
  EventHandle create() {
    std::lock_guard<std::mutex> lock(mutex_);
    auto* ev = new int(0);
    pending_.insert(ev);  // created but unrecorded events count as complete
    completed_.insert(ev);
    return ev;
  }
  void record(EventHandle ev) {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_.erase(ev);
  }
  bool completed(EventHandle ev) {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_.count(ev) != 0;
  }
  void complete(EventHandle ev) {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_.insert(ev);
  }
  void complete_all() {
    std::lock_guard<std::mutex> lock(mutex_);
    completed_ = pending_;
  }
  void destroy(EventHandle ev) {
    std::lock_guard<std::mutex> lock(mutex_);
    pending_.erase(ev);
    completed_.erase(ev);
    delete static_cast<int*>(ev);
  }
  ~DeferredEvents() {
    for (EventHandle ev : pending_) delete static_cast<int*>(ev);
  }

 private:
  std::mutex mutex_;
  std::set<EventHandle> pending_;    // every live event
  std::set<EventHandle> completed_;  // the live events that have completed
};

class SimulatedBackend : public Backend {
 public:
  explicit SimulatedBackend(std::size_t capacity) : capacity_(capacity) {
    if (capacity == 0)
      throw std::invalid_argument("dtralloc: a host or virtual pool needs a capacity > 0 bytes");
  }
  std::size_t total_bytes() override { return capacity_; }
  std::size_t free_bytes() override { return capacity_ - used_; }

  EventHandle create_event() override { return events_.create(); }
  void record_event(EventHandle ev, Stream) override { events_.record(ev); }
  bool event_completed(EventHandle ev) override { return events_.completed(ev); }
  void synchronize_event(EventHandle ev) override { events_.complete(ev); }
  void destroy_event(EventHandle ev) override { events_.destroy(ev); }
  void synchronize_device() override { events_.complete_all(); }
  void complete_events() override { events_.complete_all(); }

 protected:
  bool reserve(std::size_t bytes) {
    if (bytes > capacity_ - used_) return false;
    used_ += bytes;
    return true;
  }
  void unreserve(std::size_t bytes) { used_ -= bytes; }

 private:
  std::size_t capacity_;
  std::size_t used_ = 0;
  DeferredEvents events_;
};

// Real, aligned host memory: tests write patterns into blocks.
class HostBackend final : public SimulatedBackend {
 public:
  using SimulatedBackend::SimulatedBackend;
  const char* name() const override { return "host"; }
  bool host_accessible() const override { return true; }
  bool releases_ranges() const override { return true; }
  void* allocate(std::size_t bytes, Stream) override {
    if (!reserve(bytes)) return nullptr;
    void* p = nullptr;
    // 512 B matches the pool's block alignment (and cudaMalloc's >= 256 B).
    if (posix_memalign(&p, 512, bytes) != 0) {
      unreserve(bytes);
      return nullptr;
    }
    allocations_.add(reinterpret_cast<std::uintptr_t>(p), bytes);
    return p;
  }
  // A range of an allocation (releases_ranges): host memory is freed when
  // the last of its bytes is released, as a device frees page by page.
  void release(void* ptr, std::size_t bytes, Stream) override {
    const RangeLedger::Allocation whole =
        allocations_.release(reinterpret_cast<std::uintptr_t>(ptr), bytes, name());
    if (whole.size) std::free(reinterpret_cast<void*>(whole.addr));
    unreserve(bytes);
  }

 private:
  RangeLedger allocations_;
};

// Addresses only: a first-fit allocator over a large address range, so a
// replay of an 80 GB device runs on a laptop and released ranges are reused
// the way a real device reuses them.
class VirtualBackend final : public SimulatedBackend {
 public:
  explicit VirtualBackend(std::size_t capacity) : SimulatedBackend(capacity) {
    holes_.emplace(kBase, capacity);
  }
  const char* name() const override { return "virtual"; }
  bool releases_ranges() const override { return true; }
  void* allocate(std::size_t bytes, Stream) override {
    for (auto it = holes_.begin(); it != holes_.end(); ++it) {
      if (it->second < bytes) continue;
      if (!reserve(bytes)) return nullptr;
      std::uintptr_t addr = it->first;
      std::size_t rest = it->second - bytes;
      holes_.erase(it);
      if (rest) holes_.emplace(addr + bytes, rest);
      return reinterpret_cast<void*>(addr);
    }
    return nullptr;
  }
  void release(void* ptr, std::size_t bytes, Stream) override {
    unreserve(bytes);
    auto addr = reinterpret_cast<std::uintptr_t>(ptr);
    auto next = holes_.lower_bound(addr);
    if (next != holes_.end() && next->first == addr + bytes) {  // merge above
      bytes += next->second;
      next = holes_.erase(next);
    }
    if (next != holes_.begin()) {  // merge below
      auto prev = std::prev(next);
      if (prev->first + prev->second == addr) {
        prev->second += bytes;
        return;
      }
    }
    holes_.emplace(addr, bytes);
  }

 private:
  // 1 TiB: far from 0, so a virtual address never looks like nullptr.
  static constexpr std::uintptr_t kBase = std::uintptr_t{1} << 40;
  std::map<std::uintptr_t, std::size_t> holes_;  // free address ranges
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(std::size_t capacity_bytes) {
  return std::make_unique<HostBackend>(capacity_bytes);
}

std::unique_ptr<Backend> make_virtual_backend(std::size_t capacity_bytes) {
  return std::make_unique<VirtualBackend>(capacity_bytes);
}

}  // namespace dtralloc
