"""Inputs -> runs -> page (the body of dtralloc.dashboard)."""
from __future__ import annotations

import inspect
import os
import pickle
import sys
from typing import Optional

from .result import DEFAULT_BUDGETS, DEFAULT_POLICIES, SWEEP_FRACTIONS, Dashboard
from .page import DATA_ATTRIBUTES, build_page
from .runs import Run, live_run, replay_run, snapshot_run, snapshot_runs
from .history import build_history


def _replay_records_history() -> bool:
    from ..replay import replay

    return "history" in inspect.signature(replay).parameters


def _is_trace(x) -> bool:
    from ..trace import Trace

    return isinstance(x, Trace)


def _is_live_session(x) -> bool:
    # Without dtralloc.dtr.session imported (it imports torch) x cannot be one.
    module = sys.modules.get("dtralloc.dtr.session")
    return module is not None and isinstance(x, module.Session)


def _load_path(path: str):
    """A snapshot pickle, a .dtrace file, or a bundled trace name."""
    from ..trace import load
    from ..traces import bundled_path, list_bundled

    if not os.path.exists(path):
        if path in list_bundled():
            return load(bundled_path(path)), path
        raise ValueError(f"dtralloc.dashboard: no file {path!r} and no bundled trace of that name "
                         f"(bundled: {', '.join(list_bundled())})")
    with open(path, "rb") as f:
        head = f.read(16)
    if head[:1] == b"\x80":  # a pickle (protocol 2+): a memory snapshot
        with open(path, "rb") as f:
            return pickle.load(f), os.path.basename(path)
    try:
        return load(path), os.path.basename(path)
    except Exception as e:
        raise ValueError(f"dtralloc.dashboard: {path} is neither a memory snapshot pickle "
                         f"(torch.cuda.memory._dump_snapshot) nor a dtralloc trace: {e}") from e


def _budget_label(budget) -> str:
    from .. import _core

    if budget is None:
        return "no budget"
    if isinstance(budget, float):
        return f"budget {budget:g}"
    if isinstance(budget, int):
        return f"budget {_core.format_bytes(budget)}"
    return f"budget {budget}"


def _trace_runs(trace, budgets, policies, conf, min_budget: bool) -> list[Run]:
    from ..replay import min_feasible_budget, replay

    # The allocator's own history of a replay (for the address views) comes
    # with replay(..., history=True) where the replay driver records it.
    extra = {"history": True} if _replay_records_history() else {}
    name = str(trace.meta.get("name", "trace"))
    combos = [("none", None)]
    for p in policies:
        for b in budgets:
            if (p, b) not in combos:
                combos.append((p, b))
    # Each policy's bisection replays the step about seven times, and a
    # single-tensor policy near its boundary thrashes for seconds a replay:
    # the policies' searches run side by side (the replay releases the GIL
    # and each builds its own pool).
    searched = [p for p in dict.fromkeys(p for p, _ in combos) if p != "none"] if min_budget else []
    mins = dict(zip(searched, _parallel(lambda p: min_feasible_budget(trace, p, conf=conf), searched)))
    runs = []
    for policy, budget in combos:
        result = replay(trace, budget=budget, policy=policy, conf=conf, **extra)
        label = f"{name} · {policy if policy != 'none' else 'no eviction'} · {_budget_label(budget)}"
        runs.append(replay_run(trace, result, label, mins.get(policy)))
    return runs


def _sweep(trace, policies, budgets, conf, mins: dict) -> dict:
    from ..replay import replay

    grid = sorted({*SWEEP_FRACTIONS, *(b for b in budgets if isinstance(b, float))})
    out = {"policies": {}, "min_feasible": {p: v for p, v in mins.items() if v is not None}}
    for policy in policies:
        if policy == "none":
            continue
        # Below a known min feasible budget every replay fails, and a
        # single-tensor policy thrashes for seconds before it does: one grid
        # point under it shows the cliff.
        low = mins.get(policy)
        fractions = grid if low is None else [f for f in grid if f >= low - 0.1]
        points = []
        for f, r in zip(fractions, _parallel(lambda f: replay(trace, budget=f, policy=policy, conf=conf), fractions)):
            out["no_eviction_peak_reserved_bytes"] = int(r.no_eviction_peak_reserved_bytes)
            points.append({"fraction": f, "budget_bytes": int(r.budget_bytes), "compute_overhead": float(r.compute_overhead),
                           "feasible": bool(r.feasible), "evictions": int(r.evictions)})
        out["policies"][policy] = points
    return out


def _parallel(fn, items: list) -> list:
    """[fn(x) for x in items], on as many threads as there are cores (for
    replays, which release the GIL), in order."""
    if len(items) < 2 or (os.cpu_count() or 1) < 2:
        return [fn(x) for x in items]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=min(len(items), os.cpu_count() or 1)) as pool:
        return list(pool.map(fn, items))


def build(inputs: list, budgets=None, policies=None, conf=None, sweep: bool = True, min_budget: bool = True,
          trace=None, title: Optional[str] = None) -> Dashboard:
    from .. import _core
    from ..pool import Pool
    from ..replay import POLICIES, ReplayResult

    budgets = list(budgets if budgets is not None else DEFAULT_BUDGETS)
    policies = [p.strip() for x in (policies or DEFAULT_POLICIES) for p in x.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"dtralloc.dashboard: unknown policy {p!r}; available: {', '.join(POLICIES)}")
    if not inputs:
        inputs = [None]
    runs: list[Run] = []
    sweeps = {}
    names = []
    for x in inputs:
        if x is None:
            runs += snapshot_runs(_core.global_snapshot(True), "this process")
            names.append("this process")
            continue
        if isinstance(x, (str, os.PathLike)):
            x, name = _load_path(os.fspath(x))
            names.append(name)
        if _is_trace(x):
            trace_runs = _trace_runs(x, budgets, policies, conf, min_budget)
            runs += trace_runs
            names.append(str(x.meta.get("name", "trace")))
            if sweep:
                mins = {r.figures["policy"]: r.figures.get("min_feasible_budget") for r in trace_runs}
                sweeps = _sweep(x, policies, budgets, conf, mins)
        elif isinstance(x, ReplayResult):
            if trace is None:
                raise ValueError("dtralloc.dashboard: a replay result needs its trace for op names and phases: "
                                 "dashboard(result, trace=trace)")
            runs.append(replay_run(trace, x, f"{x.name} · {x.policy} · {_budget_label(x.budget_bytes)}"))
        elif _is_live_session(x):
            stats = x.stats()
            label = f"dtr session · {stats['device']} · {stats['policy']} · {_budget_label(stats['budget_bytes'] or None)}"
            runs.append(live_run(x, label))
            names.append("dtr session")
        elif isinstance(x, Pool) or isinstance(x, _core.Pool):
            snap = x.snapshot(columns=True)
            label = f"pool ({x.backend})"
            history = build_history(snap["device_traces"][x.device], snap["segments"])
            runs.append(snapshot_run(history, label))
            names.append(label)
        elif isinstance(x, dict):
            runs += snapshot_runs(x, "snapshot")
            names.append("snapshot")
        else:
            raise TypeError(f"dtralloc.dashboard: cannot draw a {type(x).__name__}; pass a trace, a .dtrace "
                            "path or bundled name, a memory snapshot (dict or pickle path), a Pool, a "
                            "replay result, or a dtralloc.dtr() session")
    page, facts = build_page(runs, title or "dtralloc · " + ", ".join(dict.fromkeys(names)), sweeps,
                             source=", ".join(dict.fromkeys(names)))
    figures = [{key: r.figures.get(key) for _, key in DATA_ATTRIBUTES} | {"label": r.label, "kind": r.kind}
               for r in runs]
    facts["page_bytes"] = len(page.encode("utf-8"))
    return Dashboard(page, figures, facts)
