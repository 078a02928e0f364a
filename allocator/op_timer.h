// Op costs on a GPU, measured on the GPU.
//
// A CUDA op returns to the host once its kernels are launched, so a clock
// read around the call measures the launch (a few microseconds for a matmul
// and a ReLU alike), not the op: the costs the evictor weighs would be
// noise. The live session therefore marks the end of each op on the stream
// it ran on with a timing event, and an op's cost is the GPU time between
// the previous mark on that stream and its own: the op's kernels where the
// GPU is busy (the usual case: the host runs ahead), plus the launch gap
// where it idles, which is what recomputing the op would cost then too.
//
// Marks complete in order, long after they are made; collect() hands over
// every measured interval whose marks have completed, and the session
// passes them to the engine (RematEngine::set_cost), replacing the clock's
// provisional cost. Nothing waits for the GPU. An interval in which
// something else ran (a recompute, or an op outside the engine) measures
// nothing, and neither does one spanning two streams.
#pragma once

#include <cstddef>
#include <deque>
#include <exception>
#include <utility>
#include <vector>

#include "backend.h"

namespace dtralloc {

class OpTimer {
 public:
  // Marks not yet collected, at most: past it the oldest is dropped
  // unmeasured (its op keeps the clock's cost). The GPU runs at most about a
  // thousand launches behind the host before launches block.
  static constexpr std::size_t kMaxMarks = 4096;

  explicit OpTimer(Backend& backend) : backend_(backend) {}
  ~OpTimer() { clear(); }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

  // Whether the backend times on its device (the first call makes an event
  // to find out). False for host and virtual backends, and after an error.
  bool active() {
    if (state_ == kUnknown) {
      EventHandle first = nullptr;
      const bool ok = guard([&] { first = backend_.create_timing_event(); });
      state_ = ok && first ? kActive : kOff;
      if (first) spare_.push_back(first);
    }
    return state_ == kActive;
  }

  // What was launched on `stream` since the previous mark was `op`'s (-1:
  // no op's). `clean` false: something else was launched in between, so
  // the interval measures nothing. Returns whether it marked: not while the
  // stream captures a CUDA graph, when querying events would invalidate the
  // capture (and what it launches runs later, as a graph); collect() only
  // after a mark.
  bool mark(int op, Stream stream, bool clean) {
    if (!active()) return false;
    bool marked = false;
    guard([&] {
      if (backend_.stream_capturing(stream)) {
        after_capture_ = true;
        return;
      }
      if (marks_.size() >= kMaxMarks) {
        backend_.destroy_event(marks_.front().event);  // may still be pending: destroyed once it completes
        marks_.pop_front();
      }
      marks_.push_back({take(), op, stream, clean && op >= 0 && !after_capture_});  // first: clear() destroys it on an error
      after_capture_ = false;
      backend_.record_event(marks_.back().event, stream);
      marked = true;
    });
    return marked;
  }

  // done(op, ns) for each measured interval whose marks have completed,
  // oldest first; returns how many.
  template <typename Done>
  std::size_t collect(Done&& done) {
    if (state_ != kActive) return 0;
    measured_.clear();
    guard([&] {
      while (marks_.size() >= 2) {
        const Mark& start = marks_[0];
        const Mark& end = marks_[1];
        // Completion is polled with cudaEventQuery, as the documentation of
        // cuEventElapsedTime_v2 (CUDA 12.8) asks: the elapsed-time call is
        // meant for the time only, not to poll.
        if (!backend_.event_completed(end.event)) break;
        if (end.measures && end.stream == start.stream) {  // start, earlier on the stream, completed too
          const double ms = backend_.elapsed_ms(start.event, end.event);
          if (ms < 0) break;  // not yet timed, after all: later
          measured_.emplace_back(end.op, ms * 1e6);
        }
        spare_.push_back(start.event);  // completed: it may be recorded again
        marks_.pop_front();
      }
    });
    // Outside the guard: what `done` throws is the caller's, not a device error.
    for (const auto& [op, ns] : measured_) done(op, ns);
    return measured_.size();
  }

  std::size_t pending() const { return marks_.empty() ? 0 : marks_.size() - 1; }

 private:
  struct Mark {
    EventHandle event;
    int op;
    Stream stream;
    bool measures;
  };
  enum State { kUnknown, kActive, kOff };

  EventHandle take() {
    if (spare_.empty()) return backend_.create_timing_event();
    EventHandle e = spare_.back();
    spare_.pop_back();
    return e;
  }

  // A device error here must not fail the user's op: timing stops, and the
  // clock's costs stand from then on.
  template <typename Body>
  bool guard(Body&& body) {
    try {
      body();
      return true;
    } catch (const std::exception&) {
      clear();
      state_ = kOff;
      return false;
    }
  }

  void clear() {
    for (const Mark& m : marks_) destroy(m.event);
    for (EventHandle e : spare_) destroy(e);
    marks_.clear();
    spare_.clear();
  }

  void destroy(EventHandle e) {
    if (!e) return;
    try {
      backend_.destroy_event(e);
    } catch (const std::exception&) {  // nothing more to do with it
    }
  }

  Backend& backend_;
  std::deque<Mark> marks_;  // front: the start of the oldest interval not yet collected
  std::vector<EventHandle> spare_;
  std::vector<std::pair<int, double>> measured_;  // collect()'s, kept for its capacity
  State state_ = kUnknown;
  bool after_capture_ = false;  // a mark was skipped for a capture: the next interval measures nothing
};

}  // namespace dtralloc
