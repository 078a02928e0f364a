"""Op costs that arrive late, on CPU: the code a CUDA session runs on its
GPU's timing events (allocator/op_timer.h; Note [carried costs] in
allocator/bindings/live_session.cpp), run on a simulated GPU
(allocator/simulated_timing.h) that runs a fixed number of marks behind the
host. An op is priced at its launch until its time arrives; from the second
step of a kind on, at the time the last step of that kind measured for the
same op (Note [recent steps])."""
from __future__ import annotations

import gc

import pytest
import torch

from dtralloc import _core
from dtralloc.dtr import dtr

from _live_models import build
from test_dtr import SWEEP_BATCH, no_eviction_peak

LAUNCH_NS = 2000.0  # what a CUDA op's clock gives: its launch


def simulated(lag: int, **kwargs):
    s = dtr(device="cpu", **kwargs)
    s._core.simulate_gpu_timer(lag, LAUNCH_NS)
    return s


@pytest.fixture(autouse=True)
def fresh_device():
    # Every event of an earlier test completed, and no earlier session's
    # costs carried into this test's first step.
    gc.collect()
    _core.simulated_gpu_synchronize()
    assert _core.RECENT_STEPS <= 6
    for op in ("neg_", "abs_", "sign_", "floor_", "ceil_", "trunc_")[:_core.RECENT_STEPS]:
        with simulated(0):  # a kind of step of its own, made of nothing a test runs
            getattr(torch.zeros(1), op)()
    yield


def matmuls(a, b, n=4):
    return [a @ b for _ in range(n)]


def test_ops_are_priced_at_their_launch_until_the_simulated_gpu_times_them():
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    with simulated(100) as s:
        outs = matmuls(a, b)
        early = s.stats()
        _core.simulated_gpu_synchronize()  # torch.cuda.synchronize()
        outs.append(outs[-1].sum())  # a recorded op after it: its mark collects the matmuls'
        late = s.stats()
    assert early["gpu_timed_ops"] == 0 and early["carried_costs"] == 0
    assert early["op_seconds"] == pytest.approx(4 * LAUNCH_NS * 1e-9)
    assert late["gpu_timed_ops"] >= 4
    # Now each matmul is priced at its time between marks: far above its launch.
    assert late["op_seconds"] > 100 * early["op_seconds"], (early, late)


def test_the_next_step_prices_its_ops_at_the_step_befores_time():
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    with simulated(100) as first:
        outs = matmuls(a, b)
    _core.simulated_gpu_synchronize()
    del outs
    # `first` still lives (a loop's `s`): it hands over what was timed after its block.
    with simulated(100) as again:
        outs = matmuls(a, b)
        held = again.stats()
    _core.simulated_gpu_synchronize()
    assert held["carried_costs"] == 4 and held["gpu_timed_ops"] == 0, held
    assert held["op_seconds"] > 100 * 4 * LAUNCH_NS * 1e-9, held
    # Torn down after the synchronize: its destructor hands them over.
    del first, again, outs
    gc.collect()
    with simulated(100) as third:
        outs = matmuls(a, b)
        torn_down = third.stats()
    assert torn_down["carried_costs"] == 4, torn_down
    assert torn_down["op_seconds"] == pytest.approx(held["op_seconds"], rel=1.0)


def test_a_step_that_runs_other_ops_falls_back_to_the_clock_from_the_first_that_differs():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with simulated(0) as first:
        outs = matmuls(a, b)
    del outs
    with simulated(100) as other:
        x = a @ b
        y = x + b  # differs from here
        z = y @ b
        w = z @ b
        st = other.stats()
    assert st["carried_costs"] == 1, st
    del first, other, x, y, z, w


def test_training_under_a_budget_with_late_costs_is_exact_and_carries_them():
    # Costs only choose what to evict: late or carried, the steps are plain's.
    name = "transformer_sdpa_dropout"
    budget = int(no_eviction_peak(name, SWEEP_BATCH[name]) * 0.6)
    results = {}
    for label, lag in (("plain", None), ("late", 40)):
        model, loss_fn = build(name, SWEEP_BATCH[name])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(7)
        losses, stats, s = [], [], None
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            if lag is None:
                loss = loss_fn(model)
                loss.backward()
            else:
                with simulated(lag, budget=budget) as s:
                    loss = loss_fn(model)
                    loss.backward()
                stats.append(s.stats())
            opt.step()
            losses.append(loss.detach())
            _core.simulated_gpu_synchronize()
        results[label] = losses, [p.detach().clone() for p in model.parameters()], stats
    (want_losses, want_params, _), (got_losses, got_params, stats) = results["plain"], results["late"]
    assert all(torch.equal(x, y) for x, y in zip(got_losses, want_losses))
    assert all(torch.equal(x, y) for x, y in zip(got_params, want_params))
    assert all(st["evictions"] > 0 for st in stats), stats
    assert stats[0]["carried_costs"] == 0 and stats[0]["gpu_timed_ops"] > 0, stats[0]
    # From the second step on, nearly every op is carried: all but those
    # whose interval a recompute ran in (which measures nothing).
    ops = len(s.series()["op"])
    for st in stats[1:]:
        assert st["carried_costs"] >= ops - 2 * st["remats"] - 1, (ops, st)


def test_simulate_gpu_timer_refuses_what_it_cannot_do():
    s = dtr(device="cpu")
    with pytest.raises(ValueError, match="launch_ns"):
        s._core.simulate_gpu_timer(10, -1.0)
    with s:
        with pytest.raises(RuntimeError, match="before the session starts"):
            s._core.simulate_gpu_timer(10, LAUNCH_NS)


def test_alternating_kinds_of_step_each_carry_their_own_kinds_costs():
    # A GAN's discriminator and generator steps, or training and evaluation,
    # in turn: each step learns from the last step of its own kind (Note
    # [recent steps], allocator/bindings/recent_steps.h), not only from the
    # step just before.
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    kinds = {
        "A": lambda: matmuls(a, b),
        "B": lambda: [a.cos()] + matmuls(b, a, 3),
        "C": lambda: [a.sin()] + matmuls(a, a, 2),
        "D": lambda: [a.tanh()] + matmuls(b, b, 2),
        "E": lambda: [a.exp()] + matmuls(a, b, 2),
    }

    def step(kind):
        with simulated(100) as s:
            outs = kinds[kind]()
            carried = s.stats()["carried_costs"]
        _core.simulated_gpu_synchronize()
        del outs
        return s, carried

    carried = {}
    held = []
    for i, kind in enumerate("ABABAAC"):
        s, carried[i] = step(kind)
        held.append(s)
    assert [carried[i] for i in range(7)] == [0, 0, 4, 4, 4, 4, 0], carried
    # Four kinds are kept; a fifth pushes out the one run longest ago. Now
    # C, A, B (newest first); D and E push out B. C is still carried; then B
    # comes back as a new kind and pushes out A.
    for kind in "DE":
        held.append(step(kind)[0])
    assert [step(kind)[1] for kind in "CBA"] == [3, 0, 0]
