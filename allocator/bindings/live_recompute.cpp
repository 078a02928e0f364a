// LiveSession's recomputes: an op's recipe (a template of its arguments and
// each tensor argument's geometry) rerun on the registry's storages
// (live_session.h).
#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "live_python.h"
#include "live_session.h"

namespace dtralloc::live {

Geometry Geometry::of(py::handle tensor) {
  Geometry g;
  g.dtype = get_attr(tensor, names().dtype);
  g.size = exact_tuple(call_method(tensor, names().size));  // a torch.Size
  g.stride = exact_tuple(call_method(tensor, names().stride));
  g.offset = as_int(call_method(tensor, names().storage_offset));
  // Only a complex tensor carries the conjugate bit (c10 asserts it), while
  // a real one can carry the negative bit (`x.conj().imag`).
  if (is_complex(g.dtype.ptr()) && call_method(tensor, names().is_conj).ptr() == Py_True) g.bits |= 1;
  if (call_method(tensor, names().is_neg).ptr() == Py_True) g.bits |= 2;
  return g;
}

bool Geometry::is_complex(PyObject* dtype) {
  // torch.dtype objects are singletons: each is asked once (held here).
  static auto* known = new std::vector<std::pair<PyObject*, bool>>();  // under the GIL
  for (const auto& [d, complex] : *known)
    if (d == dtype) return complex;
  static PyObject* const name = PyUnicode_InternFromString("is_complex");
  PyObject* answer = PyObject_GetAttr(dtype, name);
  if (!answer) throw py::error_already_set();
  const bool complex = answer == Py_True;
  Py_DECREF(answer);
  Py_INCREF(dtype);
  known->emplace_back(dtype, complex);
  return complex;
}

bool Geometry::try_of(py::handle tensor, Geometry* g) {
  try {
    *g = of(tensor);
    return true;
  } catch (py::error_already_set& e) {
    if (e.matches(PyExc_RuntimeError) || e.matches(PyExc_NotImplementedError)) return false;
    throw;
  }
}

// torch.empty(0, dtype=, device=storage.device).set_(storage, offset, size,
// stride), then _conj() and _neg_view() for the bits, with Python dispatch
// off so that nothing here is recorded as an op of the session. Each unpack
// in a backward makes one: called from C, with no Python frame, `with`
// statement or keyword dict around them (an unpack 0.8 us less than through
// a Python function: bench/results/live_overhead-2026-11-28b-cpu.md).
py::object Geometry::view(const py::object& storage) const {
  const Accessors& a = names();
  const py::object guard = no_dispatch();  // deleted last: dispatch back on
  static PyObject* const zero = PyLong_FromLong(0);
  static PyObject* const kwnames = [] {
    PyObject* t = PyTuple_New(2);
    PyTuple_SET_ITEM(t, 0, PyUnicode_InternFromString("dtype"));
    PyTuple_SET_ITEM(t, 1, PyUnicode_InternFromString("device"));
    return t;
  }();
  const py::object device = get_attr(storage, a.storage_device);
  PyObject* empty_args[] = {zero, dtype.ptr(), device.ptr()};
  PyObject* raw = PyObject_Vectorcall(a.empty, empty_args, 1, kwnames);
  if (!raw) throw py::error_already_set();
  const py::object empty = py::reinterpret_steal<py::object>(raw);
  const py::object at = py::reinterpret_steal<py::object>(PyLong_FromLongLong(offset));
  if (!at) throw py::error_already_set();
  PyObject* set_args[] = {empty.ptr(), storage.ptr(), at.ptr(), size.ptr(), stride.ptr()};
  raw = PyObject_Vectorcall(a.set_, set_args, 5, nullptr);
  if (!raw) throw py::error_already_set();
  py::object t = py::reinterpret_steal<py::object>(raw);
  if (bits & 1) t = call_method(t, a.conj);
  if (bits & 2) t = call_method(t, a.neg_view);
  return t;
}

// `x` with every tensor replaced by the marker; containers without tensors
// are kept as they are.
py::object LiveSession::template_of(py::handle x) const {
  PyObject* o = x.ptr();
  if (PyObject_TypeCheck(o, reinterpret_cast<PyTypeObject*>(tensor_type_.ptr()))) return marker();
  if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
    const bool tuple = PyTuple_CheckExact(o);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    py::object copy;  // made at the first tensor found; until then `o` itself will do
    for (Py_ssize_t i = 0; i < n; ++i) {
      py::object part = template_of(items[i]);
      if (!copy && part.ptr() == items[i]) continue;
      if (!copy) {
        copy = py::reinterpret_steal<py::object>(tuple ? PyTuple_New(n) : PyList_New(n));
        if (!copy) throw py::error_already_set();
        for (Py_ssize_t j = 0; j < i; ++j) {
          Py_INCREF(items[j]);
          tuple ? PyTuple_SET_ITEM(copy.ptr(), j, items[j]) : PyList_SET_ITEM(copy.ptr(), j, items[j]);
        }
      }
      PyObject* p = part.release().ptr();
      tuple ? PyTuple_SET_ITEM(copy.ptr(), i, p) : PyList_SET_ITEM(copy.ptr(), i, p);
    }
    return copy ? copy : py::reinterpret_borrow<py::object>(o);
  }
  if (PyDict_CheckExact(o)) {
    py::dict d;
    bool changed = false;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &key, &value)) {
      py::object part = template_of(value);
      changed |= part.ptr() != value;
      d[key] = part;
    }
    return changed ? py::object(d) : py::reinterpret_borrow<py::object>(o);
  }
  return py::reinterpret_borrow<py::object>(o);
}

py::object LiveSession::fill(py::handle x, const py::list& tensors, std::size_t* next) const {
  PyObject* o = x.ptr();
  if (o == marker().ptr()) return tensors[(*next)++];
  if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    py::list parts(n);
    for (Py_ssize_t i = 0; i < n; ++i) parts[i] = fill(items[i], tensors, next);
    return PyTuple_CheckExact(o) ? py::object(py::tuple(parts)) : py::object(parts);
  }
  if (PyDict_CheckExact(o)) {
    py::dict d;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(o, &pos, &key, &value)) d[key] = fill(value, tensors, next);
    return d;
  }
  return py::reinterpret_borrow<py::object>(o);
}

// A split foreach op's arguments (args, a tuple, or kwargs, a dict) with
// each list of `n` items (Tensor[] and Scalar[]) cut to its item `element`.
py::object LiveSession::one_element(const py::object& x, int n, int element) {
  auto cut = [&](PyObject* o) -> py::object {
    if ((PyList_CheckExact(o) || PyTuple_CheckExact(o)) && PySequence_Fast_GET_SIZE(o) == n) {
      PyObject* item = PySequence_Fast_ITEMS(o)[element];
      py::list one(1);
      one[0] = py::reinterpret_borrow<py::object>(item);
      return PyTuple_CheckExact(o) ? py::object(py::tuple(one)) : py::object(one);
    }
    return py::reinterpret_borrow<py::object>(o);
  };
  if (PyTuple_CheckExact(x.ptr())) {
    const Py_ssize_t m = PyTuple_GET_SIZE(x.ptr());
    py::tuple out(m);
    for (Py_ssize_t i = 0; i < m; ++i) out[i] = cut(PyTuple_GET_ITEM(x.ptr(), i));
    return out;
  }
  if (PyDict_CheckExact(x.ptr())) {
    py::dict out;
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(x.ptr(), &pos, &key, &value)) out[key] = cut(value);
    return out;
  }
  throw std::logic_error("dtralloc live session: a split op's arguments are neither a tuple nor a dict");
}

// ---- recompute -----------------------------------------------------------------

std::uintptr_t LiveSession::recompute(int value, std::size_t bytes) {
  const auto start = std::chrono::steady_clock::now();
  const Value& x = engine_->value(value);
  const LiveOp* op = static_cast<std::size_t>(x.producer) < ops_.size() ? ops_[x.producer].get() : nullptr;
  if (!op) throw std::logic_error("dtralloc live session: no recipe for value " + std::to_string(value));
  const Slot& target = slots_[value];
  auto in_recipe = [&](int v) { return std::find(x.recipe.begin(), x.recipe.end(), v) != x.recipe.end(); };
  // A foreach op split by element runs on the value's element alone: only
  // that element's refs (and those every element reads) are built.
  const int element = !op->elements ? -1 : target.out_index >= 0 ? target.out_index : op->element.at(target.write_ref);
  py::list tensors(op->refs.size());  // None where another element's
  py::object made_storage;  // the written storage a write-made value is recomputed into
  // The storage each written value gets, shared by all its refs: an op may
  // write one storage through two arguments (the same tensor twice in a
  // foreach list, two views of one base), and reads what it wrote.
  std::unordered_map<int, py::object> written_storage;
  const int target_old = target.write_ref >= 0 ? op->refs.at(target.write_ref).value : -1;
  for (std::size_t k = 0; k < op->refs.size(); ++k) {
    if (element >= 0 && op->element[k] >= 0 && op->element[k] != element) {
      tensors[k] = py::none();  // a list's other items: one_element drops them
      continue;
    }
    const ArgRef& r = op->refs[k];
    const bool is_written = std::find(op->written.begin(), op->written.end(), static_cast<int>(k)) != op->written.end();
    py::object storage;
    if (is_written) {
      // Never the live storage: the op writes what it gets. The value being
      // recomputed gets a copy of the old version (or fresh memory, if the op
      // overwrites it whole); other written arguments get scratch copies.
      auto shared = written_storage.find(r.value);
      if (shared != written_storage.end()) {
        storage = shared->second;
      } else {
        const bool resident = engine_->value(r.value).state == ValueState::kResident;
        const bool copy = resident && (r.value != target_old || in_recipe(r.value));
        py::object like = resident ? storage_of(r.value) : py::object(py::none());
        storage = new_storage_(engine_->value(r.value).nbytes, like, copy, device_);
        if (r.value == target_old) made_storage = storage;
        written_storage.emplace(r.value, storage);
      }
    } else {
      const Slot& s = slots_[r.value];
      if (!r.external) storage = storage_of(r.value);
      if (s.external) {
        const std::int64_t now = as_int(get_attr(s.external, names().version));
        if (now != r.version)
          version_error(py::str("an input of a recomputed op (" + std::string(py::str(op->func)) +
                                ") was modified in place outside the dtr session"),
                        now, r.version);
      }
    }
    tensors[k] = r.external ? detached_(r.external) : r.geometry.view(storage);
  }
  std::size_t next = 0;
  py::object args = fill(op->args, tensors, &next);
  py::object kwargs = fill(op->kwargs, tensors, &next);
  if (next != tensors.size()) throw std::logic_error("dtralloc live session: a recipe's template lost a tensor");
  if (element >= 0) {
    args = one_element(args, op->elements, element);
    kwargs = one_element(kwargs, op->elements, element);
  }
  py::object out;
  try {
    out = run_(op->func, args, kwargs, op->rng, (op->flags & kGradEnabled) != 0);
  } catch (py::error_already_set& e) {
    // On CUDA the op's allocation fails inside torch, which raises the pool's
    // OOM text as a RuntimeError: the engine's retry (held values unlocked)
    // and its OOM handling expect the pool's own exception.
    const std::string text = options_.cuda && e.matches(PyExc_RuntimeError) ? std::string(py::str(e.value())) : "";
    if (text.find(kOutOfMemoryText) == std::string::npos) throw;
    throw OutOfMemoryError(text + "\n(bringing back an evicted value) " + oom_report(0));
  }
  int leaves = 0;
  if (target.out_index >= 0) {
    const int want = element >= 0 ? 0 : target.out_index;  // a split op returns its one element's output
    for_each_tensor(out.ptr(), tensor_type_.ptr(), [&](PyObject* t) {
      if (leaves++ == want) made_storage = call_method(t, names().untyped_storage);
    });
  }
  if (!made_storage)
    throw std::logic_error("dtralloc live session: recomputing value " + std::to_string(value) + " (output " +
                           std::to_string(target.out_index) + " of " + std::string(py::str(op->func)) +
                           ", which gave " + std::to_string(leaves) + " tensors) made no storage for it");
  out = py::object();
  const auto cdata = cdata_of(made_storage);
  std::uintptr_t addr = 0;
  if (mirror_)
    addr = bytes ? allocate_mirror(bytes, value) : 0;  // may evict others
  else if (bytes)
    addr = static_cast<std::uintptr_t>(as_int(call_method(made_storage, names().data_ptr)));
  Slot& s = slot(value);
  s.storage = made_storage;  // owned: nobody else has it
  watch(value, made_storage, cdata);
  stats_.recompute_seconds +=
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return addr;
}

}  // namespace dtralloc::live
