"""``dtralloc top [PID]``: a live terminal view of processes that use dtralloc.

Reads the files the allocators publish (reader.py) and draws, per process and
device: reserved / allocated against the budget, fragmentation, the largest
free block, the peak since the last refresh (from the publisher's samples, so
a spike between two refreshes still shows), evictions and remats per second,
sparklines of the last minutes and one bar per segment. Plain terminal
output (rich), so it works over SSH; ``q`` or Ctrl-C quits.

``dtralloc top --once --json PID`` prints one frame as JSON for scripts.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import sys
import time
from typing import Optional

from .reader import Frame, frame_json, pid_alive, published_paths, read_frame

# Sparklines keep this many refreshes (two minutes at the default interval).
HISTORY = 240
SPARK = "▁▂▃▄▅▆▇█"
SHADES = "·░▒▓█"


class Tracker:
    """What a view needs beyond one frame: the peak between two refreshes,
    rates, and the history behind the sparklines."""

    def __init__(self):
        self.last = {}   # path -> previous frame
        self.hist = collections.defaultdict(lambda: collections.deque(maxlen=HISTORY))

    def update(self, f: Frame) -> dict:
        prev = self.last.get(f.path)
        # The samples since the last refresh (the whole ring the first time).
        since = prev["time_us"] if prev else -1
        window = [s for s in f.samples if s["time_us"] > since]
        peak = {}
        for key in ("reserved_bytes", "allocated_bytes"):
            value = max([s[key] for s in window] + [f[key]])
            if prev is not None and f["peak_" + key] > prev["peak_" + key]:
                value = max(value, f["peak_" + key])  # the allocator's own peak rose meanwhile: exact
            peak[key] = value
        base = prev.header if prev else (f.samples[0] if f.samples else f.header)
        dt = max(1e-6, (f["time_us"] - base["time_us"]) / 1e6)
        rate = lambda key: (f[key] - base[key]) / dt if key in base else 0.0  # noqa: E731
        self.last[f.path] = f
        self.hist[f.path].append((f["reserved_bytes"], f["allocated_bytes"], f.fragmentation))
        return {"peak_reserved_since_refresh_bytes": peak["reserved_bytes"],
                "peak_allocated_since_refresh_bytes": peak["allocated_bytes"],
                "evictions_per_s": rate("evictions"), "remats_per_s": rate("remats"),
                "eviction_calls_per_s": rate("num_eviction_calls"), "interval_s": dt}


def fmt(n: float) -> str:
    from .. import _core

    return _core.format_bytes(int(n)) if n >= 0 else "-" + _core.format_bytes(int(-n))


def sparkline(values, width: int, top: Optional[float] = None) -> str:
    values = list(values)[-width:]
    if not values:
        return ""
    hi = top if top else max(values) or 1
    return "".join(SPARK[min(len(SPARK) - 1, max(0, int(v / hi * (len(SPARK) - 1) + 0.5)))] for v in values)


def render(frames: list, tracker: Tracker, width: int, height: int):
    """The screen: one panel per published allocator."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    if not frames:
        return Panel(Text("No process publishes dtralloc counters yet (waiting).\n"
                          "Processes that called dtralloc.install() publish by themselves; a Pool "
                          "publishes after pool.publish()."), title="dtralloc top")
    panels = []
    rows_left = max(6, height - 2)
    for f in frames:
        extra = tracker.update(f)
        budget, cap = f["budget_bytes"], f["capacity_bytes"]
        limit = budget if 0 < budget < cap else max(f["peak_reserved_bytes"], f["reserved_bytes"], 1)
        bar_w = max(10, min(40, width - 80))

        def bar(value, peak, color):
            filled = int(round(bar_w * min(1.0, value / limit)))
            peak_at = int(round(bar_w * min(1.0, peak / limit))) if peak else -1
            t = Text()
            t.append("█" * filled, style=color)
            rest = bar_w - filled
            for k in range(rest):
                t.append("│" if filled + k == peak_at - 1 else "░", style="grey50" if filled + k != peak_at - 1 else "bold")
            return t

        g = Table.grid(padding=(0, 1))
        g.add_column(style="bold", no_wrap=True, min_width=9)
        g.add_column(no_wrap=True)
        g.add_column(no_wrap=True, overflow="ellipsis")
        over = " (budget)" if 0 < budget < cap else " (peak)"
        g.add_row("reserved", bar(f["reserved_bytes"], extra["peak_reserved_since_refresh_bytes"], "blue"),
                  f"{fmt(f['reserved_bytes'])} of {fmt(limit)}{over} · peak {fmt(f['peak_reserved_bytes'])}")
        g.add_row("allocated", bar(f["allocated_bytes"], extra["peak_allocated_since_refresh_bytes"], "cyan"),
                  f"{fmt(f['allocated_bytes'])} · since last refresh up to "
                  f"{fmt(extra['peak_allocated_since_refresh_bytes'])}")
        frag = f.fragmentation
        lines = Text()
        lines.append("free      ", style="bold")
        lines.append(f"cached {fmt(f['free_bytes'])} · largest block {fmt(f['largest_free_bytes'])} · ")
        lines.append(f"fragmentation {frag:.2f}", style="bold red" if frag > 0.5 else "")
        lines.append("\nevictions ", style="bold")
        lines.append(f"{extra['evictions_per_s']:.1f}/s · remats {extra['remats_per_s']:.1f}/s · ")
        lines.append(f"OOMs {f['num_ooms']}", style="bold red" if f["num_ooms"] else "")
        lines.append(f" · hook calls {f['num_eviction_calls']} · segments {f['segments']} · "
                     f"cudaMalloc {f['num_device_alloc']} / cudaFree {f['num_device_free']}")
        h = tracker.hist[f.path]
        spark_w = max(10, width - 24)
        top = max([r for r, _, _ in h] + [limit])
        h = tracker.hist[f.path]
        spark_w = max(10, width - 16)
        top = max([r for r, _, _ in h] + [limit])
        sp = Table.grid(padding=(0, 1))
        sp.add_column(style="bold", no_wrap=True, min_width=9)
        sp.add_column(no_wrap=True)
        sp.add_row("reserved", Text(sparkline([r for r, _, _ in h], spark_w, top), style="blue"))
        sp.add_row("allocated", Text(sparkline([a for _, a, _ in h], spark_w, top), style="cyan"))
        sp.add_row("frag.", Text(sparkline([x for _, _, x in h], spark_w, 1.0), style="magenta"))
        body = [g, lines, sp]
        if f.segments:
            # Every segment as one cell, by how full it is: the picture at a glance.
            strip = Text()
            for seg in f.segments:
                used = seg["allocated_bytes"] / max(1, seg["size"])
                strip.append(SHADES[min(len(SHADES) - 1, int(used * len(SHADES)))],
                             style="blue" if used >= 0.9 else "green" if used < 0.3 else "cyan")
            body.append(Text(f"segments in address order, each one cell by its use (full {SHADES[-1]} ... "
                             f"empty {SHADES[0]}), {f['segments']} segments:", style="bold"))
            body.append(strip)
        room = rows_left - 12 - (len(f.segments) // max(1, width - 4) + 1)
        if f.segments and room > 1:
            # The segments with the most free bytes: where fragmentation lives.
            segs = sorted(f.segments, key=lambda seg: (-seg["free_bytes"], -seg["size"]))[:room]
            segs.sort(key=lambda seg: seg["addr"])
            seg_w = max(10, min(40, width - 70))
            st = Table.grid(padding=(0, 1))
            for _ in range(4):
                st.add_column(no_wrap=True)
            for seg in segs:
                used = int(round(seg_w * seg["allocated_bytes"] / max(1, seg["size"])))
                t = Text()
                t.append("█" * used, style="blue")
                t.append("░" * (seg_w - used), style="green")
                st.add_row(f"{seg['addr']:#x}", f"{fmt(seg['size']):>10}", t,
                           f"{100 * seg['allocated_bytes'] / max(1, seg['size']):3.0f}% used · "
                           f"largest free {fmt(seg['largest_free_bytes'])}")
            which = (f"all {len(segs)} segments" if len(segs) == len(f.segments)
                     else f"the {len(segs)} segments with the most free bytes")
            body.append(Text(f"{which} (█ allocated, ░ free):", style="bold"))
            body.append(st)
        title = (f"pid {f.pid} · device {f.device} · {f.label} · frame {f['frame']} · "
                 f"{f['period_us'] / 1000:g} ms period · {f.age_s:.1f} s old")
        panels.append(Panel(Group(*body), title=title, title_align="left"))
        rows_left -= 14 + min(len(f.segments), max(0, rows_left - 12))
    return Group(*panels)


def _frames(pid: Optional[int], device: Optional[int]) -> list:
    out = []
    for path in published_paths(pid):
        f = read_frame(path)
        if f is not None and (device is None or f.device == device):
            out.append(f)
    return out


def run_top(pid: Optional[int] = None, once: bool = False, as_json: bool = False, interval: float = 0.5,
            device: Optional[int] = None) -> int:
    if pid is not None and not pid_alive(pid):
        print(f"error: no process {pid}", file=sys.stderr)
        return 2
    if once:
        frames = _frames(pid, device)
        if not frames:
            who = f"process {pid}" if pid is not None else "any process"
            print(f"error: {who} publishes no dtralloc counters (dtralloc.install() publishes them; "
                  "a Pool does after pool.publish())", file=sys.stderr)
            return 1
        tracker = Tracker()
        if as_json:
            out = [frame_json(f, tracker.update(f)) for f in frames]
            print(json.dumps(out[0] if len(out) == 1 else out, indent=1))
        else:
            from rich.console import Console

            c = Console()
            c.print(render(frames, tracker, c.width, c.height))
        return 0
    return _live(pid, interval, device)


def _live(pid, interval: float, device) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console()
    tracker = Tracker()
    keys = _Keys()
    try:
        with keys, Live(console=console, screen=True, auto_refresh=False) as live:
            while True:
                frames = _frames(pid, device)
                if pid is not None and not pid_alive(pid):
                    break
                # The terminal's size now (a resize applies at the next frame),
                # not a COLUMNS the shell exported when it started.
                with contextlib.suppress(OSError):
                    console.size = os.get_terminal_size(sys.stdout.fileno())
                live.update(render(frames, tracker, console.width, console.height), refresh=True)
                if keys.wait(interval) == "q":
                    break
    except KeyboardInterrupt:
        pass
    if pid is not None and not pid_alive(pid):
        print(f"process {pid} exited")
    return 0


class _Keys:
    """Single keys without Enter, when stdin is a terminal."""

    def __enter__(self):
        self.saved = None
        if sys.stdin.isatty():
            import termios
            import tty

            self.saved = termios.tcgetattr(sys.stdin)
            tty.setcbreak(sys.stdin.fileno())
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            import termios

            termios.tcsetattr(sys.stdin, termios.TCSADRAIN, self.saved)

    def wait(self, seconds: float) -> Optional[str]:
        if self.saved is None:
            time.sleep(seconds)
            return None
        ready, _, _ = select.select([sys.stdin], [], [], seconds)
        return os.read(sys.stdin.fileno(), 1).decode(errors="replace").lower() if ready else None
