"""Running replays: replay(), and the budget searches built on it
(min_feasible_budget, resident_floor)."""
from __future__ import annotations

import math
import os
from typing import Callable, Optional, Union

from .. import _core
from ..config import ConfLike, conf_text, size_in_bytes
from ..trace import Trace, load
from ..traces import bundled_path, list_bundled
from .result import POLICIES, ReplayResult


def replay(
    trace: Union[Trace, str],
    budget: Union[None, int, float, str] = None,
    policy: str = "none",
    conf: ConfLike = None,
    check_invariants: bool = False,
    progress: Optional[Callable[[int, int], None]] = None,
    history: bool = False,
    pin_outliving: bool = True,
    steps: int = 1,
    cost_lag: int = 0,
    lag_cost: Optional[float] = None,
    carried_costs: bool = True,
    empty_cache_between_steps: bool = False,
) -> ReplayResult:
    """Run `trace` through a fresh pool and measure it.

    Args:
        trace: a Trace, a path to a saved one, or a bundled trace's name ("gpt2").
        budget: None (no cap), bytes (int or "6G"), or a float in (0, 1]: that
            fraction of the no-eviction peak reserved (measured by a first
            replay without a budget).
        policy: eviction policy; "none" replays allocations only.
        conf: extra DTRALLOC_CONF settings for the pool (not `budget`).
        check_invariants: verify the pool's invariants after every op (slow).
        progress: called as progress(ops_done, ops_total) now and then.
        history: keep the pool's alloc/free/segment events, each stamped
            with its op (``result.history``, numpy columns; what the
            dashboard's address views draw).
        pin_outliving: storages made during the step and still alive after
            it (``Storage.outlives``: the parameters' gradients, the loss)
            are held by the program from the op that makes them, so they
            are pinned, as a live session finds them (``dtralloc.dtr``
            cannot evict what the program references); so are storages
            made before the step's last backward op and freed after it (the
            loss the step returns: autograd has let go of it by then, so the
            program holds it). False replays them
            as recomputable, as replays before 2026-11-23 did; dtralloc's
            lowest budgets were then up to 0.09 of the peak too low
            (docs/live.md, "Live against replay").
        steps: run the step this many times in the one pool, as a training
            loop does: what a step made and kept (its gradients) dies as
            the next one begins (``zero_grad(set_to_none=True)``), what
            was alive before the step (parameters, optimizer state) stays.
            The ``last_step_*`` figures are the last step's (the steady
            state: the pool no longer starts empty) and ``series`` samples
            it; the other figures count every step. A fractional budget is
            a share of the peak of the same number of steps without a budget.
        cost_lag: > 0 models a GPU's op timing, as a live CUDA session sees
            it (docs/live.md, "On a GPU"): each op is priced at `lag_cost`
            when it runs and at its own cost only `cost_lag` ops later, as
            its timing event completes while the host runs ahead of the
            kernels (and all of them by the step's end). The evictor decides
            with what it knows then; every figure charges the op's own cost.
        lag_cost: what an op is priced at until then, in the trace's cost
            units (None: 5% of the trace's mean op cost, a launch against a
            kernel).
        carried_costs: with cost_lag, from the second step on each op is
            priced at its own cost from the start, as a live session prices
            it at the step before's (Note [carried costs]); False: every
            step as the first.
        empty_cache_between_steps: with steps > 1, give back every whole
            free cached segment between steps, as a loop calling
            ``torch.cuda.empty_cache()`` after each step does (the no-eviction
            reference too): each step starts from the cache the first started
            from. A cache the steps before left can make a later step run out
            at a budget the first fitted (docs/allocator.md, Note [one step or
            a loop]); the segments given back and made again are counted in
            the device calls.
    """
    _check_steps(steps, "replay")
    if isinstance(cost_lag, bool) or not isinstance(cost_lag, int) or cost_lag < 0:
        raise ValueError(f"dtralloc.replay: cost_lag is a number of ops >= 0 (0: none); got {cost_lag!r}")
    if lag_cost is not None and (isinstance(lag_cost, bool) or not isinstance(lag_cost, (int, float))
                                 or not lag_cost >= 0 or math.isinf(lag_cost)):
        raise ValueError(f"dtralloc.replay: lag_cost is a cost >= 0 in the trace's units, or None; got {lag_cost!r}")
    trace = _as_trace(trace)
    if policy not in POLICIES:
        raise ValueError(f"dtralloc.replay: unknown policy {policy!r}; available: {', '.join(POLICIES)}")
    text = _pool_conf(conf)
    if policy == "none":  # DTRALLOC_CONF=policy:... chooses when the call does not
        policy = _core.describe_config(text)[_POLICY_ROW]["value"]
    columns = replay_columns(trace, pin_outliving)
    entries = _history_entries(trace, steps) if history else 0
    lag = {}
    if cost_lag:
        if lag_cost is None:
            lag_cost = 0.05 * float(sum(columns.cost)) / max(1, columns.num_ops)
        lag = {"cost_lag_ops": cost_lag, "lag_cost": float(lag_cost), "lag_carried": bool(carried_costs)}
    empty = {"empty_cache_between_steps": bool(empty_cache_between_steps)}
    if budget is None and policy == "none":  # the replay is its own no-eviction reference
        result = _run(columns, 0, "none", text, check_invariants, progress, history_entries=entries, steps=steps,
                      **empty)
        result.no_eviction_peak_reserved_bytes = result.peak_reserved_bytes
    else:
        reference = _run(columns, 0, "none", text, False, None, steps=steps, **empty).peak_reserved_bytes
        budget_bytes = 0 if budget is None else _resolve_budget(budget, reference)
        result = _run(columns, budget_bytes, policy, text, check_invariants, progress, history_entries=entries,
                      steps=steps, **lag, **empty)
        result.no_eviction_peak_reserved_bytes = reference
    result.name = str(trace.meta.get("name", ""))
    result.conf = text
    return result


_POLICY_ROW = [o["name"] for o in _core.describe_config("")].index("policy")


def _as_trace(trace: Union[Trace, str]) -> Trace:
    """A Trace, a .dtrace path, or the name of a bundled trace ("gpt2")."""
    if not isinstance(trace, str):
        return trace
    if not os.path.exists(trace):
        names = list_bundled()
        if trace in names:
            return load(bundled_path(trace))
        raise FileNotFoundError(f"dtralloc: no trace file {trace!r}, and no bundled trace of that name "
                                f"(bundled: {', '.join(names)})")
    return load(trace)


def _pool_conf(conf: ConfLike) -> str:
    """The DTRALLOC_CONF text for a replay's pool; the budget is replay()'s own argument."""
    text = conf_text(conf if conf is not None else "")
    settings = {o["name"]: o["value"] for o in _core.describe_config(text)}  # validates too
    if settings["budget"] != "none":
        raise ValueError("dtralloc.replay: pass the budget as replay(budget=...), not inside conf")
    return text


def _resolve_budget(budget, reference: int) -> int:
    if isinstance(budget, bool):
        raise TypeError("dtralloc.replay: budget must be None, bytes or a fraction, not a bool")
    if isinstance(budget, float):
        if not (0.0 < budget <= 1.0) or math.isnan(budget):
            raise ValueError(
                f"dtralloc.replay: a fractional budget must be in (0, 1] (a share of the "
                f"no-eviction peak reserved); got {budget}. Pass an int for bytes."
            )
        return max(1, int(budget * reference))
    return size_in_bytes(budget, "dtralloc.replay", "None, bytes (an int), a size such as '20G' or a fraction",
                         fraction="a share of the peak is a float: budget=0.5")


def replay_columns(trace: Trace, pin_outliving: bool = True) -> _core.ReplayTrace:
    """`trace` as the replay driver's columns (a bound struct, CSR lists);
    `pin_outliving` as in :func:`replay`."""
    def csr(lists):
        offsets, values = [0], []
        for item in lists:
            values.extend(item)
            offsets.append(len(values))
        return offsets, values

    ops = trace.ops
    t = _core.ReplayTrace()
    t.nbytes = [s.nbytes for s in trace.storages]
    t.initial = [int(s.initial) for s in trace.storages]
    # What the program holds is pinned from the op that makes it, as live
    # finds it held: what is made in the step and alive after it (the
    # gradients), and what is made before its backward ended and freed only
    # after it (the loss the step returns): autograd has let go of it by then.
    if pin_outliving:
        t.kept = kept_column(trace)
    t.frees_before = list(trace.frees_before)
    t.inputs_offsets, t.inputs = csr([o.inputs for o in ops])
    t.created_offsets, t.created = csr([o.created for o in ops])
    t.mutated_offsets, t.mutated = csr([o.mutated for o in ops])
    t.frees_offsets, t.frees = csr([o.frees for o in ops])
    # Measured duration when the trace has one, else the FLOP estimate.
    t.cost = [float(o.duration_ns if o.duration_ns > 0 else max(o.flops, 1)) for o in ops]
    t.random = [int(o.random) for o in ops]
    return t


def kept_column(trace: Trace) -> list[int]:
    """ReplayTrace.kept: 1 for a storage made in the step that outlives it, 2
    for one made before the last backward op ran and freed after it, else 0."""
    kept = [_core.ReplayTrace.KEPT_OUTLIVES if s.outlives and not s.initial else 0 for s in trace.storages]
    ops = trace.ops
    last_backward = max((i for i, o in enumerate(ops) if o.backward), default=-1)
    if last_backward < 0:
        return kept
    made_before = set()
    for o in ops[: last_backward + 1]:
        made_before.update(o.created)
    for o in ops[last_backward + 1:]:
        for sid in o.frees:
            if sid in made_before and not kept[sid]:  # made in the step: never initial
                kept[sid] = _core.ReplayTrace.KEPT_PAST_BACKWARD
    return kept


# The pool's history ring holds at most this many events (48 bytes each).
_MAX_HISTORY = 1 << 24


def _history_entries(trace: Trace, steps: int = 1) -> int:
    """A history ring for the whole replay: each storage makes an alloc and
    two free events per step, segments come and go, and recomputes allocate
    again (at most kMaxRematsPerOp per op before the replay calls it
    thrashing, but a handful on average); capped at the pool's maximum."""
    return min(_MAX_HISTORY, steps * (4 * len(trace.storages) + 16 * len(trace.ops)) + 4096)


def _run(columns, budget_bytes: int, policy: str, conf: str, check: bool, progress,
         measure_floor: bool = False, history_entries: int = 0, steps: int = 1, **lag) -> ReplayResult:
    return _core.replay(columns, budget_bytes, policy, conf, check, True, measure_floor, history_entries, progress,
                        steps, **lag)


def resident_floor(trace: Union[Trace, str], conf: ConfLike = None, pin_outliving: bool = True) -> float:
    """The budget fraction below which no eviction policy can run `trace`.

    At every op some bytes cannot be evicted: initial storages (parameters,
    optimizer state), what the program keeps after the step (gradients, the
    loss; `pin_outliving` as in :func:`replay`), values made unrecomputable
    by an in-place write to them, and the op's own inputs and outputs. The
    largest such sum over the step, as a fraction of the no-eviction peak
    reserved, bounds every policy's ``min_feasible_budget`` from below (the
    pool's fragmentation comes on top)."""
    trace = _as_trace(trace)
    r = _run(replay_columns(trace, pin_outliving), 0, "none", _pool_conf(conf), False, None, measure_floor=True)
    return r.resident_floor_bytes / r.peak_reserved_bytes if r.peak_reserved_bytes else 0.0


def _check_steps(steps, caller: str) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"dtralloc.{caller}: steps must be a whole number >= 1; got {steps!r}")
    return steps


def _searcher(trace, policy: str, conf: ConfLike, reference_bytes: Optional[int], caller: str,
              pin_outliving: bool, steps: int = 1, empty_cache_between_steps: bool = False):
    """run_at(fraction) -> ReplayResult for the budget searches, arguments
    checked. With `steps` > 1 each budget runs the step that many times in
    one pool (replay(steps=N)), a fraction being of the peak of as many
    steps without a budget."""
    _check_steps(steps, caller)
    trace = _as_trace(trace)
    if policy == "none":
        raise ValueError(f"dtralloc.{caller}: needs an eviction policy, not 'none'")
    if policy not in POLICIES:
        raise ValueError(f"dtralloc.{caller}: unknown policy {policy!r}; available: {', '.join(POLICIES)}")
    text = _pool_conf(conf)
    columns = replay_columns(trace, pin_outliving)
    if reference_bytes is not None and (isinstance(reference_bytes, bool) or not isinstance(reference_bytes, int)
                                        or reference_bytes <= 0):
        raise ValueError(f"dtralloc.{caller}: reference_bytes must be a positive int, not {reference_bytes!r}")
    empty = {"empty_cache_between_steps": bool(empty_cache_between_steps)}
    reference = reference_bytes or _run(columns, 0, "none", text, False, None, steps=steps,
                                         **empty).peak_reserved_bytes

    def run_at(fraction: float) -> ReplayResult:
        return _run(columns, max(1, int(fraction * reference)), policy, text, False, None, steps=steps, **empty)

    return run_at


def _check_step(step: float, caller: str, name: str) -> int:
    if not 0 < step < 1:
        raise ValueError(f"dtralloc.{caller}: {name} must be in (0, 1), not {step!r}")
    return round(1 / step)


def min_feasible_budget(
    trace: Union[Trace, str], policy: str = "dtralloc", conf: ConfLike = None, tolerance: float = 0.01,
    method: str = "bisect", reference_bytes: Optional[int] = None, pin_outliving: bool = True, steps: int = 1,
    empty_cache_between_steps: bool = False,
) -> Optional[float]:
    """Smallest budget fraction (of the no-eviction peak reserved) at which
    `policy` completes the trace; None if even 1.0 fails.

    ``method="bisect"`` (default) bisects to `tolerance` in about
    log2(1/tolerance) replays. ``method="scan"`` steps down from 1.0 by
    `tolerance` and returns the last budget before the first failure: every
    budget on that grid from there up is feasible (about (1 - result) /
    tolerance replays).

    Feasibility need not be monotone in the budget: where the pool puts
    blocks, and so which tensors are evicted when, changes with it, and a
    budget can fail where a smaller one runs (a "hole", see
    :func:`feasible_budgets`). Where a policy has a hole, bisection may
    report a point below a budget that fails; where it has none, both
    methods find the same boundary, to within `tolerance`. With gradients
    pinned, as live (the default), ``dtralloc`` has no hole above the scan's
    answer on the 0.005 grid of any of the 48 recordings of
    bench/replay_recordings.py (bench/results/replay_recordings-2026-11-24f-
    cpu.md), and bisection to 0.005 lands within 0.005 of the scan on 46 of
    them. Off the grid, or below the scan's answer, a budget can still fail
    between two that run: on one vit recording 0.225 fails while 0.219 runs
    (bisection answers 0.219, the scan 0.23), on the bundled vit a budget
    near 0.23 fails while 0.225 and 0.23 run (bisection answers 0.2305, the
    scan 0.225). Use the scan for a budget you can rely on.

    Fractions are of the no-eviction peak reserved under `conf`, or of
    `reference_bytes` when given (to compare settings against one fixed
    reference, such as the default pool's peak). `pin_outliving` as in
    :func:`replay`. `steps` > 1 asks it of a training loop: every budget
    runs the step that many times in one pool (``replay(steps=N)``), feasible
    when every step fits, and the fractions are of the peak of as many steps
    without a budget. A pool that no longer starts empty can rank budgets
    and settings otherwise than one step from an empty pool does
    (docs/allocator.md, Note [one step or a loop]);
    `empty_cache_between_steps` as in :func:`replay`."""
    if method not in ("bisect", "scan"):
        raise ValueError(f"dtralloc.min_feasible_budget: method must be 'bisect' or 'scan', not {method!r}")
    points = _check_step(tolerance, "min_feasible_budget", "tolerance")
    run_at = _searcher(trace, policy, conf, reference_bytes, "min_feasible_budget", pin_outliving, steps,
                       empty_cache_between_steps)

    def feasible(fraction: float) -> bool:
        return run_at(fraction).feasible

    if not feasible(1.0):
        return None
    if method == "scan":
        lowest = 1.0
        for k in range(points - 1, 0, -1):
            fraction = k / points
            if not feasible(fraction):
                break
            lowest = fraction
        return lowest
    lo, hi = 0.0, 1.0
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def feasible_budgets(
    trace: Union[Trace, str], policy: str = "dtralloc", conf: ConfLike = None, step: float = 0.005,
    lowest: float = 0.0, reference_bytes: Optional[int] = None, pin_outliving: bool = True, steps: int = 1,
    empty_cache_between_steps: bool = False,
) -> dict[float, bool]:
    """Whether `policy` completes the trace at every budget fraction on the
    grid of `step`, from 1.0 down to `lowest` (say the trace's
    :func:`resident_floor`, below which no policy runs): {fraction: feasible},
    highest first. A *hole* is a failing fraction above the lowest feasible
    one: more memory, and the step ran out. One replay per grid point
    (:func:`overhead_grid` keeps what each one cost as well).

    Fractions, `conf`, `reference_bytes`, `pin_outliving`, `steps` and
    `empty_cache_between_steps` as in :func:`min_feasible_budget`."""
    grid = _grid(trace, policy, conf, step, lowest, reference_bytes, pin_outliving, "feasible_budgets", steps,
                 empty_cache_between_steps)
    return {fraction: overhead is not None for fraction, overhead in grid.items()}


def overhead_grid(
    trace: Union[Trace, str], policy: str = "dtralloc", conf: ConfLike = None, step: float = 0.005,
    lowest: float = 0.0, reference_bytes: Optional[int] = None, pin_outliving: bool = True, steps: int = 1,
    empty_cache_between_steps: bool = False,
) -> dict[float, Optional[float]]:
    """The grid of :func:`feasible_budgets` with what each budget costs:
    {fraction: the replay's ``compute_overhead``, or None where the step
    runs out}, highest first, from the same replays (one per grid point).
    An *overhead spike* is a budget that runs but recomputes far more than
    one a little above it (bench/replay_recordings.py lists them). With
    `steps` > 1 the overhead is the last step's (``last_step_compute_overhead``).

    Arguments as in :func:`feasible_budgets`."""
    return _grid(trace, policy, conf, step, lowest, reference_bytes, pin_outliving, "overhead_grid", steps,
                 empty_cache_between_steps)


def _grid(trace, policy, conf, step, lowest, reference_bytes, pin_outliving, caller,
          steps: int = 1, empty_cache_between_steps: bool = False) -> dict[float, Optional[float]]:
    points = _check_step(step, caller, "step")
    if not 0 <= lowest <= 1:
        raise ValueError(f"dtralloc.{caller}: lowest must be in [0, 1], not {lowest!r}")
    run_at = _searcher(trace, policy, conf, reference_bytes, caller, pin_outliving, steps, empty_cache_between_steps)
    out = {}
    for k in range(points, 0, -1):
        fraction = k / points
        if fraction < lowest:
            break
        result = run_at(fraction)
        if not result.feasible:
            out[fraction] = None
        else:
            out[fraction] = result.last_step_compute_overhead if steps > 1 else result.compute_overhead
    return out


def feasibility_holes(grid: dict[float, bool]) -> list[float]:
    """The holes of a :func:`feasible_budgets` grid: failing fractions above
    its lowest feasible one, ascending."""
    ok = [f for f, fits in grid.items() if fits]
    return sorted(f for f, fits in grid.items() if not fits and ok and f > min(ok))
