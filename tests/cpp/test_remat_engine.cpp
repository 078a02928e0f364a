// RematEngine: the per-op protocol, state machine, recompute chains (on an
// explicit stack), e*, in-place versions, fake deletion, locks, unwinding
// after an OOM. Memory comes from a fake driver that records live blocks.
#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <thread>

#include "allocator.h"
#include "check.h"
#include "remat_engine.h"

using namespace dtralloc;

namespace {

// Addresses from here up stand for memory the driver already held (adopted
// by add_output), not allocated through this fake.
constexpr std::uintptr_t kAdopted = std::uintptr_t{1} << 40;

class FakeMemory : public RematDriver {
 public:
  std::uintptr_t allocate(std::size_t bytes, int value) override {
    if (on_allocate) on_allocate(value);
    if (fail_after >= 0 && fail_after-- == 0) throw std::runtime_error("fake OOM");
    if (!bytes) return 0;
    const std::uintptr_t addr = next_;
    next_ += (bytes + 511) / 512 * 512 + 512;
    live[addr] = bytes;
    return addr;
  }
  void release(int value, std::uintptr_t addr) override {
    released.push_back(value);
    if (addr && addr < kAdopted) CHECK(live.erase(addr) == 1);
  }
  std::uintptr_t recompute(int value, std::size_t bytes) override {
    recomputed.push_back(value);
    return allocate(bytes, value);
  }
  bool held_elsewhere(int value) const override { return held.count(value) > 0; }
  std::size_t budget_bytes() override { return budget; }
  std::map<std::uintptr_t, std::size_t> live;
  std::size_t budget = 0;  // budget_bytes' answer
  std::function<void(int)> on_allocate;  // before each allocation, e.g. to evict
  int fail_after = -1;                   // >= 0: that many more allocations succeed, then one throws
  std::vector<int> released, recomputed;
  std::set<int> held;

 private:
  std::uintptr_t next_ = 0x10000;
};

OpCall call(double cost, std::vector<int> reads = {}, std::vector<int> writes = {}, bool random = false) {
  OpCall c;
  c.cost = cost;
  c.random = random;
  c.reads = std::move(reads);
  c.writes = std::move(writes);
  return c;
}

// One op with no inputs making one value of `bytes` at `cost`.
int leaf(RematEngine& e, std::size_t bytes, double cost) {
  const int op = e.begin_op(call(cost));
  const int v = e.add_output(op, bytes);
  e.end_op(op);
  return v;
}

// One op reading `inputs`, making one value.
int apply(RematEngine& e, std::vector<int> inputs, std::size_t bytes, double cost, bool random = false) {
  const int op = e.begin_op(call(cost, inputs, {}, random));
  const int v = e.add_output(op, bytes);
  e.end_op(op);
  return v;
}

// An op that only reads `inputs` (the way a test asks for values).
void read(RematEngine& e, std::vector<int> inputs) { e.end_op(e.begin_op(call(1, std::move(inputs)))); }

void test_states_and_release() {
  FakeMemory mem;
  RematEngine e(mem);
  const int w = e.add_initial(4096);
  CHECK(e.value(w).pinned);
  CHECK(!e.evictable(w));
  const int a = apply(e, {w}, 1024, 10);
  CHECK(e.value(a).state == ValueState::kResident);
  CHECK(e.evictable(a));
  CHECK_EQ(mem.live.size(), std::size_t{2});
  // Nobody needs a: killing it releases it and its memory.
  e.kill(a);
  CHECK(e.value(a).state == ValueState::kReleased);
  CHECK_EQ(mem.live.size(), std::size_t{1});
  e.check_invariants();
  e.release_all();
}

void test_evict_and_recompute_chain() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(1024);
  const int a = apply(e, {x}, 1024, 3);
  const int b = apply(e, {a}, 1024, 5);
  const int c = apply(e, {b}, 1024, 7);
  // a dies but b's recipe reads it: fake deletion keeps the recipe only.
  e.kill(a);
  CHECK(e.value(a).state == ValueState::kDeadNeeded);
  CHECK_EQ(e.counters().fake_deletions, std::size_t{1});
  CHECK(e.evict(b));
  CHECK(e.value(b).state == ValueState::kEvicted);
  // e* of the resident c: its memoryless neighbourhood {b} -> {a} is one
  // union-find class costing 5 + 3.
  CHECK_EQ(e.estar_eq(c), 7.0 + 5.0 + 3.0);
  CHECK_EQ(e.estar_exact(c), 15.0);
  CHECK_EQ(e.chain_cost(c), 15.0);  // what recomputing c after evicting it costs
  CHECK(e.evict(c));
  CHECK_EQ(mem.live.size(), std::size_t{1});  // x only
  e.check_invariants();
  // Reading c recomputes a, then b, then c.
  read(e, {c});
  CHECK_EQ(e.counters().remats, std::size_t{3});
  CHECK_EQ(e.counters().remat_cost, 15.0);
  CHECK(e.value(c).state == ValueState::kResident);
  CHECK(e.value(b).state == ValueState::kResident);
  CHECK_EQ(e.value(c).recomputes, 1);
  // a came back only for b: dead, resident, an ordinary candidate.
  CHECK(e.value(a).state == ValueState::kResident);
  CHECK(!e.value(a).alive);
  CHECK(e.evictable(a));
  e.check_invariants();
  e.release_all();
}

void test_estar_classes() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(512);
  const int a = apply(e, {x}, 512, 1);
  const int b = apply(e, {a}, 512, 2);
  const int c = apply(e, {b}, 512, 4);
  const int d = apply(e, {c}, 512, 8);
  CHECK_EQ(e.estar_eq(b), 2.0);  // no evicted neighbour
  CHECK(e.evict(a));
  CHECK(e.evict(c));
  // b touches two classes: {a} and {c}.
  CHECK_EQ(e.estar_eq(b), 2.0 + 1.0 + 4.0);
  CHECK(e.evict(b));
  // d touches one class {a, b, c}.
  CHECK_EQ(e.estar_eq(d), 8.0 + 7.0);
  CHECK_EQ(e.estar_exact(d), 15.0);
  e.check_invariants();
  e.release_all();
}

void test_in_place_versions() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(1024);
  const int a = apply(e, {x}, 2048, 3);
  const std::uintptr_t addr = e.value(a).addr;
  // relu_(a): the block stays, the new version takes it.
  const int op = e.begin_op(call(2, {a}, {a}));
  const int a2 = e.write(op, a);
  CHECK(e.value(a2).locks > 0);  // pinned while the write is live
  CHECK(!e.evictable(a2));
  e.end_op(op);
  CHECK_EQ(e.value(a2).addr, addr);
  CHECK(e.value(a).state == ValueState::kDeadNeeded);  // old version: recipe only
  CHECK(e.evictable(a2));
  CHECK_EQ(mem.live.size(), std::size_t{2});
  e.check_invariants();
  // Evict the new version; reading it recomputes the old one, then the write.
  CHECK(e.evict(a2));
  read(e, {a2});
  CHECK_EQ(e.counters().remats, std::size_t{2});
  CHECK_EQ(e.counters().remat_cost, 5.0);
  e.check_invariants();
  e.release_all();
}

void test_write_to_pinned_value() {
  FakeMemory mem;
  RematEngine e(mem);
  const int p = e.add_initial(1024);  // a parameter
  const int a = apply(e, {p}, 1024, 3);
  CHECK(e.evict(a));
  // The optimizer overwrites p: a must come back first and is pinned after.
  const int op = e.begin_op(call(1, {p}, {p}));
  CHECK(e.value(a).state == ValueState::kResident);
  const int p2 = e.write(op, p);
  e.end_op(op);
  CHECK(e.value(a).pinned);
  CHECK(e.value(p2).pinned);
  CHECK(!e.evictable(a));
  CHECK(e.value(p).state == ValueState::kReleased);
  e.check_invariants();
  e.release_all();
}

// Overwriting an unrecomputable value pins what reads it and nothing
// further: a value computed from a reader recomputes from the pinned reader.
// FSDP2 frees every parameter after its block (an overwrite: live_saved.cpp,
// resizing), and every later activation descends from the first block's.
// A reader the program dropped, kept without memory for its readers' recipes,
// is not recomputed for them: its readers are pinned in its place (an evicted
// one brought back) and it goes.
void test_write_to_pinned_value_pins_only_its_readers() {
  FakeMemory mem;
  RematEngine e(mem);
  const int p = e.add_initial(1024);  // a parameter
  const int a = apply(e, {p}, 1024, 3);
  const int b = apply(e, {a}, 1024, 3);
  const int c = apply(e, {b}, 1024, 3);
  const int d = apply(e, {p}, 1024, 3);  // dropped by the program; f reads it
  const int f = apply(e, {d}, 1024, 3);
  const int g = apply(e, {p}, 1024, 3);  // dropped; h reads it, h is evicted
  const int h = apply(e, {g}, 1024, 3);
  CHECK(e.evict(a));
  CHECK(e.evict(b));
  CHECK(e.evict(h));
  e.kill(d);
  e.kill(g);
  CHECK(e.value(d).state == ValueState::kDeadNeeded);
  CHECK(e.value(g).state == ValueState::kDeadNeeded);
  mem.recomputed.clear();
  const int op = e.begin_op(call(1, {p}, {p}));
  const int p2 = e.write(op, p);
  e.end_op(op);
  CHECK(p2 >= 0);
  // a came back; h came back through g; f was resident: nothing ran for it.
  std::sort(mem.recomputed.begin(), mem.recomputed.end());
  CHECK(mem.recomputed == std::vector<int>({a, g, h}));
  for (int r : {a, f, h}) {
    CHECK(e.value(r).pinned);
    CHECK(e.value(r).state == ValueState::kResident);
  }
  CHECK(e.value(d).state == ValueState::kReleased);
  CHECK(e.value(g).state == ValueState::kReleased);
  CHECK(!e.value(b).pinned && e.value(b).state == ValueState::kEvicted);
  CHECK(!e.value(c).pinned && e.evictable(c));
  e.check_invariants();
  // b recomputes from pinned a; c can go and come back through b.
  CHECK(e.evict(c));
  mem.recomputed.clear();
  read(e, {c});
  CHECK(mem.recomputed == std::vector<int>({b, c}));
  // a, dropped by the program, stays while b's recipe reads it.
  e.kill(a);
  CHECK(e.value(a).state == ValueState::kResident);
  e.kill(b);
  CHECK(e.evict(c));
  CHECK(e.value(a).state == ValueState::kResident);
  e.kill(c);
  CHECK(e.value(a).state == ValueState::kReleased);
  e.check_invariants();
  e.release_all();
}

// Where the value's memory is freed mid-step (FSDP2's reshard: a storage
// resized by its owner) and what no eviction could free would crowd the
// budget, a dead reader whose readers are more than twice its size comes
// back and is pinned in their place: they stay evictable. Where what no
// eviction can free, those readers included, would take no more than half
// the budget, or at an op's in-place write (above), it goes, and nothing is
// recomputed for it.
void test_write_to_pinned_value_under_pressure_keeps_big_readers_evictable() {
  // budget: unevictable now p (1024) + g's readers (4096) against half of it.
  for (const std::size_t budget : {std::size_t{8192}, std::size_t{10240}, std::size_t{1} << 20, std::size_t{0}}) {
    const bool short_of_room = budget == 8192;  // 5120 > 4096; 5120 is not over 5120
    FakeMemory mem;
    mem.budget = budget;
    RematEngine e(mem);
    const int p = e.add_initial(1024);
    const int g = apply(e, {p}, 1024, 3);      // dropped: an input gradient
    const int w = apply(e, {g}, 4096, 3);      // a weight gradient, four times its size
    const int s = apply(e, {p}, 1024, 3);      // dropped; its reader is its size
    const int t = apply(e, {s}, 1024, 3);
    e.kill(g);
    e.kill(s);
    mem.recomputed.clear();
    const std::vector<int> pinned = e.prepare_writes({p}, /*freed=*/true);
    CHECK(mem.recomputed == (short_of_room ? std::vector<int>({g}) : std::vector<int>()));
    CHECK(pinned == (short_of_room ? std::vector<int>({g, t}) : std::vector<int>({w, t})));  // t in s's place
    const int op = e.begin_op(call(1, {p}, {p}));
    e.write(op, p);
    e.end_op(op);
    CHECK(e.value(s).state == ValueState::kReleased);
    CHECK(e.value(t).pinned);
    e.check_invariants();
    if (!short_of_room) {
      CHECK(e.value(g).state == ValueState::kReleased);
      CHECK(e.value(w).pinned && !e.evictable(w));
      e.release_all();
      continue;
    }
    CHECK(mem.recomputed == std::vector<int>({g}));
    CHECK(e.value(g).pinned && e.value(g).state == ValueState::kResident);
    CHECK(!e.value(w).pinned && e.evictable(w));
    // w goes and comes back from g; g goes with w.
    CHECK(e.evict(w));
    read(e, {w});
    CHECK(mem.recomputed == std::vector<int>({g, w}));
    e.kill(w);
    CHECK(e.value(g).state == ValueState::kReleased);
    e.check_invariants();
    e.release_all();
  }
}

// Where a storage is about to be resized away by its owner (FSDP2's
// reshard), a copy of its contents can serve the recipes that read it: they
// stay recomputable instead of being pinned, and the copy goes with the last
// of them. If the copy's memory cannot be had, nothing has changed.
void test_a_copy_serves_the_recipes_of_a_value_about_to_be_lost() {
  FakeMemory mem;
  RematEngine e(mem);
  const int p = e.add_initial(1024);
  const int a = apply(e, {p}, 4096, 3);
  const int b = apply(e, {p, a}, 4096, 3);
  const int t = apply(e, {b}, 4096, 3);
  e.kill(b);                                       // dead, kept for t's recipe
  CHECK(e.overwrite_pin_bytes(p) == 2 * 4096);     // a, and t in b's place
  CHECK(e.copy_readers(p) == std::vector<int>({a, b}));
  const std::size_t values = e.num_values();
  mem.fail_after = 0;
  bool threw = false;
  try {
    e.add_copy(p);
  } catch (const std::runtime_error&) {
    threw = true;
  }
  CHECK(threw && e.num_values() == values);
  CHECK(e.value(p).needed_by == 2 && e.copy_readers(p) == std::vector<int>({a, b}));
  e.check_invariants();
  const int c = e.add_copy(p);
  CHECK(e.value(c).pinned && !e.value(c).alive && e.value(c).state == ValueState::kResident);
  CHECK(e.value(c).needed_by == 2 && e.value(p).needed_by == 0);
  CHECK(e.value(a).recipe == std::vector<int>({c}) && e.value(b).recipe == std::vector<int>({c, a}));
  CHECK(e.copy_readers(p).empty() && e.overwrite_pin_bytes(p) == 0);
  CHECK(e.prepare_writes({p}, /*freed=*/true).empty());
  e.make_external(p);
  CHECK(!e.value(a).pinned && !e.value(t).pinned && e.evictable(a) && e.evictable(t));
  e.check_invariants();
  // Both come back from the copy.
  mem.recomputed.clear();
  CHECK(e.evict(a) && e.evict(t));
  read(e, {a});
  read(e, {t});
  CHECK(mem.recomputed == std::vector<int>({a, b, t}));
  e.check_invariants();
  e.kill(t);
  CHECK(e.value(b).state == ValueState::kReleased && e.value(c).state == ValueState::kResident);
  e.kill(a);
  CHECK(e.value(c).state == ValueState::kReleased);
  CHECK(std::find(mem.released.begin(), mem.released.end(), c) != mem.released.end());
  e.check_invariants();
  e.release_all();
}

// An op that writes several values reads them all (split_with_sizes_copy
// into FSDP2's parameters: out= lists). A new version that reads another of
// them, one nobody can recompute, reads what the op overwrites for good,
// whichever is written first: it is pinned.
void test_an_op_writing_several_values() {
  for (int order = 0; order < 2; ++order) {
    FakeMemory mem;
    RematEngine e(mem);
    const int p = e.add_initial(1024);  // a parameter
    const int src = leaf(e, 1024, 1);
    const int x = apply(e, {src}, 1024, 1);  // recomputable
    const int op = e.begin_op(call(1, {src, p, x}, {p, x}));
    int np = -1, nx = -1;
    if (order == 0) {
      nx = e.write(op, x, false);
      np = e.write(op, p, false);
    } else {
      np = e.write(op, p, false);
      nx = e.write(op, x, false);
    }
    e.end_op(op);
    CHECK(e.value(nx).pinned);
    CHECK(!e.value(np).pinned);  // it reads x's old version, which stays recomputable
    CHECK(e.value(p).state == ValueState::kReleased);
    e.check_invariants();
    e.release_all();
  }
}

// An optimizer's foreach update: one op reads N parameters and N session
// values (gradients) and writes the N parameters. The new versions read
// versions gone for good, so they are pinned without a recipe: no N x 2N
// recipe entries, and the gradients' dependents and needed_by stay as they
// were (a recipe made and dropped at once cost an optimizer step milliseconds).
void test_foreach_write_to_pinned_values_keeps_no_recipe() {
  FakeMemory mem;
  RematEngine e(mem);
  constexpr int kN = 50;
  std::vector<int> params, grads, reads;
  for (int i = 0; i < kN; ++i) params.push_back(e.add_initial(1024));
  for (int i = 0; i < kN; ++i) grads.push_back(apply(e, {params[i]}, 1024, 1));
  reads = params;
  reads.insert(reads.end(), grads.begin(), grads.end());
  const int op = e.begin_op(call(1, reads, params));
  std::vector<int> updated;
  for (int p : params) updated.push_back(e.write(op, p));
  e.end_op(op);
  for (int n : updated) {
    CHECK(e.value(n).pinned);
    CHECK(e.value(n).recipe.empty());
    CHECK(e.value(n).state == ValueState::kResident);
  }
  for (int g : grads) {
    CHECK(e.value(g).dependents.empty());
    CHECK(e.value(g).needed_by == 0);
    CHECK(e.value(g).pinned);  // its recipe read a parameter's old version
  }
  // A recomputable value written in place: the new version's recipe reads
  // the old one, which stays recomputable.
  const int x = leaf(e, 1024, 1);
  const int w = e.begin_op(call(1, {x}, {x}));
  const int x2 = e.write(w, x);
  e.end_op(w);
  CHECK(!e.value(x2).pinned);
  CHECK(e.value(x2).recipe == std::vector<int>{x});
  CHECK(e.value(x).state == ValueState::kDeadNeeded);
  e.check_invariants();
  e.release_all();
}

// A foreach op's outputs and writes, each given the reads of its own element
// (add_output's and write's `reads`): recipes of 2 or 3 values, not 2N; a
// recompute of one output brings back its element's inputs alone.
void test_per_output_reads_make_per_element_recipes() {
  FakeMemory mem;
  RematEngine e(mem);
  constexpr int kN = 20;
  std::vector<int> xs, ys, all;
  for (int i = 0; i < kN; ++i) xs.push_back(leaf(e, 1024, 1));
  for (int i = 0; i < kN; ++i) ys.push_back(leaf(e, 1024, 1));
  const int scale = leaf(e, 64, 1);  // a single tensor every element reads
  all = xs;
  all.insert(all.end(), ys.begin(), ys.end());
  all.push_back(scale);
  const int op = e.begin_op(call(kN, all));
  std::vector<int> outs;
  for (int i = 0; i < kN; ++i) {
    const std::vector<int> reads{xs[i], ys[i], scale};
    outs.push_back(e.add_output(op, 1024, 0, false, false, &reads));
  }
  e.end_op(op);
  for (int i = 0; i < kN; ++i) {
    CHECK((e.value(outs[i]).recipe == std::vector<int>{xs[i], ys[i], scale}));
    CHECK(e.value(xs[i]).dependents == std::vector<int>{outs[i]});
  }
  CHECK(e.value(scale).dependents.size() == static_cast<std::size_t>(kN));
  // In place, over the outputs: the new version of element i reads its old
  // version and x_i; with reads_old false, x_i alone.
  std::vector<int> reads_w = outs;
  reads_w.insert(reads_w.end(), xs.begin(), xs.end());
  const int w = e.begin_op(call(1, reads_w, outs));
  const std::vector<int> r0{outs[0], xs[0]}, r1{outs[1], xs[1]};
  const int n0 = e.write(w, outs[0], true, &r0);
  const int n1 = e.write(w, outs[1], false, &r1);
  e.end_op(w);
  CHECK((e.value(n0).recipe == std::vector<int>{outs[0], xs[0]}));
  CHECK((e.value(n1).recipe == std::vector<int>{xs[1]}));
  // Evict element 5's inputs and output: bringing it back recomputes x_5,
  // y_5 and the output, none of the other elements.
  for (int v : {xs[5], ys[5], outs[5]}) e.evict(v);
  const std::size_t before = e.counters().remats;
  read(e, {outs[5]});
  CHECK(e.counters().remats - before == 3);
  e.check_invariants();
  e.release_all();
}

void test_locked_never_evicted_and_random() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(1024);
  const int r = apply(e, {x}, 1024, 4, /*random=*/true);
  CHECK(e.op(e.value(r).producer).random);
  const int op = e.begin_op(call(1, {r}));
  CHECK(!e.evict(r));  // in use by the op in flight (3.7)
  CHECK_EQ(e.counters().refused_locked, std::size_t{1});
  CHECK_CONTAINS(check::thrown_message<std::logic_error>([&] { e.check_invariants(); }), "3.7");
  e.end_op(op);
  CHECK(e.evict(r));
  read(e, {r});
  CHECK_EQ(e.counters().random_replays, std::size_t{1});
  e.release_all();
}

}  // namespace

// `missing` counts recipe entries without memory; chain_cost reads it to stop
// at values whose inputs are all resident.
void test_missing_inputs() {
  FakeMemory mem;
  RematEngine e(mem);
  const int a = leaf(e, 1024, 7);
  const int b = apply(e, {a}, 1024, 2);
  const int c = apply(e, {a, b}, 1024, 3);
  CHECK_EQ(e.value(c).missing, 0);
  CHECK_EQ(e.chain_cost(c), 3.0);
  CHECK(e.evict(a));
  CHECK_EQ(e.value(b).missing, 1);
  CHECK_EQ(e.value(c).missing, 1);
  CHECK_EQ(e.chain_cost(c), 10.0);  // c, then a
  CHECK(e.evict(b));
  CHECK_EQ(e.value(c).missing, 2);
  CHECK_EQ(e.chain_cost(c), 12.0);  // c, b, a: a counted once
  e.check_invariants();
  read(e, {b});  // recomputes a, then b
  CHECK_EQ(e.value(b).missing, 0);
  CHECK_EQ(e.value(c).missing, 0);
  e.check_invariants();
  e.release_all();
}

// recompute_need_bytes: the most one op of the recompute chain holds at once,
// its output and its unpinned inputs (a pinned input is counted with the
// kept values, kept_resident_bytes: pinned or held by the program).
void test_recompute_need_bytes() {
  FakeMemory mem;
  RematEngine e(mem);
  const int w = e.add_initial(4096);  // a parameter: pinned
  const int a = leaf(e, 1000, 1);
  const int b = apply(e, {a, w}, 3000, 1);
  const int c = apply(e, {b}, 500, 1);
  CHECK_EQ(e.kept_resident_bytes(), std::size_t{4096});
  // Every input resident: c's own op, c and b.
  CHECK_EQ(e.recompute_need_bytes(c), 3500.0);
  CHECK_EQ(e.recompute_need_bytes(b), 4000.0);  // b and a; w is pinned
  CHECK(e.evict(b));
  // b is missing now: bringing c back first runs b's op (b, a) then c's (c, b).
  CHECK_EQ(e.recompute_need_bytes(c), 4000.0);
  CHECK(e.evict(a));
  CHECK_EQ(e.recompute_need_bytes(c), 4000.0);  // a's own op holds only a
  CHECK_EQ(e.kept_resident_bytes(), std::size_t{4096});
  mem.held.insert(c);  // the program holds c: kept, though not pinned
  CHECK_EQ(e.kept_resident_bytes(), std::size_t{4096 + 500});
  mem.held.clear();
  e.add_external(1 << 20);  // memory outside the pool: not the budget's
  CHECK_EQ(e.kept_resident_bytes(), std::size_t{4096});
  // Reused within a pass: a stale answer until a fresh call (c's chain now
  // starts at b's op again, 4000, after b came back and a was evicted: 3500).
  e.begin_need_pass();
  CHECK_EQ(e.recompute_need_bytes(c, false), 4000.0);
  read(e, {b});
  CHECK_EQ(e.recompute_need_bytes(c, false), 4000.0);
  CHECK_EQ(e.recompute_need_bytes(c), 3500.0);
  e.check_invariants();
  e.release_all();
}

// A chain 20,000 values deep, all evicted but the first, walks without
// recursion; its largest op (one 4 KiB value among 1 KiB ones) is found.
void test_recompute_need_of_a_deep_chain() {
  FakeMemory mem;
  RematEngine e(mem);
  std::vector<int> chain{leaf(e, 1024, 1)};
  for (int i = 1; i < 20000; ++i) chain.push_back(apply(e, {chain.back()}, i == 7 ? 4096 : 1024, 1));
  for (int i = 1; i + 1 < 20000; ++i) CHECK(e.evict(chain[i]));
  CHECK_EQ(e.recompute_need_bytes(chain.back()), 4096.0 + 1024.0);  // value 7's op: 7 and 6
  e.release_all();
}

// An op's resident inputs are locked only once its missing inputs are back:
// while b (and a, for b's recipe) is recomputed, c stays evictable, and the
// evictor may take it; hold() then brings c back in a second round.
void test_inputs_locked_after_recompute() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(1024);
  const int a = apply(e, {x}, 1024, 2);
  const int b = apply(e, {a}, 1024, 3);
  const int c = apply(e, {x}, 1024, 5);
  CHECK(e.evict(b));
  CHECK(e.evict(a));
  std::vector<int> c_locks;
  bool evict_c = true;
  mem.on_allocate = [&](int) {
    c_locks.push_back(e.value(c).locks);
    if (evict_c && e.evictable(c)) {
      evict_c = false;
      CHECK(e.evict(c));
    }
  };
  const int op = e.begin_op(call(1, {c, b}));  // c resident, b missing (and a, in b's recipe)
  mem.on_allocate = nullptr;
  // Allocations: a, b (c unlocked, evicted at the first), then c again.
  CHECK_EQ(c_locks.size(), std::size_t{3});
  CHECK_EQ(c_locks[0], 0);
  CHECK_EQ(c_locks[1], 0);
  CHECK_EQ(e.counters().remats, std::size_t{3});
  CHECK(e.value(b).state == ValueState::kResident && e.value(b).locks == 1);
  CHECK(e.value(c).state == ValueState::kResident && e.value(c).locks == 1);
  CHECK_EQ(e.value(a).locks, 0);  // b's recipe: unlocked once b is made
  e.end_op(op);
  CHECK_EQ(e.value(c).locks, 0);
  e.check_invariants();
  e.release_all();
}

// A chain far deeper than any C stack allows for recursion (and than
// Python's recursion limit): recomputing its end runs on the engine's
// explicit stack.
void test_deep_chain_recomputes_without_recursion() {
  FakeMemory mem;
  RematEngine e(mem);
  constexpr int kDepth = 100000;
  std::vector<int> chain{e.add_initial(512)};
  for (int i = 0; i < kDepth; ++i) chain.push_back(apply(e, {chain.back()}, 512, 1));
  for (int i = 1; i <= kDepth; ++i) CHECK(e.evict(chain[i]));
  read(e, {chain.back()});
  CHECK_EQ(e.counters().remats, std::size_t{kDepth});
  // Recomputed in dependency order: the value next to the parameter first.
  CHECK_EQ(mem.recomputed.front(), chain[1]);
  CHECK_EQ(mem.recomputed.back(), chain.back());
  for (int v : chain) CHECK_EQ(e.value(v).locks, 0);
  e.check_invariants();
  e.release_all();
}

// An OOM in the middle of a recompute chain leaves nothing locked; what was
// brought back stays, the rest stays evicted, and the engine goes on.
void test_oom_during_recompute_unwinds() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(1024);
  const int a = apply(e, {x}, 1024, 1);
  const int b = apply(e, {a}, 1024, 2);
  const int c = apply(e, {b}, 1024, 3);
  for (int v : {a, b, c}) CHECK(e.evict(v));
  mem.fail_after = 1;  // a comes back, b's allocation fails
  CHECK_CONTAINS(check::thrown_message<std::runtime_error>([&] { read(e, {c}); }), "fake OOM");
  CHECK(e.value(a).state == ValueState::kResident);
  CHECK(e.value(b).state == ValueState::kEvicted && e.value(c).state == ValueState::kEvicted);
  for (int v : {x, a, b, c}) CHECK_EQ(e.value(v).locks, 0);
  CHECK(e.evictable(a));
  e.check_invariants();
  read(e, {c});
  CHECK(e.value(c).state == ValueState::kResident);
  // An OOM for an op's output leaves no value behind and the inputs unlockable.
  const std::size_t values = e.num_values();
  const int op = e.begin_op(call(1, {c}));
  mem.fail_after = 0;
  CHECK_CONTAINS(check::thrown_message<std::runtime_error>([&] { e.add_output(op, 1024); }), "fake OOM");
  CHECK_EQ(e.num_values(), values);
  e.end_op(op);
  CHECK_EQ(e.value(c).locks, 0);
  e.check_invariants();
  e.release_all();
}

// recompute_can_retry: true while a recompute runs that, should it run out
// of memory, is tried once more with what its hold brought back unlocked
// (the evictor then spares a ruinous victim: PolicyTraits::spare_ruinous).
// C = f(A, B), A and B from X, all three evicted; reading C recomputes A
// (nothing held yet: no retry), B (A held: a retry) and C (its hold frame
// holds nothing: A and B are its recipe, locked by the recompute itself).
void test_recompute_can_retry() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(1024);
  const int a = apply(e, {x}, 1024, 1);
  const int b = apply(e, {x}, 1024, 1);
  const int c = apply(e, {a, b}, 1024, 1);
  for (int v : {a, b, c}) CHECK(e.evict(v));
  std::vector<std::pair<int, bool>> seen;  // (value, can retry) at each recompute's allocation
  bool oom_once = true;
  bool elsewhere = true;  // what another thread sees meanwhile: never a retry
  mem.on_allocate = [&](int v) {
    seen.emplace_back(v, e.recompute_can_retry());
    std::thread([&] { elsewhere = elsewhere && !e.recompute_can_retry(); }).join();
    // B's first recompute runs out: the hold unlocks A and tries B again.
    if (v == b && oom_once) {
      oom_once = false;
      throw OutOfMemoryError("fake OOM");
    }
  };
  read(e, {c});
  CHECK((seen == std::vector<std::pair<int, bool>>{{a, false}, {b, true}, {b, false}, {c, false}}));
  CHECK(elsewhere);
  CHECK(!e.recompute_can_retry());
  // Outside a recompute (an op's own output), never.
  seen.clear();
  apply(e, {c}, 1024, 1);
  CHECK_EQ(seen.size(), std::size_t{1});
  CHECK(!seen.front().second);
  e.check_invariants();
  e.release_all();
}

// The live driver: outputs adopt memory it already holds, may be pinned
// (not recomputable), and get their cost when the op has run.
void test_adopted_pinned_and_late_cost() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_external(4096);
  CHECK(e.value(x).external && e.value(x).pinned && e.value(x).addr == 0);
  CHECK(e.value(x).state == ValueState::kResident);
  const int op = e.begin_op(call(0, {x}));
  const int a = e.add_output(op, 2048, kAdopted + 0xA0000);
  const int p = e.add_output(op, 512, kAdopted + 0xB0000, /*pinned=*/true);
  e.end_op(op, 42.0);
  CHECK(mem.live.empty());  // nothing allocated through the driver
  CHECK_EQ(e.value(a).addr, kAdopted + 0xA0000);
  CHECK_EQ(e.value(a).cost, 42.0);
  CHECK_EQ(e.counters().base_cost, 42.0);
  CHECK_EQ(e.value(x).needed_by, 1);  // a's recipe; p keeps none
  CHECK(e.value(p).recipe.empty() && !e.evictable(p));
  CHECK(e.evictable(a));
  mem.held.insert(a);  // a user's tensor still points at it
  CHECK(!e.evictable(a));
  CHECK(!e.evict(a));
  mem.held.clear();
  CHECK(e.evict(a));
  CHECK_EQ(mem.released.back(), a);
  e.acquire(a);  // autograd asks for it: back, and locked until handed out
  CHECK(e.value(a).state == ValueState::kResident && e.value(a).locks == 1);
  CHECK(!e.evictable(a));
  e.unacquire(a);
  CHECK(e.evictable(a));
  // An in-place write to external memory keeps the memory external.
  const int w = e.begin_op(call(1, {x}, {x}));
  const int x2 = e.write(w, x);
  e.end_op(w);
  CHECK(e.value(x2).external && e.value(x2).pinned);
  // Memory taken away by its owner (a storage resized outside the
  // dispatcher): p lets go of its block, which another value may then adopt.
  const std::size_t kept = e.kept_resident_bytes();
  CHECK_EQ(e.make_external(p), kAdopted + 0xB0000);
  CHECK_EQ(e.kept_resident_bytes(), kept - 512);  // external memory is not the budget's
  CHECK(e.value(p).external && e.value(p).addr == 0 && e.value(p).state == ValueState::kResident);
  CHECK_EQ(e.make_external(p), std::uintptr_t{0});  // already external
  const int op2 = e.begin_op(call(2, {x2}));
  const int q = e.add_output(op2, 512, kAdopted + 0xB0000);
  e.end_op(op2);
  CHECK_EQ(e.value_at(kAdopted + 0xB0000), q);
  // And where an op overwrites it whole without reading it (copy_): pinned,
  // with no recipe, never evicted (its memory is not the pool's).
  const int src = leaf(e, 4096, 1);
  const int w2 = e.begin_op(call(1, {src}, {x2}));
  const int x3 = e.write(w2, x2, /*reads_old=*/false);
  e.end_op(w2);
  CHECK(e.value(x3).external && e.value(x3).pinned && e.value(x3).recipe.empty() && !e.evictable(x3));
  CHECK(e.value(x3).addr == 0 && e.value(x3).state == ValueState::kResident);
  e.evict_all();
  CHECK(e.value(x3).state == ValueState::kResident);
  e.check_invariants();
  e.release_all();
}

// A cost measured after the op ended (the live session on a GPU): the op's
// values, the class an evicted one sits in and the counters follow, as if
// the cost had been known from the start; an initial value added between
// the op's outputs and the next op is not the op's.
void test_cost_measured_after_the_op() {
  FakeMemory mem;
  RematEngine e(mem);
  const int x = e.add_initial(512);
  const int op = e.begin_op(call(0, {x}));
  const int a = e.add_output(op, 512);
  const int a2 = e.add_output(op, 512);
  e.end_op(op, 3.0);  // the clock's provisional cost
  const int late = e.add_initial(512);
  const int b = apply(e, {a}, 512, 5);
  const int c = apply(e, {b}, 512, 7);
  CHECK(e.evict(a));
  CHECK(e.evict(c));
  CHECK_EQ(e.estar_eq(b), 5.0 + 3.0 + 7.0);
  read(e, {a});  // a recomputed once at the provisional cost
  CHECK_EQ(e.value(a).recomputes, 1);
  CHECK_EQ(e.counters().remat_cost, 3.0);
  CHECK(e.evict(a));
  e.set_cost(op, 11.0);
  CHECK_EQ(e.value(a).cost, 11.0);
  CHECK_EQ(e.value(a2).cost, 11.0);
  CHECK_EQ(e.value(late).cost, 0.0);
  CHECK_EQ(e.estar_eq(b), 5.0 + 11.0 + 7.0);  // a's class follows
  CHECK_EQ(e.counters().base_cost, 11.0 + 5.0 + 7.0 + 1.0);  // the read op costs 1
  CHECK_EQ(e.counters().remat_cost, 11.0);
  const int b_op = e.value(b).producer;
  e.set_cost(b_op, 2.0);
  CHECK_EQ(e.value(b).cost, 2.0);
  CHECK_EQ(e.value(c).cost, 7.0);
  CHECK_EQ(e.counters().base_cost, 11.0 + 2.0 + 7.0 + 1.0);
  e.check_invariants();
  e.release_all();
}

int main() {
  test_states_and_release();
  test_evict_and_recompute_chain();
  test_estar_classes();
  test_in_place_versions();
  test_write_to_pinned_value();
  test_write_to_pinned_value_pins_only_its_readers();
  test_an_op_writing_several_values();
  test_write_to_pinned_value_under_pressure_keeps_big_readers_evictable();
  test_a_copy_serves_the_recipes_of_a_value_about_to_be_lost();
  test_foreach_write_to_pinned_values_keeps_no_recipe();
  test_per_output_reads_make_per_element_recipes();
  test_locked_never_evicted_and_random();
  test_missing_inputs();
  test_recompute_need_bytes();
  test_recompute_need_of_a_deep_chain();
  test_inputs_locked_after_recompute();
  test_deep_chain_recomputes_without_recursion();
  test_oom_during_recompute_unwinds();
  test_recompute_can_retry();
  test_adopted_pinned_and_late_cost();
  test_cost_measured_after_the_op();
  return check::check_summary("test_remat_engine");
}
