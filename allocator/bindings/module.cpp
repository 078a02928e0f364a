// dtralloc._core: the module itself, its exceptions and the config helpers;
// every room's bindings are added by its bind_* (bindings.h).
#include <pybind11/stl.h>

#include <string>

#include "allocator.h"
#include "backend.h"
#include "bindings.h"
#include "config.h"

namespace py = pybind11;
using namespace dtralloc;

PYBIND11_MODULE(_core, m) {
  m.doc() = "dtralloc native core (private: use the dtralloc package)";

  // A MemoryError, as CuPy's OOM is, and a RuntimeError, as
  // torch.cuda.OutOfMemoryError is: code written for either catches it.
  py::register_exception<OutOfMemoryError>(
      m, "OutOfMemoryError",
      py::make_tuple(py::handle(PyExc_MemoryError), py::handle(PyExc_RuntimeError)));
  m.attr("OUT_OF_MEMORY_TEXT") = kOutOfMemoryText;
  py::register_exception<InvalidPointerError>(m, "InvalidPointerError", PyExc_ValueError);
  py::register_exception<ConfigError>(m, "ConfigError", PyExc_ValueError);

  m.def("describe_config", [](const std::string& text) {
    py::list out;
    for (const OptionInfo& o : describe_config(parse_config(text))) {
      py::dict d;
      d["name"] = o.name;
      d["value"] = o.value;
      d["default"] = o.default_value;
      d["accepts"] = o.accepts;
      d["doc"] = o.doc;
      out.append(d);
    }
    return out;
  }, py::arg("text"), "Parse DTRALLOC_CONF text; list every option with its effective value.");
  // install(): refuse, before torch's allocator is swapped, what creating
  // the cuda backend would refuse at the first allocation
  // (make_cuda_backend_for: unmap_pages:on where no device has VMM,
  // async_segments:on where none has memory pools).
  m.def("check_cuda_config", [](const std::string& text) {
    const Config config = parse_config(text);
    for (int device = 0; device < cuda_device_count(); ++device) {
      if (config.unmap_pages == Switch::kOn) check_cuda_unmap_pages(device);
      if (config.async_segments == Switch::kOn) check_cuda_async_segments(device);
    }
  }, py::arg("text"), "Raise ConfigError if the cuda backend cannot run these settings.");
  m.def("cuda_vmm_unavailable", &cuda_vmm_unavailable, py::arg("device"),
        "Why CUDA device `device` cannot have VMM segments (unmap_pages); empty when it can.");
  m.def("graph_capture_refusal", &graph_capture_refusal, py::arg("what"),
        "The text dtralloc refuses a CUDA graph capture with: `what` happened, why dtralloc "
        "refuses it and what to do instead.");
  m.def("parse_size", [](const std::string& text) { return parse_size("size", text, 1); });
  m.def("format_bytes", &format_bytes);
  m.def("cuda_device_count", &cuda_device_count);
  m.def("cuda_runtime_path", &cuda_runtime_path);
  m.def("prefer_cuda_runtime_major", &prefer_cuda_runtime_major, py::arg("major"),
        "Search libcudart.so.<major> first when dtralloc loads a CUDA runtime.");

  bindings::bind_pool(m);
  bindings::bind_replay(m);
  bindings::bind_live(m);
  bindings::bind_dashboard(m);
}
