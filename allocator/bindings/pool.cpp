// Bindings of the pool room: dtralloc.Pool, the process-wide allocators,
// stats and snapshots as the dicts torch's own memory tools read
// (torch.cuda.memory_stats() keys, torch.cuda.memory._snapshot() layout).
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "allocator.h"
#include "backend.h"
#include "bindings.h"
#include "config.h"
#include "global.h"
#include "microbench.h"

namespace dtralloc::bindings {
namespace {

void put_stat(py::dict& d, const std::string& prefix, const Stat& s) {
  d[py::str(prefix + ".current")] = s.current;
  d[py::str(prefix + ".peak")] = s.peak;
  d[py::str(prefix + ".allocated")] = s.allocated;
  d[py::str(prefix + ".freed")] = s.freed;
}

py::dict stats_dict(const StatsReport& r) {
  py::dict d;
  const Stats& s = r.stats;
#define DTRALLOC_PUT_POOL(name)                                            \
  for (int i = 0; i < kNumStatIndices; ++i)                                \
    put_stat(d, std::string(#name ".") + kStatIndexNames[i], s.name[i]);
  DTRALLOC_POOL_STATS(DTRALLOC_PUT_POOL)
#undef DTRALLOC_PUT_POOL
#define DTRALLOC_PUT_PLAIN(name) put_stat(d, #name, s.name);
  DTRALLOC_PLAIN_STATS(DTRALLOC_PUT_PLAIN)
#undef DTRALLOC_PUT_PLAIN
#define DTRALLOC_PUT_COUNTER(name) d[#name] = s.name;
  DTRALLOC_COUNTERS(DTRALLOC_PUT_COUNTER)
#undef DTRALLOC_PUT_COUNTER
  d["max_split_size"] = split_size_for_python(r.max_split_size);
  // dtralloc's own keys: the budget and fragmentation.
  const auto reserved = s.reserved_bytes[kStatAll].current;
  const auto allocated = s.allocated_bytes[kStatAll].current;
  d["budget_bytes"] = r.budget_bytes;
  d["capacity_bytes"] = r.capacity_bytes;
  d["fragmentation.largest_free_bytes"] = r.largest_free_bytes;
  d["fragmentation.free_bytes"] = r.free_cached_bytes;
  d["fragmentation.reserved_unallocated_bytes"] = reserved - allocated;
  d["fragmentation.external"] =
      r.free_cached_bytes ? 1.0 - double(r.largest_free_bytes) / double(r.free_cached_bytes) : 0.0;
  return d;
}

py::list segments_list(const Snapshot& snap, int device) {
  py::list segments;
  for (const SegmentInfo& seg : snap.segments) {
    py::list blocks;
    for (const BlockInfo& b : seg.blocks) {
      py::dict bd;
      bd["address"] = b.addr;
      bd["size"] = b.size;
      bd["requested_size"] = b.requested_size;
      bd["state"] = b.state;
      bd["frames"] = py::list();
      blocks.append(bd);
    }
    py::dict sd;
    sd["device"] = device;
    sd["address"] = seg.addr;
    sd["total_size"] = seg.total_size;
    sd["allocated_size"] = seg.allocated_size;
    sd["active_size"] = seg.active_size;
    sd["requested_size"] = seg.requested_size;
    sd["stream"] = seg.stream;
    sd["segment_type"] = seg.small_pool ? "small" : "large";
    sd["segment_pool_id"] = py::make_tuple(0, 0);
    sd["is_expandable"] = false;
    sd["frames"] = py::list();
    sd["blocks"] = blocks;
    segments.append(sd);
  }
  return segments;
}

py::list trace_list(const Snapshot& snap, int device) {
  py::list trace;
  for (const TraceEntry& e : snap.trace) {
    py::dict ed;
    ed["action"] = trace_action_name(e.action);
    ed["addr"] = e.addr;
    ed["size"] = e.size;
    ed["stream"] = e.stream;
    ed["time_us"] = e.time_us;
    ed["device"] = device;
    ed["frames"] = py::list();
    if (e.action == TraceAction::kOom) ed["device_free"] = e.device_free;
    trace.append(ed);
  }
  return trace;
}

// One device's snapshot in torch's layout; device_traces has one list per
// device index up to `device`.
py::dict snapshot_dict(const Snapshot& snap, int device) {
  py::dict d;
  d["segments"] = segments_list(snap, device);
  py::list traces;
  for (int i = 0; i < device; ++i) traces.append(py::list());
  traces.append(trace_list(snap, device));
  d["device_traces"] = traces;
  return d;
}

class PyEvictionHook : public EvictionHook {
 public:
  explicit PyEvictionHook(py::function fn) : fn_(std::move(fn)) {}
  ~PyEvictionHook() override {
    py::gil_scoped_acquire gil;
    fn_ = py::function();
  }
  bool make_room(std::size_t bytes, Stream stream) override {
    py::gil_scoped_acquire gil;
    py::object answer = fn_(bytes, stream);
    if (!PyBool_Check(answer.ptr())) {
      const std::string name = py::hasattr(fn_, "__qualname__")
                                   ? py::str(fn_.attr("__qualname__")).cast<std::string>()
                                   : py::repr(fn_).cast<std::string>();
      throw py::type_error(
          "dtralloc: the eviction hook " + name + " returned " + py::repr(answer).cast<std::string>() +
          " (a " + py::str(py::type::of(answer).attr("__name__")).cast<std::string>() +
          "); it must return True when it freed memory (the pool tries again) or False when it "
          "has nothing more to free (the malloc fails with an out-of-memory error)");
    }
    return answer.ptr() == Py_True;
  }

 private:
  py::function fn_;
};

std::unique_ptr<Backend> make_backend(const std::string& name, std::size_t capacity, int device) {
  if (name == "host") return make_host_backend(capacity);
  if (name == "virtual") return make_virtual_backend(capacity);
  if (name == "cuda") return make_cuda_backend(device);
  throw std::invalid_argument("dtralloc: unknown backend '" + name +
                              "'; use one of 'cuda', 'host', 'virtual'");
}


std::uintptr_t to_addr(void* p) { return reinterpret_cast<std::uintptr_t>(p); }
void* to_ptr(std::uintptr_t a) { return reinterpret_cast<void*>(a); }

}  // namespace

void bind_pool(py::module_& m) {
  py::class_<Allocator>(m, "Pool")
      .def(py::init([](const std::string& backend, std::size_t capacity, const std::string& conf,
                       int device) {
             Config config = parse_config(conf);
             return std::make_unique<Allocator>(make_backend(backend, capacity, device), config, device);
           }),
           py::arg("backend"), py::arg("capacity"), py::arg("conf"), py::arg("device") = 0)
      .def("malloc", [](Allocator& a, std::size_t size, Stream stream) {
             return to_addr(a.malloc(size, stream));
           }, py::arg("size"), py::arg("stream") = 0)
      .def("free", [](Allocator& a, std::uintptr_t addr) { a.free(to_ptr(addr)); }, py::arg("address"))
      .def("record_stream", [](Allocator& a, std::uintptr_t addr, Stream s) { a.record_stream(to_ptr(addr), s); },
           py::arg("address"), py::arg("stream"))
      .def("owns", [](Allocator& a, std::uintptr_t addr) { return a.owns(to_ptr(addr)); })
      .def("empty_cache", &Allocator::empty_cache)
      .def("complete_events", &Allocator::complete_events)
      .def("set_memory_fraction", &Allocator::set_memory_fraction)
      .def("set_eviction_hook", [](Allocator& a, py::object fn) {
             if (fn.is_none()) a.set_eviction_hook(nullptr);
             else a.set_eviction_hook(std::make_shared<PyEvictionHook>(fn.cast<py::function>()));
           }, py::arg("hook"))
      .def("stats", [](Allocator& a) { return stats_dict(a.stats_report()); })
      .def("usage", [](Allocator& a) {
             StatsReport r = a.stats_report();
             return py::make_tuple(r.stats.allocated_bytes[kStatAll].current,
                                   r.stats.reserved_bytes[kStatAll].current,
                                   r.largest_free_bytes, r.free_cached_bytes,
                                   r.stats.segment[kStatAll].current);
           }, "(allocated, reserved, largest free block, free cached bytes, segments): "
              "the few numbers a replay samples after every op, without building stats()")
      .def("snapshot", [](Allocator& a) { return snapshot_dict(a.snapshot(), a.device()); })
      .def("record_history", &Allocator::set_history_entries, py::arg("entries"),
           "Resize (and clear) the event history ring; 0 turns it off.")
      .def_property_readonly("history_entries", &Allocator::history_entries)
      .def("reset_peak_stats", &Allocator::reset_peak_stats)
      .def("reset_accumulated_stats", &Allocator::reset_accumulated_stats)
      .def("check_invariants", &Allocator::check_invariants)
      .def_property_readonly("budget_bytes", &Allocator::budget_bytes)
      .def_property_readonly("capacity_bytes", &Allocator::capacity_bytes)
      .def_property_readonly("device", &Allocator::device)
      .def_property_readonly("backend", [](Allocator& a) { return std::string(a.backend().name()); })
      .def_property_readonly("host_accessible", [](Allocator& a) { return a.backend().host_accessible(); });

  // The process-wide allocators, the same ones the C ABI serves.
  m.def("configure", &global::configure, py::arg("text"));
  m.def("config_text", &global::config_text);
  m.def("global_pool", [](int device) { return &global::allocator(device); },
        py::return_value_policy::reference, py::arg("device"));
  m.def("existing_global_pool", [](int device) { return global::existing(device); },
        py::return_value_policy::reference, py::arg("device"));
  m.def("global_snapshot", []() {
    py::dict d;
    py::list segments, traces;
    int last = -1;
    for (Allocator* a : global::all_existing()) {
      Snapshot snap = a->snapshot();
      for (auto item : segments_list(snap, a->device())) segments.append(item);
      while (last + 1 < a->device()) {
        traces.append(py::list());
        ++last;
      }
      traces.append(trace_list(snap, a->device()));
      last = a->device();
    }
    d["segments"] = segments;
    d["device_traces"] = traces;
    return d;
  });
  m.def("reset_for_tests", &global::reset_for_tests);
  m.def("bench_pool_pairs", &bench_pool_pairs, py::arg("pool"), py::arg("sizes"), py::arg("pairs_per_thread"),
        py::arg("threads"), py::arg("repeats"), py::arg("stream_per_thread"),
        py::call_guard<py::gil_scoped_release>());
  m.def("bench_pool_churn", &bench_pool_churn, py::arg("pool"), py::arg("sizes"), py::arg("live_copies"),
        py::arg("pairs_per_thread"), py::arg("threads"), py::arg("repeats"), py::arg("stream_per_thread"),
        py::call_guard<py::gil_scoped_release>());
  m.def("bench_libc_pairs", &bench_libc_pairs, py::arg("sizes"), py::arg("pairs_per_thread"),
        py::arg("threads"), py::arg("repeats"),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace dtralloc::bindings
