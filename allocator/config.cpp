// Parsing and printing of the DTRALLOC_OPTIONS table (see config.h).
#include "config.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <set>
#include <sstream>

namespace dtralloc {
namespace {

std::string trim(const std::string& s) {
  std::size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

[[noreturn]] void bad_value(const std::string& key, const std::string& value,
                            const std::string& accepts) {
  throw ConfigError("DTRALLOC_CONF: bad value '" + value + "' for key '" + key +
                    "': expected " + accepts);
}

// Strict decimal number: the whole text must be consumed.
bool parse_number(const std::string& text, double* out) {
  if (text.empty()) return false;
  std::size_t used = 0;
  try {
    *out = std::stod(text, &used);
  } catch (const std::exception&) {
    return false;
  }
  return used == text.size() && std::isfinite(*out);
}

std::string format_double(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}

// ---- one struct of static functions per option kind ----------------------

// One rule, no guessing: a fraction is written 0.x or x%, a size carries a
// unit. A bare number of 1 or more is refused, because `budget:1` read as
// "the whole device" and `budget:2` as "2 bytes" meant the same-looking text
// changed meaning at 1.
struct BudgetKind {
  static constexpr const char* accepts =
      "a fraction of device memory written 0.5 or 50% (up to 100%), a size with a unit "
      "such as 6G, 512M or 4096B, or none; a bare number is read only as a fraction "
      "below 1";
  static Budget parse(const std::string& key, const std::string& text) {
    Budget b;
    const std::string t = trim(text);
    if (lower(t) == "none") return b;
    double v = 0;
    if (!t.empty() && t.back() == '%') {
      if (!parse_number(trim(t.substr(0, t.size() - 1)), &v) || !(v > 0.0) || v > 100.0)
        bad_value(key, text, accepts);
      b.fraction = v / 100.0;
      return b;
    }
    if (parse_number(t, &v)) {  // bare: a fraction, or an error
      if (!(v > 0.0 && v < 1.0)) bad_value(key, text, accepts);
      b.fraction = v;
      return b;
    }
    const bool bytes_unit = t.size() >= 2 && (t.back() == 'B' || t.back() == 'b') &&
                            (std::isdigit(static_cast<unsigned char>(t[t.size() - 2])) ||
                             t[t.size() - 2] == '.');
    b.bytes = bytes_unit ? parse_size(key, t.substr(0, t.size() - 1), 1) : parse_size(key, t, 1);
    if (b.bytes == 0) bad_value(key, text, accepts);
    return b;
  }
  static std::string format(const Budget& b) {
    if (b.none()) return "none";
    if (b.fraction > 0) return format_double(b.fraction);
    return format_bytes(b.bytes);
  }
};

struct SizeMbKind {
  static constexpr const char* accepts =
      "megabytes (200), a size with suffix (200M, 1G), or none";
  static std::size_t parse(const std::string& key, const std::string& text) {
    if (lower(text) == "none") return kNoLimit;
    return parse_size(key, text, kMiB);
  }
  static std::string format(std::size_t v) {
    return v == kNoLimit ? "none" : format_bytes(v);
  }
};

struct SplitSizeKind {
  static constexpr const char* accepts =
      "megabytes (200), a size with suffix (200M, 1G), none, or auto";
  static std::size_t parse(const std::string& key, const std::string& text) {
    if (lower(text) == "auto") return kAutoSplit;
    return SizeMbKind::parse(key, text);
  }
  static std::string format(std::size_t v) {
    return v == kAutoSplit ? "auto" : SizeMbKind::format(v);
  }
};

struct SwitchKind {
  static constexpr const char* accepts = "on, off or auto";
  static Switch parse(const std::string& key, const std::string& text) {
    const std::string v = lower(text);
    if (v == "on") return Switch::kOn;
    if (v == "off") return Switch::kOff;
    if (v == "auto") return Switch::kAuto;
    bad_value(key, text, accepts);
  }
  static std::string format(Switch v) {
    return v == Switch::kOn ? "on" : v == Switch::kOff ? "off" : "auto";
  }
};

struct DivisionsKind {
  static constexpr const char* accepts = "0, 1 or a power of two up to 64";
  static std::size_t parse(const std::string& key, const std::string& text) {
    double v = 0;
    if (!parse_number(text, &v) || v < 0 || v > 64 || v != std::floor(v))
      bad_value(key, text, accepts);
    auto n = static_cast<std::size_t>(v);
    if (n > 1 && (n & (n - 1)) != 0) bad_value(key, text, accepts);
    return n;
  }
  static std::string format(std::size_t v) { return std::to_string(v); }
};

struct FractionKind {
  static constexpr const char* accepts = "a number in [0, 1), 0 = off";
  static double parse(const std::string& key, const std::string& text) {
    double v = 0;
    if (!parse_number(text, &v) || v < 0 || v >= 1) bad_value(key, text, accepts);
    return v;
  }
  static std::string format(double v) { return format_double(v); }
};

struct CountKind {
  static constexpr const char* accepts = "a non-negative integer (suffix K/M allowed)";
  static std::size_t parse(const std::string& key, const std::string& text) {
    if (text.find_first_of(".eE") != std::string::npos) bad_value(key, text, accepts);
    return parse_size(key, text, 1);
  }
  static std::string format(std::size_t v) { return std::to_string(v); }
};

struct PolicyKind {
  static const std::string accepts;  // "one of: " + the policy table's names
  static Policy parse(const std::string& key, const std::string& text) {
    try {
      return parse_policy(lower(trim(text)));
    } catch (const ConfigError&) {
      bad_value(key, text, accepts);
    }
  }
  static std::string format(Policy v) { return policy_name(v); }
};
const std::string PolicyKind::accepts = "one of: " + policy_names();

struct RealKind {
  static constexpr const char* accepts = "a number >= 1";
  static double parse(const std::string& key, const std::string& text) {
    double v = 0;
    if (!parse_number(text, &v) || v < 1) bad_value(key, text, accepts);
    return v;
  }
  static std::string format(double v) { return format_double(v); }
};

struct SizeKind {
  static constexpr const char* accepts = "a size such as 0, 512, 64K, 1M";
  static std::size_t parse(const std::string& key, const std::string& text) {
    return parse_size(key, text, 1);
  }
  static std::string format(std::size_t v) { return format_bytes(v); }
};

template <typename Option> struct KindOf;
template <> struct KindOf<BudgetOption> { using type = BudgetKind; };
template <> struct KindOf<SizeMbOption> { using type = SizeMbKind; };
template <> struct KindOf<SplitSizeOption> { using type = SplitSizeKind; };
template <> struct KindOf<SwitchOption> { using type = SwitchKind; };
template <> struct KindOf<DivisionsOption> { using type = DivisionsKind; };
template <> struct KindOf<FractionOption> { using type = FractionKind; };
template <> struct KindOf<CountOption> { using type = CountKind; };
template <> struct KindOf<PolicyOption> { using type = PolicyKind; };
template <> struct KindOf<RealOption> { using type = RealKind; };
template <> struct KindOf<SizeOption> { using type = SizeKind; };

// PYTORCH_CUDA_ALLOC_CONF keys we deliberately do not implement: say so
// instead of "unknown key", so a copied torch setting gets a precise answer.
const std::set<std::string>& torch_only_keys() {
  static const std::set<std::string> keys = {
      "expandable_segments", "backend", "release_lock_on_cudamalloc",
      "pinned_use_cuda_host_register", "pinned_num_register_threads",
      "pinned_use_background_threads", "graph_capture_record_stream_reuse",
      "per_process_memory_fraction"};
  return keys;
}

std::string known_keys() {
  std::string out;
#define DTRALLOC_NAME(name, kind, def, doc) out += (out.empty() ? "" : ", ") + std::string(#name);
  DTRALLOC_OPTIONS(DTRALLOC_NAME)
#undef DTRALLOC_NAME
  return out;
}

void set_option(Config& config, const std::string& key, const std::string& value) {
  // A kind's parser may fail inside a shared helper (parse_size) whose
  // message knows only sizes; the error users see names every form the key
  // accepts.
#define DTRALLOC_SET(name, kind, def, doc)                       \
  if (key == #name) {                                            \
    try {                                                        \
      config.name = KindOf<kind>::type::parse(key, value);       \
    } catch (const ConfigError&) {                               \
      bad_value(key, value, KindOf<kind>::type::accepts);        \
    }                                                            \
    return;                                                      \
  }
  DTRALLOC_OPTIONS(DTRALLOC_SET)
#undef DTRALLOC_SET
  if (torch_only_keys().count(key))
    throw ConfigError("DTRALLOC_CONF: key '" + key +
                      "' is a PYTORCH_CUDA_ALLOC_CONF setting that dtralloc does "
                      "not implement; remove it. Known keys: " + known_keys());
  throw ConfigError("DTRALLOC_CONF: unknown key '" + key + "'. Known keys: " +
                    known_keys() + " (run `python -m dtralloc config` for docs)");
}

}  // namespace

std::size_t Budget::resolve(std::size_t capacity) const {
  if (fraction > 0) return static_cast<std::size_t>(fraction * static_cast<double>(capacity));
  if (bytes > 0) return bytes;
  return capacity;
}

std::size_t parse_size(const std::string& key, const std::string& text,
                       std::size_t unit) {
  const std::string accepts =
      unit == 1 ? "a size such as 512, 64K, 200M, 6G" : "megabytes (200) or a size such as 200M, 1G";
  std::string t = trim(text);
  std::size_t multiplier = unit;
  if (!t.empty()) {
    char s = static_cast<char>(std::toupper(static_cast<unsigned char>(t.back())));
    std::string body = t;
    if (s == 'B' && t.size() >= 2 && std::isalpha(static_cast<unsigned char>(t[t.size() - 2]))) {
      body.pop_back();  // accept "6GB" as well as "6G"
      s = static_cast<char>(std::toupper(static_cast<unsigned char>(body.back())));
    }
    const char* suffixes = "KMGT";
    for (int i = 0; i < 4; ++i) {
      if (s == suffixes[i]) {
        multiplier = std::size_t{1} << (10 * (i + 1));
        body.pop_back();
        break;
      }
    }
    t = trim(body);
  }
  double v = 0;
  if (!parse_number(t, &v) || v < 0) bad_value(key, text, accepts);
  double bytes = v * static_cast<double>(multiplier);
  if (bytes >= 1.8e19) bad_value(key, text, accepts);
  return static_cast<std::size_t>(std::llround(bytes));
}

Config parse_config(const std::string& text) {
  Config config;
  std::set<std::string> seen;
  std::stringstream items(text);
  std::string item;
  while (std::getline(items, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    auto colon = item.find(':');
    if (colon == std::string::npos)
      throw ConfigError("DTRALLOC_CONF: item '" + item +
                        "' has no value; write key:value pairs separated by "
                        "commas, e.g. budget:6G,max_split_size_mb:256");
    std::string key = trim(item.substr(0, colon));
    std::string value = trim(item.substr(colon + 1));
    if (!seen.insert(key).second)
      throw ConfigError("DTRALLOC_CONF: key '" + key + "' is given twice");
    if (value.empty())
      throw ConfigError("DTRALLOC_CONF: key '" + key + "' has an empty value");
    set_option(config, key, value);
  }
  // The ring buffer is allocated up front: bound it (48 bytes an entry).
  if (config.history_entries > kMaxHistoryEntries)
    throw ConfigError("DTRALLOC_CONF: history_entries must be at most " +
                      std::to_string(kMaxHistoryEntries) + " (16M entries, 768 MiB); got " +
                      std::to_string(config.history_entries));
  // Cross-key rule torch also enforces: a split limit below the large
  // segment size would leave every large block unsplittable.
  if (config.max_split_size_mb != kNoLimit && config.max_split_size_mb != kAutoSplit &&
      config.max_split_size_mb <= 20 * kMiB)
    throw ConfigError(
        "DTRALLOC_CONF: max_split_size_mb must be more than 20 (MB), the size of a "
        "large-pool segment; got " + format_bytes(config.max_split_size_mb));
  // arena:on and what it needs (Note [arena], Allocator::make_arena): one
  // segment holds every size, so no block may be too large to split, a small
  // request must be able to take a large-pool block (no room is left for
  // small segments), and no page of it is given back.
  if (config.arena == Switch::kOn) {
    if (config.max_split_size_mb != kAutoSplit && config.max_split_size_mb != kNoLimit)
      throw ConfigError("DTRALLOC_CONF: arena:on needs max_split_size_mb:none (or auto): blocks of at least "
                        "max_split_size_mb are never split, and the arena is one such block while it is empty, "
                        "so no request could take part of it. Drop max_split_size_mb, or set arena:off.");
    if (config.small_in_large == Switch::kOff)
      throw ConfigError("DTRALLOC_CONF: arena:on needs small_in_large on (or auto): the arena takes what the "
                        "budget leaves, so small requests have no room for small segments of their own and must "
                        "take blocks of the arena. Drop small_in_large:off, or set arena:off.");
    if (config.unmap_pages == Switch::kOn)
      throw ConfigError("DTRALLOC_CONF: arena:on and unmap_pages:on exclude each other: the arena is kept whole "
                        "(reserving the budget once), unmap_pages gives pages of segments back. Choose one.");
  }
  if (config.async_segments == Switch::kOn && config.unmap_pages == Switch::kOn)
    throw ConfigError("DTRALLOC_CONF: async_segments:on and unmap_pages:on exclude each other on cuda: unmap_pages "
                      "gives back pages of VMM segments, async_segments makes segments with the stream-ordered "
                      "allocator, which frees them only whole. Choose one.");
  return config;
}

// Under the dtralloc policy with a budget, a block of 32 MiB or more is never
// split: a big tensor keeps its segment to itself. Otherwise a big segment
// freed once is carved up by small long-lived tensors (weight gradients,
// optimizer state), and its holes are what the budget then lacks and no
// eviction can join. 32 MiB: the limits from 24 to 40 MiB all lowered
// dtralloc's min feasible budget on the bundled traces, 48 and up lost the
// gains on the transformers (bench/results/replay_policies-*.md).
//
// segment_fit:auto is on under the same condition (BlockPool::segment_size):
// torch's 20 MiB segment holds two 9 MiB weights and strands 2 MiB, and a
// transformer strands a hundred such tails across weights, gradients and
// Adam state, which tight budgets lack (same bench).
//
// small_in_large:auto too (Allocator::try_allocate, step 5): on a model of a
// hundred MiB a 2 MiB small segment is a few percent of the budget, and the
// budget can run out for one while the large pool holds megabytes free
// beside a parameter. The pools keeping apart is what fits torch's
// workloads; under a budget, a small block out of a large free one beats an
// eviction. It lowered dtralloc's min feasible budget on the compact traces
// (vit-compact 0.63 -> 0.585) and removed more feasibility holes than it
// made (same bench).
//
// unmap_pages (Allocator::release_free_pages) takes away the last cause of
// feasibility holes it can without knowing the future: a gradient placed by
// best fit in a segment among activations pins the segment, and the free
// memory beside it can serve no request larger than that free block. With
// the pages given back, those budgets run: over 48 recordings, holes 12 -> 9
// and lower minimums on 10 traces, none higher (replay_recordings-2026-11-
// 23e-cpu.md). Since holds drop spent values the pages also go back before
// the evictor is asked, sparing evicted values' rooms: holes 7 -> 5, traces
// missing a target 6 -> 3 (-24c; docs/allocator.md, Note [unmap_pages]).
//
// spare_evicted:auto too (Allocator::try_allocate, step 1): best fit hands
// the room an evicted value left to whatever request comes next, and a
// gradient pinned there for the rest of the step leaves the value, when
// backward needs it back, no contiguous room (lstm-compact: its 22.8 MiB
// workspace evicted, a 2.9 MiB gradient put at the start of its 24 MiB
// segment, no 22.8 MiB anywhere at the workspace's backward, from 0.64 to
// 0.665 of the peak). Sparing that room removed those 18 holes over three
// recordings and lowered lstm-compact's minimum from 0.67 to 0.58
// (bench/results/replay_recordings-2026-11-23d-cpu.md).
//
// long_lived:auto too (Allocator::expect_long_lived): best fit puts a block
// at the low end of the free block it takes, wherever that is, and a
// gradient that lands that way in a free block among activations keeps the
// room on both of its sides apart for the rest of the step. At the high end
// it sits against whatever held the block's upper neighbour, and the room
// below joins what the activations free. On convbn-compact's first recording
// the weight gradients scattered across three segments at 0.56-0.57 of the
// peak left a 7.66 MiB request 7.32 MiB of contiguous room (the last three
// feasibility holes of the 48 recordings); with them at the high ends they
// pack and the step runs (bench/results/replay_recordings-2026-11-24f-cpu.md).
Config resolve_config(Config config, bool releases_ranges) {
  const bool dtralloc_placement = config.policy == Policy::kDtralloc && !config.budget.none();
  // arena:on settles what it needs (the rules: parse_config).
  if (config.arena == Switch::kAuto) config.arena = Switch::kOff;
  if (config.async_segments == Switch::kAuto) config.async_segments = Switch::kOff;
  if (config.arena == Switch::kOn) {  // parse_config refused what contradicts it
    config.max_split_size_mb = kNoLimit;
    config.small_in_large = Switch::kOn;
    config.unmap_pages = Switch::kOff;
    if (config.split_oversize == Switch::kAuto) config.split_oversize = Switch::kOff;  // nothing is oversize
  }
  if (config.max_split_size_mb == kAutoSplit)
    config.max_split_size_mb = dtralloc_placement ? kDtrallocMaxSplit : kNoLimit;
  if (config.segment_fit == Switch::kAuto)
    config.segment_fit = dtralloc_placement ? Switch::kOn : Switch::kOff;
  if (config.small_in_large == Switch::kAuto)
    config.small_in_large = dtralloc_placement ? Switch::kOn : Switch::kOff;
  if (config.spare_evicted == Switch::kAuto)
    config.spare_evicted = dtralloc_placement ? Switch::kOn : Switch::kOff;
  if (config.long_lived == Switch::kAuto)
    config.long_lived = dtralloc_placement ? Switch::kOn : Switch::kOff;
  // Where the backend gives back ranges (host, virtual: replays, CPU
  // sessions; cuda's VMM segments), unmap_pages returns a segment's free
  // pages to the budget; where it frees segments only whole (cudaMalloc),
  // giving one back to make another waits for the device.
  if (config.split_oversize == Switch::kAuto)
    config.split_oversize = dtralloc_placement && !releases_ranges ? Switch::kOn : Switch::kOff;
  // The cuda backend gives back pages only through VMM segments, which it
  // makes for unmap_pages:on alone: auto stays off there (make_cuda_backend_for).
  if (config.unmap_pages == Switch::kAuto)
    config.unmap_pages = dtralloc_placement && releases_ranges ? Switch::kOn : Switch::kOff;
  return config;
}

void check_backend_config(const Config& config, const std::string& backend, bool releases_ranges) {
  if (config.unmap_pages == Switch::kOn && !releases_ranges)
    throw ConfigError("DTRALLOC_CONF: unmap_pages:on needs a backend that can give back part of a segment, and this " +
                      backend +
                      " backend cannot (its segments come from cudaMalloc, which frees them only whole; "
                      "dtralloc.install() and Pool('cuda') make VMM segments for unmap_pages where the "
                      "driver supports them). Leave unmap_pages at auto or off for this backend.");
}

std::vector<OptionInfo> describe_config(const Config& config) {
  std::vector<OptionInfo> out;
  const Config defaults;
#define DTRALLOC_DESCRIBE(name, kind, def, doc)                       \
  out.push_back({#name, KindOf<kind>::type::format(config.name),      \
                 KindOf<kind>::type::format(defaults.name),           \
                 KindOf<kind>::type::accepts, doc});
  DTRALLOC_OPTIONS(DTRALLOC_DESCRIBE)
#undef DTRALLOC_DESCRIBE
  return out;
}

std::string format_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[48];
  if (u == 0)
    std::snprintf(buf, sizeof buf, "%zu B", bytes);
  else
    std::snprintf(buf, sizeof buf, "%.4g %s", v, units[u]);
  return buf;
}

}  // namespace dtralloc
