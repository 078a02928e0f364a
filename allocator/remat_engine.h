// RematEngine: the computation graph DTR needs to evict and recompute.
//
// Map of the structures
// ---------------------
//   values_   every *value* ever produced: a storage's contents at one version.
//             A storage written in place gets a new value (its new version)
//             that takes over the block; the old value keeps its recipe and
//             loses its memory (Coop's recomputable in-place).
//   ops_      every op that ran: cost, random flag, saved RNG state, and the
//             values it read (its recipe inputs, at the versions it read).
//   uf_       union-find over values without memory (evicted or fake-deleted):
//             each class sums the cost of its members, so DTR's e*(t) is
//             cost(t) + the classes of t's memoryless neighbours (h_DTR-eq).
//
// States (Value::state) and flags:
//   kResident    owns exactly one block (Value::addr)
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
//   state == kResident <=> addr != 0 <=> by_addr_[addr] == id      (DESIGN 3.6)
//   evicted/dead-needed values are recomputable (not pinned)
//   no locked value is ever evicted (evict() refuses; counted)     (DESIGN 3.7)
//   needed_by(v) == #unreleased values whose recipe contains v
//   missing(v) == #entries of v's recipe that are not resident (unreleased v)
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace dtralloc {

// Where the engine's memory comes from: the pool (through the Allocator) in
// the drivers, a fake in the unit tests. allocate may evict (re-entering the
// engine through the evictor) and may throw OutOfMemoryError.
class MemoryPort {
 public:
  virtual ~MemoryPort() = default;
  // Memory for `value` (its id tags the pool block for the evictor's walk).
  virtual std::uintptr_t allocate(std::size_t bytes, int value) = 0;
  virtual void release(std::uintptr_t addr) = 0;
};

enum class ValueState : std::uint8_t { kResident, kEvicted, kDeadNeeded, kReleased };

// Hot scalars first, in one 64-byte line: the evictor's address walk and its
// weights read only these, once per block, mostly from cold cache.
struct alignas(64) Value {
  std::size_t nbytes = 0;
  std::uintptr_t addr = 0;       // block while resident; 0 otherwise (or 0-byte)
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
  std::vector<int> recipe;       // values the producer read (at those versions)
  std::vector<int> dependents;   // values whose recipe contains this one
};

struct OpRecord {
  double cost = 0;
  bool random = false;
  std::uint64_t rng_state = 0;   // saved at first run; restored on recompute
  std::vector<int> inputs;       // values read (locked while the op runs)
  std::vector<int> locked;       // everything locked for this op
};

struct EngineCounters {
  std::size_t evictions = 0;
  std::size_t remats = 0;
  std::size_t random_replays = 0;     // recomputes of random ops (RNG restored)
  std::size_t fake_deletions = 0;
  std::size_t releases = 0;
  std::size_t refused_locked = 0;     // evict() calls on locked values (3.7)
  double base_cost = 0;               // cost of every op once
  double remat_cost = 0;              // extra cost of recomputes
};

class RematEngine {
 public:
  explicit RematEngine(MemoryPort& memory) : memory_(memory) {}

  // An initial storage (parameter, input): allocated now, pinned.
  int add_initial(std::size_t nbytes);

  // --- one op: begin, use inputs, create outputs, write in place, end ----
  int begin_op(double cost, bool random);
  // Makes `v` resident (recomputing it and, recursively, its recipe) and
  // locks it for the op. Records it as a recipe input of the op.
  void use_input(int op, int v);
  // The same for all of an op's (distinct) inputs at once: missing ones are
  // recomputed before resident ones are locked (hold()).
  void use_inputs(int op, const std::vector<int>& vs);
  // A new value made by `op`, allocated through the memory port, locked.
  // Its recipe is the op's inputs except `not_read` (values this op
  // overwrites without reading for this output, e.g. batch norm's running
  // statistics).
  int create_output(int op, std::size_t nbytes, const std::vector<int>& not_read = {});
  // `op` writes `v` in place: returns the new version, which takes the block
  // (locked for the op). `v` keeps its recipe without memory, or, if `v` was
  // not recomputable, its dependents become pinned (evicted ones are
  // rematerialized first: call prepare_write before the op writes).
  int write_in_place(int op, int v);
  // Before any allocation of the op: makes sure overwriting `v` loses no
  // value that something alive still needs.
  void prepare_write(int v);
  void end_op(int op);

  // The program dropped its reference to `v`.
  void kill(int v);

  // --- eviction interface (the Evictor) --------------------------------
  bool evictable(int v) const {
    const Value& x = values_[v];
    return x.state == ValueState::kResident && !x.pinned && x.locks == 0 && x.nbytes > 0 &&
           x.producer >= 0;
  }
  // Frees `v`'s block. Returns false (and counts) if `v` is not evictable.
  bool evict(int v);
  // DTR's e*: cost plus the cost of memoryless neighbours.
  double estar_eq(int v);                  // union-find classes (h_DTR-eq)
  double estar_exact(int v, int cap = 256);  // walks the neighbourhood (h_DTR)
  double chain_cost(int v, int cap = 256);   // producer plus evicted ancestors (MSPS)
  int value_at(std::uintptr_t addr) const;   // resident value at addr, or -1
  const std::vector<int>& resident() const { return resident_; }
  // Bytes of resident values no eviction can free now (pinned or locked).
  std::size_t unevictable_resident_bytes() const;

  const Value& value(int v) const { return values_[v]; }
  const OpRecord& op(int o) const { return ops_[o]; }
  std::size_t num_values() const { return values_.size(); }
  std::uint64_t clock() const { return clock_; }
  void tick() { ++clock_; }
  const EngineCounters& counters() const { return counters_; }

  // Frees every block still held (end of a replay).
  void release_all();
  // Throws std::logic_error naming the broken invariant.
  void check_invariants() const;

 private:
  // The walk behind estar_exact and chain_cost (remat_engine.cpp).
  template <typename Counts>
  double reachable_cost(int v, int cap, bool both_ways, Counts counts);
  int new_value(std::size_t nbytes, int producer, double cost);
  void set_recipe(int v, int op, const std::vector<int>& not_read);
  std::uint32_t next_epoch();
  void rematerialize(int v, int depth);
  // Makes every value of `vs` resident and locked (see remat_engine.cpp).
  void hold(const std::vector<int>& vs, int depth);
  void lock(int v) { ++values_[v].locks; }
  void unlock(int v);
  void take_block(int v, std::uintptr_t addr);
  std::uintptr_t drop_block(int v);       // leaves the resident set; returns addr
  void lose_memory(int v);                // into the union-find
  void maybe_release(int v);
  void release(int v);
  void pin_descendants(int v);
  int find(int v);
  void unite(int a, int b);

  MemoryPort& memory_;
  std::vector<Value> values_;
  std::vector<OpRecord> ops_;
  std::vector<int> resident_;
  std::unordered_map<std::uintptr_t, int> by_addr_;
  std::vector<int> uf_parent_;
  std::vector<double> uf_cost_;
  std::vector<std::uint32_t> mark_;  // visit marks of reachable_cost
  std::uint32_t epoch_ = 0;
  std::vector<int> walk_;
  std::uint64_t clock_ = 1;
  std::uint64_t rng_counter_ = 0x9e3779b97f4a7c15ull;
  EngineCounters counters_;
};

}  // namespace dtralloc
