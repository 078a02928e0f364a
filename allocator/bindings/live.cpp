// Bindings of the live room (python/dtralloc/dtr/): LiveSession, the C++
// half of dtralloc.dtr(), and SavedValue, the handle autograd holds for a
// saved tensor (live_session.h).
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings.h"
#include "global.h"
#include "live_session.h"
#include "policies.h"

namespace dtralloc::bindings {

using live::LiveSession;
using live::SavedValue;

namespace {

// The two calls made per op (record) and per saved tensor (pack), as plain
// CPython functions bound to one session: pybind11's argument handling costs
// about a microsecond per call, which is a tenth of the per-op budget.
// `self` is a capsule owning a shared_ptr to the session.
LiveSession* session_of(PyObject* self) {
  auto* holder = static_cast<std::shared_ptr<LiveSession>*>(PyCapsule_GetPointer(self, "dtralloc.LiveSession"));
  return holder ? holder->get() : nullptr;
}

// Runs `body` (returning a py::object) as a CPython function must: a new
// reference, or nullptr with the Python error set; C++ errors
// (OutOfMemoryError, logic errors) are mapped as pybind11 maps them.
template <typename Body>
PyObject* guarded(Body&& body) {
  try {
    return body().release().ptr();
  } catch (py::error_already_set& e) {
    e.restore();
    return nullptr;
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

// record(func, args, kwargs, out, writes, flags, pin, cost, rng)
PyObject* fast_record(PyObject* self, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs != 9) {
    PyErr_SetString(PyExc_TypeError, "record takes 9 arguments");
    return nullptr;
  }
  LiveSession* s = session_of(self);
  if (!s) return nullptr;
  const unsigned long flags = PyLong_AsUnsignedLong(argv[5]);
  const long pin = PyLong_AsLong(argv[6]);
  const double cost = PyFloat_AsDouble(argv[7]);
  if (PyErr_Occurred()) return nullptr;
  return guarded([&] {
    s->record(argv[0], argv[1], argv[2], argv[3], argv[4], static_cast<std::uint32_t>(flags), static_cast<int>(pin),
              cost, argv[8]);
    return py::none();
  });
}

PyObject* fast_pack(PyObject* self, PyObject* tensor) {
  LiveSession* s = session_of(self);
  if (!s) return nullptr;
  return guarded([&] { return s->pack(tensor); });
}

// __torch_dispatch__(func, types, args, kwargs) of the session's mode, for
// the ops the classifier calls fast (no writes, not random, nothing decided
// per call): run, time, record. Others go to the Python mode's slow path.
// Bound to the mode as a method (torch wants one), so argv[0] is the mode.
PyObject* fast_dispatch(PyObject* self, PyObject* const* argv, Py_ssize_t nargs) {
  if (nargs < 4 || nargs > 5) {
    PyErr_SetString(PyExc_TypeError, "__torch_dispatch__ takes (mode, func, types, args, kwargs)");
    return nullptr;
  }
  LiveSession* s = session_of(self);
  if (!s) return nullptr;
  return guarded([&] { return s->dispatch(argv[1], argv[2], argv[3], nargs == 5 ? argv[4] : Py_None); });
}

PyMethodDef kDispatchDef = {
    "__torch_dispatch__", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_dispatch)),
    METH_FASTCALL, "The dtr mode's __torch_dispatch__ (see fast_calls)."};
PyMethodDef kRecordDef = {"record", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_record)),
                          METH_FASTCALL, "LiveSession.record, bound (see fast_calls)."};
PyMethodDef kPackDef = {"pack", &fast_pack, METH_O, "LiveSession.pack, bound (see fast_calls)."};

// (record, pack, dispatch) bound to `session`: plain CPython functions.
py::tuple fast_calls(const std::shared_ptr<LiveSession>& session) {
  py::capsule owner(new std::shared_ptr<LiveSession>(session), "dtralloc.LiveSession", [](PyObject* capsule) {
    delete static_cast<std::shared_ptr<LiveSession>*>(PyCapsule_GetPointer(capsule, "dtralloc.LiveSession"));
  });
  PyObject* record = PyCFunction_New(&kRecordDef, owner.ptr());
  if (!record) throw py::error_already_set();
  py::object r = py::reinterpret_steal<py::object>(record);
  PyObject* pack = PyCFunction_New(&kPackDef, owner.ptr());
  if (!pack) throw py::error_already_set();
  py::object p = py::reinterpret_steal<py::object>(pack);
  PyObject* dispatch = PyCFunction_New(&kDispatchDef, owner.ptr());
  if (!dispatch) throw py::error_already_set();
  return py::make_tuple(r, p, py::reinterpret_steal<py::object>(dispatch));
}

}  // namespace

void bind_live(py::module_& m) {
  py::class_<SavedValue>(m, "SavedValue", "A saved tensor as autograd holds it under dtralloc.dtr().")
      .def_readonly("value", &SavedValue::value)
      .def_readonly("version", &SavedValue::version)
      .def("unpack", [](const SavedValue& s) { return s.session->unpack(s); },
           "The saved tensor (recomputed if it was evicted), as the view autograd saved.");

  py::class_<LiveSession, std::shared_ptr<LiveSession>>(m, "LiveSession",
                                                        "The C++ half of a dtralloc.dtr() session.")
      .def(py::init([](bool cuda, int device, std::size_t budget_bytes, const std::string& conf,
                       const std::string& policy, bool chaos, bool check_invariants, py::dict helpers,
                       std::size_t series_ops, std::size_t history_entries, bool fused_foreach) {
             LiveSession::Options o;
             o.cuda = cuda;
             o.device = device;
             o.budget_bytes = budget_bytes;
             o.conf = conf;
             o.policy = parse_policy(policy);
             o.chaos = chaos;
             o.check_invariants = check_invariants;
             o.series_ops = series_ops;
             o.history_entries = history_entries;
             o.fused_foreach = fused_foreach;
             return std::make_shared<LiveSession>(o, helpers);
           }),
           py::arg("cuda"), py::arg("device"), py::arg("budget_bytes"), py::arg("conf"), py::arg("policy"),
           py::arg("chaos"), py::arg("check_invariants"), py::arg("helpers"), py::arg("series_ops") = 0,
           py::arg("history_entries") = 0, py::arg("fused_foreach") = false)
      .def("start", &LiveSession::start)
      .def("simulate_gpu_timer", &LiveSession::simulate_gpu_timer, py::arg("lag_ops"), py::arg("launch_ns"),
           py::arg("carry") = true,
           "CPU, before the session is entered: time its ops on a simulated GPU that runs lag_ops marks "
           "behind the host, each op priced at launch_ns until its time arrives, or with carry at the "
           "steps before's time for the same op (tests and benches of late costs)")
      .def("stop", &LiveSession::stop)
      .def("end_block", &LiveSession::end_block)
      .def("before_write", &LiveSession::before_write, py::arg("writes"))
      .def("record", &LiveSession::record, py::arg("func"), py::arg("args"), py::arg("kwargs"), py::arg("out"),
           py::arg("writes"), py::arg("flags"), py::arg("pin"), py::arg("cost"), py::arg("rng"))
      .def("pack", &LiveSession::pack, py::arg("tensor"))
      .def("exported", &LiveSession::exported, py::arg("tensor"))
      .def("resizing", &LiveSession::resizing, py::arg("storage"),
           "Before UntypedStorage.resize_ on `storage`: what depends on its contents comes back and is pinned")
      .def("flush_deaths", &LiveSession::flush_deaths)
      .def("evict_all", &LiveSession::evict_all)
      .def("stats", &LiveSession::stats)
      .def("oom_report", [](LiveSession& s, std::size_t request_bytes) { return s.oom_report(request_bytes); },
           py::arg("request_bytes") = 0)
      .def("check_invariants", &LiveSession::check_invariants)
      .def("series", [](const LiveSession& s) {
        py::dict d = series_columns(s.series(), py::handle());
        d["phase"] = column(s.series_phase(), py::handle());
        d["name_index"] = column(s.series_name(), py::handle());
        py::list names;
        for (const py::object& n : s.op_names()) names.append(n);
        d["names"] = names;
        return d;
      }, "The per-op series (copies): the replay's columns (op, reserved, allocated, evictable, "
         "largest_free, free, event with a history) plus phase (0 forward, 1 backward, 2 optimizer) "
         "and name_index into names (the ops' names)")
      .def("events", [](const LiveSession& s) { return event_columns(s.events(), py::handle()); },
           "The evictor's calls, evictions and recomputes (copies), as ReplayResult.events")
      .def("pool_snapshot", [](LiveSession& s) { return snapshot_dict(s.pool(), true); },
           "The session's pool (the CPU mirror, or the device's) as Pool.snapshot(columns=True)")
      .def("use_raw_refcount", &LiveSession::use_raw_refcount, py::arg("on"))
      .def("fast_calls", &fast_calls,
           "(record, pack, dispatch) as plain CPython functions bound to this session (the per-op path)")
      .def("set_dispatch_helpers", &LiveSession::set_dispatch_helpers, py::arg("classify"), py::arg("slow"),
           py::arg("on_error"), py::arg("default_generator"),
           "classify(func) -> (fast, flags, pin, call, view, writes, random) (mode._classify_for_c); "
           "slow(func, types, args, kwargs): the mode's Python path; on_error(exception): may replace an error "
           "the op raised; default_generator(tensor): the generator a random op on its device draws from "
           "without a generator argument, or None");

  m.attr("RECENT_STEPS") = kRecentSteps;  // Note [recent steps]: kinds of step a device remembers
  m.def("simulated_gpu_synchronize", &SimulatedTimingBackend::synchronize_all,
        "Complete every event on the simulated GPU (LiveSession.simulate_gpu_timer), as "
        "torch.cuda.synchronize() does a GPU's.");
  m.def("live_sessions_on_device", [](int device) {
    Allocator* pool = global::existing(device);
    return pool ? LiveSession::live_sessions_on(pool) : std::size_t{0};
  }, py::arg("device"),
        "How many dtr() sessions are live on the installed pool of `device` (the newest one's budget is the "
        "pool's); 0 when that pool does not exist yet.");

  // The strong count of a StorageImpl as LiveSession reads it without torch
  // (the low 32 bits after the vtable pointer); dtr/ compares it with
  // torch._C._storage_Use_Count before trusting it.
  m.def("storage_refcount_word", [](std::uintptr_t cdata) {
    return __atomic_load_n(reinterpret_cast<const std::uint32_t*>(cdata + sizeof(void*)), __ATOMIC_RELAXED);
  }, py::arg("cdata"));
}

}  // namespace dtralloc::bindings
