"""What a live dtr() session records for dashboards (issue 15): the per-op
series as numpy columns named as the replay's, with each op's phase and
name; the engine's event log of evictions, remats and the evictor's calls;
op stamps in the pool's history; and the page dtralloc.dashboard builds."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from _live_models import build

import dtralloc
from dtralloc.dtr import PHASES, dtr
from dtralloc.traces import bundled_path


def _step(model, loss_fn, opt, **session):
    opt.zero_grad(set_to_none=True)
    with dtr(device="cpu", **session) as s:
        loss_fn(model).backward()
        opt.step()
    return s


@pytest.fixture(scope="module")
def session():
    """One AdamW step of an MLP with dropout at 0.6 of its peak, with history."""
    torch.manual_seed(3)
    model, loss_fn = build("mlp_inplace_dropout", 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):  # kernels and the optimizer's state allocate on their first step
        peak = _step(model, loss_fn, opt).stats()["peak_bytes"]
    return _step(model, loss_fn, opt, budget=int(peak * 0.6), history=True)


def test_series_columns_are_the_replays_plus_phase_and_name(session):
    s, stats = session.series(), session.stats()
    trace_replay = dtralloc.replay(dtralloc.trace.load(bundled_path("resnet50")), budget=0.7)
    assert set(trace_replay.series) <= set(s) and {"phase", "name"} <= set(s)
    n = len(s["op"])
    assert n == stats["series_ops"] > 0 and stats["series_dropped"] == 0
    for k, v in s.items():
        assert isinstance(v, np.ndarray) and len(v) == n, k
    assert np.array_equal(s["op"], np.arange(n))  # one sample per op the engine saw
    assert np.all(s["reserved"] <= stats["budget_bytes"]) and s["reserved"].max() <= stats["peak_bytes"]
    assert np.all(s["allocated"] <= s["reserved"]) and np.all(s["largest_free"] <= s["free"])
    assert np.all(s["free"] <= s["reserved"] - s["allocated"]) and s["evictable"].max() > 0
    assert "aten.addmm.default" in set(s["name"]) and all(str(x).startswith("aten.") for x in s["name"])
    # Phases in step order: forward, then backward (a graph task), then the
    # optimizer (no grad, after a backward); each a single band here.
    phase = s["phase"]
    assert phase[0] == PHASES.index("forward") and phase[-1] == PHASES.index("optimizer")
    assert np.all(np.diff(phase.astype(int)) >= 0) and set(phase) == {0, 1, 2}
    assert "aten.addmm.default" in set(s["name"][phase == 0]) and "aten.mm.default" in set(s["name"][phase == 1])


def test_events_match_the_stats(session):
    e, stats = session.events(), session.stats()
    kinds = np.bincount(e["kind"], minlength=3)
    assert stats["evictions"] > 0 and stats["remats"] > 0
    assert (kinds[0], kinds[1], kinds[2]) == (stats["eviction_calls"], stats["evictions"], stats["remats"])
    assert np.all((e["op"] >= 0) & (e["op"] < len(session.series()["op"])))
    asked = e["kind"] == 0
    assert np.all(e["value"][asked] == -1) and np.all(e["bytes"][asked] > 0) and np.all(e["plan"][asked] > 0)
    assert np.all(e["addr"][~asked] > 0) and np.all(e["bytes"][~asked] > 0)


def test_history_carries_op_stamps(session):
    h = session.pool_snapshot()["device_traces"][-1]
    s, stats = session.series(), session.stats()
    assert len(h["op"]) == stats["history_recorded"] > 0
    assert np.all(np.diff(h["op"]) >= 0) and h["op"][0] >= 0 and h["op"].max() <= len(s["op"])
    # Each sample counts the events before it; an op's outputs are allocated
    # before its sample, so the events up to it carry its stamp or earlier.
    assert np.all(np.diff(s["event"]) >= 0) and s["event"][-1] <= len(h["op"])
    for k in range(0, len(s["op"]), 7):
        before = h["op"][:s["event"][k]]
        assert before.size == 0 or before.max() <= k


def test_recording_is_bounded_and_can_be_off():
    x = torch.randn(64, 64, requires_grad=True)
    with dtr(device="cpu", series=5) as s:
        for _ in range(4):
            x = torch.tanh(x) * 2
        x.sum().backward()
    stats = s.stats()
    assert stats["series_ops"] == 5 and stats["series_dropped"] > 0 and len(s.series()["name"]) == 5
    with dtr(device="cpu", series=0) as s:
        torch.tanh(x).sum()
    assert len(s.series()["op"]) == 0 and len(s.events()["op"]) == 0 and s.stats()["series_dropped"] > 0
    with pytest.raises(TypeError, match="series is a number of ops"):
        dtr(device="cpu", series=-1)


def test_dashboard_of_a_session_without_history_says_how_to_get_one():
    x = torch.randn(64, 64, requires_grad=True)
    with dtr(device="cpu") as s:
        torch.tanh(x).sum().backward()
    d = dtralloc.dashboard(s)
    assert d.runs[0]["kind"] == "live" and d.runs[0]["peak_reserved_bytes"] == s.stats()["peak_bytes"]
    assert "history=True" in d.html
