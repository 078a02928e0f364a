// Replay driver: runs a recorded trace (docs/trace-format.md) through an
// Allocator on the virtual backend with the RematEngine and an Evictor, under
// a budget. Addresses only; costs are the trace's op costs.
//
// Per op: (1) before a write to a value nobody can recompute, bring back what
// depends on it; (2) lock the inputs and written storages, rematerializing
// evicted ones recursively (each remat allocates through the pool and may
// evict others, never a locked value: DESIGN 3.7); (3) allocate the created
// storages (locked); (4) in-place writes take over the block, the old value
// becomes a recomputable version; (5) unlock; (6) apply the frees: released,
// or fake-deleted when a recipe still needs the value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "config.h"
#include "evictor.h"

namespace dtralloc {

// The trace's columns; lists are CSR (offsets has one entry more than ops).
struct ReplayTrace {
  std::vector<std::size_t> nbytes;     // per storage
  std::vector<char> initial;           // per storage
  std::vector<int> frees_before;
  std::vector<int> inputs_offsets, inputs;
  std::vector<int> created_offsets, created;
  std::vector<int> mutated_offsets, mutated;
  std::vector<int> frees_offsets, frees;
  std::vector<double> cost;            // per op: duration_ns, else flops
  std::vector<char> random;            // per op

  std::size_t num_ops() const { return cost.size(); }
  void validate() const;  // throws std::invalid_argument on malformed columns
};

struct ReplayOptions {
  std::size_t budget_bytes = 0;        // 0: no budget
  Policy policy = Policy::kDtralloc;
  Config config;                       // pool settings and eviction knobs
  bool check_invariants = false;       // pool + engine invariants after every op
};

struct ReplayOutcome {
  bool feasible = true;
  int oom_op = -2;                     // -2: none; -1: initial storages
  std::string message;
  std::size_t peak_reserved_bytes = 0;
  std::size_t peak_allocated_bytes = 0;
  std::size_t final_reserved_bytes = 0;
  std::int64_t segments_peak = 0;
  std::int64_t device_alloc_calls = 0;
  std::int64_t device_free_calls = 0;
  std::size_t invariant_checks = 0;
  std::size_t max_split_size = kNoLimit;  // the pool's, max_split_size_mb:auto resolved
  bool segment_fit = false;                // the pool's, segment_fit:auto resolved
  // Policy none only: the most bytes that had to be resident at once, pinned
  // values plus what the op in flight holds locked, sampled when the op's
  // outputs are allocated. No eviction policy can run the trace with less
  // allocated (the pool adds its fragmentation on top).
  std::size_t resident_floor_bytes = 0;
  EngineCounters engine;
  EvictorStats evictor;
};

ReplayOutcome run_replay(const ReplayTrace& trace, const ReplayOptions& options);

}  // namespace dtralloc
