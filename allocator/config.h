// Config: every tunable of dtralloc, declared once in DTRALLOC_OPTIONS.
//
// The table below is the single source of truth: the Config struct, the
// parser of DTRALLOC_CONF="key:value,...", `python -m dtralloc config` and the
// README table are all generated from it. Names shared with
// PYTORCH_CUDA_ALLOC_CONF mean the same thing (and the same unit: *_mb keys
// take megabytes). Sizes accept K/M/G/T suffixes (powers of 1024).
//
// A bad key or value throws ConfigError naming the key and what it accepts;
// it never aborts the process (torch's allocator once crashed `import torch`
// on a typo in its env var; we do not repeat that).
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "policies.h"

namespace dtralloc {

constexpr std::size_t kMiB = 1024 * 1024;
constexpr std::size_t kNoLimit = std::numeric_limits<std::size_t>::max();
// max_split_size_mb:auto (the default): the Allocator resolves it to
// kDtrallocMaxSplit under the dtralloc policy with a budget, else kNoLimit.
constexpr std::size_t kAutoSplit = kNoLimit - 1;
constexpr std::size_t kDtrallocMaxSplit = 32 * kMiB;
// An on/off setting whose `auto` the Allocator resolves (segment_fit,
// small_in_large).
enum class Switch : std::uint8_t { kOff, kOn, kAuto };
// The history ring is allocated up front (48 bytes an entry): at most 768 MiB.
constexpr std::size_t kMaxHistoryEntries = std::size_t{1} << 24;

class ConfigError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// budget: a hard cap on reserved bytes, absolute or a fraction of capacity.
struct Budget {
  std::size_t bytes = 0;   // used when fraction == 0
  double fraction = 0.0;   // in (0, 1] (0.x or x% up to 100%); 0 means bytes (or none)
  bool none() const { return bytes == 0 && fraction == 0.0; }
  // The cap for a device of `capacity` bytes (capacity when none()).
  std::size_t resolve(std::size_t capacity) const;
};

// Value kinds; each knows how to parse and print itself.
struct BudgetOption { using value_type = Budget; };
struct SizeMbOption { using value_type = std::size_t; };    // stored in bytes
struct SplitSizeOption { using value_type = std::size_t; }; // SizeMb, or auto
struct SwitchOption { using value_type = Switch; };         // on, off or auto
struct DivisionsOption { using value_type = std::size_t; }; // 0, 1 or power of 2
struct FractionOption { using value_type = double; };       // [0, 1)
struct CountOption { using value_type = std::size_t; };
struct PolicyOption { using value_type = Policy; };         // policies.h
struct RealOption { using value_type = double; };           // a number >= 1
struct SizeOption { using value_type = std::size_t; };      // bytes

// X(name, kind, default, doc). The doc is one line; it is what users read.
#define DTRALLOC_OPTIONS(X)                                                    \
  X(budget, BudgetOption, Budget{},                                            \
    "hard cap on reserved bytes: a size with a unit (6G, 512M) or a fraction " \
    "of device memory (0.5 or 50%); a bare number of 1 or more is an error; "  \
    "none = the whole device")                                                 \
  X(max_split_size_mb, SplitSizeOption, kAutoSplit,                           \
    "blocks at least this large (MB) are never split; small requests will "    \
    "not use them. Lowers fragmentation for mixed sizes. none = no limit; "    \
    "auto = 32 under the dtralloc policy with a budget (big tensors keep "     \
    "their segments, so what eviction frees stays contiguous), else none")     \
  X(segment_fit, SwitchOption, Switch::kAuto,                                  \
    "on: a 1-10 MB request gets a segment of as many copies of itself as fit " \
    "in 20 MB (2 MB-rounded) instead of 20 MB, so same-size tensors "          \
    "(weights, gradients, optimizer state) strand no tail; off: always 20 MB " \
    "(torch); auto = on under the dtralloc policy with a budget, else off")    \
  X(small_in_large, SwitchOption, Switch::kAuto,                               \
    "on: a small request (<= 1 MB) the budget leaves no room for a new 2 MB "  \
    "small segment takes a free block of the large pool, rather than "         \
    "evicting or failing, and where only an eviction in the large pool would " \
    "make room the evictor makes it there; a large block then splits off "    \
    "any rest of 512 B or more (torch: over 1 MB) for small requests to use; " \
    "off: the pools never mix (torch); "                                       \
    "auto = on under the dtralloc policy with a budget, else off")             \
  X(spare_evicted, SwitchOption, Switch::kAuto,                                \
    "on: a new request avoids the free room an evicted value (over 1 MB) "     \
    "left, when another cached block fits, so that the value can come back "   \
    "to a contiguous room when it is recomputed; off: best fit only (torch); " \
    "auto = on under the dtralloc policy with a budget, else off")             \
  X(long_lived, SwitchOption, Switch::kAuto,                                   \
    "on: a request expected to outlive the step (one a previous step of the "  \
    "same ops still held at its end: gradients, optimizer state; in a replay, " \
    "what the trace keeps) takes the high end of the free block best fit "    \
    "gives it, so that what dies sooner packs the low ends and leaves "        \
    "contiguous room; off: the low end always (torch); auto = on under the "   \
    "dtralloc policy with a budget, else off")                                 \
  X(unmap_pages, SwitchOption, Switch::kAuto,                                  \
    "on: where the budget has no room for a request's own segment, give the "  \
    "device back the whole 2 MB pages of free blocks in segments that also "   \
    "hold tensors until it has, before evicting (sparing the rooms evicted "   \
    "values left) and again before an out-of-memory error; needs a backend "  \
    "that frees part of a segment: host, virtual (replay, CPU sessions) and "  \
    "cuda, whose segments are then VMM ones (CUDA's virtual memory API), "    \
    "made and released a 2 MB page at a time; auto = on under the dtralloc " \
    "policy with a budget on host and virtual, off on cuda (its segments "    \
    "cudaMalloc'd: on an H100, VMM segments made training under a budget "    \
    "5-20x slower a sample, docs/allocator.md); leave it off where one GPU "  \
    "reads another's tensors or CUDA tensors cross processes (VMM memory is " \
    "mapped for its own device only, and has no IPC handle)")                 \
  X(split_oversize, SwitchOption, Switch::kAuto,                               \
    "on: where the budget has no room for an oversize request's own segment, " \
    "it takes the low end of the smallest whole free oversize segment whose "  \
    "rest is oversize too (only oversize requests use that rest), instead of " \
    "giving that segment back and making its own (a cudaFree waits for the "   \
    "device: ResNet-50 at its budget gave back and made 6 segments a step); "  \
    "off: give back and make (torch); auto = on under the dtralloc policy "   \
    "with a budget on cuda's cudaMalloc'd segments, else off (where pages "    \
    "are given back, unmap_pages returns the room: host, virtual, VMM)")       \
  X(arena, SwitchOption, Switch::kOff,                                         \
    "on: under a budget, the first large request (over 1 MB) the cache "      \
    "cannot serve reserves all the budget has left in one segment, the "       \
    "arena, which every request of its stream shares from then on (small "    \
    "ones and what outlives the step at its top), so the pool makes and "      \
    "gives back no segment at the budget: "                                    \
    "eviction makes room in it by contiguous windows; empty_cache() gives "    \
    "it back. Needs "                                                          \
    "max_split_size_mb none (auto is), small_in_large on (auto is), "          \
    "unmap_pages off (auto is); on an H200 under dtr() it trained ResNet-50 " \
    "at 3x the batch in the same memory at +11% step time (off: +36-56%) "     \
    "and GPT-2 at 6x at +10% (off: +28%), but ResNet-50's largest batch was "  \
    "4x (off: 5x). off: segments per request size (torch); auto = off "        \
    "(docs/allocator.md, Note [arena])")                                       \
  X(async_segments, SwitchOption, Switch::kOff,                              \
    "cuda: on: segments come from a memory pool of CUDA's stream-ordered "    \
    "allocator (cudaMallocFromPoolAsync and cudaFreeAsync on the segment's "   \
    "stream), so making or giving back a segment never waits for the device, " \
    "as cudaMalloc and cudaFree do (under a budget the pool gives segments "   \
    "back to make others, many times a step); where the driver grew past the " \
    "budget rather than reuse what was given back, the pool waits for the "   \
    "device once, so the excess lasts one allocation (memory_stats: "          \
    "device_pool_reserved_bytes, num_device_pool_waits); off: "               \
    "cudaMalloc (torch); auto = off (on an H200 the driver's pool held up to " \
    "1.8 GB past the budget: docs/allocator.md). No effect on host and "      \
    "virtual. Excludes "                                                       \
    "unmap_pages:on; leave it off where one GPU reads another's tensors or "   \
    "CUDA tensors cross processes (pool memory is its device's only)")        \
  X(max_non_split_rounding_mb, SizeMbOption, 20 * kMiB,                        \
    "a request of max_split_size or more may take an unsplittable cached "     \
    "block up to this much (MB) larger than itself")                           \
  X(roundup_power2_divisions, DivisionsOption, 0,                              \
    "round request sizes up to one of N steps between powers of two (N a "     \
    "power of two; 0 or 1 = round to 512 B only)")                             \
  X(garbage_collection_threshold, FractionOption, 0.0,                         \
    "when reserved passes this fraction of the budget, release the least "     \
    "recently used cached segments before growing (0 = off)")                  \
  X(history_entries, CountOption, 0,                                           \
    "size of the alloc/free event ring buffer kept for snapshot() "            \
    "device_traces; 0 = off, as in torch (costs ~15 ns a malloc+free pair). "  \
    "dtralloc.record_memory_history() changes it at run time")                \
  X(policy, PolicyOption, Policy::kNone,                                        \
    "eviction policy under the budget (replay and live DTR); the policy "      \
    "table in the README says how each chooses")                               \
  X(recompute_penalty, RealOption, 1.0,                                        \
    "dtralloc policy: a tensor's cost is multiplied by this per recompute it " \
    "already had (1 = off: on the bundled traces every value > 1 raised the " \
    "min feasible budget; raise it if a workload thrashes)")                   \
  X(small_tensor_cutoff, SizeOption, 64 * 1024,                                \
    "dtralloc policy: no window starts at a tensor smaller than this (fewer "  \
    "windows to score); small tensors still join windows that need them")      \
  X(eviction_sample_threshold, CountOption, 1024,                              \
    "dtralloc policy: with more candidate windows than this, score only "      \
    "sqrt(N) of them (fixed-seed sample) to bound the search time")            \
  X(eviction_seed, CountOption, 1,                                             \
    "seed of the eviction sampler; the same trace, budget and seed always "   \
    "evict the same tensors")

// One field per option, named as the key. Unit: a *_mb key takes megabytes
// (as in PYTORCH_CUDA_ALLOC_CONF) but its field holds bytes, already
// multiplied out (SizeMbOption); kNoLimit is "none".
struct Config {
#define DTRALLOC_DECLARE_FIELD(name, kind, def, doc) \
  kind::value_type name = def;
  DTRALLOC_OPTIONS(DTRALLOC_DECLARE_FIELD)
#undef DTRALLOC_DECLARE_FIELD
};

// Parses "key:value,key:value". Empty text gives the defaults.
Config parse_config(const std::string& text);

// `config` with the values that depend on other keys settled (what the
// Allocator runs with): max_split_size_mb:auto becomes a size or none,
// segment_fit:auto and small_in_large:auto on or off, unmap_pages:auto on
// only where the backend `releases_ranges` (Backend::releases_ranges),
// split_oversize:auto only where it does not. arena:on settles
// max_split_size_mb (none), small_in_large (on) and unmap_pages (off);
// parse_config refuses them set against it.
Config resolve_config(Config config, bool releases_ranges = true);

// Parses a size with an optional K/M/G/T suffix ("6G", "512", "1.5M").
// `unit` multiplies a bare number (1 for bytes, kMiB for *_mb keys).
// Throws ConfigError mentioning `key` on malformed input.
std::size_t parse_size(const std::string& key, const std::string& text,
                       std::size_t unit);

struct OptionInfo {
  std::string name;
  std::string value;          // the effective value, formatted
  std::string default_value;  // formatted
  std::string accepts;        // what values are allowed
  std::string doc;
};
std::vector<OptionInfo> describe_config(const Config& config);

// Throws ConfigError when resolved `config` asks for what a backend named
// `backend` cannot do (unmap_pages:on without releases_ranges(), backend.h).
void check_backend_config(const Config& config, const std::string& backend, bool releases_ranges);

// Formats bytes for humans: "1.5 GiB", "512 B".
std::string format_bytes(std::size_t bytes);

}  // namespace dtralloc
