"""`dtralloc top`: one frame as JSON for scripts, and the live view in a real
terminal (tmux: send-keys / capture-pane), against a process that publishes
a pool whose stats it prints."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from dtralloc import _core
from dtralloc.top import Tracker
from dtralloc.top.reader import read_frame

WORKER = os.path.join(os.path.dirname(__file__), "_publisher_worker.py")
TOP = [sys.executable, "-m", "dtralloc", "top"]


@pytest.fixture
def publisher():
    proc = subprocess.Popen([sys.executable, WORKER, "pool", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    info = json.loads(proc.stdout.readline())
    info["proc"] = proc
    yield info
    if proc.poll() is None:
        proc.communicate("exit\n", timeout=30)


def test_once_json_prints_the_frame_of_a_process(publisher):
    pid, stats = publisher["proc"].pid, publisher["stats"]
    out = subprocess.run(TOP + ["--once", "--json", str(pid)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    frame = json.loads(out.stdout)
    assert frame["pid"] == pid and frame["device"] == 0 and frame["label"] == "pool virtual"
    assert frame["allocated_bytes"] == stats["allocated_bytes.all.current"]
    assert frame["reserved_bytes"] == stats["reserved_bytes.all.current"]
    assert frame["budget_bytes"] == stats["budget_bytes"] == 20 << 30
    assert frame["largest_free_bytes"] == stats["fragmentation.largest_free_bytes"]
    assert frame["free_bytes"] == stats["fragmentation.free_bytes"]
    assert frame["segments"] == stats["segment.all.current"] == len(frame["segment_table"])
    assert (frame["evictions"], frame["remats"]) == (12, 5)
    free = stats["fragmentation.free_bytes"]
    assert frame["fragmentation"] == pytest.approx(1 - stats["fragmentation.largest_free_bytes"] / free)


def test_once_json_shows_a_cpu_dtr_session():
    """A process inside a dtr(device="cpu") block: its mirror pool publishes
    as an installed allocator does, with the session's evictions and remats."""
    proc = subprocess.Popen([sys.executable, WORKER, "dtr"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        stats = json.loads(proc.stdout.readline())["stats"]
        out = subprocess.run(TOP + ["--once", "--json", str(proc.pid)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        frame = json.loads(out.stdout)
        assert frame["pid"] == proc.pid and frame["label"] == "dtr cpu mirror"
        assert stats["evictions"] > 0 and stats["remats"] > 0
        assert (frame["evictions"], frame["remats"]) == (stats["evictions"], stats["remats"])
        assert frame["budget_bytes"] == stats["budget_bytes"] > 0
        assert frame["reserved_bytes"] == stats["reserved_bytes"]
        assert frame["allocated_bytes"] == stats["allocated_bytes"]
        assert frame["peak_reserved_bytes"] == stats["peak_bytes"]
    finally:
        proc.communicate("exit\n", timeout=30)
    assert proc.returncode == 0


def test_once_names_the_problem_when_nothing_publishes():
    out = subprocess.run(TOP + ["--once", "--json", str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "publishes no dtralloc counters" in out.stderr
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    out = subprocess.run(TOP + ["--once", dead.stdout.strip()], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no process" in out.stderr


def test_tracker_sees_a_spike_between_two_refreshes(publisher):
    proc = publisher["proc"]
    path = publisher["path"]
    tracker = Tracker()
    tracker.update(read_frame(path))
    proc.stdin.write("spike\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"
    frame = read_frame(path)
    seen = tracker.update(frame)
    assert frame["allocated_bytes"] == publisher["stats"]["allocated_bytes.all.current"]
    assert seen["peak_allocated_since_refresh_bytes"] == frame["allocated_bytes"] + (1 << 30)
    assert tracker.update(read_frame(path))["peak_allocated_since_refresh_bytes"] < 1 << 30


def _tmux(*args, check=True):
    return subprocess.run(["tmux", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_in_a_terminal(publisher, tmp_path):
    pid, stats = publisher["proc"].pid, publisher["stats"]
    session = f"dtralloc-top-test-{os.getpid()}"
    env_cmd = f"cd {os.getcwd()} && {sys.executable} -m dtralloc top {pid} --interval 0.2"
    _tmux("-L", session, "new-session", "-d", "-s", session, "-x", "120", "-y", "40", env_cmd)
    try:
        screen = ""
        deadline = time.time() + 30
        while time.time() < deadline and "segments in address order" not in screen:
            time.sleep(0.3)
            screen = _tmux("-L", session, "capture-pane", "-p", "-t", session).stdout
        time.sleep(1.0)  # a few refreshes more: the first frames may predate the pane's final size
        screen = _tmux("-L", session, "capture-pane", "-p", "-t", session).stdout
        assert f"pid {pid}" in screen and "pool virtual" in screen, screen
        fmt = _core.format_bytes
        assert f"{fmt(stats['reserved_bytes.all.current'])} of {fmt(20 << 30)} (budget)" in screen, screen
        assert fmt(stats["allocated_bytes.all.current"]) in screen
        assert f"largest block {fmt(stats['fragmentation.largest_free_bytes'])}" in screen
        assert "segments in address order" in screen and "█" in screen
        if os.environ.get("DTRALLOC_UPDATE_SCREENSHOTS"):
            colored = _tmux("-L", session, "capture-pane", "-e", "-p", "-t", session).stdout
            _save_terminal_png(colored, os.path.join(os.path.dirname(__file__), "..", "docs", "img", "top.png"))
        _tmux("-L", session, "send-keys", "-t", session, "q")
        deadline = time.time() + 15
        while time.time() < deadline and _tmux("-L", session, "has-session", "-t", session, check=False).returncode == 0:
            time.sleep(0.2)
        assert _tmux("-L", session, "has-session", "-t", session, check=False).returncode != 0, "q did not quit"
    finally:
        _tmux("-L", session, "kill-server", check=False)


def _save_terminal_png(ansi: str, path: str) -> None:
    """The captured terminal as a PNG: rich renders the ANSI text to SVG, the
    headless browser draws the SVG."""
    from rich.console import Console
    from rich.text import Text

    from _browser import launch

    with open(os.devnull, "w") as sink:
        console = Console(record=True, width=120, file=sink)
        console.print(Text.from_ansi(ansi.rstrip("\n")))
    svg = console.export_svg(title="dtralloc top")
    with launch() as browser:
        page = browser.new_page(viewport={"width": 1300, "height": 900})
        page.set_content(f"<html><body style='margin:0'>{svg}</body></html>")
        page.locator("svg").screenshot(path=path)
