// Replay driver: runs a recorded trace (docs/trace-format.md) through an
// Allocator on the virtual backend with the RematEngine and an Evictor, under
// a budget. Addresses only; costs are the trace's op costs. It is a thin
// loop over the engine's per-op protocol (remat_engine.h): for each op,
// begin_op (its reads and writes), add_output per created storage, write per
// storage written in place, end_op, kill per storage that died. With policy
// `none` nothing is evicted and no recipe is kept (every value is created
// pinned): that is the allocation-only replay, whose pool traffic is the
// program's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "config.h"
#include "event_log.h"
#include "evictor.h"
#include "op_series.h"

namespace dtralloc {

// The trace's columns; lists are CSR (offsets has one entry more than ops).
struct ReplayTrace {
  std::vector<std::size_t> nbytes;     // per storage
  std::vector<std::uint8_t> initial;   // per storage
  // Per storage, or empty (none): what the program holds from the op that
  // makes it, pinned (never evicted) as the live driver finds it
  // (LiveSession::held_elsewhere). kKeptOutlives: made during the step and
  // still alive when it returned (Storage.outlives: a parameter's gradient),
  // also placed as long-lived; kKeptPastBackward: made before the step's
  // backward ended and freed after it (the loss the step returns), which
  // autograd no longer holds.
  static constexpr std::uint8_t kKeptOutlives = 1, kKeptPastBackward = 2;
  std::vector<std::uint8_t> kept;
  std::vector<int> frees_before;
  std::vector<int> inputs_offsets, inputs;
  std::vector<int> created_offsets, created;
  std::vector<int> mutated_offsets, mutated;
  std::vector<int> frees_offsets, frees;
  std::vector<double> cost;            // per op: duration_ns, else flops
  std::vector<std::uint8_t> random;    // per op

  std::size_t num_ops() const { return cost.size(); }
  void validate() const;  // throws std::invalid_argument on malformed columns
};

struct ReplayOptions {
  std::size_t budget_bytes = 0;        // 0: no budget
  Policy policy = Policy::kDtralloc;
  Config config;                       // pool settings and eviction knobs
  bool check_invariants = false;       // pool + engine invariants after every op
  bool series = true;                  // sample the pool after every op (ReplayResult's columns)
  // Policy none only: keep recipes as an evicting policy would, and measure
  // resident_floor_bytes. Without it the allocation-only replay keeps none,
  // so every storage is freed exactly when the trace frees it.
  bool measure_floor = false;
  // > 0: the pool keeps that many events of its alloc/free history, each
  // stamped with the op it happened in (ReplayResult::history).
  std::size_t history_entries = 0;
  // Called now and then with (ops done, ops in all), from the replaying thread.
  std::function<void(std::size_t, std::size_t)> progress;
  // The step this many times in one pool, as a training loop repeats it
  // (run_replay): what a step kept past its end (its outputs the program
  // holds: the gradients) dies as the next step begins, as
  // zero_grad(set_to_none=True) lets it go; the storages alive before the
  // step (parameters, optimizer state) stay. The last_step_* figures are the
  // last step's; the series samples the last step only.
  std::size_t steps = 1;
  // > 0: a GPU's op timing, as a live CUDA session sees it (op_timer.h): each
  // op is priced at `lag_cost` (its launch) when it runs, and at its own cost
  // only `cost_lag_ops` ops later, when its timing event would have
  // completed while the host ran ahead (and at each step's end, when the
  // GPU has caught up). With `lag_carried`, from the second step on an op is
  // priced at its own cost from the start, as the step before measured it
  // (Note [carried costs], bindings/live_session.cpp). The figures charge
  // every recompute at the op's own cost either way (RematEngine::set_cost).
  std::size_t cost_lag_ops = 0;
  double lag_cost = 0;
  bool lag_carried = true;
  // Between steps, give back every whole free cached segment, as a training
  // loop that calls torch.cuda.empty_cache() after each step does: the next
  // step starts from the cache the first one started from (docs/allocator.md,
  // Note [one step or a loop]).
  bool empty_cache_between_steps = false;
};

// The replay's scalar figures, declared once: the struct below and the
// Python class (bindings/replay.cpp) are generated from this table.
// X(type, name, default, doc)
#define DTRALLOC_REPLAY_FIGURES(X)                                                        \
  X(bool, feasible, true, "every op ran within the budget")                               \
  X(std::size_t, peak_reserved_bytes, 0, "most bytes the pool held from the device")      \
  X(std::size_t, peak_allocated_bytes, 0, "most bytes handed out at once")                \
  X(std::size_t, final_reserved_bytes, 0, "bytes the pool held after the last op")        \
  X(std::int64_t, segments_peak, 0, "most segments at once")                              \
  X(std::int64_t, device_alloc_calls, 0, "segments obtained from the device (cudaMalloc)")\
  X(std::int64_t, device_free_calls, 0, "segments returned to the device (cudaFree)")     \
  X(std::int64_t, page_releases, 0,                                                       \
    "unmap_pages: ranges of free pages given back from segments still in use")            \
  X(std::int64_t, long_lived, 0,                                                          \
    "long_lived: outputs the trace keeps placed at the high end of their block")          \
  X(std::size_t, invariant_checks, 0, "times every invariant was checked")                \
  X(bool, segment_fit, false, "1-10 MiB requests got fitted segments (segment_fit:auto resolved)") \
  X(double, base_cost, 0.0, "cost of running every op once (ns, or flops)")               \
  X(double, remat_cost, 0.0, "cost of the recomputes")                                    \
  X(double, compute_overhead, 0.0, "remat_cost / base_cost")                              \
  X(std::size_t, evictions, 0, "values evicted")                                          \
  X(std::size_t, remats, 0, "values recomputed")                                          \
  X(std::size_t, random_replays, 0, "recomputes of random ops (replayed with their first RNG state)") \
  X(std::size_t, fake_deletions, 0, "dead values whose memory was dropped but recipe kept")\
  X(std::size_t, hold_restarts, 0,                                                        \
    "recomputes that ran out of memory and started over from an emptied pool")            \
  X(std::size_t, eviction_calls, 0, "times the pool asked the evictor for room")          \
  X(std::size_t, window_evictions, 0, "calls served by a window of adjacent blocks")      \
  X(std::size_t, segment_releases, 0, "calls served by releasing whole segments")        \
  X(std::size_t, no_plan, 0, "calls where no eviction could serve the request")           \
  X(std::size_t, large_windows, 0,                                                        \
    "calls that evicted a window in the large pool for a small request "                \
    "(small_in_large: the small pool could neither serve nor grow, no pages made room)") \
  X(std::size_t, ruinous_spared, 0,                                                       \
    "calls that spared a value whose recompute chain costs over a fifth of the step's "   \
    "compute so far: free pages given back instead, or its hold's recompute retried "    \
    "with what the hold had brought back evictable")                                      \
  X(double, search_ns, 0.0, "median time to choose victims, per call (ns)")              \
  X(double, mean_reserved_fragmentation, 0.0,                                             \
    "1 - allocated / reserved after each op, averaged over the ops")                      \
  X(double, mean_external_fragmentation, 0.0,                                             \
    "1 - largest free block / free cached bytes after each op, averaged over the ops")    \
  X(double, free_share_at_evictions, 0.0,                                                 \
    "mean (budget - allocated) / budget when the evictor was called: 0 = the budget was " \
    "full of live data; more = free but unusable (fragmented) memory forced the call")    \
  X(std::size_t, steps, 1, "steps begun in the pool (ReplayOptions::steps; the last failed if not feasible)") \
  X(std::int64_t, last_step_device_alloc_calls, 0, "cudaMalloc calls in the last step")    \
  X(std::int64_t, last_step_device_free_calls, 0, "cudaFree calls in the last step")       \
  X(std::size_t, last_step_evictions, 0, "values evicted in the last step")                \
  X(double, last_step_compute_overhead, 0.0,                                              \
    "the last step's recompute cost over its ops' cost")                                  \
  X(std::size_t, resident_floor_bytes, 0,                                                 \
    "policy none with measure_floor only: the most bytes that had to be resident at "     \
    "once (pinned values plus what the op in flight holds); no policy can run the "       \
    "trace with less")

struct ReplayResult {
#define DTRALLOC_REPLAY_FIELD(type, name, def, doc) type name = def;
  DTRALLOC_REPLAY_FIGURES(DTRALLOC_REPLAY_FIELD)
#undef DTRALLOC_REPLAY_FIELD
  std::size_t budget_bytes = 0;        // 0: no budget
  int oom_op = -2;                     // -2: none; -1: the initial storages
  std::string name;                    // the trace's (set by the caller)
  std::string conf;                    // the pool settings (set by the caller)
  std::size_t no_eviction_peak_reserved_bytes = 0;  // set by the caller: a fractional budget's reference
  std::string oom_message;
  Policy policy = Policy::kNone;
  std::size_t max_split_size = kNoLimit;  // the pool's, max_split_size_mb:auto resolved
  std::vector<std::int64_t> search_ns_per_call;
  std::vector<double> free_share_per_call;
  // Per op, sampled after its outputs are allocated and before its frees
  // (ReplayOptions::series; ops after an OOM are absent).
  OpSeries series;
  EventLog events;
  // The pool's event history, oldest first (ReplayOptions::history_entries);
  // op stamps: -1 for the storages alive before the step.
  std::vector<TraceEntry> history;
  bool history_wrapped = false;        // the ring overflowed: the oldest events are gone
};

ReplayResult run_replay(const ReplayTrace& trace, const ReplayOptions& options);

}  // namespace dtralloc
