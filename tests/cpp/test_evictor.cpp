// Evictor: every policy picks the victims worked out by hand on a crafted
// address layout, and make_room frees a contiguous range the request uses.
#include <algorithm>
#include <memory>
#include <string>

#include "allocator.h"
#include "backend.h"
#include "check.h"
#include "wrapped_backend.h"
#include "evictor.h"
#include "remat_engine.h"

using namespace dtralloc;

namespace {

constexpr std::size_t kQuarter = 512 * 1024;  // four fill one 2 MiB small segment

// An engine on a virtual device under `conf` (which names the budget).
struct Graph {
  Allocator allocator;
  PoolPort port;
  RematEngine engine;

  explicit Graph(const std::string& conf)
      : allocator(make_virtual_backend(std::size_t{1} << 40), parse_config(conf)),
        port(allocator),
        engine(port) {}
  ~Graph() { engine.release_all(); }
  // The output (`bytes`) of an op of `cost` that reads `input` (-1: none).
  int make(double cost, int input, std::size_t bytes) {
    OpCall call;
    call.cost = cost;
    if (input >= 0) call.reads = {input};
    const int op = engine.begin_op(call);
    const int v = engine.add_output(op, bytes);
    engine.end_op(op);
    return v;
  }
  // An op of no cost that only reads `v`.
  void read(int v) {
    OpCall call;
    call.reads = {v};
    engine.end_op(engine.begin_op(call));
  }
};

// One small-pool segment (the whole 2 MiB budget) holding, in address order,
//   A (cost 10)  B (cost 1)  C (cost 1)  D (cost 100)
// each 512 KiB, made by input-less ops at the same clock.
struct Layout : Graph {
  int a, b, c, d;

  explicit Layout(const std::string& conf = "") : Graph("budget:2M" + conf) {
    a = make(10, -1, kQuarter);
    b = make(1, -1, kQuarter);
    c = make(1, -1, kQuarter);
    d = make(100, -1, kQuarter);
    CHECK(engine.value(a).addr < engine.value(b).addr);
    CHECK(engine.value(c).addr < engine.value(d).addr);
  }
};

std::vector<int> choose(const std::string& policy, Layout& l, std::size_t bytes) {
  Evictor ev(l.allocator, l.engine, parse_policy(policy), l.allocator.config());
  return ev.choose(bytes, 0);
}

void test_single_tensor_policies() {
  Layout l;
  l.engine.tick();
  // lru: all equally stale -> lowest id; size: all equal -> lowest id.
  CHECK(choose("lru", l, 1 << 20) == std::vector<int>{l.a});
  CHECK(choose("size", l, 1 << 20) == std::vector<int>{l.a});
  // Cost-based scores pick the cheapest (B before C on ties).
  for (const char* p : {"msps", "dtr", "dtr_eq", "dtr_local", "dte"})
    CHECK(choose(p, l, 1 << 20) == std::vector<int>{l.b});
  // Touch B: now A is least recently used, and B's staleness shrinks.
  l.engine.tick();
  l.read(l.b);
  l.engine.tick();
  CHECK(choose("lru", l, 1 << 20) == std::vector<int>{l.a});
  CHECK(choose("dtr_local", l, 1 << 20) == std::vector<int>{l.c});
}

void test_dte_counts_free_neighbours() {
  Layout l;
  // Evict C: it becomes a free 512 KiB block between B and D.
  CHECK(l.engine.evict(l.c));
  // dte: B = (1 + e* 1) / (512K + 512K free); A = 10 / 512K; D = (100 + 1) / 1M.
  CHECK(choose("dte", l, 1 << 20) == std::vector<int>{l.b});
  // dtr_eq ignores the free space: B (2 / 512K) still first, A next would be 10.
  CHECK(choose("dtr_eq", l, 1 << 20) == std::vector<int>{l.b});
}

void test_window_policies() {
  Layout l;
  // 1 MiB windows: AB costs 11, BC 2, CD 101 -> both pick {B, C}.
  CHECK(choose("coop", l, 1 << 20) == (std::vector<int>{l.b, l.c}));
  CHECK(choose("dtralloc", l, 1 << 20) == (std::vector<int>{l.b, l.c}));
  // One quarter: the cheapest single block, B (lower address than C).
  CHECK(choose("coop", l, kQuarter) == (std::vector<int>{l.b}));
  CHECK(choose("dtralloc", l, kQuarter) == (std::vector<int>{l.b}));
  // Evict A: a free block beside B. Now 1 MiB is (free A, B) for cost 1,
  // cheaper than B + C (2) for both policies.
  CHECK(l.engine.evict(l.a));
  CHECK(choose("dtralloc", l, 1 << 20) == (std::vector<int>{l.b}));
  CHECK(choose("coop", l, 1 << 20) == (std::vector<int>{l.b}));
}

void test_dtralloc_recompute_penalty() {
  Layout l(",recompute_penalty:8");
  // B recomputed three times weighs 1 * 8^3 = 512 in dtralloc's score, so
  // the 1 MiB windows cost AB 522, BC 513, CD 101 (same staleness): CD wins.
  for (int i = 0; i < 3; ++i) {
    CHECK(l.engine.evict(l.b));
    l.read(l.b);
  }
  CHECK_EQ(l.engine.value(l.b).recomputes, 3);
  CHECK(choose("dtralloc", l, 1 << 20) == (std::vector<int>{l.c, l.d}));
  CHECK(choose("coop", l, 1 << 20) == (std::vector<int>{l.b, l.c}));  // coop has no penalty
}

void test_dtralloc_charges_the_recompute_chain() {
  // P (cost 50)  Q = f(P) (cost 1)  R (cost 1)  S (cost 3), 512 KiB each.
  Graph g("budget:2M");
  RematEngine& engine = g.engine;
  Allocator& allocator = g.allocator;
  const int p = g.make(50, -1, kQuarter), q = g.make(1, p, kQuarter);
  const int r = g.make(1, -1, kQuarter), s = g.make(3, -1, kQuarter);
  CHECK(engine.evict(p));  // free 512 KiB beside Q; recomputing Q now reruns P
  CHECK_EQ(engine.chain_cost(q), 51.0);
  // 1 MiB: (free P, Q) costs 51 with the chain, (R, S) 4: dtralloc takes R, S.
  // Coop charges Q's own op only (1) and takes Q.
  Evictor dtralloc_ev(allocator, engine, Policy::kDtralloc, allocator.config());
  CHECK(dtralloc_ev.choose(1 << 20, 0) == (std::vector<int>{r, s}));
  Evictor coop_ev(allocator, engine, Policy::kCoop, allocator.config());
  CHECK(coop_ev.choose(1 << 20, 0) == (std::vector<int>{q}));
}

// dtralloc keeps a value whose recompute could not fit beside the kept
// values (kRecoverableShare of the room they leave): in one 2 MiB segment,
//   X  Y  Z  (cost 100 each)  V = g(X, Y, Z) (cost 1), 512 KiB each.
// Recomputing V holds all four, the whole budget: V is the cheapest victim,
// but evicting it would leave an op that reads it nothing to run with once
// anything else is resident. Coop (no such rule) still takes it.
void test_dtralloc_keeps_what_could_not_come_back() {
  Graph g("budget:2M");
  const int x = g.make(100, -1, kQuarter), y = g.make(100, -1, kQuarter), z = g.make(100, -1, kQuarter);
  OpCall call;
  call.cost = 1;
  call.reads = {x, y, z};
  const int op = g.engine.begin_op(call);
  const int v = g.engine.add_output(op, kQuarter);
  g.engine.end_op(op);
  CHECK_EQ(g.engine.recompute_need_bytes(v), 4.0 * kQuarter);
  CHECK(4.0 * kQuarter > kRecoverableShare * (2 << 20));
  Evictor dtralloc_ev(g.allocator, g.engine, Policy::kDtralloc, g.allocator.config());
  const std::vector<int> taken = dtralloc_ev.choose(kQuarter, 0);
  CHECK_EQ(taken.size(), std::size_t{1});
  CHECK(taken.front() != v);
  Evictor coop_ev(g.allocator, g.engine, Policy::kCoop, g.allocator.config());
  CHECK(coop_ev.choose(kQuarter, 0) == std::vector<int>{v});
  // With X evicted V's recompute needs no more (X's own op holds only X).
  CHECK(g.engine.evict(x));
  CHECK_EQ(g.engine.recompute_need_bytes(v), 4.0 * kQuarter);

  // The room is what the kept values leave: with 1.5 MiB of parameters
  // beside A (cost 1, no inputs), A's recompute needs 512 KiB, more than 0.9
  // of the 512 KiB left, and dtralloc finds nothing to evict.
  Graph p("budget:2M");
  for (int i = 0; i < 3; ++i) p.engine.add_initial(kQuarter);
  const int a = p.make(1, -1, kQuarter);
  CHECK_EQ(p.engine.kept_resident_bytes(), 3 * kQuarter);
  CHECK(Evictor(p.allocator, p.engine, Policy::kDtralloc, p.allocator.config()).choose(kQuarter, 0).empty());
  CHECK(Evictor(p.allocator, p.engine, Policy::kCoop, p.allocator.config()).choose(kQuarter, 0) ==
        std::vector<int>{a});
}

// dtralloc does not evict a value ruinous to bring back (its chain costs
// over kRuinousShare of the step so far) where free pages make room, the
// pages of a room spared for an evicted value included. Budget 44 MiB:
//   segment A (20 MiB): H (8 MiB, cost 1, evicted: its room spared)
//                       W (8 MiB, cost 100)  pin (4 MiB, initial)
//   segment B (20 MiB): initial, pinned
// A 12 MiB output: 4 MiB of headroom, no free pages outside H's room (so
// none went back before the evictor was asked), and W is the only victim.
void test_dtralloc_spares_a_ruinous_victim() {
  for (Policy policy : {Policy::kDtralloc, Policy::kCoop}) {
    Graph g("budget:44M,segment_fit:off,unmap_pages:on,spare_evicted:on");
    constexpr std::size_t k8 = 8 << 20;
    const int h = g.make(1, -1, k8);
    const int w = g.make(100, -1, k8);
    g.engine.add_initial(4 << 20);
    g.engine.add_initial(20 << 20);
    CHECK_EQ(g.engine.value(w).addr, g.engine.value(h).addr + k8);
    CHECK_EQ(g.allocator.stats_report().stats.reserved_bytes[kStatAll].current, std::int64_t{40} << 20);
    const std::uintptr_t h_addr = g.engine.value(h).addr;
    CHECK(g.engine.evict(h));
    CHECK(g.engine.value(h).home);
    auto ev = std::make_shared<Evictor>(g.allocator, g.engine, policy, g.allocator.config());
    g.allocator.set_eviction_hook(ev);
    CHECK(ev->choose(12 << 20, 0) == std::vector<int>{w});
    CHECK(ev->ruinous({w}));  // 100 > 0.2 * 101
    OpCall call;
    call.cost = 1;
    const int op = g.engine.begin_op(call);
    const int out = g.engine.add_output(op, 12 << 20);
    g.engine.end_op(op);
    const Stats st = g.allocator.stats_report().stats;
    if (policy == Policy::kDtralloc) {
      // H's 8 MiB of pages went back; W stays; the output got its own segment.
      CHECK(g.engine.value(w).state == ValueState::kResident);
      CHECK_EQ(ev->stats().ruinous_spared, std::size_t{1});
      CHECK_EQ(st.num_page_releases, 1);
      CHECK(g.engine.value(out).addr != h_addr);
    } else {
      // Coop (no such rule) evicts W and the output takes H's and W's room.
      CHECK(g.engine.value(w).state == ValueState::kEvicted);
      CHECK_EQ(ev->stats().ruinous_spared, std::size_t{0});
      CHECK_EQ(st.num_page_releases, 0);
      CHECK_EQ(g.engine.value(out).addr, h_addr);
    }
    CHECK_EQ(g.engine.counters().evictions, policy == Policy::kDtralloc ? 1u : 2u);
    g.allocator.check_invariants();
    g.engine.check_invariants();
    g.allocator.set_eviction_hook(nullptr);
  }
  // Not ruinous: a chain within the share of the step so far.
  Graph g("budget:44M");
  const int a = g.make(10, -1, 1 << 20);
  g.make(90, -1, 1 << 20);
  Evictor ev(g.allocator, g.engine, Policy::kDtralloc, g.allocator.config());
  CHECK(!ev.ruinous({a}));  // 10 <= 0.2 * 100
}

void test_make_room_serves_request() {
  Layout l;
  auto ev = std::make_shared<Evictor>(l.allocator, l.engine, Policy::kDtralloc, l.allocator.config());
  l.allocator.set_eviction_hook(ev);
  EventLog log;
  ev->set_event_log(&log);
  l.engine.set_event_log(&log);
  const std::uintptr_t b_addr = l.engine.value(l.b).addr;
  // A 1 MiB output does not fit under the budget: B and C go, it lands there.
  OpCall call;
  call.cost = 5;
  const int op = l.engine.begin_op(call);
  const int e = l.engine.add_output(op, 1 << 20);
  l.engine.end_op(op);
  CHECK_EQ(l.engine.value(e).addr, b_addr);
  // Logged: the call (a window over B and C, at B's address), then B and C.
  CHECK_EQ(log.size(), std::size_t{3});
  CHECK_EQ(log.kind[0], static_cast<std::uint8_t>(EventKind::kRoomAsked));
  CHECK_EQ(log.plan[0], static_cast<std::uint8_t>(PlanKind::kWindow));
  CHECK_EQ(log.window_addr[0], b_addr);
  CHECK_EQ(log.window_bytes[0], std::int64_t{1 << 20});
  CHECK_EQ(log.bytes[0], std::int64_t{1 << 20});
  CHECK(log.score[0] > 0);
  CHECK_EQ(log.kind[1], static_cast<std::uint8_t>(EventKind::kEvicted));
  CHECK_EQ(log.value[1], l.b);
  CHECK_EQ(log.value[2], l.c);
  CHECK_EQ(log.op[1], op);
  CHECK(l.engine.value(l.b).state == ValueState::kEvicted);
  CHECK(l.engine.value(l.c).state == ValueState::kEvicted);
  CHECK(l.engine.value(l.a).state == ValueState::kResident);
  CHECK_EQ(ev->stats().calls, std::size_t{1});
  CHECK_EQ(ev->stats().windows, std::size_t{1});
  l.allocator.check_invariants();
  l.engine.check_invariants();
  l.allocator.set_eviction_hook(nullptr);
}

// A GPU that other memory shares (its CUDA context, another process): it
// reports `total` bytes, as cudaMemGetInfo does, but refuses segments past
// `limit` bytes of its own, and says so in free_bytes().
class SharedDevice final : public WrappedBackend {
 public:
  SharedDevice(std::size_t total, std::size_t limit) : WrappedBackend(make_virtual_backend(total)), limit_(limit) {}
  const char* name() const override { return "shared-device"; }
  void* allocate(std::size_t bytes, Stream stream) override {
    if (used_ + bytes > limit_) return nullptr;
    void* p = inner().allocate(bytes, stream);
    if (p) used_ += bytes;
    return p;
  }
  void release(void* ptr, std::size_t bytes, Stream stream) override {
    inner().release(ptr, bytes, stream);
    used_ -= bytes;
  }
  std::size_t free_bytes() override { return limit_ - used_; }

 private:
  std::size_t limit_;
  std::size_t used_ = 0;
};

// No budget (the pool's is the device's capacity), and the device full long
// before it: dtralloc.install() and dtr() on a GPU, training a model that
// does not fit. Five 12 MiB values in segments of their own fill the 64 MiB
// the device lets the pool have; a 24 MiB output fits none of their
// segments, so only releasing two of them makes room. Once the device has
// refused the segment, the headroom is its 4 MiB, not the budget's 1 GiB -
// 60 MiB: a plan that trusted the budget found nothing to release, and the
// output ran out of memory.
void test_the_device_limits_the_headroom_not_only_the_budget() {
  for (const char* policy : {"dtralloc", "coop"}) {
    Allocator allocator(std::make_unique<SharedDevice>(std::size_t{1} << 30, std::size_t{64} << 20),
                        parse_config(std::string("unmap_pages:off,policy:") + policy));
    PoolPort port(allocator);
    RematEngine engine(port);
    auto make = [&](double cost, std::size_t bytes) {
      OpCall call;
      call.cost = cost;
      const int op = engine.begin_op(call);
      const int v = engine.add_output(op, bytes);
      engine.end_op(op);
      return v;
    };
    constexpr std::size_t k12 = 12 << 20;
    std::vector<int> made;
    for (int i = 0; i < 5; ++i) made.push_back(make(1 + i, k12));
    CHECK_EQ(allocator.budget_bytes(), std::size_t{1} << 30);
    CHECK_EQ(allocator.stats_report().stats.reserved_bytes[kStatAll].current, std::int64_t{60} << 20);
    auto ev = std::make_shared<Evictor>(allocator, engine, parse_policy(policy), allocator.config());
    allocator.set_eviction_hook(ev);
    const int out = make(1, 24 << 20);
    CHECK(engine.value(out).state == ValueState::kResident);
    CHECK_EQ(engine.counters().evictions, 2u);  // the two cheapest segments
    CHECK(engine.value(made[0]).state == ValueState::kEvicted);
    CHECK(engine.value(made[1]).state == ValueState::kEvicted);
    CHECK_EQ(ev->stats().segment_releases, std::size_t{1});
    // 60 MiB again, 4 MiB left on the device. A 3 MiB output would get a
    // 20 MiB segment, which the device refuses; one of its own 2 MiB-rounded
    // size (4 MiB) fits, and nothing is evicted for it.
    const int small = make(1, 3 << 20);
    CHECK(engine.value(small).state == ValueState::kResident);
    CHECK_EQ(engine.counters().evictions, 2u);
    CHECK(allocator.stats_report().stats.reserved_bytes[kStatAll].current <= std::int64_t{64} << 20);
    allocator.check_invariants();
    engine.check_invariants();
    allocator.set_eviction_hook(nullptr);
    engine.release_all();
  }
}

// Large-pool segments of their own: X (cost 5), Y (cost 1), Z (initial,
// pinned), 20 MiB each, in three 20 MiB segments.
struct Segments : Graph {
  int x, y, z;
  explicit Segments(const std::string& budget) : Graph("budget:" + budget) {
    constexpr std::size_t k20 = 20 << 20;
    x = make(5, -1, k20);
    y = make(1, -1, k20);
    z = engine.add_initial(k20);
    CHECK_EQ(allocator.stats_report().stats.segment[kStatAll].current, 3);
  }
};

void test_release_plans() {
  {
    Segments s("60M");  // no headroom
    // 40 MiB fits no segment: release X's and Y's (Z is pinned).
    for (const char* p : {"dtralloc", "coop"}) {
      Evictor ev(s.allocator, s.engine, parse_policy(p), s.allocator.config());
      std::vector<int> v = ev.choose(40 << 20, 0);
      std::sort(v.begin(), v.end());
      CHECK(v == (std::vector<int>{s.x, s.y}));
    }
    // 20 MiB: Y's segment, as a window or a release (same cost per byte).
    Evictor ev(s.allocator, s.engine, Policy::kDtralloc, s.allocator.config());
    CHECK(ev.choose(20 << 20, 0) == std::vector<int>{s.y});
    // 60 MiB: even X and Y together leave too little: no plan, nothing evicted.
    CHECK(ev.choose(60 << 20, 0).empty());
  }
  {
    Segments s("70M");  // 10 MiB of headroom: 30 MiB needs one segment released
    Evictor ev(s.allocator, s.engine, Policy::kDtralloc, s.allocator.config());
    CHECK(ev.choose(30 << 20, 0) == std::vector<int>{s.y});
    CHECK(ev.choose(50 << 20, 0).size() == 2);
  }
  {
    // Through the allocator: a 40 MiB output evicts X and Y in one call, and
    // the pool releases their segments to make room.
    Segments s("60M");
    auto ev = std::make_shared<Evictor>(s.allocator, s.engine, Policy::kDtralloc, s.allocator.config());
    s.allocator.set_eviction_hook(ev);
    OpCall call;
    call.cost = 1;
    const int op = s.engine.begin_op(call);
    const int big = s.engine.add_output(op, 40 << 20);
    s.engine.end_op(op);
    CHECK(s.engine.value(big).state == ValueState::kResident);
    CHECK(s.engine.value(s.x).state == ValueState::kEvicted);
    CHECK(s.engine.value(s.y).state == ValueState::kEvicted);
    CHECK_EQ(ev->stats().calls, std::size_t{1});
    CHECK_EQ(ev->stats().segment_releases, std::size_t{1});
    // Now nothing can make 60 MiB: make_room says so at once, and malloc OOMs.
    const int op2 = s.engine.begin_op(call);
    CHECK_CONTAINS(check::thrown_message<OutOfMemoryError>([&] { s.engine.add_output(op2, 60 << 20); }),
                   "out of memory");
    CHECK_EQ(ev->stats().no_plan, std::size_t{1});
    s.engine.end_op(op2);
    s.allocator.check_invariants();
    s.allocator.set_eviction_hook(nullptr);
  }
}

void test_release_plan_costs_chains() {
  // Own 20 MiB segments: P (cost 50, then evicted: its segment stays cached,
  // free), Q = f(P) (cost 1), R (cost 3), and a pinned one; 20 MiB headroom.
  // 40 MiB fits no segment, so one segment must go. By producer cost Q is
  // cheapest, but bringing Q back reruns P: 51. dtralloc releases R's.
  Graph g("budget:100M");
  RematEngine& engine = g.engine;
  Allocator& allocator = g.allocator;
  constexpr std::size_t k20 = 20 << 20;
  const int p = g.make(50, -1, k20), q = g.make(1, p, k20), r = g.make(3, -1, k20);
  engine.add_initial(k20);
  CHECK(engine.evict(p));
  CHECK_EQ(engine.chain_cost(q), 51.0);
  Evictor ev(allocator, engine, Policy::kDtralloc, allocator.config());
  CHECK(ev.choose(40 << 20, 0) == std::vector<int>{r});
  // Needing two segments, the greedy takes both Q's and R's.
  Evictor tight(allocator, engine, Policy::kDtralloc, allocator.config());
  std::vector<int> both = tight.choose(60 << 20, 0);
  std::sort(both.begin(), both.end());
  CHECK(both == (std::vector<int>{q, r}));
}

// Thorough search (dtralloc): an 18 MiB tensor L held (acquired: locked, not
// pinned, so the room recomputes have is the whole budget), an evictable
// 20 MiB X in its own segment, four evictable quarters S in one small segment.
//   - 2.5 MiB under a budget leaving 2 MiB of headroom: its own 4 MiB
//     segment needs one small segment released; the large pool offers
//     nothing (L's segment is held, X's is dearer per byte than the
//     quarters). Requests under 20 MiB walk the small pool at once.
//   - 22 MiB with no headroom: X's segment alone is 2 MiB short. The first
//     search (large pool only) finds no plan; the second, over every pool,
//     releases X's segment and the small one.
// Coop, not thorough, evicts X for the first (the large pool's only window)
// and finds no plan for the second.
void test_thorough_search() {
  constexpr std::size_t k18 = 18 << 20, k20 = 20 << 20;
  for (const char* budget : {"42M", "40M"}) {
    Graph g(std::string("budget:") + budget);
    g.engine.acquire(g.make(1000, -1, k18));
    const int x = g.make(50, -1, k20);
    std::vector<int> quarters;
    for (int i = 0; i < 4; ++i) quarters.push_back(g.make(1, -1, kQuarter));
    CHECK_EQ(g.allocator.stats_report().stats.reserved_bytes[kStatAll].current, std::int64_t{40} << 20);
    const bool headroom = std::string(budget) == "42M";
    const std::size_t request = headroom ? (5 << 20) / 2 : 22 << 20;
    Evictor dtralloc(g.allocator, g.engine, Policy::kDtralloc, g.allocator.config());
    std::vector<int> got = dtralloc.choose(request, 0);
    std::sort(got.begin(), got.end());
    std::vector<int> want = quarters;
    if (!headroom) want.insert(want.begin(), x);
    CHECK(got == want);
    CHECK_EQ(dtralloc.stats().widened, headroom ? std::size_t{0} : std::size_t{1});
    Evictor coop(g.allocator, g.engine, Policy::kCoop, g.allocator.config());
    CHECK(coop.choose(request, 0) == (headroom ? std::vector<int>{x} : std::vector<int>{}));
  }
}

// small_in_large: a small request that the small pool can neither serve
// (its one segment is pinned) nor grow for (no headroom) takes a window in
// the large pool, whose one segment cannot be released (L is held): E goes,
// and the request lands where E was. Without small_in_large the pool could
// not use that room, and there is no plan.
void test_small_request_takes_a_large_window() {
  for (const char* mix : {"on", "off"}) {
    Graph g(std::string("budget:22M,segment_fit:off,unmap_pages:off,small_in_large:") + mix);
    for (int i = 0; i < 4; ++i) g.engine.add_initial(kQuarter);
    const int e = g.make(1, -1, 2 << 20);
    const int l = g.make(1000, -1, 18 << 20);
    g.engine.acquire(l);
    CHECK_EQ(g.allocator.stats_report().stats.segment[kStatAll].current, 2);
    CHECK_EQ(g.allocator.stats_report().stats.reserved_bytes[kStatAll].current, std::int64_t{22} << 20);
    auto ev = std::make_shared<Evictor>(g.allocator, g.engine, Policy::kDtralloc, g.allocator.config());
    const bool on = std::string(mix) == "on";
    CHECK(ev->choose(kQuarter, 0) == (on ? std::vector<int>{e} : std::vector<int>{}));
    CHECK_EQ(ev->stats().no_plan, on ? std::size_t{0} : std::size_t{1});
    if (on) {  // through the allocator
      const std::uintptr_t e_addr = g.engine.value(e).addr;
      g.allocator.set_eviction_hook(ev);
      OpCall call;
      call.cost = 1;
      const int op = g.engine.begin_op(call);
      const int small = g.engine.add_output(op, kQuarter);
      g.engine.end_op(op);
      CHECK(g.engine.value(e).state == ValueState::kEvicted);
      CHECK_EQ(g.engine.value(small).addr, e_addr);
      CHECK_EQ(ev->stats().large_windows, std::size_t{1});
      g.allocator.check_invariants();
      g.engine.check_invariants();
      g.allocator.set_eviction_hook(nullptr);
    }
    g.engine.unacquire(l);
  }
}

void test_unknown_policy() {
  CHECK_CONTAINS(check::thrown_message<ConfigError>([] { parse_policy("belady"); }), "belady");
  CHECK_CONTAINS(check::thrown_message<ConfigError>([] { parse_config("policy:belady"); }), "policy");
  CHECK(parse_config("policy:dtr").policy == Policy::kDtr);
  CHECK(parse_config("policy: DTRALLOC ").policy == Policy::kDtralloc);
  // The table: names round-trip, and the descriptor is what the evictor reads.
  for (const PolicyInfo& p : policy_table()) {
    CHECK(parse_policy(p.name) == p.policy);
    CHECK(std::string(policy_name(p.policy)) == p.name);
    CHECK(policy_names().find(p.name) != std::string::npos);
  }
  CHECK(policy_traits(Policy::kNone).choice == VictimChoice::kNone);
  CHECK(policy_traits(Policy::kDtralloc).choice == VictimChoice::kWindow);
  CHECK(policy_traits(Policy::kDtr).choice == VictimChoice::kSingle);
  CHECK_CONTAINS(check::thrown_message<ConfigError>([] { parse_config("policy:belady"); }), "dtralloc");
}

}  // namespace

int main() {
  test_single_tensor_policies();
  test_dte_counts_free_neighbours();
  test_window_policies();
  test_dtralloc_recompute_penalty();
  test_dtralloc_charges_the_recompute_chain();
  test_dtralloc_keeps_what_could_not_come_back();
  test_dtralloc_spares_a_ruinous_victim();
  test_make_room_serves_request();
  test_release_plans();
  test_the_device_limits_the_headroom_not_only_the_budget();
  test_release_plan_costs_chains();
  test_thorough_search();
  test_small_request_takes_a_large_window();
  test_unknown_policy();
  return check::check_summary("test_evictor");
}
