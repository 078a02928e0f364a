"""Static baselines (dtralloc.baselines) on hand-built traces worked out by hand,
and on the bundled mlp trace.

Sizes are multiples of 512 B so the 512 B rounding of the live-byte accounting
does not blur the hand computations. K = 1024 B.
"""
from __future__ import annotations

import pytest
from dtralloc import baselines as B
from dtralloc.baselines.contraction import _contract_runs
from dtralloc.baselines.grouped import _graph
from dtralloc.trace import Op, Storage, Trace

K = 1024


def make_trace(sizes, ops, initial=(), name="hand"):
    """sizes: {sid: nbytes}; ops: list of dicts (Op fields); producer/outlives derived."""
    storages = [Storage(sizes[i], "cuda:0", "float32", i in initial) for i in range(len(sizes))]
    op_objs = []
    for i, d in enumerate(ops):
        op = Op(name=d.pop("name", f"op{i}"), **d)
        op.outputs = op.outputs or list(op.created)
        for s in op.created:
            storages[s].producer = i
        op_objs.append(op)
    alive = set(initial)
    for op in op_objs:
        alive |= set(op.created)
        alive -= set(op.frees)
    for s in alive:
        storages[s].outlives = True
    t = Trace(storages, op_objs, [], {"name": name})
    t.validate()
    return t


def chain():
    """P -> a0 -> a1 -> a2 -> a3, then a backward pass that reads each activation.

    Storage ids: P=0 (initial, 512 B), a0..a3 = 1..4, g3, g2, g1 = 5, 6, 7, gp = 8.
    No-eviction live bytes per op: 1.5K 2.5K 3.5K 4.5K | 5.5K 5.5K 4.5K 3K -> peak 5.5K.
    """
    P, a0, a1, a2, a3, g3, g2, g1, gp = range(9)
    sizes = {P: 512, a0: K, a1: K, a2: K, a3: K, g3: K, g2: K, g1: K, gp: 512}
    ops = [
        {"inputs": [P], "created": [a0], "duration_ns": 10},
        {"inputs": [a0], "created": [a1], "duration_ns": 20},
        {"inputs": [a1], "created": [a2], "duration_ns": 30},
        {"inputs": [a2], "created": [a3], "duration_ns": 40},
        {"inputs": [a3], "created": [g3], "frees": [a3], "backward": True, "duration_ns": 1},
        {"inputs": [g3, a2], "created": [g2], "frees": [g3, a2], "backward": True, "duration_ns": 1},
        {"inputs": [g2, a1], "created": [g1], "frees": [g2, a1], "backward": True, "duration_ns": 1},
        {"inputs": [g1, a0, P], "created": [gp], "frees": [g1, a0], "backward": True, "duration_ns": 1},
    ]
    return make_trace(sizes, ops, initial={P}, name="chain")


CHAIN_COMPUTE = 10 + 20 + 30 + 40 + 4


def diamond():
    """P -> a; a -> b, a -> c; (b, c) -> d; backward reads b and c.

    ids: P=0 (initial 512), a=1, b=2, c=3, d=4 (1K each), gd=5, gb=6 (1K), gp=7 (512).
    """
    P, a, b, c, d, gd, gb, gp = range(8)
    sizes = {P: 512, a: K, b: K, c: K, d: K, gd: K, gb: K, gp: 512}
    ops = [
        {"inputs": [P], "created": [a], "duration_ns": 5},
        {"inputs": [a], "created": [b], "duration_ns": 7},
        {"inputs": [a], "created": [c], "duration_ns": 11},
        {"inputs": [b, c], "created": [d], "frees": [a], "duration_ns": 13},
        {"inputs": [d, c], "created": [gd], "frees": [d, c], "backward": True, "duration_ns": 1},
        {"inputs": [gd, b], "created": [gb], "frees": [gd, b], "backward": True, "duration_ns": 1},
        {"inputs": [gb, P], "created": [gp], "frees": [gb], "backward": True, "duration_ns": 1},
    ]
    return make_trace(sizes, ops, initial={P}, name="diamond")


# -- no eviction -------------------------------------------------------------------

def test_no_eviction_peak_and_compute():
    r = B.no_eviction(chain())
    assert r.feasible and r.peak_bytes == 5 * K + 512 == r.live_peak_bytes
    assert r.baseline_compute == CHAIN_COMPUTE and r.compute_overhead == 0.0
    assert r.details["last_use_peak_bytes"] == 5 * K + 512
    assert B.no_eviction(chain(), budget=5 * K).feasible is False


def test_no_eviction_matches_trace_peak_on_bundled():
    from dtralloc.traces import load_bundled

    t = load_bundled("mlp")
    r = B.no_eviction(t)
    assert r.peak_bytes >= t.peak_live_bytes()  # 512 B rounding only adds
    assert r.peak_bytes - t.peak_live_bytes() <= 512 * len(t.storages)


def test_cost_falls_back_to_flops():
    t = chain()
    for op in t.ops:
        op.flops, op.duration_ns = op.duration_ns * 3, 0
    assert B.no_eviction(t).baseline_compute == 3 * CHAIN_COMPUTE


# -- Chen sqrt(n) -------------------------------------------------------------------

def test_chen_chain_by_hand():
    # 4 forward groups -> 2 segments {op0, op1}, {op2, op3}; a1 crosses the boundary
    # and is kept. op4 needs a3 -> recompute op2, op3 (70); op7 needs a0 -> op0 (10).
    r = B.checkpoint_sqrt_n(chain())
    assert r.details["segments"] == 2
    assert r.recompute_ops == 3
    assert r.compute_overhead == pytest.approx(80 / CHAIN_COMPUTE)
    # peak: right after op4 (P, a1, a2', a3', g3) and op5 (P, a1, a2', g3, g2)
    assert r.peak_bytes == 4 * K + 512
    assert r.feasible is True
    assert B.checkpoint_sqrt_n(chain(), budget=4 * K).feasible is False
    assert B.checkpoint_sqrt_n(chain(), budget=4 * K + 512).feasible is True


def test_chen_one_segment_recomputes_all_dropped():
    r = B.checkpoint_sqrt_n(chain(), segments=1)
    # nothing crosses a boundary: a0..a3 all dropped, all four recomputed once
    assert r.compute_overhead == pytest.approx(100 / CHAIN_COMPUTE)
    # after op4: P, a0', a1', a2', a3', g3
    assert r.peak_bytes == 5 * K + 512


def test_chen_diamond():
    # 4 forward groups -> 2 segments {a, b}, {c, d}; c reads a (crossing), d reads b
    # (crossing): a and b are checkpoints, c is dropped; d is read first by op4.
    r = B.checkpoint_sqrt_n(diamond())
    assert r.details["segments"] == 2
    assert r.compute_overhead == pytest.approx((11 + 13) / (5 + 7 + 11 + 13 + 3))
    assert r.recompute_ops == 2


def test_chen_keeps_random_and_mutated_outputs():
    # chain where op1 is random and op2 writes a1 in place in a later group:
    # a1's producer can't be recomputed (random), a2's group writes a storage it did
    # not create, so neither is dropped.
    t = chain()
    t.ops[1].random = True
    t.ops[2].mutated = [2]
    t.ops[2].inputs = [2]
    t.validate()
    g = _graph(t)
    assert [grp.recomputable for grp in g.groups[:4]] == [True, False, False, True]
    r = B.checkpoint_sqrt_n(t)
    # only a0 (op0, seg 0) and a3 (op3, seg 1) can be dropped
    assert r.compute_overhead == pytest.approx((10 + 40) / CHAIN_COMPUTE)


# -- the grouped model ----------------------------------------------------------------

def test_in_place_op_joins_its_producers_group():
    # x = empty(); x.relu_(); y = f(x): the in-place op is re-run with its producer
    x, y, P = 0, 1, 2
    t = make_trace({x: K, y: K, P: 512}, [
        {"inputs": [P], "created": [x], "duration_ns": 3},
        {"inputs": [x], "mutated": [x], "outputs": [x], "duration_ns": 4, "name": "aten::relu_"},
        {"inputs": [x], "created": [y], "frees": [x], "duration_ns": 5},
        {"inputs": [], "created": [], "outputs": [], "duration_ns": 0, "flops": 2},  # a view: cost 2
    ], initial={P})
    g = _graph(t)
    assert [grp.ops for grp in g.groups] == [[0, 1], [2, 3]]
    assert g.groups[0].recomputable and g.groups[0].recompute_cost == 7
    assert g.groups[0].recompute_nops == 2
    assert g.groups[1].recompute_cost == 5 and g.groups[1].cost == 7
    assert g.baseline_compute == 14


def test_random_op_is_never_recomputed():
    t = chain()
    t.ops[0].random = True  # a0 is dropout-like: must be kept from op0 to op7
    g = _graph(t)
    assert not g.groups[0].recomputable
    r = B.checkmate(t, 4 * K + 512)
    # a0 can't be dropped now: drop a1 instead (kept a0, recompute op1 for op6: 20)
    assert r.status == "optimal" and r.compute_overhead == pytest.approx(20 / CHAIN_COMPUTE)


def test_deadline_after_input_is_written():
    # b = f(a); a.add_(1) in a later group; b may be recomputed only until then
    P, a, b, c, d = range(5)
    t = make_trace({P: 512, a: K, b: K, c: K, d: K}, [
        {"inputs": [P], "created": [a]},
        {"inputs": [a], "created": [b]},
        {"inputs": [P], "created": [c]},
        {"inputs": [a], "mutated": [a], "outputs": [a]},  # joins c's group
        {"inputs": [b, c], "created": [d]},
    ], initial={P})
    g = _graph(t)
    assert g.groups[1].deadline == 2 and g.groups[0].recomputable is False
    assert g.groups[2].recomputable is False  # writes a storage it did not create


# -- Checkmate -----------------------------------------------------------------------

def test_checkmate_at_peak_has_no_overhead():
    for t in (chain(), diamond()):
        peak = B.no_eviction(t).peak_bytes
        r = B.checkmate(t, 1.0)
        assert r.feasible and r.compute_overhead == 0.0 and r.status == "optimal"
        r = B.checkmate(t, peak)
        assert r.feasible and r.compute_overhead == 0.0


def test_checkmate_chain_by_hand():
    t = chain()
    # one byte under the peak: dropping a0 (recomputed once for op7) is the cheapest
    r = B.checkmate(t, 5 * K + 511)
    assert r.status == "optimal" and r.feasible
    assert r.compute_overhead == pytest.approx(10 / CHAIN_COMPUTE)
    assert r.recompute_ops == 1 and r.peak_bytes == 4 * K + 512
    # Chen's budget: same plan, far cheaper than Chen's 80
    r = B.checkmate(t, 4 * K + 512)
    assert r.compute_overhead == pytest.approx(10 / CHAIN_COMPUTE)
    # 3.5K: a0 and a1 must both be gone by op3; op6 recomputes op0, op1 (30) and
    # op7 op0 again (10): keeping a0 from op6 to op7 would need 4.5K at op6
    r = B.checkmate(t, 3 * K + 512)
    assert r.status == "optimal" and r.feasible
    assert r.compute_overhead == pytest.approx(40 / CHAIN_COMPUTE)
    assert r.peak_bytes <= 3 * K + 512
    # Chen doesn't fit there
    assert B.checkpoint_sqrt_n(t, budget=3 * K + 512).feasible is False


def test_checkmate_infeasible():
    t = chain()
    # op5 needs P, g3, a2 and g2 at once: the lower bound says 3.5K without solving
    r = B.checkmate(t, 3 * K)
    assert r.status == "infeasible" and r.feasible is False and not r.details.get("solved")
    r = B.checkmate(t, 256)  # below the resident initial storages
    assert r.status == "infeasible" and r.feasible is False and not r.details.get("solved")


def test_checkmate_proves_infeasible_above_the_lower_bound():
    # P -> a (2K) -> b (1K); x (3K) and x2 (1K) from P; y = f(b, x).
    # Keeping b over op2 needs P+b+x+x2 = 5.5K; recomputing b at op3 needs
    # P+x+a = 5.5K. Every stage alone fits 5K, so only the MILP sees it.
    P, a, b, x, x2, y = range(6)
    t = make_trace({P: 512, a: 2 * K, b: K, x: 3 * K, x2: K, y: 512}, [
        {"inputs": [P], "created": [a], "duration_ns": 1},
        {"inputs": [a], "created": [b], "frees": [a], "duration_ns": 1},
        {"inputs": [P], "created": [x, x2], "frees": [x2], "duration_ns": 1},
        {"inputs": [b, x], "created": [y], "frees": [b, x], "duration_ns": 1},
    ], initial={P})
    assert B.no_eviction(t).peak_bytes == 5 * K + 512
    r = B.checkmate(t, 5 * K)
    assert r.details["lower_bound_bytes"] == 5 * K
    assert r.status == "infeasible" and r.feasible is False and r.details["solved"]


def test_checkmate_never_worse_than_chen():
    for t in (chain(), diamond()):
        chen = B.checkpoint_sqrt_n(t)
        cm = B.checkmate(t, chen.peak_bytes)
        assert cm.feasible
        assert cm.compute_overhead <= chen.compute_overhead + 1e-12
        assert cm.peak_bytes <= chen.peak_bytes


def test_checkmate_too_large():
    r = B.checkmate(chain(), 0.9, max_groups=3)
    assert r.status == "too large" and r.feasible is None and r.peak_bytes is None


def test_determinism():
    a = B.checkmate(chain(), 3 * K + 512)
    b = B.checkmate(chain(), 3 * K + 512)
    assert a.details["schedule"] == b.details["schedule"]
    assert (a.compute_overhead, a.peak_bytes) == (b.compute_overhead, b.peak_bytes)
    assert B.checkpoint_sqrt_n(diamond()) == B.checkpoint_sqrt_n(diamond())


def test_a_fractional_budget_is_a_share_of_the_live_byte_peak():
    t = chain()
    live_peak = 5 * K + 512
    for result in (B.no_eviction(t, budget=0.8), B.checkpoint_sqrt_n(t, budget=0.8), B.checkmate(t, 0.8)):
        assert result.live_peak_bytes == live_peak
        assert result.budget_bytes == int(0.8 * live_peak)
    assert B.checkmate(t, 4 * K).budget_bytes == 4 * K  # an int is bytes
    with pytest.raises(ValueError, match="share of the live-byte peak"):
        B.no_eviction(t, budget=-0.5)


def test_min_feasible_budget():
    t = chain()
    peak = 5 * K + 512
    assert B.min_feasible_budget(t, "no_eviction")["fraction"] == 1.0
    chen = B.min_feasible_budget(t, "checkpoint_sqrt_n")
    assert chen["fraction"] == pytest.approx((4 * K + 512) / peak) and chen["exact"]
    # 3.5K is also the simple lower bound, so the first solve settles it
    cm = B.min_feasible_budget(t, "checkmate", tol=0.005)
    assert cm["fraction"] == pytest.approx((3 * K + 512) / peak) and cm["exact"]
    assert cm["budget_bytes"] == 3 * K + 512 and cm["live_peak_bytes"] == peak
    with pytest.raises(ValueError):
        B.min_feasible_budget(t, "nope")


def test_budget_arguments():
    with pytest.raises(ValueError):
        B.checkmate(chain(), -1)
    with pytest.raises(TypeError):
        B.checkmate(chain(), True)
    with pytest.raises(ValueError):
        B.checkmate(chain(), None)


def test_without_optimizer():
    from dtralloc.traces import load_bundled

    t = load_bundled("mlp")
    cut = B.without_optimizer(t)
    assert len(cut.ops) == 101 and cut.ops[-1].backward
    assert B.no_eviction(cut).peak_bytes < B.no_eviction(t).peak_bytes


# -- the bundled mlp trace -------------------------------------------------------------

def test_mlp_checkmate_solves():
    from dtralloc.traces import load_bundled

    t = load_bundled("mlp")
    # The mlp step peaks in Adam's _foreach_sqrt, with every gradient alive: no
    # rematerialization can lower it, and the MILP proves it quickly.
    r = B.checkmate(t, 0.9, time_limit_s=30)
    assert r.status == "infeasible" and r.details["solved"] and r.solve_seconds < 30
    # Without the optimizer: a real solve one byte under the peak
    cut = B.without_optimizer(t)
    peak = B.no_eviction(cut).peak_bytes
    r = B.checkmate(cut, peak - 1, time_limit_s=30)
    assert r.status == "optimal" and r.feasible and r.compute_overhead == 0.0
    assert r.peak_bytes <= peak - 1


# -- Checkmate's bounds for large graphs: LP relaxation and contracted graph ----------

def long_chain(n):
    """P -> a1 -> ... -> an, then a backward pass: g_i = f(a_i, g_{i+1}).

    ids: P=0 (initial, 512 B), a_i = i (1K, forward op i costs 10 i),
    g_i = n + i (1K, cost 1), gp = 2n + 1 (512 B). 2n + 1 groups.
    """
    P, gp = 0, 2 * n + 1
    act = list(range(1, n + 1))
    grad = list(range(n + 1, 2 * n + 1))
    sizes = {P: 512, gp: 512, **{s: K for s in act + grad}}
    ops, prev = [], P
    for i, a in enumerate(act):
        ops.append({"inputs": [prev], "created": [a], "duration_ns": 10 * (i + 1)})
        prev = a
    for i in reversed(range(n)):
        upstream = [grad[i + 1]] if i + 1 < n else []
        ops.append({"inputs": [act[i], *upstream], "created": [grad[i]],
                    "frees": [act[i], *upstream], "backward": True, "duration_ns": 1})
    ops.append({"inputs": [grad[0], P], "created": [gp], "frees": [grad[0]], "backward": True,
                "duration_ns": 1})
    return make_trace(sizes, ops, initial={P}, name=f"chain{n}")


@pytest.mark.parametrize("make", [chain, diamond, lambda: long_chain(6)])
def test_lp_bound_is_below_the_exact_optimum(make):
    t = make()
    peak = B.no_eviction(t).peak_bytes
    solved = 0
    for b in range(peak - 6 * 512, peak, 512):
        exact = B.checkmate(t, b)
        lp = B.checkmate(t, b, mode="lp_bound")
        assert lp.method == "checkmate_lp_bound"
        if exact.status == "infeasible" and not exact.details.get("solved"):
            assert lp.status == "infeasible"  # the same simple lower bound, no solve
            continue
        assert exact.status == "optimal"
        assert lp.status == "lower bound" and lp.details["bound"].startswith("lower")
        # a bound, not a plan
        assert lp.feasible is None and lp.peak_bytes is None and lp.recompute_ops is None
        assert 0.0 <= lp.compute_overhead <= exact.compute_overhead + 1e-9
        solved += 1
    assert solved >= 2


def test_lp_bound_at_the_peak_is_zero():
    r = B.checkmate(chain(), 1.0, mode="lp_bound")
    assert r.status == "lower bound" and r.compute_overhead == 0.0


def test_restricted_plan_is_real_and_no_better_than_exact():
    t = long_chain(8)  # 17 groups, contracted to 8
    g = _graph(t)
    for b in (7680, 8704, 9216):
        exact = B.checkmate(t, b)
        r = B.checkmate(t, b, mode="restricted", max_groups=8)
        assert r.method == "checkmate_restricted" and r.status == "restricted optimal"
        assert r.details["contracted_groups"] <= 8 and r.details["bound"].startswith("upper")
        seq = r.details["schedule"]
        assert [j for j, orig in seq if orig] == list(range(len(g.groups)))
        # the expanded plan replays: every read finds its storage, and it fits
        assert g.simulate(seq, trace_frees=False) == r.peak_bytes <= b
        assert r.feasible is True
        assert r.compute_overhead >= exact.compute_overhead - 1e-12
        recomputed = [j for j, orig in seq if not orig]
        assert r.compute_overhead == pytest.approx(
            sum(g.groups[j].recompute_cost for j in recomputed) / g.baseline_compute)


def test_restricted_infeasible_says_nothing_about_the_exact_plan():
    # 6.5K: the exact MILP has a plan, the contracted one (memory counted per
    # super-group) has none -- the label must not claim infeasibility.
    t = long_chain(8)
    assert B.checkmate(t, 6656).status == "optimal"
    r = B.checkmate(t, 6656, mode="restricted", max_groups=8)
    assert r.status == "restricted infeasible" and r.feasible is None
    # below the exact simple lower bound it is proved for every plan
    r = B.checkmate(t, 1024, mode="restricted", max_groups=8)
    assert r.status == "infeasible" and r.feasible is False


def test_restricted_without_contraction_is_exact():
    t = chain()
    exact = B.checkmate(t, 3 * K + 512)
    r = B.checkmate(t, 3 * K + 512, mode="restricted")  # 8 groups <= the default limit
    assert r.method == "checkmate_restricted" and r.status == "optimal"
    assert r.compute_overhead == exact.compute_overhead
    assert r.details["schedule"] == exact.details["schedule"]


def test_contraction_respects_the_limit_and_order():
    g = _graph(long_chain(8))
    for k in (1, 3, 8, 17, 40):
        runs = _contract_runs(g, k)
        assert len(runs) == min(k, len(g.groups))
        assert [j for run in runs for j in run] == list(range(len(g.groups)))


def test_checkmate_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="exact.*lp_bound.*restricted"):
        B.checkmate(chain(), 0.9, mode="lp")
    with pytest.raises(ValueError, match="max_groups must be a positive int"):
        B.checkmate(chain(), 0.9, mode="restricted", max_groups=0)
    with pytest.raises(ValueError, match="max_groups"):
        B.checkmate(chain(), 0.9, max_groups=2.5)
    with pytest.raises(ValueError, match="time_limit_s must be positive"):
        B.checkmate(chain(), 0.9, time_limit_s=0)


# -- a pool that never fragments ----------------------------------------------------

def test_first_eviction_packed_by_hand():
    """chain(): P 512 B, then a0..a3 of 1K. Live bytes after each forward op:
    1.5K, 2.5K, 3.5K, 4.5K; then g3 (1K) while a3 is still alive: 5.5K."""
    t = chain()
    hit = B.first_eviction_packed(t, 3 * K)  # a2 would take 2.5K to 3.5K
    assert (hit.op, hit.op_name, hit.request_bytes, hit.free_bytes) == (2, "op2", K, K // 2)
    assert hit.free_fraction == pytest.approx(1 / 6)
    hit = B.first_eviction_packed(t, 5 * K)  # g3 at op 4, before a3 is freed after it
    assert (hit.op, hit.free_bytes) == (4, K // 2)
    assert B.first_eviction_packed(t, 5 * K + K // 2) is None  # the peak fits
    hit = B.first_eviction_packed(t, 256)  # P alone does not fit
    assert (hit.op, hit.request_bytes, hit.free_bytes) == (-1, 512, 256)


def test_first_eviction_packed_frees_after_each_op():
    """diamond(): the trace frees a after op 3, so d (op 3) is allocated while
    P, a, b and c are live (3.5K); at 4.5K the step fits."""
    t = diamond()
    hit = B.first_eviction_packed(t, 4 * K)  # op 3: P, a, b, c = 3.5K, then d
    assert (hit.op, hit.free_bytes) == (3, K // 2)
    assert B.first_eviction_packed(t, 4 * K + K // 2) is None


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_first_eviction_packed_rejects_a_non_byte_budget(bad):
    with pytest.raises(ValueError, match="positive int"):
        B.first_eviction_packed(chain(), bad)
