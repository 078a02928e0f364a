"""Static baselines (dtralloc.baselines) on hand-built traces worked out by hand,
and on the bundled mlp trace.

Sizes are multiples of 512 B so the 512 B rounding of the live-byte accounting
does not blur the hand computations. K = 1024 B.
"""
from __future__ import annotations

import pytest
from dtralloc import baselines as B
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
        dict(inputs=[P], created=[a0], duration_ns=10),
        dict(inputs=[a0], created=[a1], duration_ns=20),
        dict(inputs=[a1], created=[a2], duration_ns=30),
        dict(inputs=[a2], created=[a3], duration_ns=40),
        dict(inputs=[a3], created=[g3], frees=[a3], backward=True, duration_ns=1),
        dict(inputs=[g3, a2], created=[g2], frees=[g3, a2], backward=True, duration_ns=1),
        dict(inputs=[g2, a1], created=[g1], frees=[g2, a1], backward=True, duration_ns=1),
        dict(inputs=[g1, a0, P], created=[gp], frees=[g1, a0], backward=True, duration_ns=1),
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
        dict(inputs=[P], created=[a], duration_ns=5),
        dict(inputs=[a], created=[b], duration_ns=7),
        dict(inputs=[a], created=[c], duration_ns=11),
        dict(inputs=[b, c], created=[d], frees=[a], duration_ns=13),
        dict(inputs=[d, c], created=[gd], frees=[d, c], backward=True, duration_ns=1),
        dict(inputs=[gd, b], created=[gb], frees=[gd, b], backward=True, duration_ns=1),
        dict(inputs=[gb, P], created=[gp], frees=[gb], backward=True, duration_ns=1),
    ]
    return make_trace(sizes, ops, initial={P}, name="diamond")


# -- no eviction -------------------------------------------------------------------

def test_no_eviction_peak_and_compute():
    r = B.no_eviction(chain())
    assert r.feasible and r.peak_bytes == 5 * K + 512 == r.baseline_peak_bytes
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
    g = B._graph(t)
    assert [grp.recomputable for grp in g.groups[:4]] == [True, False, False, True]
    r = B.checkpoint_sqrt_n(t)
    # only a0 (op0, seg 0) and a3 (op3, seg 1) can be dropped
    assert r.compute_overhead == pytest.approx((10 + 40) / CHAIN_COMPUTE)


# -- the grouped model ----------------------------------------------------------------

def test_in_place_op_joins_its_producers_group():
    # x = empty(); x.relu_(); y = f(x): the in-place op is re-run with its producer
    x, y, P = 0, 1, 2
    t = make_trace({x: K, y: K, P: 512}, [
        dict(inputs=[P], created=[x], duration_ns=3),
        dict(inputs=[x], mutated=[x], outputs=[x], duration_ns=4, name="aten::relu_"),
        dict(inputs=[x], created=[y], frees=[x], duration_ns=5),
        dict(inputs=[], created=[], outputs=[], duration_ns=0, flops=2),  # a view: cost 2
    ], initial={P})
    g = B._graph(t)
    assert [grp.ops for grp in g.groups] == [[0, 1], [2, 3]]
    assert g.groups[0].recomputable and g.groups[0].recompute_cost == 7
    assert g.groups[0].recompute_nops == 2
    assert g.groups[1].recompute_cost == 5 and g.groups[1].cost == 7
    assert g.baseline_compute == 14


def test_random_op_is_never_recomputed():
    t = chain()
    t.ops[0].random = True  # a0 is dropout-like: must be kept from op0 to op7
    g = B._graph(t)
    assert not g.groups[0].recomputable
    r = B.checkmate(t, 4 * K + 512)
    # a0 can't be dropped now: drop a1 instead (kept a0, recompute op1 for op6: 20)
    assert r.status == "optimal" and r.compute_overhead == pytest.approx(20 / CHAIN_COMPUTE)


def test_deadline_after_input_is_written():
    # b = f(a); a.add_(1) in a later group; b may be recomputed only until then
    P, a, b, c, d = range(5)
    t = make_trace({P: 512, a: K, b: K, c: K, d: K}, [
        dict(inputs=[P], created=[a]),
        dict(inputs=[a], created=[b]),
        dict(inputs=[P], created=[c]),
        dict(inputs=[a], mutated=[a], outputs=[a]),  # joins c's group
        dict(inputs=[b, c], created=[d]),
    ], initial={P})
    g = B._graph(t)
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
        dict(inputs=[P], created=[a], duration_ns=1),
        dict(inputs=[a], created=[b], frees=[a], duration_ns=1),
        dict(inputs=[P], created=[x, x2], frees=[x2], duration_ns=1),
        dict(inputs=[b, x], created=[y], frees=[b, x], duration_ns=1),
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


def test_min_feasible_budget():
    t = chain()
    peak = 5 * K + 512
    assert B.min_feasible_budget(t, "no_eviction")["fraction"] == 1.0
    chen = B.min_feasible_budget(t, "checkpoint_sqrt_n")
    assert chen["fraction"] == pytest.approx((4 * K + 512) / peak) and chen["exact"]
    # 3.5K is also the simple lower bound, so the first solve settles it
    cm = B.min_feasible_budget(t, "checkmate", tol=0.005)
    assert cm["fraction"] == pytest.approx((3 * K + 512) / peak) and cm["exact"]
    assert cm["bytes"] == 3 * K + 512
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
