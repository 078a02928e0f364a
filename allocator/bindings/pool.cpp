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
  // async_segments: the device memory the driver's pool holds, which can
  // pass reserved_bytes until the next synchronize (backend_cuda.cpp).
  if (r.has_device_pool) {
    d["device_pool_reserved_bytes.current"] = r.device_pool.reserved;
    d["device_pool_reserved_bytes.peak"] = r.device_pool.peak;
  }
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

// One dict per event, as torch's tools read them. Built with the C API and
// keys made once: 1M events take about a second instead of eight (big
// histories go through history_columns instead: no dict per event).
py::list trace_list(const Snapshot& snap, int device) {
  const py::str k_action("action"), k_addr("addr"), k_size("size"), k_stream("stream"),
      k_time("time_us"), k_device("device"), k_frames("frames"), k_device_free("device_free");
  // Codes 0-5 and 7 (segment_unmap; 6 is torch's segment_map, never recorded here).
  py::str names[8];
  for (int i = 0; i < 8; ++i) names[i] = py::str(trace_action_name(static_cast<TraceAction>(i)));
  const py::int_ device_obj(device);
  py::list trace(snap.trace.size());
  auto put = [](PyObject* d, const py::str& key, PyObject* value) {
    if (!value || PyDict_SetItem(d, key.ptr(), value) != 0) {
      Py_XDECREF(value);
      throw py::error_already_set();
    }
    Py_DECREF(value);
  };
  for (std::size_t i = 0; i < snap.trace.size(); ++i) {
    const TraceEntry& e = snap.trace[i];
    py::dict ed;
    PyObject* d = ed.ptr();
    if (PyDict_SetItem(d, k_action.ptr(), names[static_cast<int>(e.action)].ptr()) != 0 ||
        PyDict_SetItem(d, k_device.ptr(), device_obj.ptr()) != 0)
      throw py::error_already_set();
    put(d, k_addr, PyLong_FromUnsignedLongLong(e.addr));
    put(d, k_size, PyLong_FromSize_t(e.size));
    put(d, k_stream, PyLong_FromUnsignedLongLong(e.stream));
    put(d, k_time, PyLong_FromLongLong(e.time_us));
    put(d, k_frames, PyList_New(0));
    if (e.action == TraceAction::kOom) put(d, k_device_free, PyLong_FromSize_t(e.detail));
    trace[i] = std::move(ed);
  }
  return trace;
}

}  // namespace

// One device's snapshot in torch's layout; device_traces has one list per
// device index up to `device`. With `columns`, this device's entry is
// history_columns() (numpy arrays) instead of a list of dicts: what big
// histories and dtralloc's dashboard need, but not what torch's tools read.
py::dict snapshot_dict(Allocator& a, bool columns) {
  py::dict d;
  Snapshot snap;
  py::object history = columns ? py::object(history_columns(a, &snap)) : py::none();
  if (!columns) snap = a.snapshot();
  d["segments"] = segments_list(snap, a.device());
  py::list traces;
  for (int i = 0; i < a.device(); ++i) traces.append(py::list());
  traces.append(columns ? history : py::object(trace_list(snap, a.device())));
  d["device_traces"] = traces;
  return d;
}

namespace {

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

std::unique_ptr<Backend> make_backend(const std::string& name, std::size_t capacity, const Config& config,
                                      int device) {
  if (name == "host") return make_host_backend(capacity);
  if (name == "virtual") return make_virtual_backend(capacity);
  if (name == "cuda") return make_cuda_backend_for(config, device);
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
             return std::make_unique<Allocator>(make_backend(backend, capacity, config, device), config, device);
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
      .def("snapshot", &snapshot_dict, py::arg("columns") = false,
           "torch.cuda.memory._snapshot() layout; columns=True: this device's history as "
           "numpy columns (no dict per event) instead of a list of dicts")
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
  m.def("global_snapshot", [](bool columns) {
    py::dict d;
    py::list segments, traces;
    int last = -1;
    for (Allocator* a : global::all_existing()) {
      py::dict one = snapshot_dict(*a, columns);
      for (auto item : one["segments"]) segments.append(item);
      while (last + 1 < a->device()) {
        traces.append(py::list());
        ++last;
      }
      traces.append(one["device_traces"].cast<py::list>()[a->device()]);
      last = a->device();
    }
    d["segments"] = segments;
    d["device_traces"] = traces;
    return d;
  }, py::arg("columns") = false);
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
