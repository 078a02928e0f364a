// LiveSession: the live driver's C++ half (dtralloc.dtr(); the Python half is
// python/dtralloc/dtr/). It drives the same RematEngine and Evictor as the
// replay, with real storages: one record() call per ATen op registers what the
// op read, made and wrote; pack()/unpack() serve autograd's saved tensors;
// recomputing a value reruns its op in Python; evicting one drops the
// registry's last reference to its storage. docs/live.md has the design.
//
// Map of the structures
// ---------------------
//   slots_        per engine value: the real storage behind it (a strong
//                 reference while the registry owns it: saved by autograd, or
//                 brought back by a recompute), a weak reference that reports
//                 its death, the saved handles that name it (each with a weak
//                 reference to the tensor autograd saved: its version counter)
//   by_storage_   StorageImpl address (_cdata) -> its current value
//   ops_          per engine op with recomputable outputs: the OpOverload and
//                 its arguments with every tensor replaced by a placeholder,
//                 how it saw each tensor (value, dtype, sizes, strides,
//                 offset, version), its RNG state if it is random
//   dead_         values whose storage died (weakref callbacks); applied to
//                 the engine (kill) at the next entry point, never inside the
//                 callback
//
// Ownership. The registry owns (holds the only strong reference the engine
// relies on) a storage while a saved handle names its value, after a
// recompute brought it back, and while a recipe reads a value that cannot be
// recomputed (pinned: its data must outlive the program's references, or the
// values made from it could never come back). Owned pinned values and
// external tensors are polled (poll_owned): once only the registry holds
// one, the engine hears that it died (and keeps its memory while a recipe
// needs it); once no recipe needs it, the registry lets go. A value is evictable only while the registry
// owns it and nobody else holds it: its StorageImpl's use count is 1 (the
// preserved Python storage object) and that object's refcount is 1 (ours).
// Evicting drops that reference: torch frees the storage (on CUDA through
// dtralloc_free, re-entering the pool outside its lock).
//
// Threads. The GIL is the session's lock: every entry point runs with it
// held, and the CUDA eviction hook takes it first (it is called from
// whichever thread allocates, autograd's device threads included). The
// engine is called out of (the runner, a decref) only at the points where
// the replay driver's allocations may evict too, where its state is whole.
#pragma once

#include <pybind11/pybind11.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "allocator.h"
#include "event_log.h"
#include "evictor.h"
#include "op_series.h"
#include "op_timer.h"
#include "recent_steps.h"
#include "remat_engine.h"
#include "simulated_timing.h"

namespace dtralloc::live {

namespace py = pybind11;

// Why a value can never be recomputed (its slot's pin); the OOM message
// reports pinned bytes by these.
#define DTRALLOC_PIN_REASONS(X)                                                                    \
  X(kNone, "")                                                                                     \
  X(kExternal, "made outside the session (parameters, inputs, optimizer state)")                  \
  X(kUnwritten, "empty*() outputs no recorded op has fully written yet")                          \
  X(kExported, "data handed out of the dispatcher (data_ptr, numpy, dlpack)")                     \
  X(kCollective, "outputs of collectives")                                                         \
  X(kPythonData, "made from Python data (torch.tensor)")                                           \
  X(kSideEffects, "outputs of ops that write state besides their outputs")                         \
  X(kNondeterministic, "outputs of ops that are not bitwise deterministic on this device")         \
  X(kForeign, "memory dtralloc's pool does not hold")                                              \
  X(kResized, "storages resized outside the dispatcher (FSDP's reshard and unshard)")              \
  X(kOpaque, "made or written by ops reading tensors with no strided storage (sparse, nested, subclasses)") \
  X(kResizedCopy, "copies of storages resized outside the dispatcher, kept for the recomputes that read them")

enum class PinReason : std::uint8_t {
#define DTRALLOC_PIN_ENUM(e, doc) e,
  DTRALLOC_PIN_REASONS(DTRALLOC_PIN_ENUM)
#undef DTRALLOC_PIN_ENUM
};

// Per-op flags from the Python classifier (dtr/ops.py; the same bits there).
enum OpFlag : std::uint32_t {
  kRandom = 1,          // nondeterministic_seeded: recomputed with the RNG state it first ran with
  kOverwrites = 2,      // its writes replace the whole storage without reading it
  kScratchWrites = 4,   // it writes arguments it does not read for its outputs (batch norm's
                        // running statistics): recomputes pass scratch copies
  kGradEnabled = 8,     // grad mode was on when it ran (some kernels differ: RNN workspaces)
  kVersionsBumped = 16, // the session bumped its written tensors' version counters before
                        // record() (ops.bump_versions); else torch bumps them after it returns
};

// A tensor's dtype and place on its storage. Sizes and strides are exact
// tuples of ints, passed to view() as they are (no conversion either way). A
// recipe lives as long as its outputs, so a step keeps thousands; Python's
// garbage collector untracks an exact tuple of ints at the first collection
// it survives, so full collections do not walk them (a 40,000-op session
// has as many tracked objects as with sizes in C++). A torch.Size would stay
// tracked: Geometry::of copies it.
struct Geometry {
  py::object dtype;             // a torch.dtype: a singleton, nothing allocated
  py::object size, stride;
  std::int64_t offset = 0;
  // torch's lazy conjugate (1) and negative (2) bits: `x.conj()` and
  // `x.conj().imag` are views that only flag their data (Geometry::view sets them again).
  std::uint8_t bits = 0;
  static Geometry of(py::handle tensor);
  static bool is_complex(PyObject* dtype);  // a torch.dtype's is_complex
  // of(), or false where torch gives the tensor no sizes or strides (a
  // legacy nested tensor): nothing can rebuild it from its storage.
  static bool try_of(py::handle tensor, Geometry* g);
  // A tensor with this geometry on `storage`, its lazy bits set.
  py::object view(const py::object& storage) const;
};

struct ArgRef {                 // how an op saw one tensor argument
  int value = -1;               // the storage's value then
  py::object external;          // the external value's own tensor, when the op read that very tensor
                                // (then no geometry is read: the tensor keeps it, its version guards it)
  Geometry geometry;
  std::int64_t version = 0;     // external values: the slot tensor's _version at the op (checked at recompute)
};

struct LiveOp {                 // what recomputing an op's outputs needs
  py::object func, args, kwargs;  // args/kwargs with placeholders for the tensors
  std::vector<ArgRef> refs;
  std::vector<int> written;       // ref indices the op writes in place
  py::object rng;                 // (generator, state) or None
  std::uint32_t flags = 0;
  int recipes = 0;                // unreleased recomputable values it made
  // A foreach op split by element (LiveSession::elements_of): how many, and
  // the element each ref belongs to (-1: read by every element). A value it
  // made or wrote is recomputed by running the op on its element alone.
  int elements = 0;
  std::vector<int> element;
};

struct Slot {
  py::object storage;           // strong: the registry owns the storage
  py::object watch;             // weakref to the storage; its callback reports the death
  py::object external;          // external values: the tensor itself (kept, for versions)
  std::uintptr_t cdata = 0;     // StorageImpl address while the storage lives
  int handles = 0;              // saved handles naming it
  // A storage written in place after a save. The older version's handles
  // read the storage as it is now, as autograd would read the tensor it
  // saved: `next` is the version that replaced this one (-1: none; an old
  // version's link may skip ahead to a newer one, LiveSession::latest).
  int next = -1;
  // The newest version's: every handle reading the storage, its own and
  // those of the older versions (they ride on it). While there is one the
  // registry owns the storage; each recorded write looks at their tensors'
  // versions (LiveSession::note_versions).
  std::vector<struct SavedValue*> saved;
  int out_index = -1;           // which tensor output of its producer (-1: made by a write)
  int write_ref = -1;           // made by a write: the producer's ref it wrote
  PinReason pin = PinReason::kNone;
  bool overwritten = false;     // a recorded in-place write made a newer version
  bool counted = false;         // counted in its producer's LiveOp::recipes
};

// Which part of a training step an op belongs to (the per-op series' phase
// column; LiveSession::phase_of says how it is decided).
enum class Phase : std::uint8_t { kForward = 0, kBackward = 1, kOptimizer = 2 };

struct LiveStats {
  std::size_t ops = 0;              // ops run inside the session (views included)
  std::size_t saved = 0;            // handles handed to autograd
  std::size_t unpacked = 0;
  double recompute_seconds = 0;     // wall time in the runner
  std::size_t gpu_timed_ops = 0;    // ops whose cost the GPU measured (OpTimer)
  std::size_t carried_costs = 0;    // ops first priced by the step before's GPU time (Note [carried costs])
  std::size_t series_dropped = 0;   // engine ops past Options::series_ops, not sampled
  std::size_t resize_copies = 0;    // storages copied before a resize for their readers (keep_for_readers)
  std::size_t split_foreach_ops = 0;  // foreach calls recorded one recipe per element (split_elements)
};

struct Lifetimes;  // live_session.cpp, "what outlives the step"
struct CarriedCosts;  // live_session.cpp, Note [carried costs]

class LiveSession : public std::enable_shared_from_this<LiveSession> {
 public:
  struct Options {
    bool cuda = false;
    int device = 0;
    std::size_t budget_bytes = 0;   // 0: the pool's own (CUDA) / none (CPU)
    std::string conf;               // DTRALLOC_CONF for the CPU mirror pool and the evictor
    Policy policy = Policy::kDtralloc;
    bool chaos = false;
    bool check_invariants = false;
    // The device's foreach ops run a whole list through one fused kernel or
    // through torch's per-tensor loop (CUDA): a call splits by element only
    // where one element alone takes the route the list took (elements_of).
    // Set with `cuda`; tests set it on CPU to run CUDA's rules there.
    bool fused_foreach = false;
    // The per-op series and the event log keep the first `series_ops` ops
    // (0: none recorded); past it they stop (LiveStats::series_dropped).
    std::size_t series_ops = 0;
    std::size_t history_entries = 0;  // CPU: the mirror's history ring (0: the conf's)
  };
  // `helpers`: the Python half's functions (dtr/runner.py): view(storage,
  // dtype, size, stride, offset) -> tensor; run(func, args, kwargs, rng, grad_enabled) ->
  // out; new_storage(nbytes, like_storage_or_None, copy, device) -> storage;
  // use_count(cdata) -> int; version_error(what, now, expected) raises;
  // detached(tensor) -> the tensor outside autograd (an external input a
  // recompute reads); tensor_type (torch.Tensor); device (the session's
  // device string); accessors (the tensor and storage descriptors read per op);
  // next_sequence_nr (torch._C._autograd._get_sequence_nr, or None).
  LiveSession(const Options& options, py::dict helpers);
  ~LiveSession();
  LiveSession(const LiveSession&) = delete;
  LiveSession& operator=(const LiveSession&) = delete;

  // Joins the pool's live sessions (OnPool): its evictor answers the pool's
  // eviction hook, and on CUDA its budget becomes the pool's.
  void start();
  // CPU, before start(): times the session's ops as a CUDA session does, on
  // a simulated GPU that runs `lag_ops` marks behind the host
  // (simulated_timing.h), and prices each op at `launch_ns` until its time
  // arrives, as a CUDA op's clock gives its launch; `carry` false: not at
  // the step before's time either (as before carried costs). Tests and
  // benches of the code that runs on late costs (op_timer.h, Note [carried
  // costs]).
  void simulate_gpu_timer(std::size_t lag_ops, double launch_ns, bool carry);
  // Leaves them (the destructor calls it): the pool's budget is the newest
  // remaining session's, or the pool's own once none is left, and the hook
  // the pool had before goes back. Sessions may stop in any order.
  void stop();
  struct OnPool;
  // How many live sessions `pool` has now (tests; `dtralloc.dtr` docs).
  static std::size_t live_sessions_on(Allocator* pool);
  // The `with` block ended: the mirror stops publishing for `dtralloc top`,
  // the pool's op stamps stop (recording stops with the block).
  void end_block();

  // Before an op that writes `writes` (tensors) runs.
  void before_write(py::handle writes);
  // The mode's __torch_dispatch__: fast ops run, are timed and recorded
  // here; the rest go to the Python slow path (set_dispatch_helpers).
  py::object dispatch(PyObject* func, PyObject* types, PyObject* args, PyObject* kwargs);
  void set_dispatch_helpers(py::object classify, py::object slow, py::object on_error,
                            py::object default_generator);
  // After an op ran: everything it read, made and wrote, in one call.
  void record(py::handle func, py::handle args, py::handle kwargs, py::handle out, py::handle writes,
              std::uint32_t flags, int pin, double cost, py::handle rng);
  // autograd's pack hook: a handle for `tensor`, or None if the session does
  // not manage its storage (the caller then saves the tensor itself).
  py::object pack(py::handle tensor);
  // The saved tensor back (recomputing what is missing).
  py::object unpack(const struct SavedValue& saved);
  void drop_handle(int value);
  // A handle going away leaves its storage's list (Slot::saved).
  void unlist(const struct SavedValue& saved);
  // The data of `tensor` leave the dispatcher: its value is never recomputed.
  void exported(py::handle tensor);
  // `storage` is about to be resized outside the dispatcher
  // (UntypedStorage.resize_): its contents go (live_saved.cpp).
  void resizing(py::handle storage);
  // Values whose storage died since the last entry point go to the engine.
  void flush_deaths();
  // Owned pinned values and external tensors nobody else holds any more are
  // dead (or let go, when no recipe needs them). See Ownership above.
  void poll_owned();

  // Every evictable value evicted now (chaos mode, and tests).
  std::size_t evict_all();
  py::dict stats();
  // `what` ("for an op's output") follows the request's size.
  std::string oom_report(std::size_t request_bytes, const char* what = nullptr);
  void check_invariants();
  bool use_raw_refcount(bool on);
  const Options& options() const { return options_; }
  // What dashboards read: the pool (the CPU mirror or the device's), the
  // per-op series with each op's phase and name (an index into op_names()),
  // and the engine's and evictor's event log.
  Allocator& pool() { return *pool_; }
  const OpSeries& series() const { return series_; }
  const std::vector<std::uint8_t>& series_phase() const { return series_phase_; }
  const std::vector<std::int32_t>& series_name() const { return series_name_; }
  const std::vector<py::object>& op_names() const { return op_names_; }
  const EventLog& events() const { return events_; }

  // The driver side (LiveDriver forwards here).
  std::uintptr_t allocate_mirror(std::size_t bytes, int value);
  void release(int value, std::uintptr_t addr);
  std::uintptr_t recompute(int value, std::size_t bytes);
  bool held_elsewhere(int value) const;
  // The saved aliases holding the storage of `value` (the newest version's
  // handles: Slot::saved), each one reference in its use count.
  std::int64_t aliases(int value) const;
  void forget(int value);
  bool make_room(std::size_t bytes, Stream stream);

 private:
  class Driver;
  class Hook;

  int value_of(py::handle storage_cdata_owner, std::uintptr_t cdata) const;
  int external_value(py::handle tensor, py::handle storage, std::uintptr_t cdata);
  py::object template_of(py::handle x) const;
  py::object fill(py::handle x, const py::list& tensors, std::size_t* next) const;
  void watch(int value, py::handle storage, std::uintptr_t cdata);
  void unwatch(int value);
  Slot& slot(int value);
  // The newest version of `value`'s storage (`value` itself if nothing
  // wrote it since); shortens the links it walks.
  int latest(int value);
  // A recorded op wrote (`writes`, its written tensors) the storage these
  // handles read: the handles whose saved tensors' version counters it
  // moves note the counter and hold their inputs (SavedValue::seen, held).
  void note_versions(const std::vector<SavedValue*>& handles, py::handle writes, bool bumped);
  py::object storage_of(int value) const;
  std::int64_t use_count(std::uintptr_t cdata) const;
  [[noreturn]] void version_error(py::handle what, std::int64_t now, std::int64_t expected);
  void own_for_recipes(int value);
  // Before `storage` (value `v`, pinned) is resized away: where a copy of
  // its contents pins less than its readers would, the recipes that read it
  // read a copy instead (live_saved.cpp).
  void keep_for_readers(int v, py::handle storage);
  // Whether anything is ever evicted: a budget below the pool's capacity, or chaos.
  bool may_evict() const;
  void sample_op(int op, py::handle func, std::uint32_t flags);
  Phase phase_of(std::uint32_t flags);
  void publish_counts();
  void start_publishing();
  void mark_op(int op);
  static PyObject* storage_died(PyObject* self, PyObject* weakref);
  // long_lived (docs/live.md, "What outlives the step"): the op at `ordinal`
  // is about to run; announce what the newest matching step before kept
  // there (Note [recent steps]).
  bool expect_long_lived(PyObject* func);
  // Where a device's recent steps are kept (lifetimes, carried costs): its
  // index on CUDA, -1 for the CPU (and its simulated GPU).
  int device_key() const;
  void end_lifetimes();  // end_block: what this session kept, for the next one

  Options options_;
  py::object detached_, empty_kwargs_, run_, new_storage_, use_count_fn_, version_error_, tensor_type_, device_,
      watch_callback_;
  // torch._C._autograd._get_sequence_nr (None where torch lacks it): the
  // sequence number the next autograd node will get, on this thread.
  py::object next_sequence_nr_;
  std::unique_ptr<Allocator> mirror_;   // CPU: the virtual pool mirroring the session's storages
  Allocator* pool_ = nullptr;           // the pool the evictor walks (the mirror, or the device's)
  std::unique_ptr<Driver> driver_;
  std::unique_ptr<RematEngine> engine_;
  std::shared_ptr<Evictor> evictor_;
  // A CPU session may time its ops on a simulated GPU (simulate_gpu_timer):
  // the backend whose events timer_ then records (declared first: timer_
  // refers to it), the launch an op is priced at until its time arrives,
  // and whether the session takes the steps before's costs.
  std::unique_ptr<Backend> simulated_timing_;
  double simulated_launch_ns_ = 0;
  bool carry_costs_ = true;
  // CUDA (or the simulated GPU): op costs measured on the GPU (op_timer.h),
  // on the stream torch's current_stream_(device_index_) names;
  // remats_at_mark_ tells an interval a recompute ran in.
  std::unique_ptr<OpTimer> timer_;
  py::object current_stream_, device_index_;
  std::size_t remats_at_mark_ = 0;
  // Note [carried costs]: with a timer, each engine op's cost as the GPU
  // measured it (-1: not yet), and the steps before whose ops this one's
  // have matched so far.
  std::vector<double> gpu_ns_;
  StepsBefore<CarriedCosts> costs_in_;
  // The op's cost until the GPU's arrives: the newest matching step
  // before's for the same op (Note [recent steps]), else the host's clock
  // (`clock`).
  double provisional_cost(int op, PyObject* func, double clock);
  // Hands the engine the costs the GPU has measured since the last call.
  void collect_gpu_costs();
  // This session's GPU costs so far, for the next session on the device.
  std::shared_ptr<const CarriedCosts> measured_costs();
  void take_carried_costs();  // start(): the step before's
  void give_carried_costs();  // end_block(): this step's, so far
  void apply_budget(struct OnPool& on_pool);
  std::shared_ptr<OnPool> on_pool_;  // while started
  bool started_ = false;
  bool raw_refcount_ = false;
  int shared_pyrefs_ = 0;  // runner.shared_storage_pyrefs: torch's references to a shared storage's object (-1: no aliases)
  std::vector<Slot> slots_;
  std::vector<std::unique_ptr<LiveOp>> ops_;
  std::unordered_map<std::uintptr_t, int> by_storage_;
  std::unordered_map<PyObject*, int> watched_;
  std::vector<int> dead_;
  std::vector<int> polled_;             // owned pinned values and external values (poll_owned)
  // record()'s scratch, kept for its capacity.
  struct Seen {
    PyObject* tensor;  // borrowed from the op's arguments
    int value;
    int element = -1;  // written by a split foreach op: its element
  };
  struct Made {
    py::object storage, tensor;
    std::uintptr_t cdata;
    std::size_t nbytes;
    int out_index;
  };
  std::vector<Seen> scratch_inputs_, scratch_written_;
  std::vector<Made> scratch_made_;
  std::vector<int> scratch_recomputable_;
  std::vector<int> scratch_element_;                  // elements_of's answer
  std::vector<std::vector<int>> scratch_by_element_;  // a split op's reads, per element (-1's last)
  std::vector<int> scratch_reads_;                    // one element's reads
  std::unordered_map<int, int> scratch_first_read_;   // a written value's first input index
  std::unordered_map<int, int> scratch_on_written_;   // how many inputs are on a written value
  std::unordered_map<int, int> scratch_writes_on_;    // how many written tensors are on it
  // record()'s sets of the values an op reads and writes (a pass per op
  // over the engine's values), and of the storages it makes, so that an op
  // of hundreds of tensors (a foreach update) is recorded in linear time.
  PassMarks read_set_, written_set_;
  std::unordered_set<std::uintptr_t> made_set_;
  OpCall scratch_call_;
  // What the session knows of each OpOverload it met: the classifier's
  // answer (dispatch) and its name's index in op_names_ (the series).
  struct FuncInfo {
    bool classified = false;
    bool fast = false;
    bool view = false;  // every output aliases an input: run, counted, not recorded
    std::uint32_t flags = 0;
    int pin = 0;
    std::int32_t name = -1;
    py::object call;  // what runs the op: OpOverload._op where __call__ only forwards to it (no Python frame)
    // Not fast, but its writes are all it decides per call (mode.py,
    // _classify_for_c): the positions and names of the arguments it writes,
    // and whether it is a legacy batch norm writing arguments 3 and 4 when
    // argument 5 (training) is true.
    bool writes_here = false;
    std::vector<int> write_pos;
    std::vector<py::object> write_kw;
    bool undeclared_stats = false;
    bool overwrites = false;  // its writes replace the storage without reading it, where they cover it
    bool bumps_versions = false;  // an in-place foreach op: ops.OpInfo.bumps_versions
    // Random (nondeterministic_seeded) and run here: the positions of its
    // dropout_p (random only when that is nonzero) and generator arguments,
    // -1 where it has none.
    bool random_here = false;
    int dropout_pos = -1;
    int generator_pos = -1;
    int per_element = 0;  // ops.PER_ELEMENT_*
  };
  // The tensors `known` writes in this call (ops.written's rule), as a tuple.
  py::tuple written_by(const FuncInfo& known, PyObject* args, PyObject* kwargs) const;
  // The generator a random op draws from (ops.generator_for's rule): its
  // generator argument, else the default generator of its first tensor
  // argument's device; None where there is none to restore (the Python
  // path then decides).
  py::object generator_of(const FuncInfo& known, PyObject* args, PyObject* kwargs) const;
  // Whether writing `t` writes every byte of its storage (ops.covers_storage).
  static bool covers_storage(py::handle t);
  // How a foreach op's call splits by element: the number of elements (0:
  // not split), and into *element the element of each tensor argument in
  // for_each_tensor's order (-1: a single tensor every element reads).
  int elements_of(const FuncInfo& known, PyObject* args, PyObject* kwargs, std::vector<int>* element) const;
  std::vector<bool> fused_route_at(const std::vector<PyObject*>& tensors, const std::vector<int>& element, int n) const;
  int split_elements(py::handle func, py::handle args, py::handle kwargs, int outputs, int writes);
  static py::object one_element(const py::object& x, int n, int element);
  FuncInfo& func_info(PyObject* func);
  py::object grad_fn_name(const py::object& grad_fn);
  std::unordered_map<PyObject*, py::object> grad_fn_names_;  // by node class, kept alive by grad_fn_types_
  std::vector<py::object> grad_fn_types_;
  std::unordered_map<PyObject*, FuncInfo> funcs_;  // kept alive by func_refs_
  std::vector<py::object> func_refs_;
  py::object classify_, slow_, on_error_, grad_enabled_, default_generator_;
  py::object increment_version_;  // torch.autograd.graph.increment_version, looked up at first use
  std::size_t ops_since_poll_ = 0;
  LiveStats stats_;
  std::size_t peak_reserved_bytes_ = 0;
  // The per-op series (sample_op) and the event log the engine and the
  // evictor write (the replay's columns), with per sample the op's phase and
  // name (an index into op_names_, one entry per OpOverload met).
  OpSeries series_;
  std::vector<std::uint8_t> series_phase_;
  std::vector<std::int32_t> series_name_;
  std::vector<py::object> op_names_;
  EventLog events_;
  py::object graph_task_id_;            // torch._C._current_graph_task_id: >= 0 inside backward
  bool backward_seen_ = false;          // a backward op ran since the last grad-mode op outside it
  std::size_t published_evictions_ = 0, published_remats_ = 0;  // what `dtralloc top` has been told
  bool publishing_ = false;             // the CPU mirror has started publishing (start_publishing)
  std::int64_t ooms_at_start_ = 0;      // the pool's OOM count when the session started
  // This session's ops, each recorded op's OpOverload by ordinal (= its
  // engine op index), for the sessions after it: what they learn from it
  // (lifetimes, carried costs) is by ordinal (Note [recent steps]). Noted
  // where either is. Identity only, never dereferenced.
  std::vector<PyObject*> step_funcs_;
  // long_lived: the recent sessions' lifetimes on this device still
  // matching this one, and what this one made (the ordinal, the bytes, a
  // weakref to the storage).
  StepsBefore<Lifetimes> lifetimes_in_;
  bool lifetimes_on_ = false;           // noting what the step keeps (start())
  bool would_place_ = false;            // long_lived on or auto under the dtralloc policy
  struct MadeAt {
    std::size_t ordinal, nbytes;
    py::object watch;
  };
  std::vector<MadeAt> made_at_;
  std::int64_t long_lived_at_start_ = 0;  // the pool's num_long_lived when the session started
  std::int64_t device_calls_at_start_ = 0;  // the pool's num_device_alloc + num_device_free then
  std::int64_t device_ns_at_start_ = 0;     // and its device_alloc_ns + device_free_ns
  std::int64_t device_waits_at_start_ = 0;  // and its num_device_pool_waits (async_segments)
};

// A saved tensor as autograd holds it: the value and the view geometry.
struct SavedValue {
  std::shared_ptr<LiveSession> session;
  int value;
  // The saved tensor's geometry, once `described`: read at the pack where
  // no alias is kept, else from the alias when it goes (Note [saved alias]).
  Geometry geometry;
  bool described = false;
  Geometry geometry_now() const;  // geometry, or the alias's while not described
  std::int64_t version;
  // A weakref to the tensor autograd saved: its version counter is the one
  // torch would check (an in-place write outside the session shows there;
  // other tensors on the storage, such as views the unpack rebuilt, count
  // their own versions).
  py::object tensor;
  // A weakref to its base, where the saved tensor is a view (None
  // otherwise): the base and every view of it share one version counter,
  // and any live view keeps its base alive, so once the saved view itself
  // is gone (a view made for the op, `x[::2].sin()`) the base still tells
  // a write through any of them.
  py::object base;
  // What torch's version error names, with the geometry's dtype and size:
  py::object device, grad_fn_name;  // grad_fn_name unset for a leaf
  // Saved as an output of the node that saved it (exp saves its result),
  // not as an input: torch's error then names that node; for an input it
  // names the tensor's grad_fn at the unpack (an in-place op moved it).
  bool is_output = false;
  std::int64_t output_nr = 0;
  // Once a recorded write moved the saved tensor's version counter, its
  // unpack will raise torch's error, even if the program drops the tensor
  // before the backward (autograd would have kept it): `seen` is the
  // counter after that write (-1: no such write), and a saved input (or its
  // base, the saved view being gone) is held, so that the error names its
  // grad_fn then, as torch's does. An output is not: it would hold the node
  // that holds this handle (torch does not keep outputs for that reason),
  // and the error names that node anyway. Programs that do not misuse
  // in-place ops never get either.
  std::int64_t seen = -1;
  py::object held;
  // A detach() of the saved tensor, made at the pack (Note [saved alias]):
  // it shares the saved tensor's version counter and storage, so while the
  // storage is resident it tells every write torch would see, whoever holds
  // the tensor, and the unpack returns it instead of building a view. Let
  // go when the storage is evicted (LiveSession::release; `seen` keeps its
  // version then) and with the handle. Each one counts once in the
  // storage's use count (LiveSession::aliases).
  py::object alias;
  int listed = -1;  // its index in Slot::saved of the storage's newest version
  // The saved tensor, else its base, whichever is alive (nullptr: neither).
  PyObject* watched() const;
  // What tells the saved tensor's version counter now: the alias, else
  // watched() (nullptr: none; `seen` then).
  PyObject* version_source() const { return alias ? alias.ptr() : watched(); }
  ~SavedValue();
};

}  // namespace dtralloc::live
