"""dtralloc.replay: a trace's allocations and frees through the real pool on the
virtual backend, under a budget; and the `dtralloc replay` / `dtralloc record`
commands.

A hand-made trace whose segments are easy to count pins the numbers exactly
(peaks, fragmentation, the op that runs out of memory); a recorded training
step checks the same promises on real traffic; every bundled trace replays
with the pool's invariants checked after every op.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from _steps import training_step
from conftest import MiB

import dtralloc
from dtralloc.replay import POLICIES, format_results, table_row
from dtralloc.trace import Op, Storage, Trace

MIN_BLOCK = 512
LARGE_SEGMENT = 20 * MiB  # the pool's segment for requests of 1-10 MiB
SMALL_SEGMENT = 2 * MiB   # ... and for requests up to 1 MiB


def _exact_trace() -> Trace:
    """1 MiB alive before the step (a 2 MiB small segment); op 0 makes 3 MiB
    (a 20 MiB large segment); op 1 makes 5 MiB in the same segment, then frees
    the 3 MiB; op 2 makes 100 B and frees everything but the initial storage.
    Peak allocated 9 MiB after op 1, peak reserved 22 MiB, 2 device calls."""
    storages = [Storage(MiB, "cuda:0", "float32", True, outlives=True),
                Storage(3 * MiB, "cuda:0", "float32", False, producer=0),
                Storage(5 * MiB, "cuda:0", "float32", False, producer=1),
                Storage(100, "cuda:0", "float32", False, producer=2)]
    ops = [Op("aten::a", inputs=[0], outputs=[1], created=[1]),
           Op("aten::b", inputs=[1], outputs=[2], created=[2], frees=[1]),
           Op("aten::c", inputs=[2], outputs=[3], created=[3], frees=[2, 3])]
    trace = Trace(storages, ops, meta={"name": "exact"})
    trace.validate()
    return trace


def _mlp_trace() -> Trace:
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Dropout(0.1), nn.Linear(512, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    step = training_step(model, opt, nn.functional.cross_entropy, x, y)
    step()
    return dtralloc.trace.record(step, name="mlp")


@pytest.fixture(scope="module")
def mlp_trace() -> Trace:
    return _mlp_trace()


@pytest.fixture(scope="module")
def mlp_file(mlp_trace, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("replay") / "mlp.dtrace")
    mlp_trace.save(path)
    return path


def _rounded(nbytes: int) -> int:
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


# -- exact numbers on a hand-made trace -------------------------------------------

def test_exact_trace_without_budget():
    r = dtralloc.replay(_exact_trace(), check_invariants=True)
    assert r.feasible and r.oom_op is None and r.oom_message == ""
    assert r.budget_bytes is None
    assert r.peak_allocated_bytes == 9 * MiB
    assert r.peak_reserved_bytes == r.no_eviction_peak_reserved_bytes == SMALL_SEGMENT + LARGE_SEGMENT
    assert r.final_reserved_bytes == SMALL_SEGMENT + LARGE_SEGMENT  # policy none keeps its cache
    assert r.segments_peak == 2 and r.device_alloc_calls == 2 and r.device_free_calls == 0
    reserved = 22 * MiB
    # Sampled after each op's outputs are placed, before its frees.
    assert r.reserved_fragmentation == pytest.approx(
        [1 - 4 * MiB / reserved, 1 - 9 * MiB / reserved, 1 - (6 * MiB + 512) / reserved])
    # Free after op 0: 1 MiB in the small segment, 17 MiB in the large one.
    assert r.external_fragmentation[0] == pytest.approx(1 - 17 / 18)
    assert r.external_fragmentation[1] == pytest.approx(1 - 12 / 13)
    assert r.reserved_over_allocated == pytest.approx(22 / 9)
    assert r.mean_reserved_fragmentation == pytest.approx(sum(r.reserved_fragmentation) / 3)


def test_exact_trace_under_budgets():
    trace = _exact_trace()
    fits = dtralloc.replay(trace, budget=22 * MiB, check_invariants=True)
    assert fits.feasible and fits.budget_bytes == 22 * MiB and fits.peak_reserved_bytes == 22 * MiB
    # One byte short of a 20 MiB segment: the large requests fall back to
    # segments of their own 2 MiB-rounded size (2 + 4 + 6 MiB).
    tight = dtralloc.replay(trace, budget=22 * MiB - 1, check_invariants=True)
    assert tight.feasible and tight.peak_reserved_bytes == 12 * MiB
    # 11 MiB: op 0's 4 MiB segment fits, op 1's 6 MiB one does not.
    short = dtralloc.replay(trace, budget=11 * MiB, check_invariants=True)
    assert not short.feasible and short.oom_op == 1
    assert "out of memory" in short.oom_message and short.peak_reserved_bytes <= 11 * MiB
    assert short.no_eviction_peak_reserved_bytes == 22 * MiB
    assert len(short.reserved_fragmentation) == 1, "sampled only for ops that completed"
    # Not even the storages alive before the step fit.
    none = dtralloc.replay(trace, budget=MiB)
    assert not none.feasible and none.oom_op == -1
    assert table_row(none)["feasible"] == "OOM: initial storages"
    assert table_row(short)["feasible"] == "OOM at op 1"


# -- a recorded training step -------------------------------------------------------

def test_no_budget_is_feasible_and_bounded_by_the_trace(mlp_trace):
    r = dtralloc.replay(mlp_trace)
    live_peak = mlp_trace.peak_live_bytes()
    assert r.feasible and r.budget_bytes is None
    assert r.no_eviction_peak_reserved_bytes == r.peak_reserved_bytes >= r.peak_allocated_bytes
    # Allocated bytes are the trace's live bytes, each rounded up to 512.
    assert live_peak <= r.peak_allocated_bytes <= live_peak + MIN_BLOCK * len(mlp_trace.storages)
    initial = sum(_rounded(s.nbytes) for s in mlp_trace.storages if s.initial)
    assert r.peak_allocated_bytes - initial >= live_peak - sum(
        s.nbytes for s in mlp_trace.storages if s.initial)
    assert r.device_alloc_calls >= r.segments_peak >= 1
    assert r.final_reserved_bytes <= r.peak_reserved_bytes
    assert r.name == "mlp" and r.policy == "none"


def test_fragmentation_is_sampled_once_per_op_in_unit_range(mlp_trace):
    r = dtralloc.replay(mlp_trace)
    for series in (r.reserved_fragmentation, r.external_fragmentation):
        assert len(series) == len(mlp_trace.ops)
        assert all(0.0 <= f <= 1.0 for f in series)
    assert 0.0 <= r.mean_reserved_fragmentation <= 1.0 and 0.0 <= r.mean_external_fragmentation <= 1.0


def test_fractional_budgets(mlp_trace):
    base = dtralloc.replay(mlp_trace)
    full = dtralloc.replay(mlp_trace, budget=1.0, check_invariants=True)
    assert full.feasible and full.budget_bytes == base.peak_reserved_bytes
    assert full.peak_reserved_bytes <= full.budget_bytes
    assert full.no_eviction_peak_reserved_bytes == base.peak_reserved_bytes
    # Below the allocated peak nothing fits without eviction, which policy
    # "none" does not do.
    fraction = 0.9 * base.peak_allocated_bytes / base.peak_reserved_bytes
    tight = dtralloc.replay(mlp_trace, budget=fraction, check_invariants=True)
    assert not tight.feasible
    assert tight.budget_bytes == int(fraction * base.peak_reserved_bytes)
    assert tight.oom_op is not None and -1 <= tight.oom_op < len(mlp_trace.ops)
    assert "out of memory" in tight.oom_message
    assert tight.peak_reserved_bytes <= tight.budget_bytes
    assert tight.no_eviction_peak_reserved_bytes == base.peak_reserved_bytes


def test_byte_budgets_and_size_strings(mlp_trace):
    base = dtralloc.replay(mlp_trace)
    exact = dtralloc.replay(mlp_trace, budget=base.peak_reserved_bytes)
    assert exact.feasible and exact.peak_reserved_bytes == base.peak_reserved_bytes
    big = dtralloc.replay(mlp_trace, budget="6G")
    assert big.feasible and big.budget_bytes == 6 << 30
    assert dtralloc.replay(mlp_trace, budget="64K").budget_bytes == 64 << 10
    assert not dtralloc.replay(mlp_trace, budget="64K").feasible


@pytest.mark.parametrize("budget,error,match", [
    (0, ValueError, "positive"),
    (-5, ValueError, "positive"),
    (0.0, ValueError, r"in \(0, 1\]"),
    (1.5, ValueError, r"in \(0, 1\]"),
    (-0.5, ValueError, r"in \(0, 1\]"),
    (math.nan, ValueError, r"in \(0, 1\]"),
    (True, TypeError, "bool"),
    ([1], TypeError, "list"),
    ("lots", ValueError, "size"),
    ("0.5", ValueError, r"not a whole one; .* \(a share of the peak is a float: budget=0.5\)"),
    ("0", ValueError, "positive"),
])
def test_invalid_budgets_raise(budget, error, match):
    with pytest.raises(error, match=match):
        dtralloc.replay(_exact_trace(), budget=budget)


def test_unknown_policy_lists_the_policies():
    with pytest.raises(ValueError, match="unknown policy 'belady'.*available: none") as info:
        dtralloc.replay(_exact_trace(), policy="belady")
    assert all(p in str(info.value) for p in POLICIES)


def test_conf_is_passed_to_the_pool_but_not_a_budget():
    with pytest.raises(ValueError, match=r"replay\(budget=...\)"):
        dtralloc.replay(_exact_trace(), conf="budget:1G")
    with pytest.raises(ValueError, match="budget"):
        dtralloc.replay(_exact_trace(), conf={"budget": "1G"})
    with pytest.raises(dtralloc.ConfigError, match="no_such_key"):
        dtralloc.replay(_exact_trace(), conf="no_such_key:1")
    r = dtralloc.replay(_exact_trace(), conf="max_split_size_mb:64")
    assert r.feasible and r.conf == "max_split_size_mb:64"
    assert table_row(r)["conf"] == "max_split_size_mb:64"


def test_conf_none_does_not_pick_up_the_environment(monkeypatch):
    # replay(conf=None) means "no settings" for the replay pool, like Pool().
    monkeypatch.setenv("DTRALLOC_CONF", "budget:1G")
    assert dtralloc.replay(_exact_trace()).feasible


def test_the_same_trace_replays_identically(mlp_trace):
    assert dtralloc.replay(mlp_trace) == dtralloc.replay(mlp_trace)
    a = dtralloc.replay(mlp_trace, budget=0.5)
    b = dtralloc.replay(mlp_trace, budget=0.5)
    assert a == b


def _repeated_trace() -> Trace:
    """1 MiB alive before the step (a parameter); op 0 makes 3 MiB the step
    keeps (its gradient: still alive when the step returns); op 1 makes 5 MiB
    and frees it. Repeated, the 3 MiB of a step dies as the next begins."""
    storages = [Storage(MiB, "cuda:0", "float32", True, outlives=True),
                Storage(3 * MiB, "cuda:0", "float32", False, producer=0, outlives=True),
                Storage(5 * MiB, "cuda:0", "float32", False, producer=1)]
    ops = [Op("aten::a", inputs=[0], outputs=[1], created=[1]),
           Op("aten::b", inputs=[0, 1], outputs=[2], created=[2], frees=[2])]
    trace = Trace(storages, ops, meta={"name": "repeated"})
    trace.validate()
    return trace


def test_steps_repeat_the_step_in_one_pool():
    one = dtralloc.replay(_repeated_trace(), check_invariants=True)
    three = dtralloc.replay(_repeated_trace(), check_invariants=True, steps=3)
    assert one.steps == 1 and three.steps == 3 and three.feasible
    # The first step fills the pool (a small segment for the parameter, one
    # 20 MiB segment for 3 + 5 MiB); the later ones are served from it: the
    # kept 3 MiB of the step before is free again when the step makes its own.
    assert one.device_alloc_calls == three.device_alloc_calls == 2
    assert one.last_step_device_alloc_calls == 1  # the parameter's segment came before the step
    assert three.last_step_device_alloc_calls == three.last_step_device_free_calls == 0
    assert three.peak_allocated_bytes == one.peak_allocated_bytes == _rounded(MiB) + 8 * MiB
    assert len(three.reserved_fragmentation) == len(_repeated_trace().ops)  # the last step's samples


def test_one_step_is_the_default(mlp_trace):
    assert dtralloc.replay(mlp_trace, budget=0.5, steps=1) == dtralloc.replay(mlp_trace, budget=0.5)
    r = dtralloc.replay(mlp_trace, budget=0.5)
    assert r.last_step_evictions == r.evictions
    assert r.last_step_compute_overhead == pytest.approx(r.compute_overhead)


def test_repeated_steps_under_a_budget_evict_every_step():
    r = dtralloc.replay("convbn", budget=0.5, policy="dtralloc", steps=3, check_invariants=True)
    assert r.feasible and r.steps == 3
    assert 0 < r.last_step_evictions < r.evictions
    assert r.last_step_compute_overhead > 0
    first = dtralloc.replay("convbn", budget=0.5, policy="dtralloc")
    # The no-eviction peak of three steps is the reference of the fraction.
    assert r.no_eviction_peak_reserved_bytes >= first.no_eviction_peak_reserved_bytes


@pytest.mark.parametrize("steps", [0, -1, 1.5, True, "2"])
def test_steps_must_be_a_whole_number(mlp_trace, steps):
    with pytest.raises(ValueError, match="steps must be a whole number >= 1"):
        dtralloc.replay(mlp_trace, steps=steps)


def test_late_op_costs_mislead_the_evictor_and_carried_ones_do_not():
    """cost_lag models a GPU's timing events: an op is priced at a launch
    until its own cost arrives ops later, and the evictor decides with what
    it knows then (docs/live.md, "On a GPU"; bench/replay_cost_lag.py)."""
    kw = dict(budget=0.5, policy="dtralloc", steps=2)
    exact = dtralloc.replay("convbn", **kw)
    late = dtralloc.replay("convbn", cost_lag=300, carried_costs=False, check_invariants=True, **kw)
    carried = dtralloc.replay("convbn", cost_lag=300, **kw)
    assert exact.feasible and late.feasible and carried.feasible
    # Every op is charged its own cost in the end: the step's cost is the same.
    assert late.base_cost == pytest.approx(exact.base_cost, rel=1e-9)
    assert late.last_step_compute_overhead > 2 * exact.last_step_compute_overhead
    # From the second step on, the step before's costs: decided as if known.
    assert carried.last_step_compute_overhead == pytest.approx(exact.last_step_compute_overhead, rel=0.05)
    assert carried.compute_overhead > exact.compute_overhead  # the first step still decided late
    # A lag of 0 is the replay as it was; lag_cost prices the wait.
    assert dtralloc.replay("convbn", cost_lag=0, **kw) == exact
    free = dtralloc.replay("convbn", cost_lag=300, lag_cost=0.0, carried_costs=False, **kw)
    assert free.feasible and free.last_step_compute_overhead > exact.last_step_compute_overhead


@pytest.mark.parametrize("kwargs, match", [
    ({"cost_lag": -1}, "cost_lag is a number of ops >= 0"),
    ({"cost_lag": True}, "cost_lag is a number of ops >= 0"),
    ({"cost_lag": 2.5}, "cost_lag is a number of ops >= 0"),
    ({"cost_lag": 10, "lag_cost": -1.0}, "lag_cost is a cost >= 0"),
    ({"cost_lag": 10, "lag_cost": float("nan")}, "lag_cost is a cost >= 0"),
    ({"cost_lag": 10, "lag_cost": "1"}, "lag_cost is a cost >= 0"),
])
def test_cost_lag_arguments_are_checked(mlp_trace, kwargs, match):
    with pytest.raises(ValueError, match=match):
        dtralloc.replay(mlp_trace, budget=0.5, policy="dtralloc", **kwargs)


def test_a_step_that_reads_what_it_frees_from_before_cannot_repeat():
    """An op reads a storage alive before the step, which a later op frees:
    the step after has nothing to read there."""
    storages = [Storage(MiB, "cuda:0", "float32", True),
                Storage(MiB, "cuda:0", "float32", False, producer=0)]
    ops = [Op("aten::a", inputs=[0], outputs=[1], created=[1], frees=[0]),
           Op("aten::b", inputs=[1], frees=[1])]
    trace = Trace(storages, ops, meta={"name": "once"})
    trace.validate()
    assert dtralloc.replay(trace).feasible
    with pytest.raises(ValueError, match="op 0 reads storage 0, which the step before freed: this trace cannot be "
                                         "repeated"):
        dtralloc.replay(trace, steps=2)


def test_progress_reaches_the_total(mlp_trace):
    for budget in (None, 1.0):
        calls = []
        dtralloc.replay(mlp_trace, budget=budget, progress=lambda done, total: calls.append((done, total)))
        total = len(mlp_trace.ops)
        assert calls and calls[-1] == (total, total)
        assert all(t == total for _, t in calls)
        assert [d for d, _ in calls] == sorted(d for d, _ in calls)
    calls = []
    dtralloc.replay(mlp_trace, budget=1.0, steps=2, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (2 * len(mlp_trace.ops), 2 * len(mlp_trace.ops))


def test_replay_reads_a_saved_trace(mlp_trace, mlp_file):
    assert dtralloc.replay(mlp_file) == dtralloc.replay(mlp_trace)


def test_empty_trace():
    r = dtralloc.replay(Trace(meta={"name": "empty"}), budget="1M", check_invariants=True)
    assert r.feasible and r.peak_allocated_bytes == 0 and len(r.reserved_fragmentation) == 0


def test_zero_byte_storages_take_no_memory():
    trace = Trace([Storage(0, "cpu", "float32", False, producer=0)],
                  [Op("aten::empty", outputs=[0], created=[0], frees=[0])])
    r = dtralloc.replay(trace, check_invariants=True)
    assert r.feasible and r.peak_allocated_bytes == 0


def test_format_results_is_a_table(mlp_trace):
    results = [dtralloc.replay(mlp_trace), dtralloc.replay(mlp_trace, budget="1K")]
    lines = format_results(results).splitlines()
    assert len(lines) == 4
    assert "peak reserved" in lines[0] and "feasible" in lines[0]
    assert set(lines[1]) <= {"-", " "}
    assert "yes" in lines[2] and "OOM" in lines[3]
    assert format_results([]) == "(no results)"


# -- bundled traces ----------------------------------------------------------------

try:  # python/dtralloc/traces is being written alongside these tests
    from dtralloc.traces import list_bundled, load_bundled
except ImportError:
    list_bundled = load_bundled = None

_BUNDLED = list_bundled() if list_bundled else []
_NO_BUNDLE = pytest.mark.skipif(list_bundled is None, reason="dtralloc.traces does not exist yet")


@_NO_BUNDLE
def test_bundled_traces_exist():
    assert _BUNDLED, "dtralloc.traces bundles no trace"


@_NO_BUNDLE
@pytest.mark.parametrize("name", _BUNDLED)
def test_every_bundled_trace_replays_with_invariants_checked(name):
    trace = load_bundled(name)
    trace.validate()
    r = dtralloc.replay(trace, check_invariants=True)
    assert r.feasible and len(r.reserved_fragmentation) == len(trace.ops)
    assert trace.peak_live_bytes() <= r.peak_allocated_bytes <= r.peak_reserved_bytes


@_NO_BUNDLE
def test_cli_replays_bundled_traces_by_name():
    run = _dtralloc("replay", _BUNDLED[0])
    assert run.returncode == 0, run.stderr
    assert "yes" in run.stdout
    run = _dtralloc("replay", "no_such_model")
    assert run.returncode != 0 and "no_such_model" in run.stderr and _BUNDLED[0] in run.stderr


# -- the command line ----------------------------------------------------------------

def _dtralloc(*args, cwd=None):
    env = dict(os.environ)
    env.pop("DTRALLOC_CONF", None)
    return subprocess.run([sys.executable, "-m", "dtralloc", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_cli_replay_prints_a_table_and_fails_on_oom(tmp_path):
    path = str(tmp_path / "exact.dtrace")
    _exact_trace().save(path)
    run = _dtralloc("replay", path, "--budget", "0.5", "--budget", "1G")
    assert run.returncode == 1, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 4 and "peak reserved" in lines[0]
    assert "OOM at op 1" in lines[2] and "11 MiB" in lines[2]
    assert "yes" in lines[3] and "1 GiB" in lines[3]
    assert "exact: 3 ops" in run.stderr  # the trace summary
    run = _dtralloc("replay", path, "--budget", "1G", "--budget", "1.0")
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("yes") == 2


def test_cli_replay_repeats_steps(tmp_path):
    path = str(tmp_path / "repeated.dtrace")
    _repeated_trace().save(path)
    run = _dtralloc("replay", path, "--steps", "3")
    assert run.returncode == 0, run.stderr
    header, _, row = run.stdout.strip().splitlines()
    assert "last step cudaMalloc/cudaFree" in header and "steps" in header
    assert row.split()[-2:] == ["3", "0/0"], row  # the later steps are served from the pool
    run = _dtralloc("replay", path, "--steps", "0")
    assert run.returncode == 2 and "--steps: expected a whole number >= 1, got '0'" in run.stderr


def test_cli_replay_errors(tmp_path):
    bad = tmp_path / "bad.dtrace"
    bad.write_text("not a trace")
    run = _dtralloc("replay", str(bad))
    assert run.returncode == 2 and "not a dtralloc trace" in run.stderr
    path = str(tmp_path / "exact.dtrace")
    _exact_trace().save(path)
    run = _dtralloc("replay", path, "--budget", "lots")
    assert run.returncode == 2 and "error:" in run.stderr and "Traceback" not in run.stderr


_STEP_MODULE = """
import torch

def make_step():
    lin = torch.nn.Linear(32, 8)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(16, 32)

    def step():
        opt.zero_grad()
        loss = lin(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    return step

not_a_factory = 3

def returns_data():
    return 42
"""


@pytest.fixture
def step_module(tmp_path, monkeypatch):
    """A module `tinystep_<n>` in tmp_path, tmp_path as the working directory."""
    name = f"tinystep_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_STEP_MODULE))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def test_cli_record_writes_a_loadable_trace(step_module, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "t.dtrace"
    run = _dtralloc("record", f"{step_module}:make_step", "--out", str(out), cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}" in run.stdout
    trace = dtralloc.trace.load(str(out))
    trace.validate()
    assert trace.meta["name"] == "make_step"
    assert any(op.backward for op in trace.ops) and any(op.name == "aten::addmm" for op in trace.ops)
    assert dtralloc.replay(trace).feasible


@pytest.mark.parametrize("target,message", [
    ("{mod}:no_such_function", "has no attribute 'no_such_function'"),
    ("{mod}:returns_data", "must return the step function"),
])
def test_cli_record_bad_targets_say_why(step_module, target, message):
    pytest.importorskip("torch")
    from dtralloc.cli import main

    with pytest.raises(SystemExit) as info:
        main(["record", target.format(mod=step_module), "--out", "x.dtrace"])
    assert message in str(info.value) and str(info.value).startswith("error:")
    assert not os.path.exists("x.dtrace")


def test_cli_record_missing_module_says_why(step_module):
    from dtralloc.cli import main

    with pytest.raises(SystemExit, match="error:.*no_such_module"):
        main(["record", "no_such_module_xyz:make_step"])


def test_cli_replay_with_policies_adds_eviction_columns(tmp_path):
    from dtralloc.traces import bundled_path

    run = _dtralloc("replay", bundled_path("resnet50"), "--budget", "0.6", "--policy", "dtr",
                    "--policy", "dtralloc")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = lines[0].split()
    for column in ("policy", "overhead", "evictions", "remats"):
        assert column in header
    rows = lines[2:]
    assert len(rows) == 2 and rows[0].split()[-4] == "dtr" and rows[1].split()[-4] == "dtralloc"
    for row in rows:
        overhead, evictions, remats = float(row.split()[-3]), int(row.split()[-2]), int(row.split()[-1])
        assert overhead > 0 and evictions > 0 and remats > 0
    bad = _dtralloc("replay", bundled_path("mlp"), "--budget", "0.5", "--policy", "bogus")
    assert bad.returncode == 2 and "unknown policy 'bogus'" in bad.stderr


def test_history_is_stamped_with_ops_and_agrees_with_the_series():
    from dtralloc.dashboard.history import build_history
    from dtralloc.traces import load_bundled

    trace = load_bundled("resnet50")
    assert dtralloc.replay(trace, budget=0.5, policy="dtralloc").history is None
    r = dtralloc.replay(trace, budget=0.5, policy="dtralloc", history=True)
    assert r.feasible and r.evictions > 0 and not r.history_wrapped
    h, s = r.history, r.series
    assert np.all(np.diff(h["op"]) >= 0) and h["op"][0] == -1 and h["op"][-1] == len(trace.ops) - 1
    assert np.all(np.diff(s["event"]) >= 0) and s["event"][-1] <= len(h["op"])
    model = build_history(h).model
    for i in range(0, len(s["op"]), 7):  # what was allocated at each op's sample, from the events alone
        e = s["event"][i] - 1
        live = (model["block_start"] <= e) & (e < model["block_free_requested"])
        assert int(model["block_size"][live].sum()) == s["allocated"][i], i


def test_replay_takes_a_bundled_traces_name():
    from dtralloc.traces import load_bundled

    by_name = dtralloc.replay("mlp")
    assert by_name.peak_reserved_bytes == dtralloc.replay(load_bundled("mlp")).peak_reserved_bytes
    with pytest.raises(FileNotFoundError, match="no bundled trace of that name.*gpt2"):
        dtralloc.replay("no-such-trace")
