// RematEngine: states, recipes, recompute, fake deletion (remat_engine.h).
#include "remat_engine.h"

#include <algorithm>
#include <string>

#include "allocator.h"
#include "event_log.h"

namespace dtralloc {
namespace {

// A recompute chain deeper than this is a bug (a cycle in the recipes): the
// explicit stack would otherwise grow without end. Each level is two frames.
constexpr std::size_t kMaxFrames = std::size_t{1} << 22;

[[noreturn]] void broken(int v, const std::string& what) {
  throw std::logic_error("remat engine invariant broken at value " + std::to_string(v) + ": " + what);
}

}  // namespace

int RematEngine::new_value(std::size_t nbytes, int producer, double cost) {
  const int id = static_cast<int>(values_.size());
  values_.emplace_back();
  Value& v = values_.back();
  v.nbytes = nbytes;
  v.producer = producer;
  v.cost = cost;
  v.last_access = clock_;
  uf_parent_.push_back(id);
  uf_cost_.push_back(0);
  return id;
}

void RematEngine::take_block(int v, std::uintptr_t addr) {
  Value& x = values_[v];
  x.state = ValueState::kResident;
  x.addr = addr;
  if (addr) by_addr_[addr] = v;
  x.resident_pos = static_cast<int>(resident_.size());
  resident_.push_back(v);
  for (int d : x.dependents) --values_[d].missing;
}

std::uintptr_t RematEngine::drop_block(int v) {
  Value& x = values_[v];
  const std::uintptr_t addr = x.addr;
  if (addr) {
    auto it = by_addr_.find(addr);
    if (it != by_addr_.end() && it->second == v) by_addr_.erase(it);
  }
  const int pos = x.resident_pos;
  const int last = resident_.back();
  resident_[pos] = last;
  values_[last].resident_pos = pos;
  resident_.pop_back();
  x.resident_pos = -1;
  x.addr = 0;
  for (int d : x.dependents) ++values_[d].missing;
  return addr;
}

int RematEngine::add_initial(std::size_t nbytes) {
  const int id = static_cast<int>(values_.size());
  const std::uintptr_t addr = nbytes ? driver_.allocate(nbytes, id) : 0;
  const int v = new_value(nbytes, -1, 0);
  values_[v].pinned = true;
  take_block(v, addr);
  return v;
}

int RematEngine::add_external(std::size_t nbytes) {
  const int v = new_value(nbytes, -1, 0);
  values_[v].pinned = true;
  values_[v].external = true;
  take_block(v, 0);
  return v;
}

std::uintptr_t RematEngine::make_external(int v) {
  Value& x = values_[v];
  if (x.state != ValueState::kResident || !x.pinned) broken(v, "made external while not resident and pinned");
  if (x.external) return 0;
  const std::uintptr_t addr = drop_block(v);
  x.external = true;
  take_block(v, 0);
  return addr;
}

int RematEngine::begin_op(const OpCall& call) {
  OpRecord rec;
  rec.cost = call.cost;
  rec.random = call.random;
  rec.first_value = static_cast<int>(values_.size());
  rec.writes = call.writes;
  ops_.push_back(std::move(rec));
  counters_.base_cost += call.cost;
  const int op = static_cast<int>(ops_.size()) - 1;
  for (int w : call.writes) prepare_write(w);
  if (call.writes.size() >= 2) {  // for reads_other_overwrite
    op_writes_.next(values_.size());
    for (int w : call.writes) op_writes_.mark(w);
  }
  // What the op holds: its reads, then the written values it does not read.
  std::vector<int>& vs = ops_[op].inputs;
  vs = call.reads;
  for (int w : call.writes)
    if (std::find(call.reads.begin(), call.reads.end(), w) == call.reads.end()) vs.push_back(w);
  for (int v : vs)
    if (values_[v].state == ValueState::kReleased) broken(v, "an op reads a released value");
  hold(vs);
  for (int v : vs) values_[v].last_access = clock_;
  ops_[op].locked = vs;
  return op;
}

void RematEngine::acquire(int v) {
  if (values_[v].state == ValueState::kReleased) broken(v, "acquiring a released value");
  hold({v});
  values_[v].last_access = clock_;
}

void RematEngine::unacquire(int v) { unlock(v); }

// Makes `vs` resident and locked. Missing values first (each comes back
// locked), resident ones locked only then: locking them up front would keep
// them locked through every nested recompute, and those locks are what
// leaves the evictor no room. A resident value evicted meanwhile is
// recomputed in the next round; every round holds at least one more value,
// so the loop ends. Nested recomputes are frames on `stack`, not calls.
void RematEngine::hold(const std::vector<int>& vs) {
  if (in_hold_) broken(-1, "hold() re-entered (a driver recomputed from inside a recompute)");
  // The common case (every op of a live run, most of a replay): all resident,
  // nothing to recompute, no stack to build.
  if (std::all_of(vs.begin(), vs.end(), [&](int v) { return values_[v].state == ValueState::kResident; })) {
    for (int v : vs) lock(v);
    return;
  }
  in_hold_ = true;
  dropped_.next(values_.size());  // nothing dropped in this hold yet
  attempt_ = 0;
  std::vector<Frame> stack;
  for (;;) {
    retried_.clear();
    stack.clear();
    if (drop_spent_) plan_hold(vs);  // again after a restart: what is missing changed
    stack.push_back(Frame{});
    stack.back().vs = vs;
    stack.back().held.assign(vs.size(), 0);
    try {
      while (!stack.empty()) {
        if (stack.size() > kMaxFrames) broken(stack.back().v, "recompute chain too deep (a cycle?)");
        if (stack.back().remat)
          step_remat(stack);
        else
          step_hold(stack);
      }
    } catch (const OutOfMemoryError&) {
      unwind(stack);
      if (attempt_ + 1 < kHoldAttempts &&
          std::none_of(vs.begin(), vs.end(), [&](int v) { return values_[v].state == ValueState::kReleased; })) {
        restart_hold();
        continue;
      }
      end_hold();
      throw;
    } catch (...) {
      unwind(stack);
      end_hold();
      throw;
    }
    break;
  }
  end_hold();
}

// The fallbacks before a hold's OOM leaves. Whatever the hold placed sat
// where free memory happened to be when it came back, and a value locked
// there for a recompute (a recipe's input) can split the only room a large
// value has, while the same values placed in another order, or elsewhere,
// fit: lstm-compact's backward failed from 0.595 to 0.62 of its peak and ran
// at 0.58, a 1.5 MiB input of the 22.8 MiB workspace's recompute sitting in
// the one segment the workspace could take. So every evictable value goes,
// and the hold starts over in that emptiest pool the budget allows, in the
// order that suits a fresh start (step_hold); on the second restart new
// segments are also cut to the request's own size (RematDriver::
// tight_placement), so no value the hold locks can strand a standard
// segment. Two kinds of placement because neither covers the other: own-size
// segments of 1-10 MiB values waste up to 2 MiB each, and resnet50 at 0.235
// fits with fitted segments only. Only a hold that would fail gets here: a
// step that runs without them runs exactly as before. A restarted hold that
// recomputes more than kRestartRematsPerValue per value the engine knows is
// thrashing (each eviction it makes evicts what it needs next) and gives up:
// lru on bert at 0.7 recomputed 2.2 million values in one such hold (1100
// per value, 17 s), resnet50's optimizer step at 0.235, which then fits,
// 1.5 per value.
void RematEngine::restart_hold() {
  ++attempt_;
  ++counters_.hold_restarts;
  evict_all();
  driver_.tight_placement(attempt_ >= 2);
  restart_remats_ = counters_.remats;
}

void RematEngine::end_hold() {
  clear_plan();
  if (attempt_ >= 2) driver_.tight_placement(false);
  attempt_ = 0;
  in_hold_ = false;
  retry_left_ = false;  // a driver's exception other than an OOM skipped the reset
}

void RematEngine::clear_plan() {
  for (int v : planned_) plan_uses_[v] = 0;
  planned_.clear();
}

void RematEngine::plan_hold(const std::vector<int>& vs) {
  clear_plan();
  if (plan_uses_.size() < values_.size()) plan_uses_.resize(values_.size(), 0);
  visited_.next(values_.size());  // marks the missing values walked
  walk_.clear();
  for (int v : vs)
    if (values_[v].state != ValueState::kResident && !visited_.marked(v)) visited_.mark(v), walk_.push_back(v);
  while (!walk_.empty()) {
    const int x = walk_.back();
    walk_.pop_back();
    for (int r : values_[x].recipe) {
      if (plan_uses_[r]++ == 0) planned_.push_back(r);
      if (values_[r].state != ValueState::kResident && !visited_.marked(r)) visited_.mark(r), walk_.push_back(r);
    }
  }
}

// The recompute that read `recipe` has run (its locks are gone): its reads
// come off the hold's counts, and a dead input no recompute left in the
// hold reads is evicted now. Left resident,
// it takes room until the evictor finds it, and the evictor needs a
// contiguous run: on unet near its lowest budget the op that reads the
// skip-connection gradient brought back 6 forward activations of 64 MiB
// twelve times each, a chain evicting the room the next one needed, and
// the step failed or ran at 2.5-3x its compute. Once per value and hold: a
// value dropped and read again (a resident consumer was evicted meanwhile,
// and its recompute reads it) is needed after all, and dropping it again
// is how a hold thrashes (convbn-compact: 1440 recomputes in one op).
void RematEngine::spend(const std::vector<int>& recipe) {
  for (int r : recipe)
    if (plan_uses_[r] > 0) --plan_uses_[r];
  dropped_.grow(values_.size());
  for (int r : recipe) {
    const Value& x = values_[r];
    if (plan_uses_[r] != 0 || x.alive || x.recomputes == 0 || dropped_.marked(r) || !evictable(r)) continue;
    dropped_.mark(r);
    evict(r);
  }
}

void RematEngine::evict_all() {
  // A copy: evicting reorders resident_.
  const std::vector<int> resident = resident_;
  for (int v : resident)
    if (evictable(v)) evict(v);
}

// One step of the hold frame on top: start recomputing the next missing
// value, or, once the round is through, lock the resident rest; the frame
// ends when every value is held. Each value recomputed comes back locked and
// stays locked while the rest of the round runs, so a round takes its
// missing values biggest recompute first: the one whose chain (the value and
// its missing ancestors) must bring back the largest value, ties broken by
// the chain's bytes. That chain then runs while the frame holds the least.
// In list order, the gradient whose chain runs back through the loss (an
// embedding's, written last in backward) came last in the optimizer's first
// in-place write, with every other gradient locked, and a budget with room
// for the step failed (feasibility holes on gpt2, unet, resnet50 and encdec,
// bench/results/replay_policies-*.md). Sizes, not op costs: the order should
// not flip with a recording's timings.
//
// A hold started over from an emptied pool (restart_hold) first takes the
// value whose recompute needs the most memory beyond what it leaves locked:
// the chain's peak (the most any of its values and their missing inputs need
// at once) less the value's own bytes, the rule that orders the evaluation
// of independent subtrees for the least peak (Sethi-Ullman). After a flush
// every chain is long and that peak is what decides: in lstm-compact's
// backward the 22.8 MiB workspace came back first (the largest value) and a
// 1.5 MiB input whose chain runs three 7.8 MiB values at once no longer fit
// beside it. It is not the first try's order: there it moved vit's and
// encdec's minimum budgets and raised unet's overhead at 0.4 (2.73 -> 3.29).
void RematEngine::step_hold(std::vector<Frame>& stack) {
  Frame& f = stack.back();
  if (f.next == 0) {
    f.order.clear();
    for (std::size_t i = 0; i < f.vs.size(); ++i)
      if (!f.held[i] && values_[f.vs[i]].state != ValueState::kResident) f.order.push_back(static_cast<int>(i));
    if (f.order.size() > 1) {
      struct Key {
        double transient, largest, total;
        int slot;
      };
      std::vector<Key> keyed;
      keyed.reserve(f.order.size());
      for (int i : f.order) {
        double largest = 0, peak = 0;
        const double total = chain_bytes(f.vs[i], &largest, &peak);
        keyed.push_back({peak - static_cast<double>(values_[f.vs[i]].nbytes), largest, total, i});
      }
      const bool fresh = attempt_ > 0;
      std::stable_sort(keyed.begin(), keyed.end(), [fresh](const Key& a, const Key& b) {
        if (fresh && a.transient != b.transient) return a.transient > b.transient;
        return a.largest != b.largest ? a.largest > b.largest : a.total > b.total;
      });
      for (std::size_t k = 0; k < keyed.size(); ++k) f.order[k] = keyed[k].slot;
    }
  }
  while (f.next < f.order.size()) {
    const int i = f.order[f.next++];
    const int v = f.vs[i];
    if (f.held[i] || values_[v].state == ValueState::kResident) continue;
    Frame r;  // invalidates f
    r.remat = true;
    r.v = v;
    r.parent_slot = i;
    stack.push_back(std::move(r));
    return;
  }
  bool all_held = true;
  for (std::size_t i = 0; i < f.vs.size(); ++i) {
    if (f.held[i]) continue;
    if (values_[f.vs[i]].state == ValueState::kResident)
      lock(f.vs[i]), f.held[i] = 1;
    else
      all_held = false;
  }
  if (all_held)
    stack.pop_back();  // its values stay locked: the caller (or the remat below) owns them now
  else
    f.next = 0;
}

// One step of the recompute frame on top: first hold its recipe (a hold
// frame above it); when that is done, lock the value, have the driver bring
// it back, unlock the recipe, and hand the locked value to the hold frame
// below.
void RematEngine::step_remat(std::vector<Frame>& stack) {
  Frame& f = stack.back();
  const int v = f.v;
  if (!f.started) {
    if (values_[v].pinned || values_[v].producer < 0) broken(v, "asked to recompute a pinned value");
    f.started = true;
    f.vs = values_[v].recipe;
    Frame h;  // invalidates f
    h.vs = stack.back().vs;
    h.held.assign(h.vs.size(), 0);
    stack.push_back(std::move(h));
    return;
  }
  f.recipe_held = true;  // the hold frame above is done
  lock(v);
  f.locked_self = true;
  const OpRecord& op = ops_[values_[v].producer];
  const std::size_t nbytes = values_[v].nbytes;
  if (attempt_ > 0 && static_cast<double>(counters_.remats - restart_remats_) >
                          kRestartRematsPerValue * static_cast<double>(values_.size()))
    throw OutOfMemoryError(std::string(driver_.out_of_memory_text()) +
                           " Bringing back what an op needs took more than " +
                           std::to_string(static_cast<int>(kRestartRematsPerValue)) +
                           " recomputes per value even after every evictable value was evicted "
                           "(thrashing): raise the budget, or try another eviction policy");
  std::uintptr_t addr = 0;
  leave_home(v);  // the room it left is its own to take again
  const bool first_try = std::find(retried_.begin(), retried_.end(), v) == retried_.end();
  try {
    retry_left_ = first_try && any_unlockable(stack);
    retry_thread_ = std::this_thread::get_id();
    addr = driver_.recompute(v, nbytes);  // may evict others; may throw
    retry_left_ = false;
  } catch (const OutOfMemoryError&) {
    // The last resort before the OOM: what the frames below have held so far
    // is unlocked (it stays resident) and the recompute tried once more;
    // once per value and hold(), so two recomputes evicting each other's
    // values cannot loop.
    retry_left_ = false;
    if (!first_try || !unlock_held(stack)) throw;
    retried_.push_back(v);
    addr = driver_.recompute(v, nbytes);
  }
  take_block(v, addr);
  Value& x = values_[v];
  ++x.recomputes;
  x.last_access = clock_;
  ++counters_.remats;
  counters_.remat_cost += op.cost;
  if (op.random) ++counters_.random_replays;  // the driver reran it with its first RNG state
  if (log_) log_->add(current_op(), EventKind::kRecomputed, v, nbytes, addr);
  // Union-find cannot split: the class just forgets this member's cost.
  const int root = find(v);
  uf_cost_[root] = std::max(0.0, uf_cost_[root] - x.cost);
  const std::vector<int> recipe = std::move(f.vs);
  const int slot = f.parent_slot;
  stack.pop_back();
  for (int r : recipe) unlock(r);
  stack.back().held[slot] = 1;  // v comes back locked
  if (!planned_.empty()) spend(recipe);
}

// Unlocks what the hold frames on the stack have brought back or locked so
// far (they stay resident, now evictable; each frame holds them again at the
// end of its round, recomputing what was evicted meanwhile). Values that
// nothing needs would be released by the unlock and stay locked. Returns
// whether anything was unlocked.
bool RematEngine::unlock_held(std::vector<Frame>& stack) {
  bool any = false;
  for (Frame& f : stack) {
    if (f.remat) continue;
    for (std::size_t i = 0; i < f.vs.size(); ++i) {
      if (!unlockable(f, i)) continue;
      unlock(f.vs[i]);
      f.held[i] = 0;
      any = true;
    }
  }
  return any;
}

// Whether unlock_held(stack) would unlock anything (it changes nothing).
bool RematEngine::any_unlockable(const std::vector<Frame>& stack) const {
  for (const Frame& f : stack) {
    if (f.remat) continue;
    for (std::size_t i = 0; i < f.vs.size(); ++i)
      if (unlockable(f, i)) return true;
  }
  return false;
}

// Frame f holds its i-th value, and something still needs it: the program,
// or a recipe (a value nothing needs would be released by the unlock).
bool RematEngine::unlockable(const Frame& f, std::size_t i) const {
  if (!f.held[i]) return false;
  const Value& x = values_[f.vs[i]];
  return x.alive || x.needed_by > 0;
}

// After an exception (OOM in the driver): every lock the frames took is
// released, innermost first; values not yet brought back stay evicted.
void RematEngine::unwind(std::vector<Frame>& stack) {
  while (!stack.empty()) {
    Frame f = std::move(stack.back());
    stack.pop_back();
    if (f.remat) {
      if (f.locked_self) unlock(f.v);
      if (f.recipe_held)
        for (int r : f.vs) unlock(r);
    } else {
      for (std::size_t i = 0; i < f.vs.size(); ++i)
        if (f.held[i]) unlock(f.vs[i]);
    }
  }
}

// v's recipe: the op's inputs, each once, except `not_read`. Marks instead
// of searches: a foreach op reads hundreds of values and writes hundreds.
void RematEngine::set_recipe(int v, int op, const std::vector<int>& not_read, const std::vector<int>* reads) {
  const std::vector<int>& from = reads ? *reads : ops_[op].inputs;
  visited_.next(values_.size());
  values_[v].recipe.reserve(from.size());
  for (int r : not_read) visited_.mark(r);
  for (int r : from) {
    if (visited_.marked(r)) continue;
    if (reads && values_[r].locks == 0)  // the op's inputs are locked while it runs
      broken(v, "an output's reads must be among its op's");
    visited_.mark(r);
    values_[v].recipe.push_back(r);
    values_[v].recipe_bytes += values_[r].nbytes;
    values_[r].dependents.push_back(v);
    ++values_[r].needed_by;
    if (values_[r].state != ValueState::kResident) ++values_[v].missing;
  }
}

int RematEngine::add_output(int op, std::size_t nbytes, std::uintptr_t addr, bool pinned, bool external,
                            const std::vector<int>* reads) {
  // Memory first, under the id the value will have: if the driver throws
  // (OOM), nothing has changed. While the pool makes room the value does not
  // exist yet, so the evictor cannot pick it.
  const int id = static_cast<int>(values_.size());
  if (external)
    addr = 0;
  else if (!addr && nbytes)
    addr = driver_.allocate(nbytes, id);
  const int v = new_value(nbytes, op, ops_[op].cost);
  if (v != id) broken(v, "a value was created while the driver allocated");
  values_[v].external = external;
  if (pinned || external)
    values_[v].pinned = true;  // never recomputed: no recipe to keep
  else
    set_recipe(v, op, ops_[op].writes, reads);
  lock(v);
  ops_[op].locked.push_back(v);
  take_block(v, addr);
  return v;
}

void RematEngine::prepare_write(int v, std::vector<int>* pinned, bool may_bring_back) {
  if (!values_[v].pinned) return;  // the old version stays recomputable
  // Overwriting a value nobody can recompute: what reads it is pinned, the
  // evicted readers brought back first. What the pinned values are read by
  // keeps its recipe: they stay as long as they are needed (maybe_release).
  // Pinning the whole descendant closure instead would pin everything FSDP2
  // computes after its first reshard, which overwrites a parameter every
  // later block's activations descend from.
  //
  // A dead reader without memory (its readers were computed from it while it
  // was resident; it stays only for their recipes) either comes back now to
  // be pinned, which costs its recompute, or goes, and its own readers are
  // treated as v's: pinned, never evicted again. A direct reader comes back
  // only where the value's memory is freed mid-step (may_bring_back: FSDP2's
  // reshards), where that pins less than half of what going would
  // (frontier_bytes), and where what going would pin, with what no eviction
  // can free already (kept_resident_bytes: pinned or held by the program),
  // is more than kUnevictableShare of the budget: FSDP2's
  // post-backward reshard frees a weight whose dead input gradient is read,
  // through other dead values, by the weight gradients of the block below,
  // twice its size, while the gradients held and the values pinned fill the
  // budget. What cannot be evicted, not how full memory is: with half the
  // budget allocated (the rule of d77f04c) a transformer's reshards
  // recomputed 33 to 69 values a step at budgets where passing through
  // evicted nothing, and gained nothing at the smallest budgets
  // (bench/results/fsdp_budget-2026-11-29b-cpu.md). With room to spare
  // nothing runs for a value the program no longer holds. At an in-place
  // update (an optimizer's), the readers are about to be used and die:
  // bringing dead values back for them only costs memory (the replay's UNet
  // at 0.34 of its peak ran out of it).
  std::vector<int> pin, through;
  const std::size_t budget = may_bring_back ? driver_.budget_bytes() : 0;
  const bool brought = plan_write(v, budget, pin, through);
  if (pin.empty() && through.empty()) return;
  try {
    hold(pin);  // an evicted reader of a value passed through recomputes that value once more, here
  } catch (const OutOfMemoryError&) {
    // No room to bring the dead readers back (an optimizer's first write,
    // where every gradient must be resident): they go after all.
    if (!brought) throw;
    plan_write(v, 0, pin, through);
    hold(pin);
  }
  for (int d : pin) pin_value(d, v);
  if (pinned) pinned->insert(pinned->end(), pin.begin(), pin.end());
  for (int d : through) pin_value(d, v);
  for (int d : through) maybe_release(d);
  for (int d : pin) unlock(d);
}

bool RematEngine::plan_write(int v, std::size_t budget, std::vector<int>& pin, std::vector<int>& through) {
  // prepare_write's plan (it says why): `pin`, ascending ids, and `through`,
  // the dead readers that go. budget > 0: a dead direct reader may come back
  // (then true).
  std::size_t kept_bytes = 0;  // kept_resident_bytes() once asked, plus what this plan pins
  bool counted = false;
  auto crowds_budget = [&](std::size_t frontier) {
    if (!counted) kept_bytes = kept_resident_bytes();
    counted = true;
    return static_cast<double>(kept_bytes + frontier) > kUnevictableShare * static_cast<double>(budget);
  };
  std::vector<int> todo{v};
  pin.clear();
  through.clear();
  visited_.next(values_.size());
  bool brought = false;
  while (!todo.empty()) {
    const int x = todo.back();
    todo.pop_back();
    for (int d : values_[x].dependents) {
      const Value& y = values_[d];
      if (visited_.marked(d) || y.state == ValueState::kReleased || y.pinned) continue;
      visited_.mark(d);
      bool keep = y.alive || y.state == ValueState::kResident;
      if (!keep && budget > 0 && x == v) {  // a direct reader: a deeper one would recompute those above it
        const std::size_t frontier = frontier_bytes(d);
        keep = frontier > 2 * y.nbytes && crowds_budget(frontier);
        if (counted) kept_bytes += keep ? y.nbytes : frontier;
        brought = brought || keep;
      }
      if (keep) {
        pin.push_back(d);
      } else {
        through.push_back(d);
        todo.push_back(d);
      }
    }
  }
  std::sort(pin.begin(), pin.end());  // ids ascend in creation order: a topological order
  return brought;
}

std::size_t RematEngine::overwrite_pin_bytes(int v) {
  if (!values_[v].pinned) return 0;
  std::vector<int> pin, through;
  plan_write(v, driver_.budget_bytes(), pin, through);
  std::size_t total = 0;
  for (int d : pin) total += values_[d].nbytes;
  return total;
}

std::vector<int> RematEngine::copy_readers(int v) const {
  std::vector<int> readers;
  for (int d : values_[v].dependents)
    if (!values_[d].pinned && values_[d].state != ValueState::kReleased) readers.push_back(d);
  return readers;
}

int RematEngine::add_copy(int v, std::uintptr_t addr) {
  if (values_[v].state != ValueState::kResident || !values_[v].pinned)
    broken(v, "copied for its readers while not resident and pinned");
  // Memory first, under the id the copy will have (as add_output).
  const int id = static_cast<int>(values_.size());
  const std::size_t nbytes = values_[v].nbytes;
  if (!addr && nbytes) addr = driver_.allocate(nbytes, id);
  const int c = new_value(nbytes, -1, 0);
  if (c != id) broken(c, "a value was created while the driver allocated");
  const std::vector<int> readers = copy_readers(v);
  if (readers.empty()) broken(v, "copied with no recipe reading it");
  values_[c].pinned = true;
  values_[c].alive = false;  // only recipes read it: released with the last
  take_block(c, addr);
  // Both resident: the readers' missing counts stay as they are.
  for (int d : readers) {
    std::vector<int>& recipe = values_[d].recipe;
    const auto at = std::find(recipe.begin(), recipe.end(), v);
    if (at == recipe.end()) broken(d, "a dependent whose recipe does not read the value copied");
    *at = c;
    values_[c].dependents.push_back(d);
  }
  values_[c].needed_by = static_cast<int>(readers.size());
  values_[v].needed_by -= static_cast<int>(readers.size());
  std::vector<int>& deps = values_[v].dependents;
  deps.erase(std::remove_if(deps.begin(), deps.end(),
                            [&](int d) { return !values_[d].pinned && values_[d].state != ValueState::kReleased; }),
             deps.end());
  return c;
}

std::size_t RematEngine::frontier_bytes(int d) {
  // The first values at or below `d`'s readers that are alive or resident,
  // reached through dead values without memory: what prepare_write pins if
  // `d` goes. Its own marks (prepare_write's walk holds visited_).
  std::size_t total = 0;
  std::vector<int> todo{d};
  frontier_seen_.next(values_.size());
  frontier_seen_.mark(d);
  while (!todo.empty()) {
    const int x = todo.back();
    todo.pop_back();
    for (int r : values_[x].dependents) {
      const Value& y = values_[r];
      if (frontier_seen_.marked(r) || y.state == ValueState::kReleased || y.pinned) continue;
      frontier_seen_.mark(r);
      if (y.alive || y.state == ValueState::kResident)
        total += y.nbytes;
      else
        todo.push_back(r);
    }
  }
  return total;
}

void RematEngine::pin_value(int d, int overwritten) {
  Value& y = values_[d];
  if (y.pinned || y.state == ValueState::kReleased) return;
  if (y.alive && y.state != ValueState::kResident) broken(d, "pinned while evicted (prepare_write was skipped)");
  y.pinned = true;
  // A pinned value is never recomputed: its recipe is no longer needed.
  for (int r : y.recipe) {
    --values_[r].needed_by;
    if (r != overwritten) maybe_release(r);
  }
}

std::vector<int> RematEngine::prepare_writes(const std::vector<int>& vs, bool freed) {
  std::vector<int> pinned;
  for (int v : vs) prepare_write(v, &pinned, freed);
  return pinned;
}

bool RematEngine::reads_other_overwrite(int op, int v, const std::vector<int>* reads) const {
  // An op that writes several values (split_with_sizes_copy into FSDP2's
  // unsharded parameters, out= lists) reads them all: a new version whose
  // recipe reads another of them that nobody can recompute reads a version
  // this op overwrites for good (before or after this one).
  if (ops_[op].writes.size() < 2) return false;
  for (int r : reads ? *reads : ops_[op].inputs)
    if (r != v && values_[r].pinned && op_writes_.marked(r)) return true;  // begin_op marked them
  return false;
}

int RematEngine::write(int op, int v, bool reads_old, const std::vector<int>* reads) {
  if (values_[v].state != ValueState::kResident || values_[v].locks == 0)
    broken(v, "an in-place write needs the value resident and locked (begin_op's writes)");
  const int n = new_value(values_[v].nbytes, op, ops_[op].cost);
  // The memory stays where it was; memory outside the pool is never evicted
  // (nor could a recompute put the value back there), even where an op
  // overwrote it whole (copy_ into a storage its owner resized and refilled).
  values_[n].external = values_[v].external;
  if (values_[n].external || (reads_old && values_[v].pinned) || reads_other_overwrite(op, v, reads))
    values_[n].pinned = true;  // or it reads a version gone for good (below): no recipe to keep
  else if (reads_old)
    set_recipe(n, op, {}, reads);
  else
    set_recipe(n, op, {v}, reads);
  // The block stays where it is; it now holds the new version.
  const std::uintptr_t addr = drop_block(v);
  take_block(n, addr);
  lock(n);
  ops_[op].locked.push_back(n);
  values_[n].last_access = clock_;
  Value& old = values_[v];
  old.alive = false;
  if (old.pinned) {
    for (int d : old.dependents)  // prepare_write pinned or released them all
      if (!values_[d].pinned && values_[d].state != ValueState::kReleased)
        broken(d, "reads a version overwritten for good (prepare_write was skipped)");
    old.state = ValueState::kReleased;
    ++counters_.releases;
    driver_.forget(v);
  } else {
    old.state = ValueState::kDeadNeeded;  // the recomputable old version
    lose_memory(v);
  }
  return n;
}

void RematEngine::end_op(int op, double cost) {
  std::vector<int> locked;
  locked.swap(ops_[op].locked);
  if (cost >= 0 && cost != ops_[op].cost) {
    counters_.base_cost += cost - ops_[op].cost;
    ops_[op].cost = cost;
    for (int v : locked)
      if (values_[v].producer == op) values_[v].cost = cost;
  }
  for (int v : locked) unlock(v);
}

void RematEngine::set_cost(int op, double cost) {
  assert(op >= 0 && op < static_cast<int>(ops_.size()) && cost >= 0);
  OpRecord& rec = ops_[op];
  assert(rec.locked.empty());  // after end_op
  const double delta = cost - rec.cost;
  if (delta == 0) return;
  rec.cost = cost;
  counters_.base_cost += delta;
  const int end = op + 1 < static_cast<int>(ops_.size()) ? ops_[op + 1].first_value : static_cast<int>(values_.size());
  for (int v = rec.first_value; v < end; ++v) {
    Value& x = values_[v];
    if (x.producer != op) continue;  // an initial value added between two ops
    // Recomputes already counted at the old cost: the same total as if the
    // cost had been known from the start.
    counters_.remat_cost += delta * x.recomputes;
    if (x.state == ValueState::kEvicted || x.state == ValueState::kDeadNeeded) {
      const int root = find(v);
      uf_cost_[root] = std::max(0.0, uf_cost_[root] + (cost - x.cost));
    }
    x.cost = cost;
  }
}

// A dead value brought back for a recompute stays resident afterwards, an
// ordinary eviction candidate (as in DTR): dropping it at once would make
// every later recompute that reads it pay for it again. (Under drop_spent a
// hold evicts it once no recompute left in that hold reads it: spend().)
void RematEngine::unlock(int v) {
  Value& x = values_[v];
  if (x.locks <= 0) broken(v, "unlocked more often than locked");
  if (--x.locks == 0 && !x.alive && x.needed_by <= 0) release(v);
}

void RematEngine::kill(int v) {
  values_[v].alive = false;
  maybe_release(v);
}

// Settles a value nobody references: released if no recipe needs it, else
// memory dropped and recipe kept (fake deletion); pinned ones keep memory.
void RematEngine::maybe_release(int v) {
  Value& x = values_[v];
  if (x.alive || x.locks > 0 || x.state == ValueState::kReleased) return;
  if (x.needed_by <= 0) {
    release(v);
    return;
  }
  if (x.pinned) return;  // needed, not recomputable: must keep its bytes
  if (x.state == ValueState::kResident) {
    const std::uintptr_t addr = drop_block(v);
    x.state = ValueState::kDeadNeeded;
    ++counters_.fake_deletions;
    lose_memory(v);
    driver_.release(v, addr);
  } else {
    leave_home(v);
    x.state = ValueState::kDeadNeeded;
  }
}

void RematEngine::leave_home(int v) {
  Value& x = values_[v];
  if (!x.home) return;
  x.home = false;
  driver_.drop_home(v);
}

void RematEngine::release(int first) {
  std::vector<int> todo{first};
  while (!todo.empty()) {
    const int v = todo.back();
    todo.pop_back();
    Value& x = values_[v];
    if (x.state == ValueState::kReleased || x.alive || x.locks > 0 || x.needed_by > 0) continue;
    const bool had_memory = x.state == ValueState::kResident;
    const std::uintptr_t addr = had_memory ? drop_block(v) : 0;
    leave_home(v);
    x.state = ValueState::kReleased;
    ++counters_.releases;
    if (!x.pinned)
      for (int r : x.recipe)
        if (--values_[r].needed_by == 0) todo.push_back(r);
    if (had_memory) driver_.release(v, addr);
    driver_.forget(v);
  }
}

bool RematEngine::evict(int v) {
  if (!evictable(v)) {
    if (values_[v].locks > 0) ++counters_.refused_locked;
    return false;
  }
  // A value the hold's recomputes still read, evicted: its own recompute
  // will read its recipe once more (plan_hold's counts stay true).
  if (!planned_.empty() && plan_uses_[v] > 0)
    for (int r : values_[v].recipe)
      if (plan_uses_[r]++ == 0) planned_.push_back(r);
  const std::uintptr_t addr = drop_block(v);
  Value& x = values_[v];
  x.state = x.alive ? ValueState::kEvicted : ValueState::kDeadNeeded;
  ++counters_.evictions;
  lose_memory(v);
  if (log_) log_->add(current_op(), EventKind::kEvicted, v, x.nbytes, addr);
  driver_.release(v, addr);
  Value& y = values_[v];  // (the driver ran code: no reference kept across it)
  // The program will read it again: where it was is where it fits.
  if (y.alive && addr) y.home = driver_.keep_home(v, addr, y.nbytes);
  return true;
}

void RematEngine::pin(int v) {
  Value& x = values_[v];
  if (x.pinned || x.state == ValueState::kReleased) return;
  if (x.state != ValueState::kResident) broken(v, "pinning a value without memory");
  x.pinned = true;
  for (int r : x.recipe) {
    --values_[r].needed_by;
    maybe_release(r);
  }
}

void RematEngine::lose_memory(int v) {
  uf_parent_[v] = v;
  uf_cost_[v] = values_[v].cost;
  auto join = [&](int n) {
    const ValueState s = values_[n].state;
    if (s == ValueState::kEvicted || s == ValueState::kDeadNeeded) unite(v, n);
  };
  for (int r : values_[v].recipe) join(r);
  for (int d : values_[v].dependents) join(d);
}

int RematEngine::find(int v) {
  while (uf_parent_[v] != v) {
    uf_parent_[v] = uf_parent_[uf_parent_[v]];
    v = uf_parent_[v];
  }
  return v;
}

void RematEngine::unite(int a, int b) {
  a = find(a);
  b = find(b);
  if (a == b) return;
  uf_parent_[b] = a;
  uf_cost_[a] += uf_cost_[b];
}

double RematEngine::estar_eq(int v) {
  double total = values_[v].cost;
  int roots[64];
  int nroots = 0;
  auto add = [&](int n) {
    const ValueState s = values_[n].state;
    if (s != ValueState::kEvicted && s != ValueState::kDeadNeeded) return;
    const int r = find(n);
    for (int i = 0; i < nroots; ++i)
      if (roots[i] == r) return;
    if (nroots < 64) roots[nroots++] = r;
    total += uf_cost_[r];
  };
  for (int r : values_[v].recipe) add(r);
  for (int d : values_[v].dependents) add(d);
  return total;
}

// Cost of `v` plus every value reachable from it through recipes (and
// dependents, when `both_ways`) for which `counts` holds, visiting at most
// `cap` values. Visited values are marked in a fresh pass: no clearing,
// no search.
template <typename Counts, typename Weigh>
double RematEngine::reachable_cost(int v, int cap, bool both_ways, Counts counts, Weigh weigh) {
  visited_.next(values_.size());
  double total = weigh(v);
  walk_.assign(1, v);
  visited_.mark(v);
  int visited = 1;
  while (!walk_.empty() && visited < cap) {
    const int x = walk_.back();
    walk_.pop_back();
    auto visit = [&](int n) {
      if (!counts(values_[n].state) || visited_.marked(n)) return;
      visited_.mark(n);
      ++visited;
      walk_.push_back(n);
      total += weigh(n);
    };
    // With every input resident the walk ends at x (most values, most of
    // the time): no need to look at a recipe of hundreds (foreach ops).
    if (both_ways || values_[x].missing > 0)
      for (int r : values_[x].recipe) visit(r);
    if (both_ways)
      for (int d : values_[x].dependents) visit(d);
  }
  return total;
}

double RematEngine::estar_exact(int v, int cap) {
  return reachable_cost(
      v, cap, true, [](ValueState s) { return s == ValueState::kEvicted || s == ValueState::kDeadNeeded; },
      [&](int n) { return values_[n].cost; });
}

double RematEngine::chain_cost(int v, int cap) {
  if (values_[v].missing == 0) return values_[v].cost;  // the common case: one op
  return reachable_cost(v, cap, false, [](ValueState s) { return s != ValueState::kResident; },
                        [&](int n) { return values_[n].cost; });
}

double RematEngine::chain_bytes(int v, double* largest, double* peak, int cap) {
  return reachable_cost(v, cap, false, [](ValueState s) { return s != ValueState::kResident; }, [&](int n) {
    const Value& x = values_[n];
    const auto bytes = static_cast<double>(x.nbytes);
    *largest = std::max(*largest, bytes);
    // When n runs, its missing inputs have been brought back and are locked
    // beside it (most values: none missing, no recipe to read).
    double at_n = bytes;
    if (x.missing > 0)
      for (int r : x.recipe)
        if (values_[r].state != ValueState::kResident) at_n += static_cast<double>(values_[r].nbytes);
    *peak = std::max(*peak, at_n);
    return bytes;
  });
}

template <typename Pred>
std::size_t RematEngine::resident_bytes_if(Pred pred) const {
  std::size_t total = 0;
  for (int v : resident_)
    if (pred(v)) total += values_[v].nbytes;
  return total;
}

std::size_t RematEngine::unevictable_resident_bytes() const {
  return resident_bytes_if([&](int v) { return !evictable(v); });
}

std::size_t RematEngine::kept_resident_bytes() const {
  // An external value's memory is not the pool's: the budget does not count it.
  return resident_bytes_if([&](int v) {
    const Value& x = values_[v];
    return !x.external && (x.pinned || driver_.held_elsewhere(v));
  });
}

void RematEngine::begin_need_pass() { need_done_.next(values_.size()); }

double RematEngine::recompute_need_bytes(int v, bool fresh) {
  if (fresh || need_done_.pass == 0) begin_need_pass();
  if (need_.size() < values_.size()) need_.resize(values_.size()), need_done_.grow(values_.size());
  auto own_op = [&](int x) {  // x's producer while it runs: x and its unpinned inputs
    double at_x = static_cast<double>(values_[x].nbytes);
    for (int r : values_[x].recipe)
      if (!values_[r].pinned) at_x += static_cast<double>(values_[r].nbytes);
    return at_x;
  };
  if (need_done_.marked(v)) return need_[v];
  // need(x) = max(own_op(x), need(r) for every missing r of its recipe), in
  // post-order on an explicit stack (chains may be thousands of values deep).
  // Recipes point back in time (or to a copy, which has none: add_copy), so
  // a value on the stack is never met again below itself.
  need_stack_.assign(1, {v, 0});
  need_[v] = own_op(v);
  while (!need_stack_.empty()) {
    auto& [x, next] = need_stack_.back();
    const std::vector<int>& recipe = values_[x].recipe;
    if (values_[x].missing > 0 && next < recipe.size()) {
      const int r = recipe[next++];
      if (values_[r].state == ValueState::kResident) continue;
      if (!need_done_.marked(r)) {
        need_[r] = own_op(r);
        need_stack_.push_back({r, 0});  // invalidates x, next
        continue;
      }
      need_[x] = std::max(need_[x], need_[r]);
      continue;
    }
    const int done = x;
    need_done_.mark(done);
    need_stack_.pop_back();
    if (!need_stack_.empty()) {
      const int parent = need_stack_.back().first;
      need_[parent] = std::max(need_[parent], need_[done]);
    }
  }
  return need_[v];
}

std::size_t RematEngine::evictable_resident_bytes() const {
  return resident_bytes_if([&](int v) { return evictable(v); });
}

int RematEngine::value_at(std::uintptr_t addr) const {
  auto it = by_addr_.find(addr);
  return it == by_addr_.end() ? -1 : it->second;
}

void RematEngine::release_all() {
  while (!resident_.empty()) {
    const int v = resident_.back();
    const std::uintptr_t addr = drop_block(v);
    values_[v].state = ValueState::kReleased;
    driver_.release(v, addr);
  }
}

void RematEngine::check_invariants() const {
  std::vector<int> needed(values_.size(), 0);
  std::size_t resident = 0;
  for (std::size_t i = 0; i < values_.size(); ++i) {
    const Value& x = values_[i];
    const int v = static_cast<int>(i);
    if (x.state != ValueState::kReleased && !x.pinned)
      for (int r : x.recipe) ++needed[r];
    if (x.state == ValueState::kResident) {
      ++resident;
      if (x.external ? x.addr != 0 : (x.addr != 0) != (x.nbytes != 0))
        broken(v, "resident without its block, or external with one (3.6)");
      if (x.resident_pos < 0 || resident_[x.resident_pos] != v) broken(v, "not in the resident list");
      if (x.addr && value_at(x.addr) != v) broken(v, "address map disagrees (3.6)");
    } else {
      if (x.addr != 0 || x.resident_pos >= 0) broken(v, "owns a block while not resident (3.6)");
      if (x.state == ValueState::kEvicted && (!x.alive || x.pinned)) broken(v, "evicted but dead or pinned");
      if (x.state == ValueState::kDeadNeeded && (x.alive || x.pinned)) broken(v, "dead-needed but alive or pinned");
    }
    if (x.home && x.state != ValueState::kEvicted) broken(v, "a home kept for it while not evicted (leave_home skipped)");
    if (x.locks < 0) broken(v, "negative lock count");
  }
  for (std::size_t i = 0; i < values_.size(); ++i) {
    const Value& x = values_[i];
    if (x.state == ValueState::kReleased) continue;
    int missing = 0;
    for (int r : x.recipe) missing += values_[r].state != ValueState::kResident;
    if (missing != x.missing)
      broken(static_cast<int>(i), "missing is " + std::to_string(x.missing) + ", recount gives " +
                                      std::to_string(missing));
  }
  for (std::size_t i = 0; i < values_.size(); ++i)
    if (values_[i].state != ValueState::kReleased && needed[i] != values_[i].needed_by)
      broken(static_cast<int>(i), "needed_by is " + std::to_string(values_[i].needed_by) +
                                      ", recount gives " + std::to_string(needed[i]));
  if (resident != resident_.size()) broken(-1, "resident list size");
  if (counters_.refused_locked) broken(-1, "an eviction of a locked value was attempted (3.7)");
}

}  // namespace dtralloc
