"""bench/replay_recordings.py end to end on small traces: the per-trace
targets table (dtralloc against dtr), and its errors for bad arguments."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import dtralloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    return subprocess.run([sys.executable, "bench/replay_recordings.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_report_on_a_bundled_trace_and_a_saved_one(tmp_path):
    saved = tmp_path / "rec" / "lstm-compact.dtrace"
    saved.parent.mkdir()
    dtralloc.traces.load_bundled("lstm-compact").save(str(saved))
    out = tmp_path / "report.md"
    proc = run("--traces", "mlp", str(saved.parent), "--jobs", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines()
            if line.startswith("| mlp (") or line.startswith("| lstm-compact (")}
    assert set(rows) == {"mlp (bundled)", "lstm-compact (rec)"}
    # mlp is floor-bound: dtr's minimum sits within 0.02 of its resident floor.
    assert rows["mlp (bundled)"][5] == "floor"
    floor = dtralloc.resident_floor("mlp")
    assert float(rows["mlp (bundled)"][1]) == round(floor, 3)
    # The saved copy of a bundled trace gives the bundled trace's figures.
    ours = dtralloc.min_feasible_budget("lstm-compact", tolerance=0.005, method="scan")
    assert rows["lstm-compact (rec)"][2].split()[0] == f"{ours:.3f}"
    assert "2 traces; dtralloc holes in all:" in text
    # lstm-compact recomputed its workspace over and over at 0.595-0.605 of
    # its peak (4.4x its compute, 0.24x a step above: a spike) until holds
    # dropped spent values; now no budget of it spikes (the rule itself is
    # tested on a hand-made grid below).
    at = dtralloc.replay("lstm-compact", budget=0.6, policy="dtralloc")
    assert at.feasible and at.compute_overhead < 1
    assert rows["lstm-compact (rec)"][8].strip(" |") == "-"
    assert rows["mlp (bundled)"][8].strip(" |") == "-"
    assert "dtralloc's overhead spikes in all: " in text
    family_rows = [line for line in text.splitlines() if line.startswith("| lstm-compact | 1 |")]
    assert len(family_rows) == 1 and family_rows[0].endswith(" of 1 |")
    assert "command: `python bench/replay_recordings.py --traces mlp" in text


def test_spikes_are_budgets_far_dearer_than_just_above():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        from replay_recordings import spikes
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    grid = {0.5: 0.2, 0.505: 0.25, 0.51: 4.0, 0.515: 0.3, 0.52: None, 0.525: 2.9, 0.53: 1.0, 0.6: 0.1}
    # 0.51: 4.0 > 1 and > 3 x 0.25 just above; 0.525: 2.9 < 3 x 1.0 (0.53 is all that lies within 0.025 above)
    assert spikes(grid) == [(0.51, 4.0, 0.3)]
    assert spikes({0.5: 5.0}) == []  # nothing above to compare with
    assert spikes({0.5: 0.9, 0.505: 0.1}) == []  # not dearer than the step's own compute


def test_bad_arguments_are_named():
    proc = run("--traces", "nosuchmodel")
    assert proc.returncode == 2 and "'nosuchmodel' is neither a bundled trace" in proc.stderr
    proc = run("--traces", "/nonexistent/x.dtrace")
    assert proc.returncode == 2 and "no such trace file: /nonexistent/x.dtrace" in proc.stderr
    proc = run("--traces", ROOT + "/docs")
    assert proc.returncode == 2 and "no *.dtrace file in" in proc.stderr
    proc = run("--record", "1")
    assert proc.returncode == 2 and "--record needs --dir" in proc.stderr


def test_dtr_figures_can_be_reused(tmp_path):
    saved = tmp_path / "figures.json"
    first, second = tmp_path / "first.md", tmp_path / "second.md"
    proc = run("--traces", "mlp", "--jobs", "1", "--save", str(saved), "--out", str(first))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run("--traces", "mlp", "--jobs", "1", "--dtr-from", str(saved), "--out", str(second))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mlp dtr:" not in proc.stderr  # not measured again
    table = [line for line in first.read_text().splitlines() if line.startswith("| mlp")]
    assert table == [line for line in second.read_text().splitlines() if line.startswith("| mlp")]
    proc = run("--traces", "lstm-compact", "--dtr-from", str(saved))
    assert proc.returncode == 2 and "has no dtr figures for lstm-compact" in proc.stderr
    # dtr's figures for one step a budget do not stand in for a loop's.
    proc = run("--traces", "mlp", "--steps", "2", "--dtr-from", str(saved))
    assert proc.returncode == 2 and "holds dtr's figures for 1 step(s) a budget, and --steps is 2" in proc.stderr
    figures = json.loads(saved.read_text())
    figures["_replay"].update(steps=2, empty_cache_between_steps=True)
    saved.write_text(json.dumps(figures))
    proc = run("--traces", "mlp", "--steps", "2", "--dtr-from", str(saved))
    assert proc.returncode == 2 and "with the cache given back between steps" in proc.stderr
    # Figures saved before gradients were pinned (no model key) are refused.
    figures = json.loads(saved.read_text())
    del figures["_replay"]
    saved.write_text(json.dumps(figures))
    proc = run("--traces", "mlp", "--dtr-from", str(saved))
    assert proc.returncode == 2 and "another model of what the program holds" in proc.stderr


def _bench_module():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import replay_recordings
        from replay_policies import scan_of
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    return replay_recordings, scan_of


def test_a_conf_is_judged_at_the_default_pools_bytes():
    """segment_fit:on is what auto resolves to under a budget with the
    dtralloc policy, so every budgeted replay is the default's; only the
    no-eviction peak differs (auto is off without a budget, and on lowers
    convbn-compact's peak to 0.93 of the default's). At the default's bytes
    the figures are the default's; fractions of its own peak would have put
    its lowest budget elsewhere."""
    rr, scan_of = _bench_module()
    _, _, default = rr.measure(("convbn-compact", "dtralloc", None, 1, False))
    _, _, same = rr.measure(("convbn-compact", "dtralloc", "segment_fit:on", 1, False))
    for key in ("scan", "lowest", "holes", "overhead", "spikes"):
        assert same[key] == default[key], key
    own = dtralloc.overhead_grid("convbn-compact", conf="segment_fit:on", step=rr.FINE_STEP,
                                 lowest=max(0.0, default["floor"] - rr.FINE_STEP))
    assert scan_of({f: o is not None for f, o in own.items()}) != default["scan"]


def test_steps_judge_a_training_loop():
    """--steps N: each budget runs N steps in one pool; fractions of N
    steps' peak; the overhead is the last step's."""
    rr, scan_of = _bench_module()
    _, _, loop = rr.measure(("convbn-compact", "dtralloc", None, 2, False))
    reference = dtralloc.replay("convbn-compact", policy="none", steps=2).peak_reserved_bytes
    grid = dtralloc.overhead_grid("convbn-compact", step=rr.FINE_STEP, lowest=max(0.0, loop["floor"] - rr.FINE_STEP),
                                  reference_bytes=reference, steps=2)
    assert loop["scan"] == scan_of({f: o is not None for f, o in grid.items()})
    at = dtralloc.replay("convbn-compact", budget=0.7, policy="dtralloc", steps=2)
    assert loop["overhead"][0.7] == at.last_step_compute_overhead > 0
    proc = run("--steps", "0")
    assert proc.returncode == 2 and "--steps must be at least 1" in proc.stderr
    proc = run("--empty-cache-between-steps")
    assert proc.returncode == 2 and "--empty-cache-between-steps needs --steps 2 or more" in proc.stderr
    # The cache given back between steps: convbn-compact's loop holes close (its GPU settings:
    # tests/test_remat_replay.py), and on the replays' defaults the figures stay a loop's.
    _, _, emptied = rr.measure(("convbn-compact", "dtralloc", "split_oversize:on,unmap_pages:off", 3, True))
    _, _, kept = rr.measure(("convbn-compact", "dtralloc", "split_oversize:on,unmap_pages:off", 3, False))
    assert kept["holes"] and not emptied["holes"] and emptied["scan"] < kept["scan"]


def test_pinned_outliving_bench(tmp_path):
    """bench/replay_pinned_outliving.py: each trace replayed with and without
    what outlives the step pinned, side by side."""
    out = tmp_path / "pinned.md"
    proc = subprocess.run([sys.executable, "bench/replay_pinned_outliving.py", "--traces", "convbn-compact",
                           "--policies", "dtralloc", "--jobs", "1", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| convbn-compact")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1].startswith("41 (14.14 MiB")  # its gradients (and the loss)
    before, after = (float(x) for x in cells[2].split(" -> "))
    assert after > before  # the floor rises: gradients are pinned in backward
    before, after = (float(x) for x in cells[3].split(" -> "))
    assert after >= before
    proc = subprocess.run([sys.executable, "bench/replay_pinned_outliving.py", "--traces", "nosuch"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no bundled trace or file 'nosuch'" in proc.stderr
