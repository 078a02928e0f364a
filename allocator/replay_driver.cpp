// Replay driver: trace -> pool + engine + evictor (replay_driver.h).
#include "replay_driver.h"

#include <algorithm>
#include <deque>
#include <memory>
#include <stdexcept>
#include <utility>

#include "backend.h"

namespace dtralloc {
namespace {

// Large enough for any recorded trace: only the budget limits the pool.
constexpr std::size_t kVirtualCapacity = std::size_t{1} << 44;
// Recomputes beyond this many per op mean the budget only thrashes; report
// infeasible rather than spin (DTR's own replays use the same kind of cap).
constexpr std::size_t kMaxRematsPerOp = 64;

void check_csr(const std::vector<int>& offsets, const std::vector<int>& values, std::size_t ops,
               std::size_t storages, const char* what) {
  if (offsets.size() != ops + 1 || offsets.front() != 0 ||
      static_cast<std::size_t>(offsets.back()) != values.size())
    throw std::invalid_argument(std::string("replay: malformed CSR column '") + what + "'");
  for (std::size_t i = 0; i < ops; ++i)
    if (offsets[i] > offsets[i + 1])
      throw std::invalid_argument(std::string("replay: offsets of '") + what + "' decrease");
  for (int v : values)
    if (v < 0 || static_cast<std::size_t>(v) >= storages)
      throw std::invalid_argument(std::string("replay: storage id out of range in '") + what + "'");
}

// Cross-check of DESIGN 3.6 against the pool: every resident value's block is
// allocated in the pool, and the pool holds no other allocation.
void check_engine_against_pool(const RematEngine& engine, Allocator& allocator) {
  engine.check_invariants();
  std::size_t blocks = 0;
  for (int v : engine.resident()) {
    const Value& x = engine.value(v);
    if (!x.addr) continue;
    ++blocks;
    if (!allocator.owns(reinterpret_cast<void*>(x.addr)))
      throw std::logic_error("invariant 3.6: a resident value's block is not allocated in the pool");
  }
  const auto allocations = allocator.stats_report().stats.allocation[kStatAll].current;
  if (static_cast<std::size_t>(allocations) != blocks)
    throw std::logic_error("invariant 3.6: the pool holds " + std::to_string(allocations) +
                           " allocations but " + std::to_string(blocks) + " values are resident");
}

}  // namespace

void ReplayTrace::validate() const {
  const std::size_t s = nbytes.size(), n = num_ops();
  if (initial.size() != s || random.size() != n)
    throw std::invalid_argument("replay: per-storage or per-op columns differ in length");
  if (!kept.empty() && kept.size() != s)
    throw std::invalid_argument("replay: 'kept' has an entry per storage, or none");
  for (std::uint8_t k : kept)
    if (k > kKeptPastBackward) throw std::invalid_argument("replay: a 'kept' entry is 0, 1 or 2");
  check_csr(inputs_offsets, inputs, n, s, "inputs");
  check_csr(created_offsets, created, n, s, "created");
  check_csr(mutated_offsets, mutated, n, s, "mutated");
  check_csr(frees_offsets, frees, n, s, "frees");
  for (int v : frees_before)
    if (v < 0 || static_cast<std::size_t>(v) >= s)
      throw std::invalid_argument("replay: storage id out of range in 'frees_before'");
}

namespace {

// Storage ids -> their current values, each once, in order of first appearance.
void current_values(const std::vector<int>& offsets, const std::vector<int>& sids, std::size_t op,
                    const std::vector<int>& current, std::vector<int>* out) {
  out->clear();
  for (int k = offsets[op]; k < offsets[op + 1]; ++k) {
    const int v = current[sids[k]];
    if (std::find(out->begin(), out->end(), v) == out->end()) out->push_back(v);
  }
}

// The figures derived from the counters and the per-op samples, summed in op
// order (the order Python's sum() would use).
void derive(ReplayResult* out) {
  out->compute_overhead = out->base_cost > 0 ? out->remat_cost / out->base_cost : 0.0;
  double share = 0;
  for (double f : out->free_share_per_call) share += f;
  out->free_share_at_evictions = out->free_share_per_call.empty() ? 0.0 : share / out->free_share_per_call.size();
  std::vector<std::int64_t> ns = out->search_ns_per_call;
  std::sort(ns.begin(), ns.end());
  out->search_ns = ns.empty() ? 0.0 : static_cast<double>(ns[ns.size() / 2]);
  const auto& s = out->series;
  double reserved_frag = 0, external_frag = 0;
  for (std::size_t i = 0; i < s.op.size(); ++i) {
    reserved_frag += s.reserved[i] ? 1.0 - double(s.allocated[i]) / double(s.reserved[i]) : 0.0;
    external_frag += s.free[i] ? 1.0 - double(s.largest_free[i]) / double(s.free[i]) : 0.0;
  }
  const double n = static_cast<double>(s.op.size());
  out->mean_reserved_fragmentation = s.op.empty() ? 0.0 : reserved_frag / n;
  out->mean_external_fragmentation = s.op.empty() ? 0.0 : external_frag / n;
}

}  // namespace

ReplayResult run_replay(const ReplayTrace& t, const ReplayOptions& options) {
  t.validate();
  Config config = options.config;
  config.budget = Budget{};
  config.budget.bytes = options.budget_bytes;
  config.policy = options.policy;  // what the placement's auto keys depend on
  Allocator allocator(make_virtual_backend(kVirtualCapacity), config);
  PoolPort port(allocator);
  RematEngine engine(port);
  ReplayResult out;
  out.policy = options.policy;
  out.budget_bytes = options.budget_bytes;
  engine.set_event_log(&out.events);
  auto evictor = std::make_shared<Evictor>(allocator, engine, options.policy, config);
  evictor->set_event_log(&out.events);
  const bool evicting = policy_traits(options.policy).choice != VictimChoice::kNone;
  if (evicting) allocator.set_eviction_hook(evictor);
  const bool recipes = evicting || options.measure_floor;
  if (options.history_entries) allocator.set_history_entries(options.history_entries);

  std::vector<int> current(t.nbytes.size(), -1);  // storage id -> its current value
  auto kept = [&](int sid) { return !t.kept.empty() && t.kept[sid] != 0; };
  auto outlives = [&](int sid) { return !t.kept.empty() && t.kept[sid] == ReplayTrace::kKeptOutlives; };
  auto check = [&] {
    if (!options.check_invariants) return;
    allocator.check_invariants();
    check_engine_against_pool(engine, allocator);
    ++out.invariant_checks;
  };
  // How often progress is reported: often enough for a terminal, rarely
  // enough to cost nothing next to the ops.
  constexpr std::size_t kProgressEvery = 2048;
  const std::size_t steps = std::max<std::size_t>(1, options.steps);
  const std::size_t max_remats = kMaxRematsPerOp * (steps * t.num_ops() + 16);
  std::vector<std::uint8_t> alive(t.nbytes.size(), 0);  // storage id -> its current value is alive
  auto kill = [&](int sid) {
    if (!alive[sid]) {
      // A storage alive before the step that an op frees (an earlier step's
      // gradient, zero_grad'ed mid-step): from the second step on, what
      // stands in for it died as the step began.
      if (t.initial[sid] && out.steps > 1) return;
      throw std::invalid_argument("replay: storage " + std::to_string(sid) + " freed twice");
    }
    engine.kill(current[sid]);
    alive[sid] = 0;
  };
  std::int64_t allocs_before = 0, device_frees_before = 0;
  std::size_t evictions_before = 0;
  double base_before = 0, remat_before = 0;
  OpCall call;
  // ReplayOptions::cost_lag_ops: ops priced at lag_cost, and their own costs,
  // oldest first; each handed to the engine once cost_lag_ops ops followed.
  std::deque<std::pair<int, double>> lagged;
  auto settle = [&](std::size_t keep) {
    while (lagged.size() > keep) {
      engine.set_cost(lagged.front().first, lagged.front().second);
      lagged.pop_front();
    }
  };
  try {
    out.oom_op = -1;
    for (std::size_t sid = 0; sid < t.nbytes.size(); ++sid)
      if (t.initial[sid]) current[sid] = engine.add_initial(t.nbytes[sid]), alive[sid] = 1;
    for (int sid : t.frees_before) kill(sid);
    check();
    for (out.steps = 1; out.steps <= steps; ++out.steps) {
      const bool last = out.steps == steps;
      settle(0);  // the GPU has caught up between steps: nothing of the step before is left to price
      const bool lag = options.cost_lag_ops > 0 && (out.steps == 1 || !options.lag_carried);
      if (last) {  // before the step boundary: a cache emptied there is the last step's to pay
        const StatsReport at = allocator.stats_report();
        allocs_before = at.stats.num_device_alloc;
        device_frees_before = at.stats.num_device_free;
        evictions_before = engine.counters().evictions;
        base_before = engine.counters().base_cost;
        remat_before = engine.counters().remat_cost;
      }
      if (out.steps > 1) {
        // What the step before made and kept dies as this one begins (in
        // the pool's history, at this step's first op).
        allocator.set_op_stamp(0);
        for (std::size_t sid = 0; sid < t.nbytes.size(); ++sid)
          if (alive[sid] && !t.initial[sid]) kill(static_cast<int>(sid));
        if (options.empty_cache_between_steps) allocator.empty_cache();
        check();
      }
      for (std::size_t i = 0; i < t.num_ops(); ++i) {
        out.oom_op = static_cast<int>(i);
        allocator.set_op_stamp(static_cast<std::int32_t>(i));
        engine.tick();
        call.cost = lag ? options.lag_cost : t.cost[i];
        call.random = t.random[i] != 0;
        current_values(t.inputs_offsets, t.inputs, i, current, &call.reads);
        current_values(t.mutated_offsets, t.mutated, i, current, &call.writes);
        if (out.steps > 1)
          for (int k = t.inputs_offsets[i]; k < t.inputs_offsets[i + 1]; ++k)
            if (!alive[t.inputs[k]])
              throw std::invalid_argument("replay: op " + std::to_string(i) + " reads storage " +
                                          std::to_string(t.inputs[k]) +
                                          ", which the step before freed: this trace cannot be repeated");
        const int op = engine.begin_op(call);
        for (int k = t.created_offsets[i]; k < t.created_offsets[i + 1]; ++k) {
          const int sid = t.created[k];
          // What the program keeps past the step (long_lived: as a live step
          // expects it from the step before).
          if (outlives(sid)) allocator.expect_long_lived({t.nbytes[sid]});
          current[sid] = engine.add_output(op, t.nbytes[sid], 0, /*pinned=*/!recipes || kept(sid));
          alive[sid] = 1;
          allocator.clear_long_lived();
        }
        for (int k = t.mutated_offsets[i]; k < t.mutated_offsets[i + 1]; ++k) {
          const int sid = t.mutated[k];
          current[sid] = engine.write(op, current[sid]);
          if (kept(sid)) engine.pin(current[sid]);  // each version the program holds
        }
        if (options.series && last)
          out.series.add(static_cast<std::int32_t>(i), allocator.sample(), evicting ? engine.evictable_resident_bytes() : 0);
        if (!evicting && options.measure_floor)
          out.resident_floor_bytes = std::max(out.resident_floor_bytes, engine.unevictable_resident_bytes());
        engine.end_op(op);
        if (lag) {
          lagged.emplace_back(op, t.cost[i]);
          settle(options.cost_lag_ops);
        }
        for (int k = t.frees_offsets[i]; k < t.frees_offsets[i + 1]; ++k) kill(t.frees[k]);
        check();
        if (engine.counters().remats > max_remats)
          throw OutOfMemoryError("thrashing: more than " + std::to_string(kMaxRematsPerOp) +
                                 " recomputes per op; the budget is too small for this policy");
        const std::size_t done = (out.steps - 1) * t.num_ops() + i + 1;
        if (options.progress && (i % kProgressEvery == 0 || done == steps * t.num_ops()))
          options.progress(done, steps * t.num_ops());
      }
    }
    settle(0);
    out.steps = steps;
    out.oom_op = -2;
  } catch (const OutOfMemoryError& e) {
    out.feasible = false;
    out.oom_message = e.what();
    settle(0);  // every op in it ended (the one that ran out never entered it)
  }
  allocator.set_eviction_hook(nullptr);
  if (options.history_entries) {
    out.history = allocator.snapshot().trace;
    out.history_wrapped = allocator.history_recorded() > out.history.size();
  }
  const StatsReport report = allocator.stats_report();
  out.peak_reserved_bytes = report.stats.reserved_bytes[kStatAll].peak;
  out.peak_allocated_bytes = report.stats.allocated_bytes[kStatAll].peak;
  out.final_reserved_bytes = report.stats.reserved_bytes[kStatAll].current;
  out.segments_peak = report.stats.segment[kStatAll].peak;
  out.device_alloc_calls = report.stats.num_device_alloc;
  out.device_free_calls = report.stats.num_device_free;
  out.page_releases = report.stats.num_page_releases;
  out.long_lived = report.stats.num_long_lived;
  out.max_split_size = allocator.config().max_split_size_mb;
  out.segment_fit = allocator.config().segment_fit == Switch::kOn;
  const EngineCounters& c = engine.counters();
  if (out.feasible && out.steps == steps) {
    out.last_step_device_alloc_calls = report.stats.num_device_alloc - allocs_before;
    out.last_step_device_free_calls = report.stats.num_device_free - device_frees_before;
    out.last_step_evictions = c.evictions - evictions_before;
    const double base = c.base_cost - base_before;
    out.last_step_compute_overhead = base > 0 ? (c.remat_cost - remat_before) / base : 0.0;
  }
  out.base_cost = c.base_cost;
  out.remat_cost = c.remat_cost;
  out.evictions = c.evictions;
  out.remats = c.remats;
  out.random_replays = c.random_replays;
  out.fake_deletions = c.fake_deletions;
  out.hold_restarts = c.hold_restarts;
  const EvictorStats& e = evictor->stats();
  out.eviction_calls = e.calls;
  out.window_evictions = e.windows;
  out.segment_releases = e.segment_releases;
  out.no_plan = e.no_plan;
  out.large_windows = e.large_windows;
  out.ruinous_spared = e.ruinous_spared;
  out.search_ns_per_call = e.search_ns;
  out.free_share_per_call = e.free_fraction;
  derive(&out);
  engine.release_all();
  return out;
}

}  // namespace dtralloc
