// Bindings of the replay room: a trace's columns through pool + remat engine
// + evictor under a budget (replay_driver.h).
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "config.h"
#include "replay_driver.h"

namespace dtralloc::bindings {
namespace {

// The trace arrives as its columns (python/dtralloc/replay.py builds them);
// the result is a plain dict that replay.py turns into a ReplayResult.
py::dict remat_replay(ReplayTrace trace, std::size_t budget_bytes, const std::string& policy,
                      const std::string& conf, bool check_invariants) {
  ReplayOptions options;
  options.config = parse_config(conf);
  options.policy = parse_policy(policy);
  options.budget_bytes = budget_bytes;
  options.check_invariants = check_invariants;
  ReplayOutcome r;
  {
    py::gil_scoped_release release;
    r = run_replay(trace, options);
  }
  py::dict d;
  d["feasible"] = r.feasible;
  d["oom_op"] = r.oom_op;
  d["message"] = r.message;
  d["peak_reserved_bytes"] = r.peak_reserved_bytes;
  d["peak_allocated_bytes"] = r.peak_allocated_bytes;
  d["final_reserved_bytes"] = r.final_reserved_bytes;
  d["segments_peak"] = r.segments_peak;
  d["device_alloc_calls"] = r.device_alloc_calls;
  d["device_free_calls"] = r.device_free_calls;
  d["invariant_checks"] = r.invariant_checks;
  d["max_split_size"] = split_size_for_python(r.max_split_size);
  d["segment_fit"] = r.segment_fit;
  d["base_cost"] = r.engine.base_cost;
  d["remat_cost"] = r.engine.remat_cost;
  d["evictions"] = r.engine.evictions;
  d["remats"] = r.engine.remats;
  d["random_replays"] = r.engine.random_replays;
  d["fake_deletions"] = r.engine.fake_deletions;
  d["eviction_calls"] = r.evictor.calls;
  d["window_evictions"] = r.evictor.windows;
  d["segment_releases"] = r.evictor.segment_releases;
  d["no_plan"] = r.evictor.no_plan;
  d["resident_floor_bytes"] = r.resident_floor_bytes;
  d["search_ns"] = r.evictor.search_ns;
  d["free_fraction"] = r.evictor.free_fraction;
  return d;
}
}  // namespace

void bind_replay(py::module_& m) {
  m.def("remat_replay",
        [](std::vector<std::size_t> nbytes, std::vector<int> initial, std::vector<int> frees_before,
           std::vector<int> inputs_offsets, std::vector<int> inputs, std::vector<int> created_offsets,
           std::vector<int> created, std::vector<int> mutated_offsets, std::vector<int> mutated,
           std::vector<int> frees_offsets, std::vector<int> frees, std::vector<double> cost,
           std::vector<int> random, std::size_t budget_bytes, const std::string& policy,
           const std::string& conf, bool check_invariants) {
          ReplayTrace t;
          t.nbytes = std::move(nbytes);
          t.initial.assign(initial.begin(), initial.end());
          t.frees_before = std::move(frees_before);
          t.inputs_offsets = std::move(inputs_offsets);
          t.inputs = std::move(inputs);
          t.created_offsets = std::move(created_offsets);
          t.created = std::move(created);
          t.mutated_offsets = std::move(mutated_offsets);
          t.mutated = std::move(mutated);
          t.frees_offsets = std::move(frees_offsets);
          t.frees = std::move(frees);
          t.cost = std::move(cost);
          t.random.assign(random.begin(), random.end());
          return remat_replay(std::move(t), budget_bytes, policy, conf, check_invariants);
        },
        "Replay a trace (as columns) with eviction and rematerialization under a budget "
        "(0 = none); returns a dict of results.");
}

}  // namespace dtralloc::bindings
