// Bindings of the replay room: the trace's columns (ReplayTrace), one replay
// through pool + remat engine + evictor (run_replay), its result
// (ReplayResult, generated from DTRALLOC_REPLAY_FIGURES), and the policy table.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "config.h"
#include "policies.h"
#include "replay_driver.h"

namespace dtralloc::bindings {

py::dict series_columns(const OpSeries& s, py::handle owner) {
  py::dict d;
  d["op"] = column(s.op, owner);
  d["reserved"] = column(s.reserved, owner);
  d["allocated"] = column(s.allocated, owner);
  d["evictable"] = column(s.evictable, owner);
  d["largest_free"] = column(s.largest_free, owner);
  d["free"] = column(s.free, owner);
  if (!s.event.empty()) d["event"] = column(s.event, owner);
  return d;
}

py::dict event_columns(const EventLog& e, py::handle owner) {
  py::dict d;
  d["op"] = column(e.op, owner);
  d["kind"] = column(e.kind, owner);
  d["value"] = column(e.value, owner);
  d["bytes"] = column(e.bytes, owner);
  d["addr"] = column(e.addr, owner);
  d["plan"] = column(e.plan, owner);
  d["score"] = column(e.score, owner);
  d["window_addr"] = column(e.window_addr, owner);
  d["window_bytes"] = column(e.window_bytes, owner);
  return d;
}

namespace {

// 1 - a / b per op (0 where b is 0), as an array.
py::array_t<double> one_minus_ratio(const std::vector<std::int64_t>& a, const std::vector<std::int64_t>& b) {
  py::array_t<double> out(static_cast<py::ssize_t>(a.size()));
  auto w = out.mutable_unchecked<1>();
  for (std::size_t i = 0; i < a.size(); ++i) w(i) = b[i] ? 1.0 - double(a[i]) / double(b[i]) : 0.0;
  return out;
}

ReplayResult replay(const ReplayTrace& trace, std::size_t budget_bytes, const std::string& policy,
                    const std::string& conf, bool check_invariants, bool series, bool measure_floor,
                    std::size_t history_entries, py::object progress, std::size_t steps,
                    std::size_t cost_lag_ops, double lag_cost, bool lag_carried, bool empty_cache_between_steps) {
  if (steps < 1) throw std::invalid_argument("replay: steps must be at least 1");
  if (lag_cost < 0) throw std::invalid_argument("replay: lag_cost must be >= 0");
  ReplayOptions options;
  options.steps = steps;
  options.cost_lag_ops = cost_lag_ops;
  options.lag_cost = lag_cost;
  options.lag_carried = lag_carried;
  options.empty_cache_between_steps = empty_cache_between_steps;
  options.config = parse_config(conf);
  options.policy = parse_policy(policy);
  options.budget_bytes = budget_bytes;
  options.check_invariants = check_invariants;
  options.series = series;
  options.measure_floor = measure_floor;
  options.history_entries = history_entries;
  if (!progress.is_none()) {
    options.progress = [progress](std::size_t done, std::size_t total) {
      py::gil_scoped_acquire gil;
      progress(done, total);
    };
  }
  py::gil_scoped_release release;
  return run_replay(trace, options);
}

// Two replays measured the same: every figure, every per-op sample and
// every logged event (search times excepted: they are wall-clock).
bool same_replay(const ReplayResult& a, const ReplayResult& b) {
#define DTRALLOC_SAME(type, name, def, doc) \
  if (std::string(#name) != "search_ns" && !(a.name == b.name)) return false;
  DTRALLOC_REPLAY_FIGURES(DTRALLOC_SAME)
#undef DTRALLOC_SAME
  const auto& s = a.series;
  const auto& t = b.series;
  const auto& e = a.events;
  const auto& f = b.events;
  return a.budget_bytes == b.budget_bytes && a.oom_op == b.oom_op && a.oom_message == b.oom_message &&
         a.policy == b.policy && a.max_split_size == b.max_split_size && a.name == b.name &&
         a.conf == b.conf && a.no_eviction_peak_reserved_bytes == b.no_eviction_peak_reserved_bytes &&
         a.free_share_per_call == b.free_share_per_call && s.op == t.op && s.reserved == t.reserved &&
         s.allocated == t.allocated && s.evictable == t.evictable && s.largest_free == t.largest_free &&
         s.free == t.free && e.op == f.op && e.kind == f.kind && e.value == f.value && e.bytes == f.bytes &&
         e.addr == f.addr && e.plan == f.plan && e.score == f.score && e.window_addr == f.window_addr &&
         e.window_bytes == f.window_bytes;
}

}  // namespace

void bind_replay(py::module_& m) {
  py::class_<ReplayTrace>(m, "ReplayTrace",
                          "A trace's columns as the replay driver reads them (CSR lists: offsets "
                          "has one entry more than ops). dtralloc.replay builds it from a Trace.")
      .def(py::init<>())
      .def_readwrite("nbytes", &ReplayTrace::nbytes)
      .def_readwrite("initial", &ReplayTrace::initial)
      .def_readwrite("kept", &ReplayTrace::kept)
      .def_readonly_static("KEPT_OUTLIVES", &ReplayTrace::kKeptOutlives)
      .def_readonly_static("KEPT_PAST_BACKWARD", &ReplayTrace::kKeptPastBackward)
      .def_readwrite("frees_before", &ReplayTrace::frees_before)
      .def_readwrite("inputs_offsets", &ReplayTrace::inputs_offsets)
      .def_readwrite("inputs", &ReplayTrace::inputs)
      .def_readwrite("created_offsets", &ReplayTrace::created_offsets)
      .def_readwrite("created", &ReplayTrace::created)
      .def_readwrite("mutated_offsets", &ReplayTrace::mutated_offsets)
      .def_readwrite("mutated", &ReplayTrace::mutated)
      .def_readwrite("frees_offsets", &ReplayTrace::frees_offsets)
      .def_readwrite("frees", &ReplayTrace::frees)
      .def_readwrite("cost", &ReplayTrace::cost)
      .def_readwrite("random", &ReplayTrace::random)
      .def_property_readonly("num_ops", &ReplayTrace::num_ops)
      .def("validate", &ReplayTrace::validate, "Raise ValueError if the columns are malformed.");

  py::class_<ReplayResult> result(m, "ReplayResult", "What one replay measured (dtralloc.replay).");
#define DTRALLOC_BIND_FIGURE(type, name, def, doc) result.def_readonly(#name, &ReplayResult::name, doc);
  DTRALLOC_REPLAY_FIGURES(DTRALLOC_BIND_FIGURE)
#undef DTRALLOC_BIND_FIGURE
  result
      .def_property_readonly("budget_bytes", [](const ReplayResult& r) -> py::object {
        return r.budget_bytes ? py::cast(r.budget_bytes) : py::none();
      }, "the cap on reserved bytes; None: no budget")
      .def_property_readonly("oom_op", [](const ReplayResult& r) -> py::object {
        return r.oom_op == -2 ? py::none() : py::cast(r.oom_op);
      }, "the op whose allocation failed (-1: the storages alive before the step); None if feasible")
      .def_readonly("oom_message", &ReplayResult::oom_message)
      .def_property_readonly("policy", [](const ReplayResult& r) { return std::string(policy_name(r.policy)); })
      .def_property_readonly("max_split_size", [](const ReplayResult& r) { return split_size_for_python(r.max_split_size); },
                             "the pool's block split limit (max_split_size_mb:auto resolved), bytes; -1: none")
      .def_property_readonly("search_ns_per_call", [](py::object self) {
        return column(self.cast<const ReplayResult&>().search_ns_per_call, self);
      })
      .def_property_readonly("free_share_per_call", [](py::object self) {
        return column(self.cast<const ReplayResult&>().free_share_per_call, self);
      })
      .def_property_readonly("series", [](py::object self) {
        return series_columns(self.cast<const ReplayResult&>().series, self);
      }, "per op, after its outputs are allocated: op, reserved, allocated, evictable, largest_free, free "
         "(numpy arrays); with history=True also event, the number of history events before the sample")
      .def_property_readonly("events", [](py::object self) {
        return event_columns(self.cast<const ReplayResult&>().events, self);
      }, "the evictor's calls, evictions and recomputes: op, kind (0 room asked, 1 evicted, "
         "2 recomputed), value, bytes, addr, plan (0 none, 1 window, 2 segment release, 3 single), "
         "score, window_addr, window_bytes (numpy arrays)")
      .def_property_readonly("history", [](const ReplayResult& r) -> py::object {
        if (r.history.empty()) return py::none();
        return history_columns(r.history.data(), r.history.size(), nullptr, 0);
      }, "the pool's alloc/free/segment events, each stamped with its op (-1: before the first), as "
         "numpy columns (Pool.history()'s); None unless replay(..., history=True)")
      .def_readonly("history_wrapped", &ReplayResult::history_wrapped,
                    "the history ring filled up: its oldest events may be gone")
      .def_property_readonly("reserved_fragmentation", [](const ReplayResult& r) {
        return one_minus_ratio(r.series.allocated, r.series.reserved);
      }, "1 - allocated / reserved after each op")
      .def_property_readonly("external_fragmentation", [](const ReplayResult& r) {
        return one_minus_ratio(r.series.largest_free, r.series.free);
      }, "1 - largest free block / free cached bytes after each op")
      .def_property_readonly("reserved_over_allocated", [](const ReplayResult& r) {
        return r.peak_allocated_bytes ? double(r.peak_reserved_bytes) / double(r.peak_allocated_bytes) : 1.0;
      }, "peak reserved / peak allocated (1.0 = no cache overhead)")
      // Set by dtralloc.replay from the call (the trace's name, the pool
      // settings, and the no-eviction peak a fractional budget is a share of).
      .def_readwrite("name", &ReplayResult::name)
      .def_readwrite("conf", &ReplayResult::conf)
      .def_readwrite("no_eviction_peak_reserved_bytes", &ReplayResult::no_eviction_peak_reserved_bytes,
                     "peak reserved of the same trace replayed with no budget and no eviction: the "
                     "reference a fractional budget is a share of")
      .def("__eq__", [](const ReplayResult& a, const ReplayResult& b) { return same_replay(a, b); },
           py::is_operator())
      .def("__repr__", [](const ReplayResult& r) {
        return "<ReplayResult " + r.name + " policy=" + policy_name(r.policy) +
               " feasible=" + (r.feasible ? "True" : "False") +
               " peak_reserved=" + format_bytes(r.peak_reserved_bytes) + ">";
      });

  m.def("replay", &replay, py::arg("trace"), py::arg("budget_bytes"), py::arg("policy"), py::arg("conf"),
        py::arg("check_invariants") = false, py::arg("series") = true, py::arg("measure_floor") = false,
        py::arg("history_entries") = 0, py::arg("progress") = py::none(), py::arg("steps") = 1,
        py::arg("cost_lag_ops") = 0, py::arg("lag_cost") = 0.0, py::arg("lag_carried") = true,
        py::arg("empty_cache_between_steps") = false,
        "Replay `trace` (a ReplayTrace) `steps` times through a fresh pool on the virtual backend "
        "under `budget_bytes` (0 = none) with eviction `policy`; cost_lag_ops > 0 prices each op at "
        "lag_cost until that many ops later, as a GPU's timing events would; empty_cache_between_steps "
        "gives back the whole free cached segments between steps (ReplayOptions).");

  m.def("policies", []() {
    py::list out;
    for (const PolicyInfo& p : policy_table()) {
      const PolicyTraits& t = p.traits;
      py::dict d;
      d["name"] = p.name;
      d["doc"] = p.doc;
      d["choice"] = t.choice == VictimChoice::kNone ? "none" : t.choice == VictimChoice::kSingle ? "single" : "window";
      const char* cost = "";
      switch (t.cost) {
        case VictimCost::kNone: cost = "none"; break;
        case VictimCost::kLastAccess: cost = "last access"; break;
        case VictimCost::kUnit: cost = "1"; break;
        case VictimCost::kProducer: cost = "producer cost"; break;
        case VictimCost::kChain: cost = "recompute chain"; break;
        case VictimCost::kEstarExact: cost = "e* (exact)"; break;
        case VictimCost::kEstarEq: cost = "e* (union-find)"; break;
      }
      d["cost"] = cost;
      d["per_byte"] = t.per_byte;
      d["free_neighbours"] = t.free_neighbours;
      d["staleness"] = t.staleness;
      d["penalty"] = t.penalty;
      d["pruned"] = t.pruned;
      d["thorough"] = t.thorough;
      d["recency"] = t.recency;
      d["recent_ops"] = kRecentOps;
      d["recoverable"] = t.recoverable;
      d["recoverable_share"] = kRecoverableShare;
      d["drop_spent"] = t.drop_spent;
      d["spare_ruinous"] = t.spare_ruinous;
      d["ruinous_share"] = kRuinousShare;
      out.append(d);
    }
    return out;
  }, "The eviction policies (allocator/policies.h), in table order, with their descriptors.");
}

}  // namespace dtralloc::bindings
