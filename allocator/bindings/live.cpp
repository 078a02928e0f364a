// Bindings of the live room (python/dtralloc/dtr/): LiveSession, the C++
// half of dtralloc.dtr(), and SavedValue, the handle autograd holds for a
// saved tensor (live_session.h).
#include <pybind11/stl.h>

#include <memory>
#include <string>

#include "bindings.h"
#include "live_session.h"
#include "policies.h"

namespace dtralloc::bindings {

using live::LiveSession;
using live::SavedValue;

void bind_live(py::module_& m) {
  py::class_<SavedValue>(m, "SavedValue", "A saved tensor as autograd holds it under dtralloc.dtr().")
      .def_readonly("value", &SavedValue::value)
      .def_readonly("version", &SavedValue::version)
      .def("unpack", [](const SavedValue& s) { return s.session->unpack(s); },
           "The saved tensor (recomputed if it was evicted), as the view autograd saved.");

  py::class_<LiveSession, std::shared_ptr<LiveSession>>(m, "LiveSession",
                                                        "The C++ half of a dtralloc.dtr() session.")
      .def(py::init([](bool cuda, int device, std::size_t budget_bytes, const std::string& conf,
                       const std::string& policy, bool chaos, bool check_invariants, py::dict helpers) {
             LiveSession::Options o;
             o.cuda = cuda;
             o.device = device;
             o.budget_bytes = budget_bytes;
             o.conf = conf;
             o.policy = parse_policy(policy);
             o.chaos = chaos;
             o.check_invariants = check_invariants;
             return std::make_shared<LiveSession>(o, helpers);
           }),
           py::arg("cuda"), py::arg("device"), py::arg("budget_bytes"), py::arg("conf"), py::arg("policy"),
           py::arg("chaos"), py::arg("check_invariants"), py::arg("helpers"))
      .def("start", &LiveSession::start)
      .def("stop", &LiveSession::stop)
      .def("before_write", &LiveSession::before_write, py::arg("writes"))
      .def("record", &LiveSession::record, py::arg("func"), py::arg("args"), py::arg("kwargs"), py::arg("out"),
           py::arg("writes"), py::arg("flags"), py::arg("pin"), py::arg("cost"), py::arg("rng"))
      .def("pack", &LiveSession::pack, py::arg("tensor"))
      .def("exported", &LiveSession::exported, py::arg("tensor"))
      .def("flush_deaths", &LiveSession::flush_deaths)
      .def("evict_all", &LiveSession::evict_all)
      .def("stats", &LiveSession::stats)
      .def("oom_report", &LiveSession::oom_report, py::arg("request_bytes") = 0)
      .def("check_invariants", &LiveSession::check_invariants)
      .def("use_raw_refcount", &LiveSession::use_raw_refcount, py::arg("on"));

  // The strong count of a StorageImpl as LiveSession reads it without torch
  // (the low 32 bits after the vtable pointer); dtr/ compares it with
  // torch._C._storage_Use_Count before trusting it.
  m.def("storage_refcount_word", [](std::uintptr_t cdata) {
    return __atomic_load_n(reinterpret_cast<const std::uint32_t*>(cdata + sizeof(void*)), __ATOMIC_RELAXED);
  }, py::arg("cdata"));
}

}  // namespace dtralloc::bindings
