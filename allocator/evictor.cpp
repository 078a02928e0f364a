// Evictor: victim choice for every policy (evictor.h).
#include "evictor.h"

#include <chrono>
#include <cmath>
#include <limits>

namespace dtralloc {

Policy parse_policy(const std::string& name) {
  static const struct { const char* name; Policy policy; } kNames[] = {
      {"none", Policy::kNone},     {"lru", Policy::kLru},         {"size", Policy::kSize},
      {"msps", Policy::kMsps},     {"dtr", Policy::kDtr},         {"dtr_eq", Policy::kDtrEq},
      {"dtr_local", Policy::kDtrLocal}, {"dte", Policy::kDte},    {"coop", Policy::kCoop},
      {"dtralloc", Policy::kDtralloc}};
  for (const auto& p : kNames)
    if (name == p.name) return p.policy;
  throw ConfigError("dtralloc: unknown eviction policy '" + name +
                    "'; use one of: " DTRALLOC_EVICTION_POLICIES);
}

Evictor::Evictor(Allocator& allocator, RematEngine& engine, Policy policy, const Config& config)
    : allocator_(allocator),
      engine_(engine),
      policy_(policy),
      penalty_(config.recompute_penalty),
      cutoff_bytes_(config.small_tensor_cutoff),
      sample_threshold_(config.eviction_sample_threshold),
      rng_(config.eviction_seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull) {}

std::uint64_t Evictor::next_random() {  // xorshift64*: deterministic, seeded
  rng_ ^= rng_ >> 12;
  rng_ ^= rng_ << 25;
  rng_ ^= rng_ >> 27;
  return rng_ * 2685821657736338717ull;
}

bool Evictor::make_room(std::size_t bytes, Stream stream) {
  ++stats_.calls;
  allocator_.inspect_pool([&](const BlockPool& pool) {
    const double budget = static_cast<double>(allocator_.budget_bytes());
    const double allocated = static_cast<double>(pool.stats().allocated_bytes[kStatAll].current);
    stats_.free_fraction.push_back(budget > 0 ? (budget - allocated) / budget : 0.0);
  });
  const auto start = std::chrono::steady_clock::now();
  std::vector<int> victims = choose(bytes, stream);
  stats_.search_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                 std::chrono::steady_clock::now() - start).count());
  bool freed = false;
  for (int v : victims) freed |= engine_.evict(v);
  return freed;
}

// Snapshot of the blocks, in address order, of the stream's segments (of one
// pool kind when only_pool). Taken under the pool lock, scored without it.
void Evictor::walk(Stream stream, bool only_pool, PoolKind pool) {
  items_.clear();
  allocator_.inspect_pool([&](const BlockPool& bp) {
    int seg_index = 0;
    for (const auto& entry : bp.segments()) {
      const Segment* seg = entry.second;
      if (seg->stream != stream || (only_pool && seg->pool != pool)) continue;
      for (const Block* b = seg->head; b; b = b->next) {
        int value = kBlocked;
        if (b->in_free_set) {
          value = kFree;
        } else if (b->allocated) {
          const int v = engine_.value_at(b->addr);
          if (v >= 0 && engine_.evictable(v)) value = v;
        }
        items_.push_back({b->addr, b->size, value, seg_index});
      }
      ++seg_index;
    }
  });
}

std::size_t Evictor::free_beside(std::size_t i) const {
  std::size_t total = 0;
  if (i > 0 && items_[i - 1].segment == items_[i].segment && items_[i - 1].value == kFree)
    total += items_[i - 1].size;
  if (i + 1 < items_.size() && items_[i + 1].segment == items_[i].segment && items_[i + 1].value == kFree)
    total += items_[i + 1].size;
  return total;
}

double Evictor::single_score(int v, std::size_t free_around) {
  const Value& x = engine_.value(v);
  const double size = static_cast<double>(x.nbytes);
  const double stale = static_cast<double>(engine_.clock() - x.last_access + 1);
  switch (policy_) {
    case Policy::kLru: return static_cast<double>(x.last_access);
    case Policy::kSize: return -size;
    case Policy::kMsps: return engine_.chain_cost(v) / size;
    case Policy::kDtr: return engine_.estar_exact(v) / (size * stale);
    case Policy::kDtrEq: return engine_.estar_eq(v) / (size * stale);
    case Policy::kDtrLocal: return x.cost / (size * stale);
    case Policy::kDte: return engine_.estar_eq(v) / ((size + free_around) * stale);
    case Policy::kCoop: return x.cost / size;
    case Policy::kDtralloc:
      return window_weight(v) / (size + free_around);
    case Policy::kNone: break;
  }
  return 0;
}

// What evicting `v` costs inside a run (free blocks cost nothing).
// dtralloc charges what bringing v back will run: its producer plus every
// evicted ancestor the recompute walks (Capuchin's chain), times
// penalty^recomputes. DTR's e* (which also counts evicted *dependents*, costs
// that evicting v does not cause) and 1/staleness are left out: measured on
// the bundled traces (min feasible budget, bisection tol 0.02), swapping
// chain for e* or adding 1/staleness each raised dtralloc's min budget by
// 0.05-0.15 of the peak; the old score (e*, staleness, penalty 2) needed
// bert 0.58 / gpt2 0.58 / unet 0.58, this one 0.33 / 0.45 / 0.42.
double Evictor::window_weight(int v) {
  const Value& x = engine_.value(v);
  if (policy_ == Policy::kCoop) return x.cost;
  return engine_.chain_cost(v) * std::pow(penalty_, x.recomputes);
}

std::vector<int> Evictor::choose(std::size_t bytes, Stream stream) {
  if (policy_ == Policy::kNone) return {};
  if (policy_ == Policy::kCoop || policy_ == Policy::kDtralloc) {
    walk(stream, true, BlockPool::pool_for(bytes));
    std::vector<int> run = choose_window(bytes);
    if (!run.empty()) {
      ++stats_.windows;
      return run;
    }
    walk(stream, false, kLargePool);
    run = choose_segment();
    if (!run.empty()) {
      ++stats_.segment_fallbacks;
      return run;
    }
    ++stats_.single_fallbacks;
    std::vector<int> one = choose_single(true);
    return one.empty() ? choose_single(false) : one;
  }
  if (policy_ == Policy::kDte) walk(stream, false, kLargePool);
  return choose_single(false);
}

std::vector<int> Evictor::choose_single(bool use_cutoff) {
  if (policy_ == Policy::kDte || policy_ == Policy::kDtralloc) {
    // Scored from the address walk: neighbours' free bytes are known there.
    int best = -1;
    double best_score = std::numeric_limits<double>::infinity();
    for (std::size_t i = 0; i < items_.size(); ++i) {
      const int v = items_[i].value;
      if (v < 0) continue;
      if (use_cutoff && engine_.value(v).nbytes < cutoff_bytes_) continue;
      const double s = single_score(v, free_beside(i));
      if (s < best_score) best_score = s, best = v;
    }
    return best < 0 ? std::vector<int>{} : std::vector<int>{best};
  }
  int best = -1;
  double best_score = std::numeric_limits<double>::infinity();
  // resident() is in no stable order; ties break on the lower value id so the
  // choice never depends on hash or swap order.
  for (int v : engine_.resident()) {
    if (!engine_.evictable(v)) continue;
    const double s = single_score(v, 0);
    if (s < best_score || (s == best_score && v < best)) best_score = s, best = v;
  }
  return best < 0 ? std::vector<int>{} : std::vector<int>{best};
}

// Least-cost minimal run of free + evictable blocks reaching `bytes`, within
// one segment. Two pointers: for each start, the shortest run that fits.
std::vector<int> Evictor::choose_window(std::size_t bytes) {
  const std::size_t n = items_.size();
  // Weights are computed when a scanned run first reaches a block (a chain
  // walk each): with sampling most blocks are never reached.
  weight_.assign(n, -1.0);
  auto weight = [&](std::size_t i) {
    if (items_[i].value < 0) return 0.0;
    if (weight_[i] < 0) weight_[i] = window_weight(items_[i].value);
    return weight_[i];
  };
  std::vector<std::size_t> starts;
  for (std::size_t i = 0; i < n; ++i)
    if (items_[i].value != kBlocked) starts.push_back(i);
  if (policy_ == Policy::kDtralloc && starts.size() > sample_threshold_) {
    const auto k = static_cast<std::size_t>(std::ceil(std::sqrt(static_cast<double>(starts.size()))));
    std::vector<std::size_t> sample;
    for (std::size_t j = 0; j < k; ++j) sample.push_back(starts[next_random() % starts.size()]);
    starts.swap(sample);
  }
  double best_score = std::numeric_limits<double>::infinity();
  std::size_t best_l = 0, best_r = 0;
  bool found = false;
  for (std::size_t l : starts) {
    std::size_t have = 0, r = l;
    double cost = 0;
    bool evicts = false;
    for (; r < n && items_[r].segment == items_[l].segment && items_[r].value != kBlocked; ++r) {
      have += items_[r].size;
      cost += weight(r);
      evicts |= items_[r].value >= 0;
      if (have >= bytes) break;
    }
    if (have < bytes || !evicts) continue;
    double score = cost;
    if (policy_ == Policy::kDtralloc) {
      // Per byte it frees, free neighbours outside the run included.
      std::size_t total = have;
      if (l > 0 && items_[l - 1].segment == items_[l].segment && items_[l - 1].value == kFree)
        total += items_[l - 1].size;
      if (r + 1 < n && items_[r + 1].segment == items_[r].segment && items_[r + 1].value == kFree)
        total += items_[r + 1].size;
      score = cost / static_cast<double>(total);
    }
    if (score < best_score) best_score = score, best_l = l, best_r = r, found = true;
  }
  std::vector<int> victims;
  if (!found) return victims;
  for (std::size_t i = best_l; i <= best_r; ++i)
    if (items_[i].value >= 0) victims.push_back(items_[i].value);
  return victims;
}

// The cheapest segment (per byte) made only of free and evictable blocks:
// evicting all of it lets the pool release it and grow where it must.
std::vector<int> Evictor::choose_segment() {
  const std::size_t n = items_.size();
  double best_score = std::numeric_limits<double>::infinity();
  std::size_t best_begin = 0, best_end = 0;
  for (std::size_t b = 0; b < n;) {
    std::size_t e = b;
    bool ok = true, evicts = false;
    std::size_t bytes = 0;
    double cost = 0;
    for (; e < n && items_[e].segment == items_[b].segment; ++e) {
      bytes += items_[e].size;
      if (items_[e].value == kBlocked) ok = false;
      if (items_[e].value >= 0) {
        evicts = true;
        cost += window_weight(items_[e].value);
      }
    }
    if (ok && evicts && cost / static_cast<double>(bytes) < best_score)
      best_score = cost / static_cast<double>(bytes), best_begin = b, best_end = e;
    b = e;
  }
  std::vector<int> victims;
  for (std::size_t i = best_begin; i < best_end; ++i)
    if (items_[i].value >= 0) victims.push_back(items_[i].value);
  return victims;
}

}  // namespace dtralloc
