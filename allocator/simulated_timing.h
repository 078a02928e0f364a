// A GPU's timing events, simulated on the host: what lets a CPU dtr()
// session run the code a CUDA session runs on op costs that arrive late
// (op_timer.h; Note [carried costs] in bindings/live_session.cpp), so that
// tests and benches exercise it without a GPU.
//
// What it mirrors of the CUDA runtime's events (cudaEventRecord,
// cudaEventQuery, cudaEventElapsedTime, cudaDeviceSynchronize):
//   * an event recorded on a stream completes once the device has run what
//     was launched before it; here, once `lag` more events have been recorded
//     on the simulated device after it (a GPU that runs that many marks
//     behind the host), or once the device is synchronized;
//   * the elapsed time between two completed events is the device's time
//     between them; here, the host's clock between their records: on CPU an
//     op runs when it is called, so that is the op's own time;
//   * the elapsed time of an event not yet completed is unavailable
//     (cudaErrorNotReady; the Backend contract: negative).
// One simulated device per process, shared by every backend made here, as a
// GPU is shared by the sessions on it: a later session's marks complete an
// earlier one's. Called under the GIL (the live session's only callers).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <stdexcept>

#include "backend.h"

namespace dtralloc {

class SimulatedTimingBackend final : public Backend {
 public:
  explicit SimulatedTimingBackend(std::size_t lag) : lag_(lag) {}

  // Completes every event recorded so far (cudaDeviceSynchronize).
  static void synchronize_all() { device().synced = device().recorded; }

  const char* name() const override { return "simulated-timing"; }
  // Timing only: the session's memory is its pool's.
  void* allocate(std::size_t, Stream) override { throw std::logic_error("dtralloc: the simulated timer has no memory"); }
  void release(void*, std::size_t, Stream) override { throw std::logic_error("dtralloc: the simulated timer has no memory"); }
  std::size_t total_bytes() override { return 0; }
  std::size_t free_bytes() override { return 0; }

  EventHandle create_event() override { return new Event{}; }
  EventHandle create_timing_event() override { return new Event{}; }
  void record_event(EventHandle event, Stream) override {
    Event* e = as(event);
    e->seq = ++device().recorded;
    e->ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  bool event_completed(EventHandle event) override {
    const Event* e = as(event);
    // An event never recorded has nothing to wait for (as CUDA's).
    return e->seq == 0 || device().recorded - e->seq >= lag_ || device().synced >= e->seq;
  }
  void synchronize_event(EventHandle event) override { device().synced = std::max(device().synced, as(event)->seq); }
  void destroy_event(EventHandle event) override { delete as(event); }
  void synchronize_device() override { synchronize_all(); }
  double elapsed_ms(EventHandle start, EventHandle end) override {
    const Event* s = as(start);
    const Event* e = as(end);
    if (s->seq == 0 || e->seq == 0 || !event_completed(start) || !event_completed(end)) return -1;
    return (e->ns - s->ns) * 1e-6;
  }

 private:
  struct Event {
    std::uint64_t seq = 0;  // the device's record count when recorded; 0: never recorded
    double ns = 0;          // the host's clock then
  };
  struct Device {
    std::uint64_t recorded = 0;  // events recorded on it so far
    std::uint64_t synced = 0;    // every event up to this one has completed
  };
  static Device& device() {
    static Device d;
    return d;
  }
  static Event* as(EventHandle h) { return static_cast<Event*>(h); }

  std::size_t lag_;
};

}  // namespace dtralloc
