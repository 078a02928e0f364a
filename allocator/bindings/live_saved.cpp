// LiveSession's saved tensors: autograd's pack and unpack hooks, handles,
// torch's version error (live_session.h).
#include <algorithm>
#include <cassert>
#include <stdexcept>
#include <string>

#include "live_python.h"
#include "live_session.h"

namespace dtralloc::live {

// ---- saved tensors ------------------------------------------------------------

// Note [saved alias]
// ~~~~~~~~~~~~~~~~~~
// With saved-tensor hooks torch checks no saved tensor's version; the
// unpack must, against the saved tensor's own counter. The handle held only
// weak references (the saved tensor is often the output of the node that
// holds the handle: a strong one would make a cycle), so once the program
// dropped the tensor the counter was gone, and a write made outside the
// session (after the block, or through a detach() of it) was read silently:
// autograd unpacked the written bytes where plain eager raises. The pack
// now keeps a detach() of the saved tensor: it shares the storage and the
// version counter and holds no node. It costs one more reference on the
// storage, which the evictability check counts (held_elsewhere); evicting
// lets it go (release: `seen` keeps the counter, which nothing can move
// any more). While it lives the unpack returns it as it is, with the saved
// geometry and lazy bits, instead of building a view (Geometry::view).
// Nothing but the handle holds the alias, so nothing can reshape it: the
// pack does not read the geometry (five calls into torch a saved tensor),
// release() reads it from the alias before letting the alias go.

py::object LiveSession::pack(py::handle tensor) {
  flush_deaths();
  // None: autograd keeps the tensor itself (mode.pack's (tensor, version)):
  // one made outside the session, or one no view can rebuild (sparse, a
  // legacy nested tensor).
  py::object storage = storage_or_none(tensor);
  if (storage.is_none()) return py::none();
  const auto cdata = cdata_of(storage);
  const int v = value_of(storage, cdata);
  if (v < 0 || slots_[v].pin == PinReason::kExternal) return py::none();
  // A legacy nested tensor has no sizes: no view rebuilds it.
  if (get_attr(tensor, names().is_nested).ptr() == Py_True) return py::none();
  // Its geometry is read now only where no alias will keep it (Note [saved
  // alias]: the alias has the same, and release() reads it from there).
  const bool aliased = shared_pyrefs_ >= 0;  // -1: this torch's references are not known (runner.shared_storage_pyrefs)
  Geometry geometry;
  if (!aliased && !Geometry::try_of(tensor, &geometry)) return py::none();
  PyObject* ref = PyWeakref_NewRef(tensor.ptr(), nullptr);
  if (!ref) throw py::error_already_set();
  py::object tensor_ref = py::reinterpret_steal<py::object>(ref);
  Slot& s = slots_[v];
  if (!s.storage) s.storage = storage;  // the registry owns it now
  ++s.handles;
  ++stats_.saved;
  auto handle = std::make_unique<SavedValue>();
  handle->session = shared_from_this();
  handle->value = v;
  handle->geometry = std::move(geometry);
  handle->described = !aliased;
  handle->tensor = std::move(tensor_ref);
  py::object base = get_attr(tensor, names().base);
  if (!base.is_none()) {
    PyObject* base_ref = PyWeakref_NewRef(base.ptr(), nullptr);
    if (!base_ref) throw py::error_already_set();
    handle->base = py::reinterpret_steal<py::object>(base_ref);
  }
  handle->version = as_int(get_attr(tensor, names().version));
  if (aliased) {
    const py::object guard = no_dispatch();  // not an op of the session
    handle->alias = call_method(tensor, names().detach);
  }
  // What torch's version error would name (built only if it is raised).
  handle->device = get_attr(tensor, names().device);
  handle->output_nr = as_int(get_attr(tensor, names().output_nr));
  py::object grad_fn = get_attr(tensor, names().grad_fn);
  handle->listed = static_cast<int>(s.saved.size());
  s.saved.push_back(handle.get());
  if (!grad_fn.is_none()) {
    handle->grad_fn_name = grad_fn_name(grad_fn);
    // An output's grad_fn is the node saving it, the newest one (a node is
    // made before the inputs it saves are packed).
    static PyObject* const sequence_nr = PyUnicode_InternFromString("_sequence_nr");
    if (!next_sequence_nr_.is_none()) {
      PyObject* method = PyObject_GetAttr(grad_fn.ptr(), sequence_nr);
      if (method) {  // a node type without it: taken for an input (only the error's wording depends on it)
        py::object bound = py::reinterpret_steal<py::object>(method);
        handle->is_output = as_int(bound()) == as_int(next_sequence_nr_()) - 1;
      } else {
        PyErr_Clear();
      }
    }
  }
  return py::cast(std::move(handle));
}

// A backward node's name() is its class's: asked once per class.
py::object LiveSession::grad_fn_name(const py::object& grad_fn) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(grad_fn.ptr()));
  auto it = grad_fn_names_.find(type);
  if (it == grad_fn_names_.end()) {
    grad_fn_types_.push_back(py::reinterpret_borrow<py::object>(type));
    it = grad_fn_names_.emplace(type, grad_fn.attr("name")()).first;
  }
  return it->second;
}

void LiveSession::unlist(const SavedValue& saved) {
  if (saved.listed < 0) return;  // its pack did not finish
  Slot& holder = slots_[slots_[saved.value].next >= 0 ? latest(saved.value) : saved.value];
  // check_invariants checks that each handle is where its index says.
  assert(static_cast<std::size_t>(saved.listed) < holder.saved.size() && holder.saved[saved.listed] == &saved);
  holder.saved[saved.listed] = holder.saved.back();
  holder.saved[saved.listed]->listed = saved.listed;
  holder.saved.pop_back();
}

void LiveSession::note_versions(const std::vector<SavedValue*>& handles, py::handle writes, bool bumped) {
  // torch bumps each written tensor's version counter once the op returns
  // (its ADInplaceOrView kernel, after this record), unless the session
  // `bumped` them already (in-place foreach ops). A tensor shares the
  // counter of a written one where both are one tensor or views of one
  // base (a detach() alias shares it too, and is not seen here).
  auto root = [](PyObject* t) {
    py::object base = get_attr(t, names().base);
    return base.is_none() ? t : base.ptr();  // a view holds its base: the pointer stays valid
  };
  std::vector<PyObject*> written;
  for_each_tensor(writes.ptr(), tensor_type_.ptr(), [&](PyObject* t) { written.push_back(root(t)); });
  for (SavedValue* h : handles) {
    PyObject* t = h->watched();
    if (!t) continue;
    const auto bumps = std::count(written.begin(), written.end(), root(t));
    if (bumps == 0) continue;
    h->seen = as_int(get_attr(t, names().version)) + (bumped ? 0 : bumps);
    if (!h->is_output && !h->held && !next_sequence_nr_.is_none()) h->held = py::reinterpret_borrow<py::object>(t);
  }
}

// After unlist(): the handle has left its storage's list.
void LiveSession::drop_handle(int value) {
  --slots_[value].handles;
  // A handle of an older version rode on the storage's newest version.
  if (slots_[value].next >= 0) value = latest(value);
  Slot& s = slots_[value];
  if (!s.saved.empty()) return;  // another handle still reads the storage
  const Value& x = engine_->value(value);
  if (x.state == ValueState::kEvicted) {
    engine_->kill(value);  // nobody can read it any more
  } else if (x.state == ValueState::kResident && x.alive && x.pinned && x.needed_by > 0) {
    polled_.push_back(value);  // a recipe still needs its data: keep it, and poll it
  } else if (x.state == ValueState::kResident && x.alive && x.locks == 0) {
    // The program may still hold it; if not, it dies now and its watch says so.
    py::object storage = std::move(s.storage);
  }
}

py::object LiveSession::unpack(const SavedValue& saved) {
  flush_deaths();
  ++stats_.unpacked;
  const int value = saved.value;
  auto check_version = [&](std::int64_t now) {
    if (now != saved.version) {
      // The node torch's error names: for an output, the node that saved it
      // (its grad_fn at the pack); for an input, its grad_fn now (the
      // in-place op that moved its version made a new one), and for a saved
      // view that is gone, the node torch gives such a view once its base
      // was written (runner.version_error makes one to ask).
      const Geometry geometry = saved.geometry_now();
      py::object grad_fn = saved.grad_fn_name ? saved.grad_fn_name : py::object(py::none());
      PyObject* t = referent(saved.tensor);
      PyObject* base = referent(saved.base);
      if (!saved.is_output && t) {
        py::object current = get_attr(t, names().grad_fn);
        if (!current.is_none()) grad_fn = grad_fn_name(current);
      } else if (!saved.is_output && base) {
        grad_fn = py::make_tuple(py::reinterpret_borrow<py::object>(base), geometry.size, geometry.stride,
                                 geometry.offset);
      }
      version_error(py::make_tuple(geometry.dtype, saved.device, geometry.size,
                                   saved.output_nr, grad_fn),
                    now, saved.version);
    }
  };
  // The saved tensor's own version counter (torch checks that one; other
  // tensors on the storage count their own), read through the alias while
  // the storage is resident, else through the saved tensor or its base.
  auto saved_now = [&]() -> std::int64_t {
    PyObject* t = saved.version_source();
    return t ? as_int(get_attr(t, names().version))
             : saved.seen;  // evicted, or no alias: -1 unless a recorded write moved the counter
  };
  // Checked before and after bringing the value back: a recorded in-place op
  // (or one outside the session) that wrote through a tensor sharing the
  // saved one's counter shows there, as torch would see it. A write through
  // a tensor with a counter of its own (the gates unsafe_split makes in an
  // RNN cell, `.data`, another view an unpack rebuilt) is not a change of
  // the saved tensor for torch, and autograd reads the storage as it is
  // then: so does the unpack, from the storage's newest version (evicted,
  // it is recomputed). Its bytes under the saved view are the saved ones
  // unless such a write covered them, and then they are what plain eager
  // reads too. The alias shares the counter whoever else is gone, so a
  // write through the saved tensor outside the session, or through a
  // detach() of it, shows too (Note [saved alias]).
  if (slots_[value].overwritten) {
    const std::int64_t now = saved_now();
    if (now >= 0) check_version(now);
  }
  int read = value;
  if (slots_[value].next >= 0) {
    read = latest(value);
    // Never released while handles ride on it (the registry owns its storage
    // until they go; see record()'s writes): a broken link is a bug.
    if (engine_->value(read).state == ValueState::kReleased)
      throw std::logic_error("dtralloc live session: the newest version (value " + std::to_string(read) +
                             ") of a saved value's storage (value " + std::to_string(value) + ") was released");
  }
  engine_->acquire(read);
  py::object tensor;
  try {
    const std::int64_t now = saved_now();
    if (now >= 0) check_version(now);
    // The alias is on the storage as it is now (evicting it let the alias
    // go), with the saved tensor's geometry and lazy bits.
    tensor = saved.alias ? saved.alias : saved.geometry_now().view(storage_of(read));
  } catch (...) {
    engine_->unacquire(read);
    throw;
  }
  engine_->unacquire(read);
  publish_counts();
  if (options_.check_invariants) check_invariants();
  return tensor;
}

void LiveSession::version_error(py::handle what, std::int64_t now, std::int64_t expected) {
  version_error_(what, now, expected);
  throw std::logic_error("dtralloc live session: version_error helper returned");
}

void LiveSession::exported(py::handle tensor) {
  py::object storage = storage_or_none(tensor);
  if (storage.is_none()) return;
  const int v = value_of(storage, cdata_of(storage));
  if (v < 0) return;
  Slot& s = slots_[v];
  if (engine_->value(v).pinned || engine_->value(v).state != ValueState::kResident) return;
  engine_->pin(v);
  s.pin = PinReason::kExported;
  own_for_recipes(v);
}

// Note [copy before a resize]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// What reads a storage about to be resized away is pinned (resizing, below)
// unless a copy of the contents is kept for the recipes that read it: with
// FSDP2's reshard after forward, each Linear's or conv's output would
// otherwise stay pinned from its block's forward to its backward, and such
// outputs (batch x features) outweigh the weight they read. The copy is
// exact whatever the owner puts back: recomputes read the bytes the op
// read, while the saved tensors and the program read the storage, refilled
// (plain eager's bits). It is made only where something may be evicted (a
// budget, or chaos), where it is smaller than what would be pinned
// (RematEngine::overwrite_pin_bytes, dead readers brought back included),
// and where every recipe reading the value can read it through a view of
// the copy: not where an op wrote the value in place, and not where an
// external tensor an op read was written since, outside the session (its
// recompute would raise torch's version error: the copy would hide it).
// No room for the copy: the readers are pinned as before. The copy is a
// value of its own, pinned, dead, owned by the registry (kResizedCopy), and
// goes with the last recipe that reads it.
void LiveSession::keep_for_readers(int v, py::handle storage) {
  if (!may_evict()) return;
  const std::size_t nbytes = engine_->value(v).nbytes;
  if (nbytes == 0) return;
  // The refs that read v, each with the geometry it will read the copy by;
  // false where no copy is to be made.
  std::vector<std::pair<ArgRef*, Geometry>> moved;
  auto plan = [&] {
    moved.clear();
    const std::vector<int> readers = engine_->copy_readers(v);
    if (readers.empty() || nbytes >= engine_->overwrite_pin_bytes(v)) return false;
    const Slot& s = slots_[v];
    const std::int64_t version = s.external ? as_int(get_attr(s.external, names().version)) : 0;
    std::vector<int> seen_ops;
    for (int d : readers) {
      const int producer = engine_->value(d).producer;
      if (producer < 0 || static_cast<std::size_t>(producer) >= ops_.size() || !ops_[producer]) return false;
      if (std::find(seen_ops.begin(), seen_ops.end(), producer) != seen_ops.end()) continue;
      seen_ops.push_back(producer);
      LiveOp& op = *ops_[producer];
      for (std::size_t k = 0; k < op.refs.size(); ++k) {
        ArgRef& r = op.refs[k];
        if (r.value != v) continue;
        if (std::find(op.written.begin(), op.written.end(), static_cast<int>(k)) != op.written.end()) return false;
        if (s.external && version != r.version) return false;
        Geometry g = r.geometry;
        if (r.external && !Geometry::try_of(r.external, &g)) return false;
        moved.emplace_back(&r, std::move(g));
      }
    }
    return true;
  };
  if (!plan()) return;
  // The copy's memory. Making it may evict, and let values die (the pool's
  // hook applies queued deaths): the plan is made again once nothing more
  // can run before add_copy.
  py::object copy;
  std::uintptr_t addr = 0;
  try {
    copy = new_storage_(nbytes, storage, true, device_);  // on CUDA through the pool
    addr = mirror_ ? allocate_mirror(nbytes, static_cast<int>(engine_->num_values()))
                   : static_cast<std::uintptr_t>(as_int(call_method(copy, names().data_ptr)));
  } catch (const OutOfMemoryError&) {
    return;  // the readers are pinned as before
  } catch (py::error_already_set& e) {
    if (!e.matches(PyExc_RuntimeError) || std::string(py::str(e.value())).find(kOutOfMemoryText) == std::string::npos)
      throw;
    return;
  }
  if (!plan()) {
    if (mirror_) mirror_->free(reinterpret_cast<void*>(addr));
    return;
  }
  const auto cdata = cdata_of(copy);
  const int c = engine_->add_copy(v, addr);
  for (auto& [r, g] : moved) {
    r->value = c;
    r->geometry = std::move(g);
    r->external = py::object();
  }
  Slot& cs = slot(c);
  cs.storage = std::move(copy);
  cs.pin = PinReason::kResizedCopy;
  watch(c, cs.storage, cdata);
  ++stats_.resize_copies;
}

// A storage's contents go when it is resized outside the dispatcher: FSDP
// frees each unsharded parameter after its forward (resize_(0)) and refills
// it before its backward (resize_, then a copy under
// _unsafe_preserve_version_counter, so the version counter says nothing).
// Neither resize is an op the session sees, and no recipe could read the old
// contents afterwards. As an overwrite of an unrecomputable value: what
// depends on the contents comes back now and is pinned, and the value is
// pinned from here on (its contents are the resizer's). Its memory is the
// resizer's too: the block it held goes (the resize frees it on CUDA, where
// the pool may hand it to another value; on CPU the mirror's block is
// freed), and it counts as memory made outside the session, as parameters do.
void LiveSession::resizing(py::handle storage) {
  flush_deaths();
  const int v = value_of(storage, cdata_of(storage));
  if (v < 0) return;  // not seen by this session: the next op reading it registers it as it is then
  const Value& x = engine_->value(v);
  if (x.state != ValueState::kResident)
    throw std::logic_error("dtralloc live session: a storage being resized holds value " + std::to_string(v) +
                           ", which is not resident");
  if (!x.pinned) {
    engine_->pin(v);
    slots_[v].pin = PinReason::kResized;
  }
  keep_for_readers(v, storage);  // Note [copy before a resize]
  for (int d : engine_->prepare_writes({v}, /*freed=*/true)) own_for_recipes(d);
  const std::uintptr_t addr = engine_->make_external(v);
  if (mirror_ && addr) mirror_->free(reinterpret_cast<void*>(addr));
  publish_counts();
  if (options_.check_invariants) check_invariants();
}

Geometry SavedValue::geometry_now() const {
  if (described) return geometry;
  if (!alias) throw std::logic_error("dtralloc live session: a saved handle of value " + std::to_string(value) +
                                     " has neither its geometry nor an alias");
  return Geometry::of(alias);
}

PyObject* SavedValue::watched() const {
  PyObject* t = referent(tensor);
  return t ? t : referent(base);
}

SavedValue::~SavedValue() {
  alias = py::object();  // before drop_handle, which may let the storage go
  if (session) {
    session->unlist(*this);
    session->drop_handle(value);
  }
}

}  // namespace dtralloc::live
