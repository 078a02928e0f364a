// LiveSession: construction, the pool's sessions and hook, the registry of
// storages, the per-op record, the engine's driver, reports (live_session.h).
// Saved handles are in live_saved.cpp, recomputes in live_recompute.cpp.
#include "live_session.h"

#include <algorithm>
#include <cassert>
#include <map>
#include <sstream>
#include <stdexcept>

#include "backend.h"
#include "global.h"
#include "live_python.h"
#include "publisher.h"

namespace dtralloc::live {
namespace {

const char* pin_doc(PinReason r) {
  switch (r) {
#define DTRALLOC_PIN_DOC(e, doc) \
  case PinReason::e: return doc;
    DTRALLOC_PIN_REASONS(DTRALLOC_PIN_DOC)
#undef DTRALLOC_PIN_DOC
  }
  return "";
}

}  // namespace

// A CPU session's OOM (the mirror's), worded as torch's: " out of memory.".
constexpr char kSessionOutOfMemoryText[] = "dtralloc.dtr: out of memory.";

// The engine's driver: memory, recompute and release go to the session.
class LiveSession::Driver : public RematDriver {
 public:
  explicit Driver(LiveSession& s) : s_(s) {}
  std::uintptr_t allocate(std::size_t bytes, int value) override { return s_.allocate_mirror(bytes, value); }
  void release(int value, std::uintptr_t addr) override { s_.release(value, addr); }
  std::uintptr_t recompute(int value, std::size_t bytes) override { return s_.recompute(value, bytes); }
  bool held_elsewhere(int value) const override { return s_.held_elsewhere(value); }
  void forget(int value) override { s_.forget(value); }
  // The engine's last resort before an OOM, as in the replay (PoolPort): on
  // CUDA the device pool, shared with the rest of the process, for the hold.
  void tight_placement(bool on) override { s_.pool_->set_tight_segments(on); }
  std::size_t budget_bytes() override { return s_.pool_->budget_bytes(); }
  const char* out_of_memory_text() const override {
    return s_.options_.cuda ? kOutOfMemoryText : kSessionOutOfMemoryText;
  }
  // Homes as in the replay (PoolPort); the session tells its own apart.
  bool keep_home(int value, std::uintptr_t addr, std::size_t bytes) override {
    return s_.pool_->keep_home(&s_, value, addr, bytes);
  }
  void drop_home(int value) override { s_.pool_->drop_home(&s_, value); }

 private:
  LiveSession& s_;
};

// The live sessions on one pool, oldest first. On CUDA one pool serves every
// session of the process, and sessions end in any order: in a training loop,
// `with dtralloc.dtr() as s:` drops the previous step's session only after
// the next one has started. So the pool's budget is the newest live
// session's that sets one, and the pool's eviction hook asks every live
// session (newest first), then the hook the pool had before any. Changed and
// read only with the GIL held.
struct LiveSession::OnPool {
  std::shared_ptr<EvictionHook> before;        // the pool's hook before the first session
  std::vector<std::weak_ptr<LiveSession>> sessions;
  std::shared_ptr<EvictionHook> hook;          // the Hook below, while it is the pool's
  bool overridden = false;                     // a session set the pool's budget and placement
};

namespace {
std::unordered_map<Allocator*, std::shared_ptr<LiveSession::OnPool>>& sessions_by_pool() {
  static auto* m = new std::unordered_map<Allocator*, std::shared_ptr<LiveSession::OnPool>>();
  return *m;
}

// An op's argument at schema position `i`: positional, else the keyword
// `name` (ops.argument). Borrowed; nullptr if absent (or on an error, set).
PyObject* argument_of(PyObject* args, PyObject* kwargs, int i, PyObject* name) {
  if (i < PyTuple_GET_SIZE(args)) return PyTuple_GET_ITEM(args, i);
  return kwargs ? PyDict_GetItemWithError(kwargs, name) : nullptr;
}
}  // namespace

// The pool's eviction hook. It takes the GIL first: on CUDA it is called from
// whichever thread allocates, with or without the GIL.
class LiveSession::Hook : public EvictionHook {
 public:
  explicit Hook(std::weak_ptr<OnPool> on_pool) : on_pool_(std::move(on_pool)) {}
  bool make_room(std::size_t bytes, Stream stream) override {
    std::shared_ptr<EvictionHook> before;
    {
      py::gil_scoped_acquire gil;
      auto on_pool = on_pool_.lock();
      if (!on_pool) return false;
      const std::vector<std::weak_ptr<LiveSession>> live = on_pool->sessions;  // a session may end meanwhile
      for (auto it = live.rbegin(); it != live.rend(); ++it)
        if (auto s = it->lock())
          if (s->make_room(bytes, stream)) return true;
      before = on_pool->before;
    }
    return before && before->make_room(bytes, stream);
  }

 private:
  std::weak_ptr<OnPool> on_pool_;
};

LiveSession::LiveSession(const Options& options, py::dict helpers) : options_(options) {
  detached_ = helpers["detached"];
  empty_kwargs_ = py::dict();
  run_ = helpers["run"];
  new_storage_ = helpers["new_storage"];
  use_count_fn_ = helpers["use_count"];
  shared_pyrefs_ = helpers["shared_pyrefs"].cast<int>();
  version_error_ = helpers["version_error"];
  next_sequence_nr_ = helpers["next_sequence_nr"];
  tensor_type_ = helpers["tensor_type"];
  load_accessors(helpers["accessors"]);
  device_ = helpers["device"];
  Config config = parse_config(options.conf);
  config.policy = options.policy;
  would_place_ = config.long_lived == Switch::kOn ||
                 (config.long_lived == Switch::kAuto && options.policy == Policy::kDtralloc);
  if (options.cuda) {
    pool_ = &global::allocator(options.device);
    current_stream_ = helpers["current_stream"];
    if (!current_stream_.is_none()) timer_ = std::make_unique<OpTimer>(pool_->backend());
    device_index_ = py::int_(options.device);
  } else {
    config.budget = Budget{};
    config.budget.bytes = options.budget_bytes;
    // Any capacity: only the budget bounds the mirror.
    mirror_ = std::make_unique<Allocator>(make_virtual_backend(std::size_t{1} << 44), config);
    pool_ = mirror_.get();
  }
  driver_ = std::make_unique<Driver>(*this);
  engine_ = std::make_unique<RematEngine>(*driver_);
  evictor_ = std::make_shared<Evictor>(*pool_, *engine_, options.policy, config);
  if (options.series_ops) {
    engine_->set_event_log(&events_);
    evictor_->set_event_log(&events_);
  }
  if (mirror_ && options.history_entries) mirror_->set_history_entries(options.history_entries);
  graph_task_id_ = py::module_::import("torch._C").attr("_current_graph_task_id");
  // One callback for every storage the session watches: it only queues the
  // value; flush_deaths() tells the engine at the next entry point. A plain
  // CPython function (one per op dies; a pybind11 function costs a
  // microsecond more per call).
  static PyMethodDef def = {"dtralloc_storage_died", &LiveSession::storage_died, METH_O, nullptr};
  py::capsule self(this);
  PyObject* fn = PyCFunction_New(&def, self.ptr());
  if (!fn) throw py::error_already_set();
  watch_callback_ = py::reinterpret_steal<py::object>(fn);
}

PyObject* LiveSession::storage_died(PyObject* self, PyObject* weakref) {
  auto* session = static_cast<LiveSession*>(PyCapsule_GetPointer(self, nullptr));
  if (!session) return nullptr;
  auto it = session->watched_.find(weakref);
  if (it != session->watched_.end()) {
    session->dead_.push_back(it->second);
    session->watched_.erase(it);
  }
  Py_RETURN_NONE;
}

LiveSession::~LiveSession() {
  // Runs with the GIL (the last Python reference went). Weakrefs first, so
  // that dropping the storages reports no death into a session being torn down.
  stop();
  pool_->drop_homes(this);  // on CUDA the pool outlives the session
  for (Slot& s : slots_) s.watch = py::object();
  watched_.clear();
  for (Slot& s : slots_) {
    s.storage = py::object();
    s.external = py::object();
  }
  ops_.clear();
}

// ---- what outlives the step (long_lived) -----------------------------------
//
// A training step makes the same ops in the same order every time, and what
// it still holds when it ends (gradients, optimizer state made in the step,
// the loss) is what the next step's same ops make to keep. Best fit cannot
// know that when it places an output, and a gradient it puts at the low end
// of a free block among activations splits that room for the rest of the step
// (docs/allocator.md, long_lived). So each session notes, per recorded op
// (its ordinal: the n-th op that made or wrote a storage), which OpOverload
// ran and how many bytes of what it made were still alive when the block
// ended; the next session on the device announces those sizes to the pool
// (Allocator::expect_long_lived) right before its op of the same ordinal
// runs, if that op is the same OpOverload. Once an op differs, the steps have
// diverged and the rest of the session goes without. A wrong guess changes
// only the side of the block a request takes. The step before is the newest
// of the device's recent kinds of step still matching (Note [recent steps],
// recent_steps.h).
struct Lifetimes {
  std::vector<PyObject*> funcs;  // identity only: OpOverloads live as long as torch
  std::unordered_map<std::size_t, std::vector<std::size_t>> kept;  // ordinal -> bytes still alive
};

namespace {
// The recent sessions' lifetimes per device (device_key), under the GIL.
// Never destroyed: sessions may end during interpreter shutdown.
std::map<int, RecentSteps<Lifetimes>>& lifetimes_by_device() {
  static auto* by_device = new std::map<int, RecentSteps<Lifetimes>>();
  return *by_device;
}
}  // namespace

void LiveSession::start() {
  if (started_) return;
  started_ = true;
  std::shared_ptr<OnPool>& on_pool = sessions_by_pool()[pool_];
  if (!on_pool) {
    on_pool = std::make_shared<OnPool>();
    on_pool->before = options_.cuda ? pool_->eviction_hook() : nullptr;
    on_pool->hook = std::make_shared<Hook>(on_pool);
    pool_->set_eviction_hook(on_pool->hook);
  }
  on_pool->sessions.push_back(weak_from_this());
  on_pool_ = on_pool;
  apply_budget(*on_pool);
  // Allocations until the next recorded op are that op's (on CUDA the op
  // allocates its outputs before record() sees it).
  pool_->set_op_stamp(engine_->current_op() + 1);
  const Stats at_start = pool_->stats_report().stats;
  ooms_at_start_ = at_start.num_ooms;
  long_lived_at_start_ = at_start.num_long_lived;
  device_calls_at_start_ = at_start.num_device_alloc + at_start.num_device_free;
  device_ns_at_start_ = at_start.device_alloc_ns + at_start.device_free_ns;
  device_waits_at_start_ = at_start.num_device_pool_waits;
  // Announces what the step before kept where the pool places by it (its
  // long_lived resolved on: a budget in force, and would_place_); notes what
  // this step keeps wherever a budget would make it, so that a step without
  // one (measuring the peak, a warm-up) teaches the first step with one.
  lifetimes_on_ = would_place_;
  if (pool_->config().long_lived == Switch::kOn) {
    auto& by_device = lifetimes_by_device();
    auto it = by_device.find(device_key());
    if (it != by_device.end()) lifetimes_in_.reset(it->second);
  }
  take_carried_costs();
  mark_op(-1);  // the first op's interval starts here
}

void LiveSession::simulate_gpu_timer(std::size_t lag_ops, double launch_ns, bool carry) {
  if (options_.cuda) throw std::invalid_argument("dtralloc: a CUDA session times its ops on its GPU already");
  if (started_) throw std::logic_error("dtralloc: simulate_gpu_timer() comes before the session starts");
  if (!(launch_ns >= 0)) throw std::invalid_argument("dtralloc: launch_ns must be >= 0");
  timer_.reset();  // first: it refers to the backend
  simulated_timing_ = std::make_unique<SimulatedTimingBackend>(lag_ops);
  simulated_launch_ns_ = launch_ns;
  carry_costs_ = carry;
  timer_ = std::make_unique<OpTimer>(*simulated_timing_);
}

// `dtralloc top PID` shows the mirror as it shows an installed pool (on CUDA
// the installed pool publishes already). Started at the session's
// kPublishAfterOps-th recorded op, not at start(): a publisher is a thread and a file, whose
// start and stop cost a short session more than all its ops' bookkeeping,
// and `top` could not see a session of a few milliseconds anyway. A session
// that cannot publish still runs.
// 256 ops: a few milliseconds of a small model, tens of a real one.
constexpr std::size_t kPublishAfterOps = 256;

void LiveSession::start_publishing() {
  if (!mirror_ || publishing_) return;
  publishing_ = true;
  try {
    mirror_->publish(kDefaultPublishPeriodUs, "dtr cpu mirror");
  } catch (const std::exception& e) {
    PyErr_WarnEx(PyExc_RuntimeWarning, (std::string("dtralloc top will not see this dtr session: ") + e.what()).c_str(), 1);
    return;
  }
  published_evictions_ = published_remats_ = 0;  // counts before now were dropped: send the totals
  publish_counts();
}

void LiveSession::stop() {
  if (!started_) return;
  started_ = false;
  lifetimes_on_ = false;  // stopped (torn down) before its block ended: it teaches nothing
  if (on_pool_) {
    // Called from the destructor too, where this session's weak pointers
    // have expired already: expired entries go, this one among them.
    auto& live = on_pool_->sessions;
    live.erase(std::remove_if(live.begin(), live.end(),
                              [&](const std::weak_ptr<LiveSession>& w) {
                                auto s = w.lock();
                                return !s || s.get() == this;
                              }),
               live.end());
    apply_budget(*on_pool_);
    if (live.empty()) {
      // Another hook set after ours stays (it may chain to ours, which then finds no session).
      if (pool_->eviction_hook() == on_pool_->hook) pool_->set_eviction_hook(on_pool_->before);
      auto it = sessions_by_pool().find(pool_);
      if (it != sessions_by_pool().end() && it->second == on_pool_) sessions_by_pool().erase(it);
    }
    on_pool_.reset();
  }
  end_block();
}

// The pool's budget: the newest live session's that sets one; when none
// does any more, the pool's own again. Its auto settings (placement) resolve
// as for the newest live session's policy under that budget, so that a
// dtralloc session on a pool installed with neither (dtralloc.install(),
// then dtr(budget=...)) places as its replay and the CPU mirror do
// (Allocator::override_session). On the CPU mirror the session's budget and
// policy are the mirror's configuration: nothing to override.
void LiveSession::apply_budget(OnPool& on_pool) {
  if (!options_.cuda) return;
  std::shared_ptr<LiveSession> newest;
  std::size_t bytes = 0;
  for (auto it = on_pool.sessions.rbegin(); it != on_pool.sessions.rend(); ++it) {
    auto s = it->lock();
    if (!s) continue;
    if (!newest) newest = s;
    if (s->options_.budget_bytes) {
      bytes = s->options_.budget_bytes;
      break;
    }
  }
  if (newest) {
    pool_->override_session(bytes, newest->options_.policy);
    on_pool.overridden = true;
  } else if (on_pool.overridden) {
    pool_->end_override();
    on_pool.overridden = false;
  }
}

std::size_t LiveSession::live_sessions_on(Allocator* pool) {
  auto it = sessions_by_pool().find(pool);
  if (it == sessions_by_pool().end()) return 0;
  std::size_t n = 0;
  for (const auto& w : it->second->sessions) n += !w.expired();
  return n;
}

void LiveSession::end_block() {
  end_lifetimes();
  give_carried_costs();
  publish_counts();
  pool_->set_op_stamp(-1);  // nothing after the block is recorded
  if (mirror_ && publishing_) mirror_->publish(0, "");
}

// A session notes its first this many recorded ops only, and one that
// records more teaches nothing: a block that long is not one step (a whole
// training loop in one session), and its notes would grow with every op.
// The zoo's steps at the bench's sizes record 127-1380.
constexpr std::size_t kLifetimeOps = std::size_t{1} << 17;

int LiveSession::device_key() const { return options_.cuda ? options_.device : -1; }

bool LiveSession::expect_long_lived(PyObject* func) {
  if (lifetimes_in_.empty()) return false;
  const std::size_t ordinal = step_funcs_.size();
  bool announced = false;
  lifetimes_in_.each_at(ordinal, func, [&](const Lifetimes& before) {  // the newest matching step's
    auto it = before.kept.find(ordinal);
    if (it != before.kept.end()) {
      pool_->expect_long_lived(it->second);
      announced = true;
    }
    return true;
  });
  return announced;
}

void LiveSession::end_lifetimes() {
  if (!lifetimes_on_) return;
  lifetimes_on_ = false;  // once: ops after the block are not recorded
  flush_deaths();
  auto out = std::make_shared<Lifetimes>();
  out->funcs = step_funcs_;
  std::size_t made = 0, kept = 0;
  for (const MadeAt& m : made_at_) {
    made += m.nbytes;
    if (!referent(m.watch)) continue;  // died within the step
    out->kept[m.ordinal].push_back(m.nbytes);
    kept += m.nbytes;
  }
  made_at_.clear();
  // A step whose backward runs after the block still holds its activations
  // here: lifetimes that keep most of what it made tell nothing apart.
  if (2 * kept > made || out->funcs.size() >= kLifetimeOps) out->kept.clear();
  if (!out->funcs.empty()) lifetimes_by_device()[device_key()].remember(std::move(out));
}

// ---- op costs carried from the step before (CUDA) ----------------------------
//
// Note [carried costs]
// ~~~~~~~~~~~~~~~~~~~~
// On a GPU an op's cost arrives when the GPU has run it (op_timer.h); until
// then the engine prices it by the host's clock, a few microseconds of
// launch for a matmul and a ReLU alike. Where the kernels are the slower
// side (a large batch: the regime a budget is for), the host runs ahead of
// the GPU by up to its launch queue, hundreds of ops: when the budget fills
// late in the forward, the last layers' outputs are all priced at their
// launch, tens to hundreds of times below their recompute, so the evictor
// takes them first, and among them cannot tell a matmul's output from an
// activation's. A training step runs the same ops in the same order every
// time, so the session prices each op, until the GPU's own time arrives, at
// what the GPU measured for the same op (the same OpOverload at the same
// engine op index) in the step before on the device; from the first op
// that differs (another model, a step that took another path) it falls back
// to the clock. The step before is the newest of the device's recent kinds
// of step still matching (Note [recent steps], recent_steps.h), so that
// alternating steps (a GAN's two) each carry their own kind's. Only ops the
// GPU measured are carried, and a wrong guess only misprices an op until
// its own time arrives. The previous session hands over what it measured
// when its block ends, and again when the next session starts while it
// still lives (the usual loop: `s` holds it), so that the ops whose time
// arrived after its block (all of the forward, with the backward after the
// block) are carried too. stats()["carried_costs"] counts the ops priced
// so. A CPU session runs all of this on a simulated GPU with
// simulate_gpu_timer (simulated_timing.h; tests/test_dtr_late_costs.py).

// What a session measured, by engine op.
struct CarriedCosts {
  std::vector<PyObject*> funcs;  // identity only: OpOverloads live as long as torch
  std::vector<double> ns;        // the GPU's time, or -1
};

namespace {
// Per CUDA device, under the GIL: the latest session with a timer, and what
// it measured when it last handed its costs over. Never destroyed: sessions
// may end during interpreter shutdown.
struct CostsOnDevice {
  std::weak_ptr<LiveSession> last;
  const LiveSession* last_raw = nullptr;  // identity only: `last` has expired in its destructor
  RecentSteps<CarriedCosts> recent;
};
std::map<int, CostsOnDevice>& costs_by_device() {
  static auto* by_device = new std::map<int, CostsOnDevice>();
  return *by_device;
}

void remember_costs(RecentSteps<CarriedCosts>& recent, std::shared_ptr<const CarriedCosts> costs) {
  if (!costs->funcs.empty()) recent.remember(std::move(costs));  // a step with no op teaches nothing
}
}  // namespace

double LiveSession::provisional_cost(int op, PyObject* func, double clock) {
  const auto i = static_cast<std::size_t>(op);
  // A session longer than a step notes no more (see kLifetimeOps).
  if (i >= step_funcs_.size()) return clock;
  if (gpu_ns_.size() <= i) gpu_ns_.resize(i + 1, -1);
  double carried = -1;
  costs_in_.each_at(i, func, [&](const CarriedCosts& before) {  // the newest matching step the GPU timed it in
    carried = before.ns[i];
    return carried >= 0;
  });
  if (carried < 0) return clock;
  ++stats_.carried_costs;
  return carried;
}

void LiveSession::collect_gpu_costs() {
  stats_.gpu_timed_ops += timer_->collect([&](int o, double ns) {
    engine_->set_cost(o, ns);
    if (static_cast<std::size_t>(o) < gpu_ns_.size()) gpu_ns_[o] = ns;
  });
}

std::shared_ptr<const CarriedCosts> LiveSession::measured_costs() {
  if (timer_->active()) collect_gpu_costs();
  auto out = std::make_shared<CarriedCosts>();
  out->funcs = step_funcs_;
  out->ns = gpu_ns_;
  out->ns.resize(out->funcs.size(), -1);
  return out;
}

void LiveSession::take_carried_costs() {
  if (!timer_ || !timer_->active()) return;
  CostsOnDevice& on_device = costs_by_device()[device_key()];
  if (auto previous = on_device.last.lock())  // still alive: what arrived since its block ended too
    if (previous.get() != this) remember_costs(on_device.recent, previous->measured_costs());
  if (carry_costs_) costs_in_.reset(on_device.recent);
  on_device.last = weak_from_this();
  on_device.last_raw = this;
}

// From end_block(): at the block's end, and when the session is torn down
// (stop()) before a next one took its costs.
void LiveSession::give_carried_costs() {
  if (!timer_ || !timer_->active()) return;
  CostsOnDevice& on_device = costs_by_device()[device_key()];
  if (on_device.last_raw != this) return;  // a newer session took over
  remember_costs(on_device.recent, measured_costs());
  if (on_device.last.expired()) on_device.last_raw = nullptr;  // torn down: no later hand-over
}

Slot& LiveSession::slot(int value) {
  if (static_cast<std::size_t>(value) >= slots_.size()) slots_.resize(engine_->num_values());
  return slots_[value];
}

int LiveSession::latest(int value) {
  int last = value;
  while (slots_[last].next >= 0) last = slots_[last].next;
  // Every version on the way now links to the newest: a storage written in
  // place a thousand times (an accumulator) is walked once.
  while (slots_[value].next >= 0 && slots_[value].next != last) {
    const int next = slots_[value].next;
    slots_[value].next = last;
    value = next;
  }
  return last;
}

// ---- watching storages ---------------------------------------------------

void LiveSession::watch(int value, py::handle storage, std::uintptr_t cdata) {
  Slot& s = slot(value);
  PyObject* wr = PyWeakref_NewRef(storage.ptr(), watch_callback_.ptr());
  if (!wr) throw py::error_already_set();
  s.watch = py::reinterpret_steal<py::object>(wr);
  watched_[wr] = value;
  s.cdata = cdata;
  by_storage_[cdata] = value;
}

void LiveSession::unwatch(int value) {
  Slot& s = slots_[value];
  if (s.watch) {
    watched_.erase(s.watch.ptr());
    s.watch = py::object();
  }
  if (s.cdata) {
    auto it = by_storage_.find(s.cdata);
    if (it != by_storage_.end() && it->second == value) by_storage_.erase(it);
    s.cdata = 0;
  }
}

void LiveSession::flush_deaths() {
  while (!dead_.empty()) {
    const int v = dead_.back();
    dead_.pop_back();
    Slot& s = slots_[v];
    s.watch = py::object();  // already dead; its callback has run
    if (s.cdata) {
      auto it = by_storage_.find(s.cdata);
      if (it != by_storage_.end() && it->second == v) by_storage_.erase(it);
      s.cdata = 0;
    }
    if (engine_->value(v).state != ValueState::kReleased) engine_->kill(v);
  }
}

// ---- the driver side -------------------------------------------------------

std::uintptr_t LiveSession::allocate_mirror(std::size_t bytes, int value) {
  if (!mirror_) throw std::logic_error("dtralloc live session: on CUDA the pool allocates, not the driver");
  try {
    return reinterpret_cast<std::uintptr_t>(mirror_->malloc(bytes, 0, value));
  } catch (const OutOfMemoryError&) {
    const bool recompute = static_cast<std::size_t>(value) < engine_->num_values();
    // " out of memory." as torch words it, which batch-size finders look for
    // (accelerate's should_reduce_batch_size, behind transformers' Trainer
    // auto_find_batch_size).
    throw OutOfMemoryError(std::string(kSessionOutOfMemoryText) + " " +
                           oom_report(bytes, recompute ? "to bring back an evicted value" : "for an op's output"));
  }
}

void LiveSession::release(int value, std::uintptr_t addr) {
  if (mirror_ && addr) mirror_->free(reinterpret_cast<void*>(addr));
  Slot& s = slot(value);
  unwatch(value);
  // The handles' aliases go with the storage; each keeps the counter's
  // value, which no write can move any more (nothing else held the storage).
  for (SavedValue* h : s.saved) {
    if (!h->alias) continue;
    h->seen = as_int(get_attr(h->alias.ptr(), names().version));
    if (!h->described) {
      h->geometry = Geometry::of(h->alias);
      h->described = true;
    }
    h->alias = py::object();  // s.storage still holds the storage
  }
  // Last: dropping the storage may free device memory (dtralloc_free, which
  // re-enters the pool; it is not locked here).
  py::object storage = std::move(s.storage);
}

bool LiveSession::held_elsewhere(int value) const {
  const Slot& s = slots_[value];
  if (!s.storage) return true;  // the registry does not own it: the program does
  // The registry's reference to the storage's Python object, and torch's
  // own while tensors (here the aliases) share the storage (shared_pyrefs_).
  const std::int64_t n = aliases(value);
  if (Py_REFCNT(s.storage.ptr()) != 1 + (n > 0 ? shared_pyrefs_ : 0)) return true;
  return use_count(s.cdata) != 1 + n;
}

std::int64_t LiveSession::aliases(int value) const {
  std::int64_t n = 0;
  for (const SavedValue* h : slots_[value].saved) n += h->alias ? 1 : 0;
  return n;
}

std::int64_t LiveSession::use_count(std::uintptr_t cdata) const {
  if (raw_refcount_) {
    // c10::intrusive_ptr_target keeps its strong count in the low 32 bits of
    // the word after the vtable pointer (refcount_ in older torch,
    // combined_refcount_ in newer); use_raw_refcount() checked it agrees
    // with torch._C._storage_Use_Count on this torch before turning it on.
    return __atomic_load_n(reinterpret_cast<const std::uint32_t*>(cdata + sizeof(void*)), __ATOMIC_RELAXED);
  }
  return as_int(use_count_fn_(cdata));
}

bool LiveSession::use_raw_refcount(bool on) {
  raw_refcount_ = on;
  return raw_refcount_;
}

void LiveSession::forget(int value) {
  const int producer = engine_->value(value).producer;
  if (static_cast<std::size_t>(value) >= slots_.size() || !slots_[value].counted) return;
  slots_[value].counted = false;
  if (producer < 0 || static_cast<std::size_t>(producer) >= ops_.size() || !ops_[producer]) return;
  if (--ops_[producer]->recipes <= 0) ops_[producer].reset();
}

bool LiveSession::make_room(std::size_t bytes, Stream stream) {
  flush_deaths();
  poll_owned();
  return evictor_->make_room(bytes, stream);
}

py::object LiveSession::storage_of(int value) const {
  const Slot& s = slots_[value];
  if (s.storage) return s.storage;
  if (s.external) return call_method(s.external, names().untyped_storage);
  if (PyObject* o = referent(s.watch)) {
    // Note [storage weakrefs]: torch before 2.10 lets the StorageImpl own a
    // storage's Python object once Python's last reference goes (PyObject
    // preservation), and a reference taken back through a weakref does not
    // hand it back to Python: kept past the StorageImpl (as the registry
    // keeps what it owns), the object is deallocated under it ("Deallocating
    // UntypedStorage that still has live PyObject references") and reads
    // "Got a null Storage" after: seen on torch 2.8. _fix_weakref() hands it
    // back, as that warning asks; on newer torch, whose StorageImpl holds a
    // counted reference instead, it changes nothing.
    py::object storage = py::reinterpret_borrow<py::object>(o);
    if (names().fix_weakref != Py_None) call_method(storage, names().fix_weakref);
    return storage;
  }
  const Value& x = engine_->value(value);
  const int producer = x.producer;
  std::string made_by = "an input";
  if (producer >= 0 && static_cast<std::size_t>(producer) < ops_.size() && ops_[producer])
    made_by = py::str(ops_[producer]->func);
  throw std::logic_error("dtralloc live session: value " + std::to_string(value) + " (made by " + made_by +
                         ", pin " + std::to_string(static_cast<int>(s.pin)) + ", alive " + std::to_string(x.alive) +
                         ", state " + std::to_string(static_cast<int>(x.state)) +
                         ") is resident but its storage is gone");
}

// ---- recording an op -----------------------------------------------------

int LiveSession::value_of(py::handle, std::uintptr_t cdata) const {
  auto it = by_storage_.find(cdata);
  return it == by_storage_.end() ? -1 : it->second;
}

int LiveSession::external_value(py::handle tensor, py::handle storage, std::uintptr_t cdata) {
  const std::size_t nbytes = static_cast<std::size_t>(as_int(call_method(storage, names().nbytes)));
  const int v = engine_->add_external(nbytes);
  Slot& s = slot(v);
  s.pin = PinReason::kExternal;
  // Kept for as long as a recipe may read it; its version counter tells an
  // in-place change made outside the session.
  s.external = py::reinterpret_borrow<py::object>(tensor);
  s.cdata = cdata;
  by_storage_[cdata] = v;
  polled_.push_back(v);
  return v;
}

// A recipe now reads `value`, which cannot be recomputed: its data must
// outlive the program's references to it.
void LiveSession::own_for_recipes(int value) {
  Slot& s = slots_[value];
  const Value& x = engine_->value(value);
  if (s.storage || s.external || !x.pinned || x.needed_by <= 0 || x.state != ValueState::kResident) return;
  s.storage = storage_of(value);
  if (s.saved.empty()) polled_.push_back(value);  // no saved handle reads it
}

void LiveSession::poll_owned() {
  ops_since_poll_ = 0;
  std::size_t kept = 0;
  for (std::size_t i = 0; i < polled_.size(); ++i) {
    const int v = polled_[i];
    Slot& s = slots_[v];
    const Value& x = engine_->value(v);
    if (x.state == ValueState::kReleased || !x.alive || !s.saved.empty()) continue;  // no longer ours to poll
    if (x.locks > 0) {  // the op in flight (or a recompute) reads it now
      polled_[kept++] = v;
      continue;
    }
    if (s.external) {
      if (x.needed_by > 0) {
        polled_[kept++] = v;
        continue;
      }
      // No recipe reads it: forget it (the next op that reads the tensor
      // registers it again).
      unwatch(v);
      s.external = py::object();
      engine_->kill(v);
      continue;
    }
    if (!s.storage) continue;
    if (x.needed_by <= 0) {
      py::object dropped = std::move(s.storage);  // the program may hold it; it dies when it lets go
      continue;
    }
    if (!held_elsewhere(v)) {
      engine_->kill(v);  // dead to the program; pinned and needed, so the engine keeps its memory
      continue;
    }
    polled_[kept++] = v;
  }
  polled_.resize(kept);
}

void LiveSession::before_write(py::handle writes) {
  flush_deaths();
  std::vector<int> vs;
  for_each_tensor(writes.ptr(), tensor_type_.ptr(), [&](PyObject* t) {
    py::object storage = storage_or_none(t);
    if (storage.is_none()) return;  // sparse: not the session's
    const int v = value_of(storage, cdata_of(storage));
    if (v >= 0 && engine_->value(v).pinned) vs.push_back(v);
  });
  if (vs.empty()) return;
  // What the engine pins is read by recipes still: the registry keeps it.
  for (int d : engine_->prepare_writes(vs)) own_for_recipes(d);
}

void LiveSession::set_dispatch_helpers(py::object classify, py::object slow, py::object on_error,
                                       py::object default_generator) {
  classify_ = std::move(classify);
  slow_ = std::move(slow);
  on_error_ = std::move(on_error);
  default_generator_ = std::move(default_generator);
  grad_enabled_ = py::module_::import("torch").attr("is_grad_enabled");
}

LiveSession::FuncInfo& LiveSession::func_info(PyObject* func) {
  auto it = funcs_.find(func);
  if (it == funcs_.end()) {
    func_refs_.push_back(py::reinterpret_borrow<py::object>(func));
    it = funcs_.emplace(func, FuncInfo{}).first;
  }
  return it->second;  // a node of the map: stays valid as the map grows
}

py::object LiveSession::dispatch(PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs) {
  if (!slow_ || slow_.is_none()) throw std::logic_error("dtralloc: the dtr() session's dispatch mode ran after the session closed");
  FuncInfo& known = func_info(func);
  if (!known.classified) {
    py::tuple answer = classify_(py::handle(func));
    known.fast = answer[0].cast<bool>();
    known.flags = answer[1].cast<std::uint32_t>();
    known.pin = answer[2].cast<int>();
    known.call = answer[3];
    known.view = answer[4].cast<bool>();
    if (!answer[5].is_none()) {
      py::tuple spec = answer[5];
      for (py::handle i : spec[0]) known.write_pos.push_back(i.cast<int>());
      for (py::handle k : spec[1]) known.write_kw.push_back(py::reinterpret_borrow<py::object>(k));
      known.undeclared_stats = spec[2].cast<bool>();
      known.overwrites = spec[3].cast<bool>();
      known.bumps_versions = spec[4].cast<bool>();
      if (known.write_pos.size() != known.write_kw.size())
        throw std::logic_error("dtralloc live session: the classifier gave write positions and names of different lengths");
      known.writes_here = true;
    }
    if (!answer[6].is_none()) {
      if (!known.writes_here) throw std::logic_error("dtralloc live session: the classifier gave a random op no write spec");
      py::tuple spec = answer[6];
      known.dropout_pos = spec[0].cast<int>();
      known.generator_pos = spec[1].cast<int>();
      known.random_here = true;
    }
    known.per_element = answer[7].cast<int>();
    known.classified = true;
  }
  if (!known.fast && !known.writes_here)
    return slow_(py::handle(func), py::handle(types), py::handle(args), py::handle(kwargs));
  std::uint32_t info_flags = known.flags;
  const int info_pin = known.pin;
  const py::object call = known.call;  // a reference of its own: the op may classify others (funcs_ grows)
  const bool has_kwargs = kwargs != Py_None && PyDict_Check(kwargs) && PyDict_GET_SIZE(kwargs) > 0;
  auto run = [&] {
    PyObject* out = PyObject_Call(call.ptr(), args, has_kwargs ? kwargs : nullptr);
    if (!out) {
      py::error_already_set error;  // takes the op's exception
      // May raise a better one (on CUDA, an OOM that says what the budget holds).
      on_error_(error.value());
      throw error;
    }
    return py::reinterpret_steal<py::object>(out);
  };
  if (known.view) {  // makes and writes no storage: nothing for the engine (autograd's unpack detaches this way)
    ++stats_.ops;
    return run();
  }
  // A random op or one that writes: the Python slow path's steps for it, in
  // C (mode.py, Mode._dispatch). A random op's generator state is saved
  // first (only where its dropout_p, if it has one, is nonzero: fused
  // attention carries the tag with its dropout off); then what the op
  // writes, whether it overwrites it whole, and what reads an
  // unrecomputable value it is about to overwrite brought back and pinned.
  PyObject* const kw = has_kwargs ? kwargs : nullptr;
  py::object rng = py::none();
  if (known.random_here) {
    static PyObject* const dropout_name = PyUnicode_InternFromString("dropout_p");
    bool random = true;
    if (known.dropout_pos >= 0) {
      PyObject* p = argument_of(args, kw, known.dropout_pos, dropout_name);
      if (!p && PyErr_Occurred()) throw py::error_already_set();
      const int on = p ? PyObject_IsTrue(p) : 0;  // absent: its default, 0
      if (on < 0) throw py::error_already_set();
      random = on != 0;
    }
    if (random) {
      py::object generator = generator_of(known, args, kw);
      if (generator.is_none())  // no tensor argument, or a device whose generator is not restored: Python decides
        return slow_(py::handle(func), py::handle(types), py::handle(args), py::handle(kwargs));
      static PyObject* const get_state = PyUnicode_InternFromString("get_state");
      PyObject* state = PyObject_CallMethodNoArgs(generator.ptr(), get_state);
      if (!state) throw py::error_already_set();
      rng = py::make_tuple(generator, py::reinterpret_steal<py::object>(state));
    } else {
      info_flags &= ~static_cast<std::uint32_t>(kRandom);
    }
  }
  py::tuple writes;
  if (known.writes_here) {
    writes = written_by(known, args, kw);
    if (writes.size() > 0) {
      before_write(writes);
      if (known.overwrites) {
        bool all = true;
        for (py::handle t : writes) all = all && covers_storage(t);
        if (all) info_flags |= kOverwrites;
      }
    }
  }
  // What the previous step's same op kept is announced until it is recorded
  // (on CPU the mirror places its outputs in record()); not for an op that
  // writes, which the Python path never announced.
  struct ClearLongLived {
    Allocator* pool;
    bool set;
    ~ClearLongLived() {
      if (set) pool->clear_long_lived();
    }
  } clear_long_lived{pool_, !known.writes_here && expect_long_lived(func)};
  // An in-place foreach op: its tensors' version counters, bumped below
  // where the call did not (ops.OpInfo.bumps_versions says why).
  const bool bumps = known.bumps_versions && writes.size() > 0;
  const std::int64_t before = bumps ? as_int(get_attr(writes[0], names().version)) : 0;
  const auto start = std::chrono::steady_clock::now();
  py::object result = run();
  const double cost = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
  if (bumps && as_int(get_attr(writes[0], names().version)) == before) {
    if (!increment_version_) increment_version_ = py::module_::import("torch.autograd.graph").attr("increment_version");
    increment_version_(writes);
    info_flags |= kVersionsBumped;
  }
  PyObject* grad = PyObject_CallNoArgs(grad_enabled_.ptr());
  if (!grad) throw py::error_already_set();
  const std::uint32_t flags = info_flags | (grad == Py_True ? kGradEnabled : 0);
  Py_DECREF(grad);
  record(func, args, has_kwargs ? kwargs : Py_None, result, writes, flags, info_pin, cost, rng);
  return result;
}

py::object LiveSession::generator_of(const FuncInfo& known, PyObject* args, PyObject* kwargs) const {
  static PyObject* const generator_name = PyUnicode_InternFromString("generator");
  if (known.generator_pos >= 0) {
    PyObject* g = argument_of(args, kwargs, known.generator_pos, generator_name);
    if (PyErr_Occurred()) throw py::error_already_set();
    if (g && g != Py_None) return py::reinterpret_borrow<py::object>(g);
  }
  auto* tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type_.ptr());
  PyObject* first = nullptr;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args) && !first; ++i)
    if (PyObject_TypeCheck(PyTuple_GET_ITEM(args, i), tensor_type)) first = PyTuple_GET_ITEM(args, i);
  if (!first && kwargs) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (!first && PyDict_Next(kwargs, &pos, &key, &value))
      if (PyObject_TypeCheck(value, tensor_type)) first = value;
  }
  if (!first) return py::none();
  return default_generator_(py::handle(first));
}

bool LiveSession::covers_storage(py::handle t) {
  py::object storage = storage_or_none(t);
  if (storage.is_none()) return false;
  if (as_int(call_method(t, names().storage_offset)) != 0) return false;
  if (call_method(t, names().is_contiguous).ptr() != Py_True) return false;
  const std::int64_t bytes = as_int(call_method(t, names().numel)) * as_int(call_method(t, names().element_size));
  return bytes == as_int(call_method(storage, names().nbytes));
}

namespace {

// c10's non-overlapping-and-dense test (TensorImpl: empty, or some order of
// the dimensions whose strides chain without a gap, dimensions of size 1
// aside; c10 asks is_contiguous first only because it has it cached, and a
// contiguous tensor's strides chain in that order too).
bool non_overlapping_and_dense(const std::vector<std::int64_t>& sizes, const std::vector<std::int64_t>& strides) {
  const std::size_t dims = sizes.size();
  for (std::int64_t size : sizes)
    if (size == 0) return true;  // no elements: contiguous
  std::vector<std::size_t> order(dims);
  for (std::size_t d = 0; d < dims; ++d) order[d] = d;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    if (sizes[a] < 2) return false;
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  std::int64_t require = 1;
  for (std::size_t d : order) {
    if (sizes[d] < 2) return true;
    if (strides[d] != require) return false;
    require *= sizes[d];
  }
  return true;
}

std::vector<std::int64_t> int_tuple(const py::object& o) {
  PyObject* seq = o.ptr();
  if (!PyTuple_Check(seq)) throw std::logic_error("dtralloc live session: a tensor's size or stride is not a tuple");
  std::vector<std::int64_t> out(PyTuple_GET_SIZE(seq));
  for (std::size_t d = 0; d < out.size(); ++d) {
    out[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, d));
    if (out[d] == -1 && PyErr_Occurred()) throw py::error_already_set();
  }
  return out;
}

}  // namespace

// What each element of a foreach call passes or fails of torch's fused
// route on its own (ForeachUtils.h: _check_tensors_share_device_and_dtype's
// strided, non-overlapping and dense tensors; _check_tensors_share_sizes_and_strides'
// equal sizes at one index in every list, and equal strides where the size
// is not 1). `element`: each tensor's index in its list, -1 for a single
// tensor argument (the same for every element).
std::vector<bool> LiveSession::fused_route_at(const std::vector<PyObject*>& tensors, const std::vector<int>& element,
                                              int n) const {
  std::vector<bool> route(n, true);
  std::vector<std::vector<std::int64_t>> sizes(n), strides(n);  // each index's first tensor
  std::vector<bool> seen(n, false);
  for (std::size_t k = 0; k < tensors.size(); ++k) {
    const int e = element[k];
    if (e < 0 || !route[e]) continue;
    py::handle t(tensors[k]);
    if (get_attr(t, names().layout).ptr() != names().strided) {
      route[e] = false;
      continue;
    }
    std::vector<std::int64_t> size = int_tuple(call_method(t, names().size));
    std::vector<std::int64_t> stride = int_tuple(call_method(t, names().stride));
    if (!non_overlapping_and_dense(size, stride)) {
      route[e] = false;
    } else if (!seen[e]) {
      seen[e] = true;
      sizes[e] = std::move(size);
      strides[e] = std::move(stride);
    } else if (size != sizes[e]) {
      route[e] = false;
    } else {
      for (std::size_t d = 0; d < size.size(); ++d)
        if (size[d] != 1 && stride[d] != strides[e][d]) route[e] = false;
    }
  }
  return route;
}

// ops.PER_ELEMENT_*: the values mode.py's classifier gives (ops.py).
constexpr int kPerElementNone = 0, kPerElementReduction = 2;

int LiveSession::elements_of(const FuncInfo& known, PyObject* args, PyObject* kwargs, std::vector<int>* element) const {
  element->clear();
  if (known.per_element == kPerElementNone) return 0;
  // torch's CUDA per-tensor reductions size their partial sums by the whole
  // list (ops.py, PER_ELEMENT_REDUCTION): not split there.
  if (options_.fused_foreach && known.per_element == kPerElementReduction) return 0;
  auto* tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type_.ptr());
  Py_ssize_t n = -1;
  std::vector<Py_ssize_t> scalar_lists;  // lengths of the lists without tensors (Scalar[])
  std::vector<PyObject*> tensors, scalars;
  // One argument, as for_each_tensor walks it (a list's items in order).
  auto argument = [&](PyObject* o) {
    if (PyObject_TypeCheck(o, tensor_type)) {
      element->push_back(-1);
      tensors.push_back(o);
      return true;
    }
    if (!PyList_CheckExact(o) && !PyTuple_CheckExact(o)) return true;  // a scalar, None, a dtype...
    const Py_ssize_t m = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    bool any_tensor = false;
    for (Py_ssize_t k = 0; k < m; ++k) any_tensor = any_tensor || PyObject_TypeCheck(items[k], tensor_type);
    if (!any_tensor) {
      for (Py_ssize_t k = 0; k < m; ++k) {
        if (PyList_Check(items[k]) || PyTuple_Check(items[k])) return false;  // nested: not a Scalar[]
        scalars.push_back(items[k]);
      }
      scalar_lists.push_back(m);
      return true;
    }
    if (n >= 0 && m != n) return false;  // Tensor[] arguments of different lengths
    n = m;
    for (Py_ssize_t k = 0; k < m; ++k) {
      if (!PyObject_TypeCheck(items[k], tensor_type)) return false;  // a None in a Tensor?[]
      element->push_back(static_cast<int>(k));
      tensors.push_back(items[k]);
    }
    return true;
  };
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(args); ++i) ok = argument(PyTuple_GET_ITEM(args, i));
  if (ok && kwargs) {
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (ok && PyDict_Next(kwargs, &pos, &key, &value)) ok = argument(value);
  }
  for (Py_ssize_t m : scalar_lists) ok = ok && m == n;
  if (!ok || n < 2) {
    element->clear();
    return 0;
  }
  if (options_.fused_foreach) {
    // torch takes its fused kernel for a whole list or its per-tensor loop;
    // one element must take the kernel the list took (ForeachUtils.h,
    // check_fast_path_restrictions). What decides it for the whole list and
    // not per element: one dtype and one device for all the tensors, and
    // scalars of one kind; then what each element passes or fails on its
    // own (fused_route_at): all must pass, or all fail.
    PyObject* dtype = nullptr;
    std::int64_t device = -2;
    for (PyObject* t : tensors) {
      py::object d = get_attr(t, names().dtype);
      const std::int64_t index = as_int(call_method(t, names().get_device));
      if (!dtype) {
        dtype = d.ptr();
        device = index;
      } else if (d.ptr() != dtype || index != device) {  // dtypes are singletons
        ok = false;
        break;
      }
    }
    for (PyObject* x : scalars) ok = ok && Py_TYPE(x) == Py_TYPE(scalars.front());
    if (ok) {
      const std::vector<bool> route = fused_route_at(tensors, *element, static_cast<int>(n));
      for (bool r : route) ok = ok && r == route.front();
    }
    if (!ok) {
      element->clear();
      return 0;
    }
  }
  return static_cast<int>(n);
}

py::tuple LiveSession::written_by(const FuncInfo& known, PyObject* args, PyObject* kwargs) const {
  PyObject* tensor_type = tensor_type_.ptr();
  auto argument = [&](int i, PyObject* name) { return argument_of(args, kwargs, i, name); };
  py::list out;
  auto add = [&](PyObject* value) {
    if (!value) return;
    if (PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(tensor_type))) {
      out.append(py::handle(value));
    } else if (PyList_Check(value) || PyTuple_Check(value)) {
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(value);
      PyObject** items = PySequence_Fast_ITEMS(value);
      for (Py_ssize_t k = 0; k < n; ++k)
        if (PyObject_TypeCheck(items[k], reinterpret_cast<PyTypeObject*>(tensor_type))) out.append(py::handle(items[k]));
    }
  };
  for (std::size_t k = 0; k < known.write_pos.size(); ++k) add(argument(known.write_pos[k], known.write_kw[k].ptr()));
  if (known.undeclared_stats) {
    static PyObject* const names[] = {PyUnicode_InternFromString("running_mean"),
                                      PyUnicode_InternFromString("running_var"),
                                      PyUnicode_InternFromString("training")};
    PyObject* training = argument(5, names[2]);
    const int on = training ? PyObject_IsTrue(training) : 0;
    if (on < 0) throw py::error_already_set();
    if (on) {
      for (int i : {3, 4}) {
        PyObject* v = argument(i, names[i - 3]);
        if (v && PyObject_TypeCheck(v, reinterpret_cast<PyTypeObject*>(tensor_type))) out.append(py::handle(v));
      }
    }
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  return py::tuple(out);
}

// Empties one of record()'s scratch hash tables: clear() zeroes every
// bucket, as many as the largest op (a foreach update) ever needed, so an
// empty table is left alone.
template <typename Table>
void clear_kept(Table& table) {
  if (!table.empty()) table.clear();
}

// record()'s split of a foreach op by element (elements_of), given the
// inputs it saw (scratch_inputs_) and how many tensors the op returned and
// wrote: the number of elements, or 0 where the call does not split (its
// outputs or writes are not one tensor per element, in element order). Fills
// scratch_by_element_: element i's input values, then those every element reads.
int LiveSession::split_elements(py::handle func, py::handle args, py::handle kwargs, int outputs, int writes) {
  const FuncInfo& known = func_info(func.ptr());
  const int n = elements_of(known, args.ptr(), kwargs && !kwargs.is_none() ? kwargs.ptr() : nullptr, &scratch_element_);
  if (!n) return 0;
  const std::vector<Seen>& inputs = scratch_inputs_;
  if (scratch_element_.size() != inputs.size())
    throw std::logic_error("dtralloc live session: a foreach op's elements and its tensor arguments disagree");
  if ((!scratch_made_.empty() && outputs != n) || (!scratch_written_.empty() && writes != n)) return 0;
  // One element alone must see what the whole op saw: no storage written by
  // two elements (the same tensor twice, two views of one base), nor written
  // by one and read by another (torch's loop would show the second the
  // first's write).
  const std::vector<Seen>& written = scratch_written_;
  if (written.size() != static_cast<std::size_t>(writes)) return 0;  // a value written twice
  if (!written.empty()) {
    std::unordered_map<int, int> written_at;  // value -> its element
    for (const Seen& w : written) written_at.emplace(w.value, w.element);
    for (std::size_t k = 0; k < inputs.size(); ++k) {
      const auto it = written_at.find(inputs[k].value);
      if (it != written_at.end() && it->second != scratch_element_[k]) return 0;
    }
  }
  if (scratch_by_element_.size() < static_cast<std::size_t>(n) + 1) scratch_by_element_.resize(n + 1);
  for (int e = 0; e <= n; ++e) scratch_by_element_[e].clear();
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    const int e = scratch_element_[k];
    scratch_by_element_[e < 0 ? n : e].push_back(inputs[k].value);
  }
  return n;
}

void LiveSession::record(py::handle func, py::handle args, py::handle kwargs, py::handle out, py::handle writes,
                         std::uint32_t flags, int pin, double cost, py::handle rng) {
  flush_deaths();
  ++stats_.ops;
  engine_->tick();
  PyObject* tensor_type = tensor_type_.ptr();
  // 1. What the op read: each tensor argument's storage and value. The
  // scratch vectors are members, kept between calls for their capacity
  // (record() is never re-entered: what it calls out to only queues deaths).
  std::vector<Seen>& inputs = scratch_inputs_;
  std::vector<Seen>& written = scratch_written_;
  std::vector<Made>& made = scratch_made_;
  inputs.clear();
  written.clear();
  struct ClearMade {  // made holds references: never keep them past the call
    std::vector<Made>& m;
    ~ClearMade() { m.clear(); }
  } clear_made{made};
  // A tensor without a storage the session can own (sparse, mkldnn) is not
  // one of its values; an op reading one cannot be rerun from the registry,
  // so what it makes and writes is pinned (kOpaque).
  bool reads_opaque = false;
  auto see = [&](PyObject* t) {
    py::object storage = storage_or_none(t);
    if (storage.is_none()) {
      reads_opaque = true;
      return;
    }
    const auto cdata = cdata_of(storage);
    int v = value_of(storage, cdata);
    if (v < 0) v = external_value(t, storage, cdata);
    inputs.push_back({t, v});
  };
  for_each_tensor(args.ptr(), tensor_type, see);
  if (kwargs && !kwargs.is_none()) for_each_tensor(kwargs.ptr(), tensor_type, see);
  written_set_.next(engine_->num_values());
  clear_kept(scratch_writes_on_);
  int write_index = 0;
  for_each_tensor(writes.ptr(), tensor_type, [&](PyObject* t) {
    const int index = write_index++;
    py::object storage = storage_or_none(t);
    if (storage.is_none()) return;
    const int v = value_of(storage, cdata_of(storage));
    if (v < 0) return;
    if (flags & kOverwrites) ++scratch_writes_on_[v];  // written tensors on each value (read_besides_writes)
    if (!written_set_.marked(v)) {
      written_set_.mark(v);
      written.push_back({t, v, index});
    }
  });
  // 2. What it made: output tensors on storages the session has not seen.
  int leaf = 0;
  clear_kept(made_set_);
  for_each_tensor(out.ptr(), tensor_type, [&](PyObject* t) {
    const int index = leaf++;
    py::object storage = storage_or_none(t);
    if (storage.is_none()) return;  // a sparse output: its memory is not a value of the session
    const auto cdata = cdata_of(storage);
    if (by_storage_.count(cdata) || !made_set_.insert(cdata).second)
      return;  // a view of an input, the written tensor, or a second view of a new one
    const auto nbytes = static_cast<std::size_t>(as_int(call_method(storage, names().nbytes)));
    made.push_back({std::move(storage), py::reinterpret_borrow<py::object>(t), cdata, nbytes, index});
  });
  if (made.empty() && written.empty()) {
    mark_op(-1);  // what it launched is no engine op's
    if (options_.chaos) engine_->evict_all();
    return;  // views, detach, scalar reads: nothing for the engine
  }
  // A foreach op whose output i (or i-th written tensor) reads element i of
  // its lists (ops.PER_ELEMENT_*): each gets a recipe of its element's
  // inputs, not of all of them (n outputs x 2n inputs an optimizer step).
  const int elements =
      !reads_opaque && made.size() + written.size() > 1 ? split_elements(func, args, kwargs, leaf, write_index) : 0;
  if (elements) ++stats_.split_foreach_ops;
  auto reads_of = [&](int element) -> const std::vector<int>* {
    if (!elements) return nullptr;
    scratch_reads_ = scratch_by_element_[element];
    const std::vector<int>& every = scratch_by_element_[elements];
    scratch_reads_.insert(scratch_reads_.end(), every.begin(), every.end());
    return &scratch_reads_;
  };
  // Each op, by ordinal, for the steps after this one (Note [recent steps]).
  const std::size_t ordinal = step_funcs_.size();
  const bool noting = (lifetimes_on_ || timer_) && ordinal < kLifetimeOps;
  if (noting) {
    lifetimes_in_.follow(ordinal, func.ptr());
    costs_in_.follow(ordinal, func.ptr());
    step_funcs_.push_back(func.ptr());
  }
  // 3. The engine's protocol, all at once: the op has already run.
  OpCall& call = scratch_call_;
  call.reads.clear();
  call.writes.clear();
  call.random = (flags & kRandom) != 0;
  read_set_.next(engine_->num_values());
  for (const Seen& s : inputs)
    if (!read_set_.marked(s.value)) {
      read_set_.mark(s.value);
      call.reads.push_back(s.value);
    }
  for (const Seen& w : written) call.writes.push_back(w.value);
  const int op = engine_->begin_op(call);
  assert(!noting || static_cast<std::size_t>(op) == ordinal);  // every recorded op is an engine op, in order
  if (timer_) cost = provisional_cost(op, func.ptr(), simulated_timing_ ? simulated_launch_ns_ : cost);
  const auto reason = reads_opaque && pin == 0 ? PinReason::kOpaque : static_cast<PinReason>(pin);
  // What the op writes in place is pinned as what it makes is, except for an
  // op pinned only for writing (kSideEffects: its writes are its recipe;
  // what it makes besides them is not). Rerunning a collective's in-place
  // write would launch it on this rank alone; a nondeterministic one's would
  // write other bits.
  const bool pins_writes = reads_opaque || (reason != PinReason::kNone && reason != PinReason::kSideEffects);
  // Where each written value is first among the op's tensor arguments (its
  // ref in the recipe; a foreach update writes hundreds), and, for an op
  // whose writes may overwrite, how many of them are on it: more than the
  // tensors written there, and the op reads it through another argument.
  std::unordered_map<int, int>& first_read = scratch_first_read_;
  std::unordered_map<int, int>& on_written = scratch_on_written_;
  clear_kept(first_read);
  clear_kept(on_written);
  if (!written.empty())
    for (std::size_t k = 0; k < inputs.size(); ++k)
      if (written_set_.marked(inputs[k].value)) {
        first_read.emplace(inputs[k].value, static_cast<int>(k));
        if (flags & kOverwrites) ++on_written[inputs[k].value];
      }
  auto read_besides_writes = [&](int v) { return on_written[v] > scratch_writes_on_[v]; };
  std::vector<int>& recomputable = scratch_recomputable_;
  recomputable.clear();
  try {
    for (const Made& m : made) {
      std::uintptr_t addr = 0;
      bool foreign = false;
      if (options_.cuda && m.nbytes) {
        addr = static_cast<std::uintptr_t>(as_int(call_method(m.storage, names().data_ptr)));
        foreign = !pool_->owns(reinterpret_cast<void*>(addr));
      }
      const int v = engine_->add_output(op, m.nbytes, addr, reason != PinReason::kNone, foreign, reads_of(m.out_index));
      Slot& s = slot(v);
      s.pin = foreign ? PinReason::kForeign : reason;
      s.out_index = m.out_index;
      watch(v, m.storage, m.cdata);
      if (noting && lifetimes_on_ && m.nbytes) made_at_.push_back({ordinal, m.nbytes, s.watch});
      if (!engine_->value(v).pinned) recomputable.push_back(v);
    }
    for (const Seen& w : written) {
      // An overwriting op reads the old contents after all where another of
      // its arguments is on the written storage (torch.add(x, y, out=x)).
      const bool reads_old = !(flags & kOverwrites) || read_besides_writes(w.value);
      const int n = engine_->write(op, w.value, reads_old, reads_of(w.element));
      if (pins_writes) engine_->pin(n);  // as the op's outputs are (opaque: its recipe would need that tensor)
      Slot& s = slot(n);  // first: it may grow slots_
      Slot& old = slots_[w.value];
      // The storage now holds the new version: its watch moves over; the
      // old version keeps its recipe, for the recipes that read it. Its
      // saved handles (and those riding on it) read the storage as it is
      // now, as autograd reads a tensor it saved that another tensor wrote
      // through (each handle checks its own tensor's version first): they
      // ride on the new version, and the registry keeps owning the storage
      // for them. Without them the program holds it (it just wrote through
      // it), and it dies when the program lets go.
      // Only a storage's newest version is ever written (by_storage_ names
      // it; an older one recomputed lives in a storage only the registry holds).
      if (old.next >= 0)
        throw std::logic_error("dtralloc live session: value " + std::to_string(w.value) +
                               " written in place again after value " + std::to_string(old.next) + " replaced it");
      old.next = n;
      if (!old.saved.empty()) note_versions(old.saved, writes, (flags & kVersionsBumped) != 0);
      s.saved = std::move(old.saved);
      old.saved.clear();
      py::object dropped = std::move(old.storage);
      if (!s.saved.empty()) s.storage = std::move(dropped);
      s.external = std::move(old.external);
      // Memory outside the session stays so, pinned for the reason it was
      // (RematEngine::write).
      s.pin = engine_->value(n).external       ? old.pin
              : reads_opaque                   ? PinReason::kOpaque
              : pins_writes                    ? reason
                                               : PinReason::kNone;
      if (old.watch) {
        watched_[old.watch.ptr()] = n;
        s.watch = std::move(old.watch);
      }
      s.cdata = old.cdata;
      old.cdata = 0;
      by_storage_[s.cdata] = n;
      old.overwritten = true;
      const auto ref = first_read.find(w.value);
      s.write_ref = ref == first_read.end() ? -1 : ref->second;
      if (!engine_->value(n).pinned) recomputable.push_back(n);
    }
  } catch (const OutOfMemoryError&) {
    engine_->end_op(op, cost);  // the op's values unlocked; its outputs die with the exception
    throw;
  }
  sample_op(op, func, flags);  // as the replay samples: outputs allocated, inputs still locked
  engine_->end_op(op, cost);  // on a GPU the clock's cost stands until the GPU's arrives (mark_op)
  mark_op(op);
  for (int r : call.reads) own_for_recipes(r);
  // How often owned values are polled: often enough that memory the program
  // let go of is not held much longer than a few hundred ops, rarely enough
  // to cost nothing per op.
  constexpr std::size_t kPollEvery = 256;
  if (++ops_since_poll_ >= kPollEvery) poll_owned();
  // 4. The recipe, if anything it made can be recomputed.
  if (!recomputable.empty()) {
    auto rec = std::make_unique<LiveOp>();
    rec->func = py::reinterpret_borrow<py::object>(func);
    rec->flags = flags;
    rec->rng = py::reinterpret_borrow<py::object>(rng);
    rec->recipes = static_cast<int>(recomputable.size());
    if (elements) {
      rec->elements = elements;
      rec->element = scratch_element_;
    }
    rec->refs.reserve(inputs.size());
    bool described = true;  // every input's geometry read (a legacy nested tensor has no sizes)
    for (const Seen& s : inputs) {
      ArgRef r;
      r.value = s.value;
      py::handle t(s.tensor);
      const Slot& slot = slots_[s.value];
      const bool is_written = written_set_.marked(s.value);
      if (slot.external.ptr() == s.tensor && !is_written) {  // held by the slot: the same object at recompute
        r.external = slot.external;
        r.version = as_int(get_attr(t, names().version));
        rec->refs.push_back(std::move(r));
        continue;
      }
      if (!Geometry::try_of(t, &r.geometry)) {
        described = false;
        break;
      }
      // The version recompute checks is the slot's tensor's (live_recompute.cpp):
      // read that one here too. A tensor on the same storage may count its own
      // versions: unsafe_split's and unsafe_chunk's outputs, `.data`.
      if (slot.pin == PinReason::kExternal && slot.external)
        r.version = as_int(get_attr(slot.external, names().version));
      rec->refs.push_back(std::move(r));
    }
    if (!described) {  // no recipe can rebuild its inputs: what it made and wrote is pinned
      for (int v : recomputable) {
        engine_->pin(v);
        slots_[v].pin = PinReason::kOpaque;
      }
    } else {
      for (int v : recomputable) slots_[v].counted = true;
      for (std::size_t k = 0; k < inputs.size(); ++k)  // the arguments it writes (a tensor's value is its storage's)
        if (written_set_.marked(inputs[k].value)) rec->written.push_back(static_cast<int>(k));
      rec->args = template_of(args);
      rec->kwargs = kwargs && !kwargs.is_none() ? template_of(kwargs) : empty_kwargs_;
      if (static_cast<std::size_t>(op) >= ops_.size()) ops_.resize(op + 1);
      ops_[op] = std::move(rec);
    }
  }
  if (!mirror_) peak_reserved_bytes_ = std::max(peak_reserved_bytes_, pool_->usage().reserved);
  if (options_.chaos) engine_->evict_all();
  pool_->set_op_stamp(op + 1);
  if (mirror_ && !publishing_ && op + 1 == static_cast<int>(kPublishAfterOps)) start_publishing();
  publish_counts();
  if (options_.check_invariants) check_invariants();
}

// CUDA: marks the end of `op`'s launches on the current stream, and hands
// the engine every op cost the GPU has measured since (op_timer.h).
void LiveSession::mark_op(int op) {
  if (!timer_ || !timer_->active()) return;
  const std::size_t remats = engine_->counters().remats;
  const bool clean = remats == remats_at_mark_;  // no recompute launched since the last mark
  remats_at_mark_ = remats;
  void* stream = nullptr;  // the simulated GPU's one stream
  if (!simulated_timing_) {
    PyObject* raw = PyObject_CallOneArg(current_stream_.ptr(), device_index_.ptr());
    if (!raw) throw py::error_already_set();
    stream = PyLong_AsVoidPtr(raw);
    Py_DECREF(raw);
    if (!stream && PyErr_Occurred()) throw py::error_already_set();
  }
  if (timer_->mark(op, reinterpret_cast<Stream>(stream), clean)) collect_gpu_costs();
}

// ---- eviction and reports ---------------------------------------------------------

// One sample per recorded engine op: the replay's columns (op_series.h) plus
// the op's phase and name: one pool lock for the counters and the largest
// free block (O(streams x log blocks)), one call for the phase, and under a
// budget a walk of the resident values for the evictable bytes.
void LiveSession::sample_op(int op, py::handle func, std::uint32_t flags) {
  if (series_.size() >= options_.series_ops) {
    if (options_.series_ops) {  // full: the event log stops with the series
      engine_->set_event_log(nullptr);
      evictor_->set_event_log(nullptr);
    }
    ++stats_.series_dropped;
    return;
  }
  FuncInfo& known = func_info(func.ptr());
  if (known.name < 0) {
    op_names_.push_back(py::str(func));
    known.name = static_cast<std::int32_t>(op_names_.size() - 1);
  }
  series_name_.push_back(known.name);
  series_phase_.push_back(static_cast<std::uint8_t>(phase_of(flags)));
  // As the replay: evictable bytes only where something can be evicted (a
  // budget, or chaos); the walk of the resident values is the sample's one
  // cost that grows with the model.
  series_.add(op, pool_->sample(), may_evict() ? engine_->evictable_resident_bytes() : 0);
}

bool LiveSession::may_evict() const {
  return options_.chaos || pool_->budget_bytes() < pool_->capacity_bytes();  // no budget: the capacity
}

// The phase of the op being recorded. What the session knows: grad mode,
// and whether autograd's engine is running a backward on this thread (a
// graph task). Grad mode on: forward (the next step's forward too). Grad
// mode off inside a graph task: backward. Grad mode off outside one: the
// optimizer once a backward has run since the last forward op (optimizer
// steps run under no_grad), else forward (no_grad code before any backward,
// such as evaluation). The graph task is asked only with grad mode off (a
// call per op saved in the forward), so a backward with create_graph=True,
// which runs with grad mode on, counts as forward.
Phase LiveSession::phase_of(std::uint32_t flags) {
  if (flags & kGradEnabled) {
    backward_seen_ = false;
    return Phase::kForward;
  }
  PyObject* r = PyObject_CallNoArgs(graph_task_id_.ptr());
  if (!r) throw py::error_already_set();
  const long task = PyLong_AsLong(r);
  Py_DECREF(r);
  if (task >= 0) {
    backward_seen_ = true;
    return Phase::kBackward;
  }
  return backward_seen_ ? Phase::kOptimizer : Phase::kForward;
}

// The evictions and remats since the last call reach `dtralloc top` (the
// publisher adds them to its frames); nothing is done while none happened.
void LiveSession::publish_counts() {
  const EngineCounters& c = engine_->counters();
  if (c.evictions == published_evictions_ && c.remats == published_remats_) return;
  pool_->add_published_counts(static_cast<std::int64_t>(c.evictions - published_evictions_),
                              static_cast<std::int64_t>(c.remats - published_remats_));
  published_evictions_ = c.evictions;
  published_remats_ = c.remats;
}

std::size_t LiveSession::evict_all() {
  flush_deaths();
  const std::size_t before = engine_->counters().evictions;
  engine_->evict_all();
  publish_counts();
  return engine_->counters().evictions - before;
}

std::string LiveSession::oom_report(std::size_t request_bytes, const char* what) {
  // Resident bytes nothing can evict now, by why.
  std::size_t locked = 0, held = 0, dependents = 0, values = 0;
  std::vector<std::size_t> pinned(static_cast<std::size_t>(PinReason::kResizedCopy) + 1, 0);
  for (int v : engine_->resident()) {
    const Value& x = engine_->value(v);
    const Slot& s = slots_[v];
    const bool outside = mirror_ && x.external;  // the mirror holds no external value
    if (!outside) values += x.nbytes;
    if (outside || engine_->evictable(v)) continue;
    if (x.pinned && s.pin != PinReason::kNone)
      pinned[static_cast<std::size_t>(s.pin)] += x.nbytes;
    else if (x.pinned)
      dependents += x.nbytes;
    else if (x.locks > 0)
      locked += x.nbytes;
    else
      held += x.nbytes;
  }
  const StatsReport r = pool_->stats_report();
  const std::size_t reserved = static_cast<std::size_t>(r.stats.reserved_bytes[kStatAll].current);
  const std::size_t allocated = static_cast<std::size_t>(r.stats.allocated_bytes[kStatAll].current);
  const std::size_t budget = pool_->budget_bytes();
  std::ostringstream m;
  if (request_bytes) {
    m << "Tried to allocate " << format_bytes(request_bytes);
    if (what) m << ' ' << what;
    m << ". ";
  }
  m << "Under the dtr budget of " << format_bytes(budget) << " ("
    << (options_.cuda ? "the pool's reserved bytes" : "a virtual pool mirroring the session's storages")
    << ", policy " << policy_name(options_.policy) << "), nothing more could be evicted. Reserved "
    << format_bytes(reserved) << ", allocated " << format_bytes(allocated) << ", largest free block "
    << format_bytes(r.largest_free_bytes) << " of " << format_bytes(r.free_cached_bytes) << " free. ";
  // Note [The device is the limit] (docs/allocator.md). Once the device
  // has refused a segment, it says so where it is short of the budget now:
  // in a long-lived process the budget may be what limits a later request.
  const bool device_limited = !mirror_ && pool_->device_limited();
  const std::size_t device_free = device_limited ? pool_->device_free_bytes() : 0;
  if (device_limited && reserved + device_free < budget)
    m << "The device itself is short of the budget: it has " << format_bytes(device_free)
      << " free of its " << format_bytes(pool_->capacity_bytes())
      << " (its CUDA context, other processes or memory allocated outside torch hold the rest), so "
         "the pool can reserve no more than that. ";
  // Where a new segment is what the request lacks: the budget's room for
  // one, and, where the budget is below the smallest segment the request
  // can get at all, that cause first (the pool reserves in segments, never
  // less than kSmallBuffer, 2 MiB: block_pool.h).
  if (request_bytes) {
    const std::size_t segment = pool_->smallest_segment(BlockPool::round_size(request_bytes, pool_->config()));
    const std::size_t room = budget > reserved ? budget - reserved : 0;
    if (segment > budget) {
      m << "The budget is smaller than the smallest segment this request can get (" << format_bytes(segment)
        << "; the pool reserves memory in segments of at least " << format_bytes(kSmallBuffer) << "): no eviction can make room for it. "
           "Raise the budget to at least "
        << format_bytes(segment) << " plus what the program keeps. ";
    } else if (room < segment) {
      m << "A new segment for it takes " << format_bytes(segment) << "; the budget has " << format_bytes(room)
        << " left. ";
    }
  }
  m << "What no eviction can free now:";
  bool listed = false;
  auto line = [&](std::size_t bytes, const std::string& why) {
    if (bytes) m << "\n  " << format_bytes(bytes) << ": " << why;
    listed = listed || bytes;
  };
  line(held, "held by the program (tensors your code, an optimizer or autograd still references)");
  line(locked, "in use by the op in flight or a recompute");
  for (std::size_t i = 1; i < pinned.size(); ++i)
    if (!(static_cast<PinReason>(i) == PinReason::kExternal && mirror_))
      line(pinned[i], std::string("not recomputable: ") + pin_doc(static_cast<PinReason>(i)));
  line(dependents, "not recomputable: they depend on a value overwritten in place");
  // Allocated bytes that are no value's own (evictable or not): sizes
  // rounded up and block tails left unsplit (with small_in_large off a large
  // block keeps a tail of up to 1 MiB: Note [large tails]), and on CUDA what
  // the pool serves outside the session.
  if (allocated > values)
    line(allocated - values, mirror_ ? "allocated beyond the tensors' own bytes (sizes rounded up, block tails under 1 MiB "
                                       "that a large block keeps rather than split off where small_in_large is off)"
                                     : "allocated but no value of the session (tensors made outside it or by other code, "
                                       "sizes rounded up, block tails too small to split off)");
  if (!listed) m << " nothing.";
  m << "\nTo fit: raise the budget (dtr(budget=...)), lower the batch size, drop references to "
       "intermediate tensors you keep (lists of outputs, losses kept with their graph), or keep "
       "parameters and optimizer state out of the budget.";
  return m.str();
}

py::dict LiveSession::stats() {
  flush_deaths();
  poll_owned();
  const EngineCounters& c = engine_->counters();
  const EvictorStats& e = evictor_->stats();
  const StatsReport r = pool_->stats_report();
  py::dict d;
  d["evictions"] = c.evictions;
  d["remats"] = c.remats;
  d["rng_replays"] = c.random_replays;
  d["fake_deletions"] = c.fake_deletions;
  d["hold_restarts"] = c.hold_restarts;
  d["eviction_calls"] = e.calls;
  d["no_plan"] = e.no_plan;
  d["large_windows"] = e.large_windows;
  d["ruinous_spared"] = e.ruinous_spared;
  d["ops"] = stats_.ops;
  d["saved"] = stats_.saved;
  d["unpacked"] = stats_.unpacked;
  d["recompute_seconds"] = stats_.recompute_seconds;
  d["gpu_timed_ops"] = stats_.gpu_timed_ops;
  d["carried_costs"] = stats_.carried_costs;
  d["compute_overhead"] = c.base_cost > 0 ? c.remat_cost / c.base_cost : 0.0;
  d["op_seconds"] = c.base_cost * 1e-9;  // every recorded op once, as the engine prices them
  // A CPU session without a budget has none: its mirror's budget is the
  // mirror's capacity (16 TiB), which no one set. On CUDA it is the pool's.
  d["budget_bytes"] = mirror_ && pool_->budget_bytes() >= pool_->capacity_bytes() ? 0 : pool_->budget_bytes();
  d["reserved_bytes"] = r.stats.reserved_bytes[kStatAll].current;
  d["allocated_bytes"] = r.stats.allocated_bytes[kStatAll].current;
  d["peak_bytes"] = mirror_ ? static_cast<std::size_t>(r.stats.reserved_bytes[kStatAll].peak) : peak_reserved_bytes_;
  d["peak_allocated_bytes"] = r.stats.allocated_bytes[kStatAll].peak;
  d["policy"] = policy_name(options_.policy);
  d["device"] = options_.cuda ? "cuda:" + std::to_string(options_.device) : std::string("cpu");
  d["chaos"] = options_.chaos;
  d["ooms"] = r.stats.num_ooms - ooms_at_start_;
  d["long_lived"] = r.stats.num_long_lived - long_lived_at_start_;
  // The pool's segments made and given back since the session began (on
  // CUDA cudaMalloc and cudaFree, whose wait for the device is in the time;
  // on CPU the mirror's, which cost nothing).
  d["device_calls"] = r.stats.num_device_alloc + r.stats.num_device_free - device_calls_at_start_;
  d["device_call_seconds"] = static_cast<double>(r.stats.device_alloc_ns + r.stats.device_free_ns - device_ns_at_start_) * 1e-9;
  d["device_pool_waits"] = r.stats.num_device_pool_waits - device_waits_at_start_;
  d["series_ops"] = series_.size();
  d["series_dropped"] = stats_.series_dropped;
  d["resize_copies"] = stats_.resize_copies;
  d["split_foreach_ops"] = stats_.split_foreach_ops;
  d["history_recorded"] = pool_->history_recorded();
  return d;
}

void LiveSession::check_invariants() {
  flush_deaths();
  poll_owned();
  engine_->check_invariants();
  pool_->check_invariants();
  for (int v : engine_->resident()) {
    const Value& x = engine_->value(v);
    const Slot& s = slots_[v];
    if (x.external) continue;
    if (!s.storage && !s.watch && x.nbytes)
      throw std::logic_error("dtralloc live session: resident value " + std::to_string(v) +
                             " has no storage (pin " + std::to_string(static_cast<int>(s.pin)) + ", handles " +
                             std::to_string(s.handles) + ", alive " + std::to_string(x.alive) + ", producer " +
                             std::to_string(x.producer) + ")");
    if (mirror_ && x.addr && !mirror_->owns(reinterpret_cast<void*>(x.addr)))
      throw std::logic_error("dtralloc live session: resident value " + std::to_string(v) +
                             " has no block in the mirror pool (3.6)");
  }
  // The newest version of each storage lists the handles of every version
  // of it, each at its index; older versions list none.
  std::vector<int> reading(slots_.size(), 0);
  for (std::size_t v = 0; v < slots_.size(); ++v) reading[latest(static_cast<int>(v))] += slots_[v].handles;
  for (std::size_t v = 0; v < slots_.size(); ++v) {
    const Slot& s = slots_[v];
    const int want = s.next >= 0 ? 0 : reading[v];
    if (s.saved.size() != static_cast<std::size_t>(want))
      throw std::logic_error("dtralloc live session: value " + std::to_string(v) + " lists " +
                             std::to_string(s.saved.size()) + " saved handles, not " + std::to_string(want));
    for (std::size_t i = 0; i < s.saved.size(); ++i)
      if (s.saved[i]->listed != static_cast<int>(i) || latest(s.saved[i]->value) != static_cast<int>(v))
        throw std::logic_error("dtralloc live session: a saved handle of value " + std::to_string(s.saved[i]->value) +
                               " is not where value " + std::to_string(v) + "'s list says");
    // A saved alias holds the storage: only a resident one; without it the
    // handle has its geometry (Note [saved alias]).
    const bool resident = engine_->value(static_cast<int>(v)).state == ValueState::kResident;
    for (const SavedValue* h : s.saved) {
      if (h->alias && !resident)
        throw std::logic_error("dtralloc live session: a saved handle of value " + std::to_string(h->value) +
                               " keeps an alias of the storage of value " + std::to_string(v) + ", which is not resident");
      if (!h->alias && !h->described)
        throw std::logic_error("dtralloc live session: a saved handle of value " + std::to_string(h->value) +
                               " has neither an alias nor its geometry");
    }
  }
}

}  // namespace dtralloc::live
