// Eviction policies, declared once in DTRALLOC_POLICIES.
//
// The table is the single source of truth: the Policy enum, the names
// DTRALLOC_CONF's `policy` key and replay(policy=...) accept, dtralloc.POLICIES,
// the CLI help, the README's policy table and the bench's list are all
// generated from it. Each row carries a small descriptor (PolicyTraits) of
// how the policy chooses; the Evictor (evictor.h) reads the descriptor, not
// the policy's name.
//
// Every score is "lower = evict first". For a single-tensor policy:
//
//   score(t) = cost(t) * penalty^recomputes(t) / (bytes(t) + free beside t) / staleness(t)
//
// where each factor is present only if the descriptor says so. A window
// policy scores a run of address-adjacent blocks: the sum of cost(t) *
// penalty^recomputes(t) over the run's tensors, per byte the run frees if
// `per_byte` (free neighbours of the run counted when `free_neighbours`),
// else the plain sum (Coop). With `recency`, a tensor never recomputed
// weighs 1 + kRecentOps / staleness times its cost: what was
// just used is likely read again soon.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dtralloc {

// What a victim costs.
enum class VictimCost : std::uint8_t {
  kNone,         // no eviction
  kLastAccess,   // the engine clock at its last use (LRU: oldest first)
  kUnit,         // 1 for every tensor (so per byte: largest first)
  kProducer,     // its producer op's cost
  kChain,        // what recomputing it runs: producer + evicted ancestors (Capuchin's chain)
  kEstarExact,   // DTR's e*: producer + its memoryless neighbourhood, walked exactly
  kEstarEq,      // DTR's e* from union-find classes (h_DTR-eq)
};

// How a policy chooses.
enum class VictimChoice : std::uint8_t {
  kNone,     // never evicts: over the budget is an OOM
  kSingle,   // one tensor per call; the Allocator calls again while room is missing
  kWindow,   // one call makes all the room: a run of adjacent blocks, or whole segments released
};

struct PolicyTraits {
  VictimChoice choice;
  VictimCost cost;
  bool per_byte;          // divided by the bytes the eviction frees
  bool free_neighbours;   // free blocks beside the victim(s) count as freed
  bool staleness;         // divided by the time since last use
  bool penalty;           // times recompute_penalty^recomputes (the config's knob)
  bool pruned;            // windows: starts below small_tensor_cutoff skipped and, past
                          // eviction_sample_threshold, sampled
  bool thorough;          // windows: the small pool searched too for requests under
                          // 20 MiB, and when neither plan is found, everything
                          // again (every segment, every window start unsampled)
  bool recency;           // windows: a value not yet recomputed and used in the
                          // last few ops costs more (kRecentOps, below)
  bool recoverable;       // windows: a value whose recompute could not fit beside
                          // the kept values is kept too (kRecoverableShare, below)
  bool drop_spent;        // a dead value a hold brought back for its recomputes is
                          // evicted once they have read it (RematEngine::set_drop_spent)
  bool spare_ruinous;     // a victim whose recompute chain costs over kRuinousShare of
                          // the step's compute so far stays where free pages, the rooms
                          // spared for evicted values' too, make room (unmap_pages), or
                          // where a hold's recompute can retry with what it holds unlocked
};

// A `recency` policy weighs a value never recomputed and last used s ops
// ago (s >= 1) 1 + kRecentOps / s times its cost: what was just used is
// likely read again soon (the residual add after a block, the next layer,
// its own backward), and evicting it buys a recompute that a slightly
// dearer idle value would not have. x4 for what the last op used, +10% at
// 30 ops: nothing an idle value's choice notices. A value already
// recomputed is priced by the penalty instead: weighing it too (a value
// just brought back is also just used) made more feasibility holes (20
// against 14 over 40 traces). Over the 16 bundled traces and two more
// recordings of each model (bench/results/replay_recordings-2026-11-23-*.md):
// dtralloc's holes 22 -> 14 and traces missing a target of the policy bench
// 10 -> 7 (resnet50 at 0.7: 1.09x DTR's overhead -> 1.03x); min budgets
// fell on encdec, encdec-compact, vit-compact and resnet50 but rose on the
// bundled encdec-compact (0.675 -> 0.69), resnet50's and vit's second
// recordings (0.24 -> 0.245, 0.26 -> 0.265), the latter with 5 new holes.
// 2 lost the resnet50 gain; 5 and 8 made more holes. Dividing by staleness
// itself, as DTR does, raised min budgets instead.
inline constexpr double kRecentOps = 3.0;
// A `recoverable` policy does not evict a value whose recompute would need
// more than this share of the room that the values no eviction takes
// (pinned or held by the program: RematEngine::kept_resident_bytes) leave
// under the budget (RematEngine::recompute_need_bytes: the most one op of
// its recompute chain holds at once). Evicting it turns its next use into
// an OOM: gpt2's tied embedding gradient (147 MiB, from the 393 MiB
// log-softmax gradient, itself from two more of that size) was evicted in
// backward and could not come back where the embedding's backward adds to
// it; its budget failed from 0.32 to 0.34 of the peak and ran at 0.315. Not the whole room: the
// gradients pinned while backward runs on and the consumer's other inputs
// take part of it. At the eviction that broke gpt2's third recording the
// chain needed 0.985 of the room. Over the 48 recordings of
// bench/replay_recordings.py: holes 9 -> 4 and gpt2's min budget 0.335-0.35
// -> 0.315 on all three, encdec's third 0.395 -> 0.39, every other trace
// unchanged at 0.9 and 0.95; 1.0 left a hole on gpt2; 0.85 and 0.8 moved
// unet's holes around. The chain's own peak (inputs held while siblings are
// recomputed, Sethi-Ullman) instead of its largest op kept too much: 8 holes.
// It costs the walk 1.4-1.8x (search_ns_per_call; a few µs a call).
inline constexpr double kRecoverableShare = 0.9;
// A `spare_ruinous` policy does not evict a value whose recompute chain
// (RematEngine::chain_cost) costs more than this share of the compute the
// step has run so far (EngineCounters::base_cost) where giving back free
// pages makes room instead, the pages of rooms spared for evicted values
// included (Allocator::give_back_pages; the pages outside those rooms went
// back before the evictor was asked). Such a value is a gradient still to be
// summed in backward: what brings it back is the backward from the loss,
// through the forward activations it reads. One vit recording evicted one
// (9.2 MiB, its chain half the step) at 0.235 of the peak and recomputed 6000
// values before running out, where 0.23 ran. Over the 48 recordings of
// bench/replay_recordings.py that hole went and nothing else changed at 0.1,
// 0.2 (vit's lowest budget 0.24 -> 0.23) and 0.5; 0.05 and below made holes
// on the bundled vit (replay_recordings-2026-11-24d-cpu.md). Where no pages
// make room, a recompute of a hold that can retry (RematEngine::
// recompute_can_retry) is refused room instead: the hold then unlocks what
// it brought back and tries again, and those values go first. resnet50 at
// 0.21 evicted the 196 MiB gradient the next backward op adds to (its chain
// 74% of the step) and thrashed; now it runs, and no other recording changes
// but resnet50's second, whose lowest budget falls 0.205 -> 0.195 (-24e).
// Refusing everywhere (with no retry to take) broke the LSTMs, whose hidden
// states' chains are long by nature: lstm's lowest budget 0.66 -> 0.825.
inline constexpr double kRuinousShare = 0.2;

// X(enumerator, name, traits, doc). The doc is one line; it is what users read.
#define DTRALLOC_POLICIES(X)                                                            \
  X(kNone, none, (PolicyTraits{VictimChoice::kNone, VictimCost::kNone,                  \
                               false, false, false, false, false, false, false, false, false, false}), \
    "no eviction: a request over the budget is an out-of-memory error")                 \
  X(kLru, lru, (PolicyTraits{VictimChoice::kSingle, VictimCost::kLastAccess,            \
                             false, false, false, false, false, false, false, false, false, false}), \
    "least recently used tensor first")                                                 \
  X(kSize, size, (PolicyTraits{VictimChoice::kSingle, VictimCost::kUnit,                \
                               true, false, false, false, false, false, false, false, false, false}), \
    "largest tensor first")                                                             \
  X(kMsps, msps, (PolicyTraits{VictimChoice::kSingle, VictimCost::kChain,               \
                               true, false, false, false, false, false, false, false, false, false}), \
    "Capuchin: recompute time of the tensor's chain per byte saved")                    \
  X(kDtr, dtr, (PolicyTraits{VictimChoice::kSingle, VictimCost::kEstarExact,            \
                             true, false, true, false, false, false, false, false, false, false}),   \
    "DTR's h_DTR: e* / (size * staleness), e* walking the evicted neighbourhood")       \
  X(kDtrEq, dtr_eq, (PolicyTraits{VictimChoice::kSingle, VictimCost::kEstarEq,          \
                                  true, false, true, false, false, false, false, false, false, false}), \
    "DTR's h_DTR-eq: e* from union-find classes / (size * staleness)")                  \
  X(kDtrLocal, dtr_local, (PolicyTraits{VictimChoice::kSingle, VictimCost::kProducer,   \
                                        true, false, true, false, false, false, false, false, false, false}), \
    "DTR's h_DTR-local: producer cost / (size * staleness), no neighbourhood")          \
  X(kDte, dte, (PolicyTraits{VictimChoice::kSingle, VictimCost::kEstarEq,               \
                             true, true, true, false, false, false, false, false, false, false}),    \
    "MegEngine's DTE: e* / ((size + free neighbours) * staleness)")                     \
  X(kCoop, coop, (PolicyTraits{VictimChoice::kWindow, VictimCost::kProducer,            \
                               false, false, false, false, false, false, false, false, false, false}), \
    "Coop: the run of adjacent free + evictable blocks with the least total op cost")   \
  X(kDtralloc, dtralloc, (PolicyTraits{VictimChoice::kWindow, VictimCost::kChain,       \
                                       true, true, false, true, true, true, true, true, true, true}), \
    "ours: the run of adjacent blocks (or whole segments) with the least recompute "    \
    "chain cost per byte freed, free neighbours counted")

enum class Policy : std::uint8_t {
#define DTRALLOC_POLICY_ENUM(e, name, traits, doc) e,
  DTRALLOC_POLICIES(DTRALLOC_POLICY_ENUM)
#undef DTRALLOC_POLICY_ENUM
};

struct PolicyInfo {
  Policy policy;
  const char* name;
  PolicyTraits traits;
  const char* doc;
};

// Every policy, in table order.
const std::vector<PolicyInfo>& policy_table();
const PolicyTraits& policy_traits(Policy policy);
const char* policy_name(Policy policy);
// "none, lru, ..." in table order.
const std::string& policy_names();
// Throws ConfigError (config.h) for an unknown name, listing the known ones.
Policy parse_policy(const std::string& name);

}  // namespace dtralloc
