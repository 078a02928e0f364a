// Process-wide allocators (global.h).
#include "global.h"

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
  bool configured = false;
  std::string text;
  Config config;
  std::array<std::unique_ptr<Allocator>, kMaxDevices> allocators;
  // Published copies of allocators[i].get() for the lock-free fast path.
  std::array<std::atomic<Allocator*>, kMaxDevices> published{};
};

State& state() {
  static State* s = new State;  // never destroyed: torch may free at exit
  return *s;
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
  if (!s.allocators[device]) {
    ensure_configured(s);
    s.allocators[device] = std::make_unique<Allocator>(make_cuda_backend(device), s.config, device);
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
