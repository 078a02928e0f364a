// Process-wide allocators (global.h).
#include "global.h"

#include <pthread.h>

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "backend.h"
#include "publisher.h"

namespace dtralloc::global {
namespace {

struct State {
  std::mutex mutex;  // guards creation and configuration, not the hot path
  // Set in a child forked after an allocator existed (on_fork_child).
  std::atomic<bool> forked_child{false};
  bool configured = false;
  std::string text;
  Config config;
  std::array<std::unique_ptr<Allocator>, kMaxDevices> allocators;
  // Published copies of allocators[i].get() for the lock-free fast path.
  std::array<std::atomic<Allocator*>, kMaxDevices> published{};
};

// fork(): the child gets a copy of every allocator, but not the device
// memory or the CUDA context behind it (CUDA does not survive fork), so it
// must neither hand out the parent's blocks nor give them back. The handlers
// keep the creation mutex out of the fork (a thread holding it would leave it
// locked in the child); the child abandons the inherited allocators (never
// destroyed: that would cudaFree the parent's memory) and refuses new ones.
void on_fork_prepare();
void on_fork_parent();
void on_fork_child();

State& state() {
  static State* s = [] {
    auto* fresh = new State;  // never destroyed: torch may free at exit
    pthread_atfork(on_fork_prepare, on_fork_parent, on_fork_child);
    return fresh;
  }();
  return *s;
}

void on_fork_prepare() { state().mutex.lock(); }
void on_fork_parent() { state().mutex.unlock(); }
void on_fork_child() {
  State& s = state();
  bool inherited = false;
  for (int i = 0; i < kMaxDevices; ++i) {
    if (s.published[i].load(std::memory_order_relaxed) == nullptr) continue;
    inherited = true;
    s.published[i].store(nullptr, std::memory_order_relaxed);
    (void)s.allocators[i].release();  // leaked on purpose, see above
  }
  if (inherited) s.forked_child.store(true);
  s.mutex.unlock();
}

[[noreturn]] void throw_forked(int device) {
  throw std::runtime_error(
      "dtralloc: this process was forked from one whose dtralloc allocators held CUDA memory, "
      "and device memory and CUDA contexts do not survive fork(), so dtralloc cannot serve "
      "device " + std::to_string(device) + " here. Start worker processes with the 'spawn' or "
      "'forkserver' method (multiprocessing.set_start_method('spawn'); DataLoader workers that "
      "touch CUDA need it too), or fork before the first CUDA allocation.");
}

void ensure_configured(State& s) {
  if (s.configured) return;
  const char* env = std::getenv("DTRALLOC_CONF");
  s.text = env ? env : "";
  s.config = parse_config(s.text);
  s.configured = true;
}

}  // namespace

void configure(const std::string& text) {
  Config parsed = parse_config(text);
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (auto& a : s.allocators)
    if (a && text != s.text)
      throw std::logic_error(
          "dtralloc: the allocator of device " + std::to_string(a->device()) +
          " already runs with DTRALLOC_CONF='" + s.text +
          "'; configure before the first CUDA allocation (call dtralloc.install() first)");
  s.text = text;
  s.config = parsed;
  s.configured = true;
}

Config config() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ensure_configured(s);
  return s.config;
}

std::string config_text() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  ensure_configured(s);
  return s.text;
}

Allocator& allocator(int device) {
  if (device < 0 || device >= kMaxDevices)
    throw std::out_of_range("dtralloc: device index " + std::to_string(device) +
                            " out of range [0, " + std::to_string(kMaxDevices) + ")");
  State& s = state();
  // Fast path without the creation lock: allocators are never destroyed
  // except by reset_for_tests, which callers serialize themselves.
  if (Allocator* a = s.published[device].load(std::memory_order_acquire)) return *a;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.forked_child.load()) throw_forked(device);
  if (!s.allocators[device]) {
    ensure_configured(s);
    s.allocators[device] = std::make_unique<Allocator>(make_cuda_backend_for(s.config, device), s.config, device);
    // `dtralloc top PID` reads what the publisher writes (publisher.h). A
    // process that cannot publish still allocates: say so once and go on.
    try {
      s.allocators[device]->publish(kDefaultPublishPeriodUs, "cuda");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "dtralloc: dtralloc top will not see device %d: %s\n", device, e.what());
    }
    s.published[device].store(s.allocators[device].get(), std::memory_order_release);
  }
  return *s.allocators[device];
}

Allocator* existing(int device) {
  if (device < 0 || device >= kMaxDevices) return nullptr;
  return state().published[device].load(std::memory_order_acquire);
}

std::vector<Allocator*> all_existing() {
  std::vector<Allocator*> out;
  for (auto& a : state().published)
    if (Allocator* p = a.load(std::memory_order_acquire)) out.push_back(p);
  return out;
}

bool forked_child() { return state().forked_child.load(std::memory_order_relaxed); }

void reset_for_tests() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  for (int i = 0; i < kMaxDevices; ++i) {
    s.published[i].store(nullptr, std::memory_order_release);
    s.allocators[i].reset();
  }
  s.configured = false;
  s.text.clear();
}

}  // namespace dtralloc::global
