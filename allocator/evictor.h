// Evictor: the pool's last resort under the budget (Allocator step 5). It
// knows candidates and scores; it asks the pool about address neighbours
// (Allocator::inspect_pool) and the engine about costs and states. How it
// scores is the policy's descriptor (policies.h); the table there lists the
// policies.
//
// Single-tensor policies evict one tensor per call; the Allocator retries
// and calls again while room is missing. Window policies make room in one
// call, whichever of two plans costs less per byte it frees:
//   window   a run inside one segment of the request's pool that the
//            request fits once the run is evicted;
//   release  whole segments made only of free and evictable blocks, enough
//            of them that, released, the budget has room for the segment the
//            request needs (a request larger than every segment's runs).
// A thorough policy (the descriptor's `thorough`) searches again before
// giving up: every pool's segments and every window start, unsampled. With
// neither plan then, no eviction can serve the request now (every candidate
// run or segment holds a pinned or locked block), and they evict nothing:
// the Allocator reports OOM instead of recomputing for nothing. A caller
// does nothing differently either way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "allocator.h"
#include "config.h"
#include "event_log.h"
#include "policies.h"
#include "remat_engine.h"

namespace dtralloc {

// An Allocator as the engine's driver (stream 0): engine allocations go
// through the pool, tagged with the value id for the evictor's walk, and
// recomputing a value is placing it again. The replay driver's, and the
// evictor's tests'.
class PoolPort : public RematDriver {
 public:
  explicit PoolPort(Allocator& allocator) : allocator_(allocator) {}
  std::uintptr_t allocate(std::size_t bytes, int value) override {
    return reinterpret_cast<std::uintptr_t>(allocator_.malloc(bytes, 0, value));
  }
  void release(int /*value*/, std::uintptr_t addr) override { allocator_.free(reinterpret_cast<void*>(addr)); }
  void tight_placement(bool on) override { allocator_.set_tight_segments(on); }
  bool keep_home(int value, std::uintptr_t addr, std::size_t bytes) override {
    return allocator_.keep_home(this, value, addr, bytes);
  }
  void drop_home(int value) override { allocator_.drop_home(this, value); }
  std::size_t budget_bytes() override { return allocator_.budget_bytes(); }
  ~PoolPort() override { allocator_.drop_homes(this); }

 private:
  Allocator& allocator_;
};

struct EvictorStats {
  std::size_t calls = 0;                 // make_room calls (forced evictions)
  std::size_t windows = 0;               // calls served by a window plan
  std::size_t segment_releases = 0;      // calls served by a release plan
  std::size_t no_plan = 0;               // calls where no eviction could help
  std::size_t widened = 0;               // calls that searched everything (thorough policies)
  std::size_t large_windows = 0;         // calls that evicted a window in the large pool for a
                                         // small request (small_in_large; choose())
  std::size_t ruinous_spared = 0;        // calls that spared a ruinous victim (spare_ruinous):
                                         // free pages instead, or a hold's retry
  std::vector<std::int64_t> search_ns;   // time to choose victims, per call
  std::vector<double> free_fraction;     // (budget - allocated) / budget, per call
};

class Evictor : public EvictionHook {
 public:
  Evictor(Allocator& allocator, RematEngine& engine, Policy policy, const Config& config);
  bool make_room(std::size_t bytes, Stream stream) override;
  // The victims the policy picks now for `bytes` (rounded), evicting nothing.
  std::vector<int> choose(std::size_t bytes, Stream stream);
  // Whether one of `victims` is ruinous to bring back: its recompute chain
  // costs over kRuinousShare of the step's compute so far (spare_ruinous).
  bool ruinous(const std::vector<int>& victims);
  const EvictorStats& stats() const { return stats_; }
  // Where each call is logged (nullptr: nowhere); the engine logs the evictions.
  void set_event_log(EventLog* log) { log_ = log; }

 private:
  struct Item {             // one block of the address walk
    std::uintptr_t addr;
    std::size_t size;
    int value;              // resident value; kFree or kBlocked otherwise
    int segment;            // index into segs_
  };
  struct SegSpan {          // one segment of the walk: items_[begin, end)
    std::size_t begin, end;
    std::size_t bytes;
    PoolKind pool;
    bool blocked;           // holds a block no eviction can free
  };
  struct Plan {             // victims and their score (cost per byte freed)
    std::vector<int> victims;
    double score = std::numeric_limits<double>::infinity();
    std::uintptr_t addr = 0;  // the address range it frees (a window), for the event log
    std::size_t bytes = 0;
    bool found() const { return !victims.empty(); }
  };
  static constexpr int kFree = -1;
  static constexpr int kBlocked = -2;
  // Thorough policies walk the small pool too for requests below this: a
  // released 2 MiB small segment is a tenth of what such a request needs, or
  // more, and the room one or two of them make can be the cheapest there is.
  // 20 MiB: the large-pool segment, the most a released small segment or two
  // can stand in for; on the bundled GPU-scale traces it changed min
  // budgets by at most 0.005 (bench/results/replay_policies-*.md).
  static constexpr std::size_t kWalkSmallBelow = kLargeBuffer;

  void walk(Stream stream, bool large_only, std::size_t window_bytes);
  double victim_cost(int v);
  double single_score(int v, std::size_t free_around);
  double window_weight(int v);
  bool recoverable(int v);  // walk() only: within its need pass
  double weight(std::size_t i);
  double lower_weight(std::size_t i, bool* exact);
  std::vector<int> choose_single();
  Plan choose_window(std::size_t bytes, bool may_sample, PoolKind pool);
  Plan choose_release(std::size_t bytes, double bound);
  std::size_t free_at(std::size_t j, int segment) const;
  std::size_t free_beside(std::size_t i) const;
  std::uint64_t next_random();

  Allocator& allocator_;
  RematEngine& engine_;
  const Policy policy_;
  const PolicyTraits traits_;
  const double penalty_;
  const std::size_t cutoff_bytes_;
  const std::size_t sample_threshold_;
  std::uint64_t rng_;
  std::vector<Item> items_;                 // reused between calls
  std::vector<SegSpan> segs_;
  std::size_t headroom_ = 0;                // Allocator::limit_locked() - reserved at the walk
  bool small_in_large_ = false;              // the pool's small_in_large at the walk (read under its lock)
  double keep_above_ = 0;                   // recompute need past which a value is kept
  std::vector<std::size_t> starts_;         // window starts (choose_window)
  std::vector<double> weight_;              // per item of the walk; < 0: not yet computed
  struct Candidate {                        // a segment choose_release may release
    std::size_t seg;
    double cost;                            // exact, or a lower bound
    double per_byte;                        // cost / the segment's bytes
    bool exact;
  };
  std::vector<Candidate> candidates_;       // choose_release scratch
  std::vector<std::size_t> heap_;           // indices into candidates_
  std::vector<std::size_t> dearer_;         // the same, above the window's score
  EvictorStats stats_;
  EventLog* log_ = nullptr;
  PlanKind last_plan_ = PlanKind::kNoPlan;  // what choose() found, for the log
  bool large_window_ = false;               // choose() found a small request a large-pool window
  Plan logged_;                             // its score and range
};

}  // namespace dtralloc
