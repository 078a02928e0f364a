"""The `dtralloc` command as a user runs it: demo, bench, record, help, errors."""
import os
import subprocess
import sys

import pytest

import dtralloc
from dtralloc.cli import build_parser
from dtralloc.traces import list_bundled


def run(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "dtralloc", *args], capture_output=True, text=True,
                          timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_demo_replays_every_bundled_trace_under_each_setting():
    out = run("demo").stdout
    first, second = out.split("Under a budget below the peak")
    table = first[first.index("trace "):].split("\n\n")[0].splitlines()
    rows = table[2:]
    assert len(rows) == 3 * len(list_bundled())
    for name in list_bundled():
        assert sum(row.split()[0] == name for row in rows) == 3
    assert all(" yes " in row for row in rows), "no budget: every replay must be feasible"
    n = 3 * len(list_bundled())
    assert f"[{n}/{n}]" in first  # progress lines
    # The budget table: 3 policies x 2 budgets per trace, with eviction columns.
    table = second[second.index("trace "):].split("\n\n")[0].splitlines()
    assert {"policy", "overhead", "evictions", "remats"} <= set(table[0].split())
    rows = table[2:]
    assert len(rows) == 6 * len(list_bundled())
    assert any(" yes " in row and float(row.split()[-3]) > 0 for row in rows), \
        "some step must fit its budget by recomputing"
    # The live part: a model trained under dtr() at half its peak, losses as plain.
    live = out[out.index("Live:"):]
    assert "losses identical: yes" in live
    steps = [line.split() for line in live.splitlines() if line.strip()[:1].isdigit()]
    assert len(steps) == 3 and all(row[1] == row[2] and int(row[3]) > 0 for row in steps)
    assert "checked with verify(): bit-exact: " in live


def test_demo_takes_a_subset_and_custom_settings():
    out = run("demo", "--trace", "mlp", "--conf", "", "--conf", "max_split_size_mb:64",
              "--policy", "dtralloc", "--budget", "0.99", "--no-live").stdout
    assert "Live:" not in out
    assert "[ 2/2]" in out and "max_split_size_mb:64" in out and "gpt2" not in out
    assert "[ 1/1] mlp       dtralloc  0.99" in out


def test_demo_rejects_an_unknown_trace_with_the_list():
    proc = run("demo", "--trace", "nope", check=False)
    assert proc.returncode == 2
    assert "nope" in proc.stderr and "gpt2" in proc.stderr


def test_demo_rejects_a_bad_conf_naming_the_key():
    proc = run("demo", "--trace", "mlp", "--conf", "max_split_size_mb:tiny", check=False)
    assert proc.returncode == 2 and "max_split_size_mb" in proc.stderr


def test_bench_quick_prints_ratios():
    out = run("bench", "--quick").stdout
    rows = [line for line in out.splitlines()
            if line.split()[:2] in (["steady", "training-step"], ["steady", "random"],
                                     ["pair", "training-step"], ["pair", "random"])]
    assert len(rows) == 12  # 2 patterns x 2 size mixes x 3 thread counts
    assert {row.split()[0] for row in rows} == {"steady", "pair"}
    for row in rows:
        pool_ns, history_ns, libc_ns, ratio = (float(v) for v in row.split()[-4:])
        assert pool_ns > 0 and history_ns > 0 and libc_ns > 0
        assert ratio == pytest.approx(pool_ns / libc_ns, abs=0.006)


def test_help_lists_every_command_and_no_command_is_an_error():
    out = run("--help").stdout
    for command in ("config", "demo", "record", "replay", "bench"):
        assert command in out
    assert run(check=False).returncode == 2


def test_record_and_replay_a_zoo_model_from_outside_the_source_tree(tmp_path):
    """The installed package records a zoo model by name from any directory (it
    never imports the source tree), then replays what it wrote."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DTRALLOC_CONF")}

    def run_at_root(*args):
        return subprocess.run([sys.executable, *args], cwd="/", env=env, capture_output=True, text=True,
                              timeout=300)

    # From "/" the source tree's bench/ cannot be imported, so a zoo that still
    # lived there would fail below.
    assert run_at_root("-c", "import importlib.util as u, sys; sys.exit(u.find_spec('bench') is not None)"
                       ).returncode == 0
    out = tmp_path / "x.dtrace"
    record = run_at_root("-m", "dtralloc", "record", "resnet50", "--small", "--out", str(out))
    assert record.returncode == 0, record.stderr
    assert f"wrote {out}" in record.stdout and "warm-up step done" in record.stderr
    trace = dtralloc.trace.load(str(out))
    assert trace.meta["name"] == "resnet50" and trace.meta["description"].startswith("ResNet")
    assert any(op.backward for op in trace.ops)
    replay = run_at_root("-m", "dtralloc", "replay", str(out))
    assert replay.returncode == 0, replay.stderr
    row = replay.stdout.splitlines()[2]
    assert row.split()[0] == "resnet50" and " yes " in row


def test_record_takes_o_for_out_and_lists_every_zoo_model():
    zoo = pytest.importorskip("dtralloc.zoo")
    assert build_parser().parse_args(["record", "mlp", "-o", "step.dtrace"]).out == "step.dtrace"
    help_text = " ".join(run("record", "--help").stdout.split())
    assert all(name in help_text for name in zoo.MODELS)


def test_replay_policies_bench_runs_on_one_trace(tmp_path):
    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    proc = subprocess.run([sys.executable, "bench/replay_policies.py", "--traces", "mlp", "--out-dir",
                           str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "## Minimum feasible budget" in proc.stdout and "| mlp |" in proc.stdout
    assert any(p.name.startswith("replay_policies-") and p.suffix == ".md" for p in tmp_path.iterdir())
