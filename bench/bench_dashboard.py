"""Dashboard benchmark: page size, build time, load -> first render and cursor
redraw in a real headless browser, for allocator histories of 1M and 16M
events, and the page of a bundled trace replayed under 2 policies x 3 budgets.

The events are real allocator events: a dtralloc.Pool (virtual backend) with
its history on replays a bundled training step's allocations and frees, step
after step, with op stamps, until the history holds N events ("training"
workload); the "random" workload mallocs and frees random sizes instead
(little repetition for gzip to find: the page's worst case).

    python bench/bench_dashboard.py [--quick] [--baseline REV] [--out bench/results/dashboard-DATE.md]

--baseline REV also builds each history page with the page encoder and
decoder (dashboard/page.py and assets/) of git revision REV, from the same
history, and measures both pages side by side in the same browser.

Targets (issue 15): 1M events: page <= 5 MB, load -> first render <= 2 s,
cursor redraw <= 50 ms; 16M events: <= 40 MB, <= 15 s; bundled trace with
2 policies x 3 budgets: built in <= 10 s.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

CHROMIUM = "/usr/bin/chromium-headless-shell"


def training_pool(events: int, trace_name: str = "gpt2"):
    """A pool whose history holds `events` events of repeated training steps."""
    import dtralloc
    from dtralloc.traces import bundled_path

    trace = dtralloc.trace.load(bundled_path(trace_name))
    pool = dtralloc.Pool("virtual", capacity=1 << 44, conf=f"history_entries:{events}")
    nbytes = [s.nbytes for s in trace.storages]
    addr = {}
    for sid, s in enumerate(trace.storages):
        if s.initial and s.nbytes:
            addr[sid] = pool.malloc(s.nbytes)
    ops = [(op.created, op.frees) for op in trace.ops]
    op_id = 0
    while pool.history_size < events:  # whole steps until the ring is full
        for created, frees in ops:
            pool.set_op_stamp(op_id)
            op_id += 1
            for sid in created:
                if nbytes[sid]:
                    old = addr.pop(sid, None)
                    if old is not None:
                        pool.free(old)
                    addr[sid] = pool.malloc(nbytes[sid])
            for sid in frees:
                a = addr.pop(sid, None)
                if a is not None:
                    pool.free(a)
    return pool


def random_pool(events: int, seed: int = 0):
    import dtralloc

    rng = random.Random(seed)
    pool = dtralloc.Pool("virtual", capacity=1 << 44, conf=f"history_entries:{events}")
    live = []
    sizes = [int(2 ** rng.uniform(9, 27)) for _ in range(512)]
    i = 0
    while pool.history_size < events:
        i += 1
        pool.set_op_stamp(i // 8)
        if live and (len(live) > 3000 or rng.random() < 0.5):
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.malloc(rng.choice(sizes)))
    return pool


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure_page(path: str, cursor_moves: int) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        t0 = time.perf_counter()
        page.goto("file://" + path, timeout=300_000)
        page.evaluate("window.dtrallocDashboard.ready")
        wall = time.perf_counter() - t0
        timings = page.evaluate("window.dtrallocDashboard.timings")
        n = page.evaluate("window.dtrallocDashboard.meta.runs[0].n_x")
        rng = random.Random(1)
        redraws = [page.evaluate(f"window.dtrallocDashboard.setCursorPainted({rng.randrange(n)})")
                   for _ in range(cursor_moves)]
        browser.close()
    if errors:
        raise RuntimeError(f"page errors: {errors}")
    return {"first_render_s": timings["first_render_ms"] / 1000, "wall_s": wall,
            "decode_s": timings["decode_ms"] / 1000,
            "redraw_median_ms": statistics.median(redraws), "redraw_max_ms": max(redraws)}


def baseline_page_module(rev: str):
    """dtralloc.dashboard.page as it was at git revision `rev` (its assets
    too), loaded beside today's; the rest of the package is today's."""
    import importlib.util
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    pkg = "python/dtralloc/dashboard"
    tmp = tempfile.mkdtemp(prefix="dashboard-baseline-")

    def show(path):
        return subprocess.run(["git", "-C", root, "show", f"{rev}:{pkg}/{path}"], capture_output=True, text=True,
                              check=True).stdout

    with open(os.path.join(tmp, "page.py"), "w") as f:
        f.write(show("page.py"))
    spec = importlib.util.spec_from_file_location("dtralloc.dashboard._baseline_page", os.path.join(tmp, "page.py"))
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "dtralloc.dashboard"
    spec.loader.exec_module(mod)
    assets = {name: show(f"assets/{name}") for name in ("dashboard.js", "dashboard.css", "page.html")}
    mod._asset = assets.__getitem__
    return mod


WORKLOADS = {"training": ("training (gpt2 steps)", training_pool), "random": ("random sizes", random_pool)}


def history_case(workload: str, events: int, cursor_moves: int, baseline: str | None) -> list[str]:
    """One case in a process of its own, so that its memory figures are its own."""
    import json
    import subprocess

    out = subprocess.run([sys.executable, __file__, "--case", workload, str(events), str(cursor_moves)] +
                         (["--baseline", baseline] if baseline else []), capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.splitlines()[-1])
    rows = [f"{WORKLOADS[workload][0]:<22}{m['events']:>11,}{m['drive_s']:>8.1f}{m['export_s']:>9.2f}"
            f"{m['export_mib']:>8.0f}{m['build_s']:>8.1f}{m['page_mb']:>9.2f}{m['decode_s']:>8.2f}"
            f"{m['first_render_s']:>8.2f}{m['redraw_median_ms']:>9.1f}{m['redraw_max_ms']:>8.1f}"]
    if "baseline" in m:
        b = m["baseline"]
        rows.append(f"{'  ' + baseline + ' page':<22}{'':>11}{'':>8}{'':>9}{'':>8}{b['build_s']:>8.1f}"
                    f"{b['page_mb']:>9.2f}{b['decode_s']:>8.2f}{b['first_render_s']:>8.2f}"
                    f"{b['redraw_median_ms']:>9.1f}{b['redraw_max_ms']:>8.1f}")
        rows.append(f"{'  ratio (this/base)':<22}{'':>11}{'':>8}{'':>9}{'':>8}{m['page_build_s'] / b['build_s']:>8.2f}"
                    f"{m['page_mb'] / b['page_mb']:>9.2f}{m['decode_s'] / b['decode_s']:>8.2f}"
                    f"{m['first_render_s'] / b['first_render_s']:>8.2f}"
                    f"{m['redraw_median_ms'] / b['redraw_median_ms']:>9.2f}"
                    f"{m['redraw_max_ms'] / b['redraw_max_ms']:>8.2f}")
    return rows


def run_case(workload: str, events: int, cursor_moves: int, baseline: str | None = None) -> dict:
    import dtralloc

    t = time.perf_counter()
    pool = WORKLOADS[workload][1](events)
    drive_s = time.perf_counter() - t
    r0 = rss_mib()
    t = time.perf_counter()
    snap = pool.snapshot(columns=True)
    export_s = time.perf_counter() - t
    export_mib = rss_mib() - r0
    device = pool.device
    n = int(snap["device_traces"][device]["action"].size)
    t = time.perf_counter()
    d = dtralloc.dashboard(pool)
    build_s = time.perf_counter() - t
    del pool
    out = {"events": n, "drive_s": drive_s, "export_s": export_s, "export_mib": export_mib, "build_s": build_s}
    with tempfile.TemporaryDirectory() as tmp:
        path = d.save(os.path.join(tmp, "page.html"))
        out["page_mb"] = os.path.getsize(path) / 1e6
        del d
        if baseline:
            # Both encoders from the same history: the page's part of the build only.
            from dtralloc.dashboard.history import build_history
            from dtralloc.dashboard.page import build_page
            from dtralloc.dashboard.runs import snapshot_run

            run = snapshot_run(build_history(snap["device_traces"][device], snap["segments"]), "pool")
            base = baseline_page_module(baseline)
            times = {}
            for name, builder in (("this", build_page), ("base", base.build_page)):
                t = time.perf_counter()
                page, _ = builder([run], "page")
                times[name] = time.perf_counter() - t
                if name == "base":
                    base_path = os.path.join(tmp, "baseline.html")
                    with open(base_path, "w", encoding="utf-8") as f:
                        f.write(page)
                del page
            out["page_build_s"] = times["this"]
            out["baseline"] = {"build_s": times["base"], "page_mb": os.path.getsize(base_path) / 1e6,
                               **measure_page(base_path, cursor_moves)}
        del snap
        out.update(measure_page(path, cursor_moves))
    return out


def trace_case() -> str:
    import dtralloc

    t = time.perf_counter()
    d = dtralloc.dashboard("gpt2", budgets=[0.5, 0.7, 0.9], policies=["dtralloc", "dtr"])
    build_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as tmp:
        path = d.save(os.path.join(tmp, "page.html"))
        size = os.path.getsize(path)
        m = measure_page(path, 20)
    return (f"gpt2, policies dtralloc+dtr x budgets 0.5/0.7/0.9 (+ no budget, sweep, min budgets): "
            f"built in {build_s:.2f} s, {size / 1e6:.2f} MB, first render {m['first_render_s']:.2f} s, "
            f"cursor redraw median {m['redraw_median_ms']:.1f} ms (target: built in <= 10 s)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k and 1M events only")
    parser.add_argument("--out", help="also write the report (markdown) to this file")
    parser.add_argument("--baseline", metavar="REV", help="also measure the page encoder of this git revision")
    parser.add_argument("--case", nargs=3, metavar=("WORKLOAD", "EVENTS", "MOVES"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        import json

        print(json.dumps(run_case(args.case[0], int(args.case[1]), int(args.case[2]), args.baseline)))
        return 0
    from _report import emit, header

    sizes = [100_000, 1_000_000] if args.quick else [1_000_000, 16_000_000]
    lines = [f"{'workload':<22}{'events':>11}{'drive':>8}{'export':>9}{'+MiB':>8}{'build':>8}"
             f"{'MB':>9}{'decode':>8}{'render':>8}{'redraw':>9}{'max':>8}"]
    for workload in ("training", "random"):
        for n in sizes:
            lines += history_case(workload, n, 30, args.baseline)
    lines.append("drive: s to make the events (Python calls into the pool); export: s for snapshot(columns=True) "
                 "and the RSS it added; build: s for dtralloc.dashboard(pool); MB: page size; decode / render: "
                 "s from navigation start to the columns decoded / the first render done (Chromium headless "
                 "shell); redraw: ms from a cursor move to the next painted frame (median and max of 30: "
                 "address map, tensor list, readouts, cursor lines)" +
                 ("; baseline rows: the same history's page built by the page encoder of " + args.baseline +
                  " (build: s for build_page alone; the ratio's build compares build_page alone on both)"
                  if args.baseline else ""))
    lines.append("targets: 1M events <= 5 MB, render <= 2 s, redraw <= 50 ms; 16M events <= 40 MB, <= 15 s; "
                 "snapshot export of 1M events <= 2 s, <= 200 MB")
    try:
        lines.append("")
        lines.append(trace_case())
    except NotImplementedError as e:
        lines.append(f"bundled trace page: not measured: {e}")
    command = "python bench/bench_dashboard.py" + (" --quick" if args.quick else "") + \
        (f" --baseline {args.baseline}" if args.baseline else "")
    emit(header("dtralloc dashboard benchmark", command) + "\n```\n" + "\n".join(lines) + "\n```\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
