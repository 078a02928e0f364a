// RematEngine: the computation graph DTR needs to evict and recompute, and
// the per-op protocol both drivers (trace replay, live PyTorch) call.
//
// The per-op protocol (docs/engine.md has the diagram of who calls whom)
// -------------------------------------------------------------------------
//   op = begin_op(call)           writes prepared; every value the op reads
//                                 made resident (recomputing what is missing,
//                                 on an explicit stack, never by recursion)
//                                 and locked for the op
//   v  = add_output(op, bytes)    a value the op creates, locked; its memory
//                                 comes from the driver (or is adopted: the
//                                 live driver passes the address torch used)
//   n  = write(op, v)             the op writes v in place: n is the new
//                                 version, on v's block
//   end_op(op [, cost])           unlocked; the cost recorded (the live driver
//                                 measures it while the op runs)
//   kill(v)                       the program dropped its last reference
// The engine decides (what to recompute, in which order, what is evictable);
// the driver does the work through RematDriver: memory, recomputing a value
// (the replay places it; the live driver reruns the real op), dropping a
// value's memory (the replay frees a block; the live driver drops the last
// reference to a real storage). Evictions come from the Evictor (evictor.h),
// which the pool asks for room; they may happen inside any driver call that
// allocates, never to a locked value.
//
// Map of the structures
// ---------------------
//   values_   every *value* ever produced: a storage's contents at one version.
//             A storage written in place gets a new value (its new version)
//             that takes over the block; the old value keeps its recipe and
//             loses its memory (Coop's recomputable in-place).
//   ops_      every op that ran: cost, random flag, the values it read (its
//             recipe inputs, at the versions it read) and wrote.
//   uf_       union-find over values without memory (evicted or fake-deleted):
//             each class sums the cost of its members, so DTR's e*(t) is
//             cost(t) + the classes of t's memoryless neighbours (h_DTR-eq).
//
// States (Value::state) and flags:
//   kResident    owns exactly one block (Value::addr), or memory outside the
//                pool (external: the live driver's tensors made before the
//                session, which the budget does not count)
//   kEvicted     alive (the program holds a reference), no block, recomputable
//   kDeadNeeded  no reference left but another value's recipe reads it:
//                memory freed, recipe kept ("fake deletion"). Recomputed
//                for someone else's recompute, it is resident again (dead,
//                evictable) until evicted.
//   kReleased    gone; nothing will ever read it
//   pinned       flag: not recomputable (initial storages, values whose recipe
//                lost an input forever); never evicted
//   locks        flag-count: used by the op in flight (inputs, outputs, writes)
//                or by a recompute in flight; never evicted (DESIGN 3.7)
//
// Invariants (check_invariants):
//   state == kResident && !external <=> addr != 0 (nbytes > 0)    (DESIGN 3.6)
//   addr != 0 <=> by_addr_[addr] == id
//   evicted/dead-needed values are recomputable (not pinned)
//   no locked value is ever evicted (evict() refuses; counted)     (DESIGN 3.7)
//   needed_by(v) == #unreleased, unpinned values whose recipe contains v
//   missing(v) == #entries of v's recipe that are not resident (unreleased v)
//
// Thread safety: none of its own. The replay runs it on one thread; the live
// driver serializes every call under the GIL (dtr/ and docs/live.md).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

namespace dtralloc {

class EventLog;

// What the engine asks its driver to do. allocate and recompute may evict
// (re-entering the engine through the Evictor) and may throw
// OutOfMemoryError; the engine then unwinds what it locked.
class RematDriver {
 public:
  virtual ~RematDriver() = default;
  // Memory for a new value (`value` tags the pool block for the evictor's walk).
  virtual std::uintptr_t allocate(std::size_t bytes, int value) = 0;
  // `value`'s memory is no longer needed (evicted, released or fake-deleted).
  virtual void release(int value, std::uintptr_t addr) = 0;
  // Brings `value` back by rerunning its producer; every value of its
  // recipe is resident and locked. Returns its block. Replaying a trace,
  // running an op is placing its output.
  virtual std::uintptr_t recompute(int value, std::size_t bytes) { return allocate(bytes, value); }
  // Something outside the engine still references the value's memory (the
  // live driver: a user's tensor); such a value is never evicted.
  virtual bool held_elsewhere(int /*value*/) const { return false; }
  // `value` is released for good: nothing will ever read or recompute it
  // (after release(), if it had memory). The live driver drops its recipe.
  virtual void forget(int /*value*/) {}
  // While on, memory for new values comes in segments of its own size (no
  // standard segment with room for more), so that a value locked in one
  // blocks no more than itself; the engine's last resort before an OOM
  // (RematEngine::restart_hold). A driver without a pool of its own ignores it.
  virtual void tight_placement(bool /*on*/) {}
  // `value` was evicted from [addr, addr + bytes) and may be recomputed: its
  // pool spares that room for it (Allocator::keep_home) until drop_home,
  // which comes before its recompute allocates and when it dies. Returns
  // whether the room is kept (no pool, spare_evicted off, small: not), so
  // that only a kept home is dropped.
  virtual bool keep_home(int /*value*/, std::uintptr_t /*addr*/, std::size_t /*bytes*/) { return false; }
  virtual void drop_home(int /*value*/) {}
  // The bytes the engine's values may take (0: no budget binds). What
  // prepare_write weighs the values it would pin against.
  virtual std::size_t budget_bytes() { return 0; }
  // The words an OOM the engine raises itself starts with: torch's " out of
  // memory.", which batch-size finders look for (a live CUDA session's has
  // "CUDA", as torch's own does).
  virtual const char* out_of_memory_text() const { return "dtralloc: out of memory."; }
};

enum class ValueState : std::uint8_t { kResident, kEvicted, kDeadNeeded, kReleased };

// Hot scalars first, in one 64-byte line: the evictor's address walk and its
// weights read only these, once per block, mostly from cold cache.
struct alignas(64) Value {
  std::size_t nbytes = 0;
  std::uintptr_t addr = 0;       // block while resident; 0 otherwise (or 0-byte, or external)
  double cost = 0;               // cost of the producer op (ns, or flops)
  std::uint64_t last_access = 0; // engine clock at last use (staleness)
  int producer = -1;             // op index; -1: initial (no recipe)
  int locks = 0;                 // op / recompute in flight
  int needed_by = 0;             // unreleased values with this in their recipe
  int missing = 0;               // recipe entries not resident (0: recompute runs one op)
  int recomputes = 0;
  int resident_pos = -1;         // index in resident_ while resident
  ValueState state = ValueState::kResident;
  bool alive = true;             // the program still holds a reference
  bool pinned = false;           // not recomputable: never evicted
  bool external = false;         // memory outside the pool (live driver only)
  bool home = false;             // evicted, its room kept by the driver (keep_home said so)
  std::size_t recipe_bytes = 0;  // what the recipe's values take, pinned ones too
  std::vector<int> recipe;       // values the producer read (at those versions)
  std::vector<int> dependents;   // values whose recipe contains this one
};

struct OpRecord {
  double cost = 0;
  bool random = false;
  int first_value = 0;           // values_.size() at begin_op: the op's outputs are at or after it
  std::vector<int> inputs;       // values read (locked while the op runs)
  std::vector<int> writes;       // values written in place (their old versions)
  std::vector<int> locked;       // everything locked for this op
};

// One op as a driver describes it to begin_op.
struct OpCall {
  double cost = 0;               // known up front (replay); else given to end_op
  bool random = false;           // nondeterministic_seeded: recomputed with its first RNG state
  std::vector<int> reads;        // distinct values read
  std::vector<int> writes;       // distinct values written in place (held like reads)
};

// Per-value marks that a new pass clears all at once: v is marked in the
// current pass when at[v] == pass. Nothing is cleared but when the 32-bit
// pass counter wraps (then no stale mark may match the new pass). The
// engine's walks use them, and the live session's record() its per-op sets.
struct PassMarks {
  std::vector<std::uint32_t> at;
  std::uint32_t pass = 0;
  void next(std::size_t values) {  // a new pass, with a slot for each value
    grow(values);
    if (++pass == 0) {
      std::fill(at.begin(), at.end(), 0);
      pass = 1;
    }
  }
  void grow(std::size_t values) {
    if (at.size() < values) at.resize(values, 0);
  }
  bool marked(int v) const { return at[v] == pass; }
  void mark(int v) { at[v] = pass; }
};

struct EngineCounters {
  std::size_t evictions = 0;
  std::size_t remats = 0;
  std::size_t random_replays = 0;     // recomputes of random ops (RNG restored)
  std::size_t fake_deletions = 0;
  std::size_t releases = 0;
  std::size_t refused_locked = 0;     // evict() calls on locked values (3.7)
  std::size_t hold_restarts = 0;      // holds that ran out of memory and started over (hold())
  double base_cost = 0;               // cost of every op once
  double remat_cost = 0;              // extra cost of recomputes
};

class RematEngine {
 public:
  explicit RematEngine(RematDriver& driver) : driver_(driver) {}

  // An initial storage (parameter, input), allocated through the driver now; pinned.
  int add_initial(std::size_t nbytes);
  // An initial storage whose memory the pool does not hold (external); pinned.
  int add_external(std::size_t nbytes);
  // A resident pinned value's memory was taken away by its owner (the live
  // driver: a storage resized outside the dispatcher); from now on it is
  // external, as add_external's. Returns the address it held (0 if none),
  // which the caller frees where it holds it.
  std::uintptr_t make_external(int v);

  // --- the per-op protocol (see the top of this file) ---------------------
  int begin_op(const OpCall& call);
  // `addr` 0 (and nbytes > 0): the driver allocates; else the value adopts
  // memory the driver already holds at `addr`. The recipe is the op's reads
  // except its writes (an op that writes a storage and creates outputs, such
  // as batch norm and its running statistics, does not read what it writes
  // for them); `pinned`: not recomputable at all; `external`: its memory is
  // outside the pool (pinned too, no address). `reads`, where given, is what
  // this output alone was computed from (a subset of the op's reads; a
  // foreach op's output i reads element i of each list): the recipe is that.
  int add_output(int op, std::size_t nbytes, std::uintptr_t addr = 0, bool pinned = false,
                 bool external = false, const std::vector<int>* reads = nullptr);
  // `op` writes `v` in place: returns the new version, which takes the block
  // (locked for the op). `v` keeps its recipe without memory, or, if `v` was
  // not recomputable, what reads it is pinned (begin_op's prepare_write), and
  // so is the new version if it reads `v` or another value the op overwrites
  // for good (reads_other_overwrite). A pinned new version gets no recipe: an
  // optimizer's in-place update of N parameters would otherwise make N
  // recipes of the op's 2N inputs, only to drop them. `reads_old`
  // false: the op overwrites all of `v` without reading it (fill_, copy_,
  // zero_, out=), so the new version's recipe does not need `v`. `reads`:
  // as add_output's (the new version's recipe is that, less `v` where it
  // does not read it).
  int write(int op, int v, bool reads_old = true, const std::vector<int>* reads = nullptr);
  // What begin_op does first for its writes, for drivers that must do it
  // before the real op runs (the live driver: the write destroys the old
  // contents): what reads an unrecomputable value about to be overwritten is
  // brought back and pinned (prepare_write says which). Returns the values
  // it pinned: the live driver owns those that recipes still read. `freed`:
  // the values' memory goes mid-step (a storage resized by its owner, as
  // FSDP2 does), rather than an op overwriting them.
  std::vector<int> prepare_writes(const std::vector<int>& vs, bool freed = false);
  // What prepare_writes({v}, /*freed=*/true) would pin now (their bytes),
  // were `v`'s memory taken away; 0 if `v` stays recomputable.
  std::size_t overwrite_pin_bytes(int v);
  // The values whose recipes read `v` (its dependents not pinned or released):
  // what add_copy moves.
  std::vector<int> copy_readers(int v) const;
  // Instead of pinning what reads the contents of pinned, resident `v` about
  // to be lost (its storage resized away by its owner): a copy, a new value
  // at `addr` (0: the driver allocates it; if that throws, nothing has
  // changed), pinned and dead, that every recipe reading `v` reads in its
  // place (copy_readers: at least one). It goes with the last of them.
  int add_copy(int v, std::uintptr_t addr = 0);
  // Unlocks everything locked for the op. cost >= 0 replaces the cost given
  // to begin_op (the live driver measures it while the op runs).
  void end_op(int op, double cost = -1);
  // The op's cost, measured after end_op (the live driver on a GPU: the op's
  // time there is known only once it has run, well after its launch). Its
  // values, the classes of evicted ones and the cost counters follow.
  void set_cost(int op, double cost);
  // The program dropped its reference to `v`.
  void kill(int v);
  // Makes `v` resident (recomputing as needed) and locks it, outside any op
  // (a saved tensor autograd asks for); unacquire() unlocks it.
  void acquire(int v);
  void unacquire(int v);

  // --- eviction interface (the Evictor) --------------------------------
  bool evictable(int v) const {
    const Value& x = values_[v];
    return x.state == ValueState::kResident && !x.pinned && x.locks == 0 && x.nbytes > 0 &&
           x.producer >= 0 && !driver_.held_elsewhere(v);
  }
  // Frees `v`'s block. Returns false (and counts) if `v` is not evictable.
  bool evict(int v);
  // Evicts every value evictable now (a hold's restart; live chaos mode).
  void evict_all();
  // Spent values (the window policies that say so: PolicyTraits::drop_spent).
  // Inside a hold that recomputes, a value brought back only as a recipe
  // input (the program holds no reference: dead, kept for recomputes) is
  // evicted as soon as the last recompute of the hold that reads it has
  // run, once per value and hold, instead of staying resident until the
  // evictor takes it (remat_engine.cpp, step_remat).
  void set_drop_spent(bool on) { drop_spent_ = on; }
  // Makes `v` not recomputable from now on (its data left the engine's sight:
  // a raw pointer, numpy). Its recipe is dropped.
  void pin(int v);
  // DTR's e*: cost plus the cost of memoryless neighbours.
  double estar_eq(int v);                  // union-find classes (h_DTR-eq)
  double estar_exact(int v, int cap = 256);  // walks the neighbourhood (h_DTR)
  double chain_cost(int v, int cap = 256);   // producer plus evicted ancestors (MSPS)
  int value_at(std::uintptr_t addr) const;   // resident value at addr, or -1
  const std::vector<int>& resident() const { return resident_; }
  // Bytes of resident values no eviction can free now (pinned or locked).
  std::size_t unevictable_resident_bytes() const;
  // Bytes of resident values the evictor may take now.
  std::size_t evictable_resident_bytes() const;
  // Bytes of resident values no eviction will take while they live: pinned
  // ones (parameters, inputs, gradients the step leaves behind, what cannot
  // be recomputed) and those the program holds (held_elsewhere: in a live
  // session, a parameter's .grad, a tensor the user keeps). External values
  // (memory outside the pool) are not counted: the budget does not hold them.
  std::size_t kept_resident_bytes() const;
  // What bringing `v` back would hold at once beside the kept values, were
  // it evicted now: the most any op of its recompute (v's producer and those
  // of its missing ancestors) holds while it runs, its output and its
  // unpinned inputs. `fresh`: forget what earlier calls found; false reuses
  // what calls since begin_need_pass() found, for a batch of calls with no
  // value changing state in between (the evictor's walk), so that ancestors
  // shared by many chains are walked once.
  double recompute_need_bytes(int v, bool fresh = true);
  void begin_need_pass();

  const Value& value(int v) const { return values_[v]; }
  const OpRecord& op(int o) const { return ops_[o]; }
  std::size_t num_values() const { return values_.size(); }
  std::size_t num_ops() const { return ops_.size(); }
  std::uint64_t clock() const { return clock_; }
  void tick() { ++clock_; }
  const EngineCounters& counters() const { return counters_; }
  // Where evictions and recomputes are logged (nullptr: nowhere).
  void set_event_log(EventLog* log) { log_ = log; }
  // The op in flight (or the last one), for event stamps; -1 before any.
  int current_op() const { return static_cast<int>(ops_.size()) - 1; }
  // Whether the recompute in flight, should it run out of memory, is tried
  // once more with what its hold has brought back so far unlocked
  // (step_remat): false outside a recompute, on that second try, and on any
  // thread but the recompute's (another thread's request has no such retry).
  bool recompute_can_retry() const { return retry_left_ && retry_thread_ == std::this_thread::get_id(); }

  // Frees every block still held (end of a replay).
  void release_all();
  // Throws std::logic_error naming the broken invariant.
  void check_invariants() const;

 private:
  // One frame of the explicit stack behind hold(): a set of values being
  // made resident and locked, or one value being recomputed.
  struct Frame {
    bool remat = false;          // false: hold `vs`; true: recompute `v`
    int v = -1;                  // remat: the value; its recipe is `vs`
    int parent_slot = -1;        // remat: the index in the parent hold frame's vs
    bool started = false;        // remat: the recipe's hold frame was pushed
    bool recipe_held = false;    // remat: the recipe is resident and locked
    bool locked_self = false;    // remat: v is locked
    std::vector<int> vs;         // hold: the values; remat: the recipe
    std::vector<char> held;      // hold: vs[i] resident and locked by this frame
    std::vector<int> order;      // hold: this round's missing slots, biggest chain first
    std::size_t next = 0;        // hold: where the scan of `order` resumes
  };

  // The walk behind estar_exact and chain_cost (remat_engine.cpp).
  template <typename Counts, typename Weigh>
  double reachable_cost(int v, int cap, bool both_ways, Counts counts, Weigh weigh);
  // Bytes a recompute of missing `v` brings back (v and its missing
  // ancestors, at most `cap` values); the largest of them into *largest, and
  // into *peak the most one of them and its missing inputs hold at once.
  double chain_bytes(int v, double* largest, double* peak, int cap = 256);
  int new_value(std::size_t nbytes, int producer, double cost);
  // v's recipe: `reads` (nullptr: the op's inputs), each once, except `not_read`.
  void set_recipe(int v, int op, const std::vector<int>& not_read, const std::vector<int>* reads = nullptr);
  // Bytes of the resident values for which pred(v) holds.
  template <typename Pred>
  std::size_t resident_bytes_if(Pred pred) const;
  // Makes every value of `vs` resident and locked, recomputing missing ones
  // (and what they need) on an explicit stack. On an exception every lock it
  // took is released before the exception leaves.
  void hold(const std::vector<int>& vs);
  // hold()'s fallbacks before an OOM: evict everything evictable and start
  // over (restart_hold), and put the placement back when the hold ends.
  void restart_hold();
  void end_hold();
  // drop_spent: counts, for each value, the recomputes of the hold's missing
  // closure (every missing value of `vs` and, through recipes, every missing
  // ancestor) that read it (plan_uses_); clear_plan() zeroes them.
  void plan_hold(const std::vector<int>& vs);
  void clear_plan();
  void spend(const std::vector<int>& recipe);  // a recompute read it (drop_spent)
  void step_hold(std::vector<Frame>& stack);
  void step_remat(std::vector<Frame>& stack);
  void unwind(std::vector<Frame>& stack);
  bool unlock_held(std::vector<Frame>& stack);
  bool any_unlockable(const std::vector<Frame>& stack) const;  // what unlock_held would unlock
  bool unlockable(const Frame& f, std::size_t i) const;
  void prepare_write(int v, std::vector<int>* pinned = nullptr, bool may_bring_back = false);  // appends what it pinned
  // prepare_write's plan, not carried out: what it pins and what it passes
  // through. budget > 0: a dead direct reader may come back (returns true if one does).
  bool plan_write(int v, std::size_t budget, std::vector<int>& pin, std::vector<int>& through);
  void lock(int v) { ++values_[v].locks; }
  void unlock(int v);
  void take_block(int v, std::uintptr_t addr);
  std::uintptr_t drop_block(int v);       // leaves the resident set; returns addr
  void lose_memory(int v);                // into the union-find
  void maybe_release(int v);
  void leave_home(int v);
  void release(int v);
  // Pins `d` (resident, or dead without memory) and drops its recipe;
  // `overwritten` (the value prepare_write is about) is not released here.
  void pin_value(int d, int overwritten);
  std::size_t frontier_bytes(int d);
  bool reads_other_overwrite(int op, int v, const std::vector<int>* reads) const;
  int find(int v);
  void unite(int a, int b);

  RematDriver& driver_;
  EventLog* log_ = nullptr;
  bool in_hold_ = false;
  bool retry_left_ = false;         // recompute_can_retry
  std::thread::id retry_thread_;    // the thread that recompute runs on
  int attempt_ = 0;                 // hold()'s restarts so far (restart_hold)
  // A hold starts over at most twice (restart_hold says why): one try in the
  // usual order, one from an emptied pool, one with tight placement too.
  static constexpr int kHoldAttempts = 3;
  // prepare_write recomputes a dead value to keep its readers evictable only
  // where pinning them would leave more than this share of the budget
  // (RematDriver::budget_bytes) to values no eviction can free.
  static constexpr double kUnevictableShare = 0.5;
  // Recomputes a restarted hold may run per value of the engine before it is
  // called thrashing (restart_hold says why 4).
  static constexpr double kRestartRematsPerValue = 4;
  std::size_t restart_remats_ = 0;  // counters_.remats when the hold last restarted
  std::vector<int> retried_;        // values recomputed again after unlock_held, this hold()
  bool drop_spent_ = false;         // set_drop_spent
  std::vector<int> plan_uses_;      // per value: recomputes left in this hold that read it
  std::vector<int> planned_;        // the values whose plan_uses_ this hold set
  PassMarks dropped_;               // a pass per hold that recomputes: what spend() dropped in it
  std::vector<Value> values_;
  std::vector<OpRecord> ops_;
  std::vector<int> resident_;
  std::unordered_map<std::uintptr_t, int> by_addr_;
  std::vector<int> uf_parent_;
  std::vector<double> uf_cost_;
  PassMarks visited_;               // a pass per walk: reachable_cost, set_recipe, plan_hold
  PassMarks frontier_seen_;         // frontier_bytes' walk (inside prepare_write's)
  PassMarks op_writes_;             // the values the op in flight writes, where it writes two or more
  std::vector<int> walk_;
  // recompute_need_bytes' memo: a value's need, valid while need_done_ marks
  // it in the current pass (begin_need_pass); the explicit stack of its walk.
  std::vector<double> need_;
  PassMarks need_done_;
  std::vector<std::pair<int, std::size_t>> need_stack_;
  std::uint64_t clock_ = 1;
  EngineCounters counters_;
};

}  // namespace dtralloc
