"""Dashboard pages in a real headless browser (Chromium, via Playwright):
they load with no console or page errors and without a single network
request, the readouts at a cursor equal the figures Python computed for that
moment, moving the cursor changes them, every view draws, and the data-run
figures equal dtralloc.replay's."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
from _browser import launch, require
from _pool_workload import MiB, drive, expected, make

import dtralloc
from dtralloc.traces import bundled_path

require()

PIXELS = """(id) => {
  const c = document.getElementById(id);
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4) if (d[i + 3] > 0 && (d[i] < 235 || d[i + 1] < 235 || d[i + 2] < 235)) n++;
  return n;
}"""
VIEWS = ("timeline", "frag", "addrmap", "addrtime")


@pytest.fixture(scope="module")
def browser():
    with launch() as b:
        yield b


class Page:
    """A page opened with every request outside file:/data:/blob: recorded
    and refused, and every console error and page error recorded."""

    def __init__(self, browser, path: str):
        self.context = browser.new_context(viewport={"width": 1400, "height": 1000})
        self.external, self.errors = [], []
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "blob:"))
                     else self.external.append(r.url))
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto("file://" + path)
        self.page.evaluate("window.dtrallocDashboard.ready")

    def _route(self, route):
        url = route.request.url
        if url.startswith(("file:", "data:", "blob:")):
            route.continue_()
        else:
            self.external.append(url)
            route.abort()

    def cursor(self, x: int) -> dict:
        self.page.evaluate(f"window.dtrallocDashboard.setCursor({x})")
        return self.readout()

    def readout(self) -> dict:
        return self.page.evaluate("window.dtrallocDashboard.readout()")

    def pixels(self, canvas_id: str) -> int:
        return self.page.evaluate(PIXELS, canvas_id)

    def close(self):
        assert self.errors == [], self.errors
        assert self.external == [], self.external
        self.context.close()


@pytest.fixture
def open_page(browser):
    pages = []

    def opener(path):
        pages.append(Page(browser, str(path)))
        return pages[-1]

    yield opener
    for p in pages:
        p.close()  # no errors, no requests, on every page a test opened


def test_pool_page_readouts_equal_the_pool_stats_at_each_moment(open_page, tmp_path):
    pool = make()
    captured = drive(pool, 2500, seed=11)
    d = dtralloc.dashboard(pool)
    page = open_page(d.save(tmp_path / "pool.html"))
    assert page.page.evaluate("window.dtrallocDashboard.meta.runs.length") == 1
    for event, stats in captured[::5]:
        got = page.cursor(event)
        want = expected(stats)
        assert got["x"] == event
        for key in ("reserved", "allocated", "requested", "free", "largest_free", "pending"):
            assert got[key] == want[key], (event, key)
        assert got["map_reserved"] == want["reserved"] and got["map_allocated"] == want["allocated"]
        assert got["waste"] == want["allocated"] - want["requested"]
        free = want["free"]
        assert got["fragmentation"] == pytest.approx(1 - want["largest_free"] / free if free else 0)
    for view in VIEWS:
        assert page.pixels(view) > 2000, view
    assert page.pixels("sweep") == 0  # no budget sweep for a snapshot: the section stays hidden


def test_moving_the_cursor_changes_the_readouts(open_page, tmp_path):
    pool = make()
    drive(pool, 1500, seed=12)
    page = open_page(dtralloc.dashboard(pool).save(tmp_path / "pool.html"))
    p = page.page
    first = page.cursor(100)
    p.keyboard.press("ArrowRight")
    assert page.readout()["x"] == 101
    # A click on the timeline puts the cursor where it was clicked.
    box = p.locator("#timeline-over").bounding_box()
    before = page.readout()
    p.mouse.click(box["x"] + box["width"] * 0.8, box["y"] + box["height"] / 2)
    after = page.readout()
    assert after["x"] > before["x"] + 200
    assert after != before and first != after
    rows_before = p.locator("#tensors tbody tr:not(.spacer):not([hidden])").count()
    assert rows_before > 0
    text = p.locator("#tensors tbody tr:not(.spacer)").first.inner_text()
    page.cursor(5)
    assert p.locator("#tensors tbody tr:not(.spacer)").first.inner_text() != text


def test_torch_snapshot_pickle_through_the_command(open_page, tmp_path):
    """A snapshot in torch's layout (lists of event dicts, ring wrapped),
    pickled as torch.cuda.memory._dump_snapshot writes it, through
    `dtralloc dashboard`."""
    pool = make("history_entries:1500")
    drive(pool, 3000, seed=13, streams=False)
    final = pool.stats()
    snap = tmp_path / "snap.pickle"
    with open(snap, "wb") as f:
        pickle.dump(pool.snapshot(), f)
    out = tmp_path / "report.html"
    proc = subprocess.run([sys.executable, "-m", "dtralloc", "dashboard", str(snap), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    page = open_page(out)
    got = page.cursor(1499)
    assert got["reserved"] == final["reserved_bytes.all.current"]
    assert got["allocated"] == final["allocated_bytes.all.current"]  # alive blocks: sizes from the segments
    assert got["requested"] == final["requested_bytes.all.current"]
    row = page.page.locator("tr.run-row").first
    assert row.get_attribute("data-kind") == "snapshot"
    assert int(row.get_attribute("data-peak-reserved-bytes")) >= final["reserved_bytes.all.current"]
    for view in VIEWS:
        assert page.pixels(view) > 2000, view


def test_frames_say_what_made_a_tensor(open_page, tmp_path):
    base = 0x7F0000000000
    frame = {"name": "forward", "filename": "/home/me/model.py", "line": 42}
    events = [
        {"action": "segment_alloc", "addr": base, "size": 20 * MiB, "stream": 0, "time_us": 10, "frames": []},
        {"action": "alloc", "addr": base, "size": 3 * MiB, "stream": 0, "time_us": 20, "frames": [frame]},
        {"action": "alloc", "addr": base + 3 * MiB, "size": 1000, "stream": 0, "time_us": 30, "frames": []},
    ]
    snap = {"segments": [], "device_traces": [events]}
    page = open_page(dtralloc.dashboard(snap).save(tmp_path / "hand.html"))
    got = page.cursor(2)
    assert (got["reserved"], got["allocated"], got["requested"]) == (20 * MiB, 3 * MiB + 1024, 3 * MiB + 1000)
    assert got["largest_free"] == 20 * MiB - 3 * MiB - 1024
    rows = page.page.locator("#tensors tbody tr:not(.spacer):not([hidden])")
    assert rows.count() == 2
    assert "forward (model.py:42)" in rows.first.inner_text()


def test_notebook_display_is_an_isolated_iframe():
    pool = make()
    pool.malloc(5 * MiB)
    d = dtralloc.dashboard(pool)
    html = d._repr_html_()
    assert html.startswith("<iframe srcdoc=") and 'sandbox="allow-scripts"' in html
    assert "&lt;!DOCTYPE html&gt;" in html and "<script" not in html.replace("&lt;script", "")


def _replay_has_history() -> bool:
    import inspect

    return "history" in inspect.signature(dtralloc.replay).parameters


def test_bundled_trace_page_figures_equal_replay(open_page, tmp_path):
    # Window policies report an OOM at once (single-tensor ones thrash first):
    # the page of two of them, each feasible and not, builds in a second.
    d = dtralloc.dashboard("resnet50", budgets=[0.7, 0.2], policies=["dtralloc", "coop"])
    page = open_page(d.save(tmp_path / "resnet50.html"))
    trace = dtralloc.trace.load(bundled_path("resnet50"))
    rows = page.page.locator("tr.run-row[data-run]")
    combos = [("none", None), ("dtralloc", 0.7), ("dtralloc", 0.2), ("coop", 0.7), ("coop", 0.2)]
    assert rows.count() == len(combos)
    for i, (policy, budget) in enumerate(combos):
        r = dtralloc.replay(trace, budget=budget, policy=policy)
        row = rows.nth(i)
        assert row.get_attribute("data-policy") == r.policy
        assert row.get_attribute("data-budget-bytes") == ("none" if r.budget_bytes is None else str(r.budget_bytes))
        assert int(row.get_attribute("data-peak-reserved-bytes")) == r.peak_reserved_bytes
        assert int(row.get_attribute("data-peak-allocated-bytes")) == r.peak_allocated_bytes
        assert int(row.get_attribute("data-evictions")) == r.evictions
        assert int(row.get_attribute("data-remats")) == r.remats
        assert float(row.get_attribute("data-compute-overhead")) == r.compute_overhead
        assert row.get_attribute("data-feasible") == ("true" if r.feasible else "false")
    assert [f["peak_reserved_bytes"] for f in d.runs] == [int(rows.nth(i).get_attribute("data-peak-reserved-bytes"))
                                                           for i in range(len(combos))]
    # Readouts at an op equal the per-op series of the replay.
    r = dtralloc.replay(trace, budget=0.7, policy="dtralloc")
    assert r.feasible and r.evictions > 0
    page.page.evaluate("window.dtrallocDashboard.select(1)")
    n = len(r.series["op"])
    for op in (0, n // 2, n - 1):
        got = page.cursor(op)
        assert got["x"] == op
        for key in ("reserved", "allocated", "evictable", "largest_free", "free"):
            assert got[key] == int(r.series[key][op]), (op, key)
        assert got["budget"] == r.budget_bytes
        if _replay_has_history():  # the address views: their totals are the series'
            assert got["map_reserved"] == got["reserved"] and got["map_allocated"] == got["allocated"]
    before = page.readout()
    page.page.keyboard.press("Home")
    assert page.readout() != before and page.readout()["x"] == 0
    # A run that ran out of memory: no samples after its OOM op, shown as such.
    oom = dtralloc.replay(trace, budget=0.2, policy="coop")
    assert not oom.feasible
    page.page.evaluate("window.dtrallocDashboard.select(4)")
    assert page.page.locator("tr.run-row[data-run='4']").get_attribute("data-feasible") == "false"
    got = page.cursor(len(trace.ops) - 1)
    assert got["reserved"] != got["reserved"]  # NaN: not sampled (the cell shows "–")
    views = ("timeline", "frag", "sweep") + (("addrmap", "addrtime") if _replay_has_history() else ())
    for view in views:
        assert page.pixels(view) > 1000, view
    # The sweep behind the overhead curves: every policy at every grid budget.
    sweep = page.page.evaluate("window.dtrallocDashboard.meta.sweep")
    assert set(sweep["policies"]) == {"dtralloc", "coop"}
    for policy, points in sweep["policies"].items():
        for p in points[:3]:
            r = dtralloc.replay(trace, budget=p["fraction"], policy=policy)
            assert (p["feasible"], p["compute_overhead"], p["budget_bytes"]) == \
                (r.feasible, r.compute_overhead, r.budget_bytes)


def test_bundled_trace_screenshot_for_the_readme(open_page, tmp_path):
    """The README's picture of a bundled trace's page (written with
    DTRALLOC_UPDATE_SCREENSHOTS=1), with the cursor at the first eviction."""
    d = dtralloc.dashboard("gpt2", budgets=[0.5, 0.7], policies=["dtralloc", "coop"])
    page = open_page(d.save(tmp_path / "gpt2.html"))
    page.page.evaluate("window.dtrallocDashboard.select(1)")
    page.cursor(0)
    page.page.keyboard.press("]")  # the next marker: the evictor's first call
    assert page.readout()["x"] > 0
    assert page.pixels("timeline") > 5000
    if os.environ.get("DTRALLOC_UPDATE_SCREENSHOTS"):
        page.page.screenshot(path=os.path.join(os.path.dirname(__file__), "..", "docs", "img", "dashboard.png"),
                             clip={"x": 0, "y": 0, "width": 1400, "height": 1020})


def test_snapshot_page_screenshot_for_the_readme(open_page, tmp_path):
    """The README's picture of a snapshot page (written with
    DTRALLOC_UPDATE_SCREENSHOTS=1); it checks the views drew as well."""
    pool = make("history_entries:200000")
    drive(pool, 6000, seed=21, checkpoints=0)
    page = open_page(dtralloc.dashboard(pool).save(tmp_path / "pool.html"))
    for view in VIEWS:
        assert page.pixels(view) > 2000, view
    if os.environ.get("DTRALLOC_UPDATE_SCREENSHOTS"):
        page.page.screenshot(path=os.path.join(os.path.dirname(__file__), "..", "docs", "img",
                                               "dashboard-snapshot.png"),
                             clip={"x": 0, "y": 0, "width": 1400, "height": 1250})


def test_live_session_page_figures_equal_its_stats(open_page, tmp_path):
    """A finished CPU dtr() session under a budget, with history: the page's
    data-run figures are session.stats()'s, readouts at an op are its series'."""
    import torch

    from dtralloc.dtr import dtr

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(8)])
    x = torch.randn(4096, 128)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with dtr(device="cpu") as s:
            model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    with dtr(budget=s.stats()["peak_bytes"] * 3 // 4, device="cpu", history=True) as s:
        model(x).sum().backward()
    stats, series = s.stats(), s.series()
    assert stats["evictions"] > 0
    page = open_page(dtralloc.dashboard(s).save(tmp_path / "live.html"))
    row = page.page.locator("tr.run-row[data-run]").first
    assert row.get_attribute("data-kind") == "live" and row.get_attribute("data-policy") == stats["policy"]
    assert int(row.get_attribute("data-budget-bytes")) == stats["budget_bytes"]
    assert int(row.get_attribute("data-peak-reserved-bytes")) == stats["peak_bytes"]
    assert int(row.get_attribute("data-peak-allocated-bytes")) == stats["peak_allocated_bytes"]
    assert int(row.get_attribute("data-evictions")) == stats["evictions"]
    assert int(row.get_attribute("data-remats")) == stats["remats"]
    assert float(row.get_attribute("data-compute-overhead")) == stats["compute_overhead"]
    n = len(series["op"])
    for op in (0, n // 2, n - 1):
        got = page.cursor(op)
        for key in ("reserved", "allocated", "evictable", "largest_free", "free"):
            assert got[key] == int(series[key][op]), (op, key)
        assert got["map_reserved"] == got["reserved"] and got["map_allocated"] == got["allocated"]
    phases = page.page.evaluate("window.dtrallocDashboard.meta.runs[0].phases.map((p) => p[2])")
    assert phases == ["forward", "backward"]
    for view in VIEWS:
        assert page.pixels(view) > 1000, view
