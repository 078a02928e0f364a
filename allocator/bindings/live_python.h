// How the live session reaches Python objects on its hot path (internal to
// allocator/bindings/live_*.cpp).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace dtralloc::live {

namespace py = pybind11;

// Python objects are reached through the C API on the hot path. Tensor and
// storage attributes go straight to their descriptors (torch._C.TensorBase's
// and StorageBase's, looked up once): a lookup by name walks the type's MRO
// and costs more than the call itself.
struct Accessors {
  PyObject* untyped_storage = nullptr;  // method descriptors
  PyObject* size = nullptr;
  PyObject* stride = nullptr;
  PyObject* storage_offset = nullptr;
  PyObject* nbytes = nullptr;
  PyObject* data_ptr = nullptr;
  PyObject* is_contiguous = nullptr;
  PyObject* numel = nullptr;
  PyObject* element_size = nullptr;
  PyObject* get_device = nullptr;
  PyObject* is_conj = nullptr;
  PyObject* is_neg = nullptr;
  PyObject* set_ = nullptr;             // Geometry::view's
  PyObject* conj = nullptr;
  PyObject* neg_view = nullptr;
  PyObject* detach = nullptr;           // the pack's saved alias
  PyObject* dtype = nullptr;            // getset descriptors
  PyObject* version = nullptr;
  PyObject* cdata = nullptr;
  PyObject* device = nullptr;
  PyObject* layout = nullptr;
  PyObject* is_nested = nullptr;
  PyObject* grad_fn = nullptr;
  PyObject* output_nr = nullptr;
  PyObject* base = nullptr;             // _base: a view's base tensor, or None
  PyObject* storage_device = nullptr;   // a storage's device
  PyObject* fix_weakref = nullptr;      // StorageBase._fix_weakref, or None (Note [storage weakrefs])
  PyObject* strided = nullptr;          // torch.strided, the layout
  PyObject* empty = nullptr;            // torch.empty
  PyObject* disable_dispatch = nullptr;  // torch._C._DisableTorchDispatch: on from construction to deletion
  PyObject* tensor = nullptr;             // torch.Tensor, and the __torch_dispatch__ it has
  PyObject* disabled_torch_dispatch = nullptr;
};
inline Accessors& names() {
  static Accessors a;
  return a;
}
inline void load_accessors(py::dict d) {
  Accessors& a = names();
  if (a.untyped_storage) return;
  auto take = [&](const char* key) {
    PyObject* o = d[key].ptr();
    Py_INCREF(o);  // kept for the process's life, as the functions they describe
    return o;
  };
  a.untyped_storage = take("untyped_storage");
  a.size = take("size");
  a.stride = take("stride");
  a.storage_offset = take("storage_offset");
  a.nbytes = take("nbytes");
  a.data_ptr = take("data_ptr");
  a.is_contiguous = take("is_contiguous");
  a.numel = take("numel");
  a.element_size = take("element_size");
  a.get_device = take("get_device");
  a.is_conj = take("is_conj");
  a.is_neg = take("is_neg");
  a.set_ = take("set_");
  a.conj = take("_conj");
  a.neg_view = take("_neg_view");
  a.detach = take("detach");
  a.dtype = take("dtype");
  a.version = take("_version");
  a.cdata = take("_cdata");
  a.device = take("device");
  a.layout = take("layout");
  a.is_nested = take("is_nested");
  a.grad_fn = take("grad_fn");
  a.output_nr = take("output_nr");
  a.base = take("_base");
  a.storage_device = take("storage_device");
  a.fix_weakref = take("_fix_weakref");
  a.strided = take("strided");
  a.empty = take("empty");
  a.disable_dispatch = take("_DisableTorchDispatch");
  a.tensor = take("Tensor");
  a.disabled_torch_dispatch = take("disabled_torch_dispatch");
}

// What a weakref refers to (borrowed), or nullptr where `ref` is unset or
// its object is gone.
inline PyObject* referent(const py::object& ref) {
  if (!ref) return nullptr;
  PyObject* o = PyWeakref_GetObject(ref.ptr());
  return o && o != Py_None ? o : nullptr;
}

// torch._C._DisableTorchDispatch(): Python dispatch is off until the
// returned object is deleted (what Geometry::view and the pack's alias make
// is not an op of the session).
inline py::object no_dispatch() {
  PyObject* guard = PyObject_CallNoArgs(names().disable_dispatch);
  if (!guard) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(guard);
}

// A method descriptor called on `o` (no arguments).
inline py::object call_method(py::handle o, PyObject* descr) {
  PyObject* self = o.ptr();
  PyObject* r = PyObject_Vectorcall(descr, &self, 1, nullptr);
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}
// A getset descriptor read on `o`.
inline py::object get_attr(py::handle o, PyObject* descr) {
  PyObject* r = Py_TYPE(descr)->tp_descr_get(descr, o.ptr(), reinterpret_cast<PyObject*>(Py_TYPE(o.ptr())));
  if (!r) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}
inline std::int64_t as_int(const py::object& o) {
  const long long v = PyLong_AsLongLong(o.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}
// Whether `t` is of a tensor subclass with a __torch_dispatch__ of its own
// (a jagged NestedTensor, DTensor): a wrapper whose storage and sizes are
// not its data's. Asked once per class (kept alive by the cache).
inline bool is_wrapper_subclass(PyObject* t) {
  PyTypeObject* type = Py_TYPE(t);
  if (reinterpret_cast<PyObject*>(type) == names().tensor) return false;
  static auto* known = new std::unordered_map<PyTypeObject*, bool>();  // under the GIL
  auto it = known->find(type);
  if (it != known->end()) return it->second;
  static PyObject* const name = PyUnicode_InternFromString("__torch_dispatch__");
  PyObject* dispatch = _PyType_Lookup(type, name);  // borrowed, not bound
  const bool wrapper = dispatch && dispatch != names().disabled_torch_dispatch;
  Py_INCREF(type);
  known->emplace(type, wrapper);
  return wrapper;
}

// A tensor's untyped storage, or None for a tensor without one the session
// can own: sparse and mkldnn tensors (torch raises NotImplementedError), and
// wrapper subclasses (is_wrapper_subclass).
inline py::object storage_or_none(py::handle t) {
  if (is_wrapper_subclass(t.ptr())) return py::none();
  PyObject* self = t.ptr();
  PyObject* r = PyObject_Vectorcall(names().untyped_storage, &self, 1, nullptr);
  if (r) return py::reinterpret_steal<py::object>(r);
  if (!PyErr_ExceptionMatches(PyExc_NotImplementedError)) throw py::error_already_set();
  PyErr_Clear();
  return py::none();
}
// A storage's StorageImpl address (its `_cdata`): what the registry keys on.
inline std::uintptr_t cdata_of(py::handle storage) {
  return static_cast<std::uintptr_t>(as_int(get_attr(storage, names().cdata)));
}

// A tensor's size (a torch.Size) or stride (a tuple) as an exact tuple.
inline py::object exact_tuple(const py::object& sequence) {
  PyObject* o = sequence.ptr();
  if (PyTuple_CheckExact(o)) return sequence;
  if (!PyTuple_Check(o)) throw std::logic_error("dtralloc live session: a tensor's size or stride is not a tuple");
  PyObject* copy = PyTuple_GetSlice(o, 0, PyTuple_GET_SIZE(o));
  if (!copy) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(copy);
}

// The placeholder a template holds where a tensor was; the tensors are
// filled back in the order record() met them (for_each_tensor's order).
inline py::object& marker() {
  static py::object* m = new py::object(py::reinterpret_steal<py::object>(PyObject_CallNoArgs(
      reinterpret_cast<PyObject*>(&PyBaseObject_Type))));
  return *m;
}

// Tensor leaves of an op's arguments or outputs, in a fixed order (tuples,
// lists and dict values, depth first): record() and the recompute agree on it.
template <typename Fn>
void for_each_tensor(PyObject* o, PyObject* tensor_type, Fn&& fn, int depth = 0) {
  if (depth > 8) return;  // ATen arguments nest a list in a tuple at most
  if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(tensor_type))) {
    fn(o);
  } else if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    for (Py_ssize_t i = 0; i < n; ++i) for_each_tensor(items[i], tensor_type, fn, depth + 1);
  } else if (PyDict_CheckExact(o)) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &key, &value)) for_each_tensor(value, tensor_type, fn, depth + 1);
  }
}

}  // namespace dtralloc::live
