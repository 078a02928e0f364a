// Replay driver: trace -> pool + engine + evictor (replay_driver.h).
#include "replay_driver.h"

#include <algorithm>
#include <memory>
#include <stdexcept>

#include "backend.h"

namespace dtralloc {
namespace {

// Large enough for any recorded trace: only the budget limits the pool.
constexpr std::size_t kVirtualCapacity = std::size_t{1} << 44;
// Recomputes beyond this many per op mean the budget only thrashes; report
// infeasible rather than spin (DTR's own replays use the same kind of cap).
constexpr std::size_t kMaxRematsPerOp = 64;

void check_csr(const std::vector<int>& offsets, const std::vector<int>& values, std::size_t ops,
               std::size_t storages, const char* what) {
  if (offsets.size() != ops + 1 || offsets.front() != 0 ||
      static_cast<std::size_t>(offsets.back()) != values.size())
    throw std::invalid_argument(std::string("replay: malformed CSR column '") + what + "'");
  for (std::size_t i = 0; i < ops; ++i)
    if (offsets[i] > offsets[i + 1])
      throw std::invalid_argument(std::string("replay: offsets of '") + what + "' decrease");
  for (int v : values)
    if (v < 0 || static_cast<std::size_t>(v) >= storages)
      throw std::invalid_argument(std::string("replay: storage id out of range in '") + what + "'");
}

// Cross-check of DESIGN 3.6 against the pool: every resident value's block is
// allocated in the pool, and the pool holds no other allocation.
void check_engine_against_pool(const RematEngine& engine, Allocator& allocator) {
  engine.check_invariants();
  std::size_t blocks = 0;
  for (int v : engine.resident()) {
    const Value& x = engine.value(v);
    if (!x.addr) continue;
    ++blocks;
    if (!allocator.owns(reinterpret_cast<void*>(x.addr)))
      throw std::logic_error("invariant 3.6: a resident value's block is not allocated in the pool");
  }
  const auto allocations = allocator.stats_report().stats.allocation[kStatAll].current;
  if (static_cast<std::size_t>(allocations) != blocks)
    throw std::logic_error("invariant 3.6: the pool holds " + std::to_string(allocations) +
                           " allocations but " + std::to_string(blocks) + " values are resident");
}

}  // namespace

void ReplayTrace::validate() const {
  const std::size_t s = nbytes.size(), n = num_ops();
  if (initial.size() != s || random.size() != n)
    throw std::invalid_argument("replay: per-storage or per-op columns differ in length");
  check_csr(inputs_offsets, inputs, n, s, "inputs");
  check_csr(created_offsets, created, n, s, "created");
  check_csr(mutated_offsets, mutated, n, s, "mutated");
  check_csr(frees_offsets, frees, n, s, "frees");
  for (int v : frees_before)
    if (v < 0 || static_cast<std::size_t>(v) >= s)
      throw std::invalid_argument("replay: storage id out of range in 'frees_before'");
}

ReplayOutcome run_replay(const ReplayTrace& t, const ReplayOptions& options) {
  t.validate();
  Config config = options.config;
  config.budget = Budget{};
  config.budget.bytes = options.budget_bytes;
  config.policy = policy_name(options.policy);  // what the placement's auto keys depend on
  Allocator allocator(make_virtual_backend(kVirtualCapacity), config);
  PoolPort port(allocator);
  RematEngine engine(port);
  auto evictor = std::make_shared<Evictor>(allocator, engine, options.policy, config);
  if (options.policy != Policy::kNone) allocator.set_eviction_hook(evictor);

  ReplayOutcome out;
  std::vector<int> current(t.nbytes.size(), -1);  // storage id -> its current value
  auto check = [&] {
    if (!options.check_invariants) return;
    allocator.check_invariants();
    check_engine_against_pool(engine, allocator);
    ++out.invariant_checks;
  };
  const std::size_t max_remats = kMaxRematsPerOp * (t.num_ops() + 16);
  std::vector<int> used, not_read, inputs;
  try {
    out.oom_op = -1;
    for (std::size_t sid = 0; sid < t.nbytes.size(); ++sid)
      if (t.initial[sid]) current[sid] = engine.add_initial(t.nbytes[sid]);
    for (int sid : t.frees_before) engine.kill(current[sid]);
    check();
    for (std::size_t i = 0; i < t.num_ops(); ++i) {
      out.oom_op = static_cast<int>(i);
      engine.tick();
      const int op = engine.begin_op(t.cost[i], t.random[i] != 0);
      for (int k = t.mutated_offsets[i]; k < t.mutated_offsets[i + 1]; ++k)
        engine.prepare_write(current[t.mutated[k]]);
      used.clear();
      for (int k = t.inputs_offsets[i]; k < t.inputs_offsets[i + 1]; ++k) used.push_back(t.inputs[k]);
      for (int k = t.mutated_offsets[i]; k < t.mutated_offsets[i + 1]; ++k) used.push_back(t.mutated[k]);
      not_read.clear();
      inputs.clear();
      for (std::size_t j = 0; j < used.size(); ++j) {
        const int sid = used[j];
        if (std::find(used.begin(), used.begin() + j, sid) != used.begin() + j) continue;
        inputs.push_back(current[sid]);
      }
      engine.use_inputs(op, inputs);
      // An op that writes a storage and also creates outputs (batch norm and
      // its running statistics) does not read the written storage for them.
      for (int k = t.mutated_offsets[i]; k < t.mutated_offsets[i + 1]; ++k)
        not_read.push_back(current[t.mutated[k]]);
      for (int k = t.created_offsets[i]; k < t.created_offsets[i + 1]; ++k) {
        const int sid = t.created[k];
        current[sid] = engine.create_output(op, t.nbytes[sid], not_read);
      }
      for (int k = t.mutated_offsets[i]; k < t.mutated_offsets[i + 1]; ++k) {
        const int sid = t.mutated[k];
        current[sid] = engine.write_in_place(op, current[sid]);
      }
      if (options.policy == Policy::kNone)
        out.resident_floor_bytes = std::max(out.resident_floor_bytes, engine.unevictable_resident_bytes());
      engine.end_op(op);
      for (int k = t.frees_offsets[i]; k < t.frees_offsets[i + 1]; ++k)
        engine.kill(current[t.frees[k]]);
      check();
      if (engine.counters().remats > max_remats)
        throw OutOfMemoryError("thrashing: more than " + std::to_string(kMaxRematsPerOp) +
                               " recomputes per op; the budget is too small for this policy");
    }
    out.oom_op = -2;
  } catch (const OutOfMemoryError& e) {
    out.feasible = false;
    out.message = e.what();
  }
  allocator.set_eviction_hook(nullptr);
  const StatsReport report = allocator.stats_report();
  out.peak_reserved_bytes = report.stats.reserved_bytes[kStatAll].peak;
  out.peak_allocated_bytes = report.stats.allocated_bytes[kStatAll].peak;
  out.final_reserved_bytes = report.stats.reserved_bytes[kStatAll].current;
  out.segments_peak = report.stats.segment[kStatAll].peak;
  out.device_alloc_calls = report.stats.num_device_alloc;
  out.device_free_calls = report.stats.num_device_free;
  out.max_split_size = allocator.config().max_split_size_mb;
  out.segment_fit = allocator.config().segment_fit == Switch::kOn;
  out.engine = engine.counters();
  out.evictor = evictor->stats();
  engine.release_all();
  return out;
}

}  // namespace dtralloc
