"""The `dtralloc` command as a user runs it: demo, bench, help, errors."""
import subprocess
import sys

import pytest

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
    assert "[18/18]" in first  # progress lines
    # The budget table: 3 policies x 2 budgets per trace, with eviction columns.
    table = second[second.index("trace "):].split("\n\n")[0].splitlines()
    assert {"policy", "overhead", "evictions", "remats"} <= set(table[0].split())
    rows = table[2:]
    assert len(rows) == 6 * len(list_bundled())
    assert any(" yes " in row and float(row.split()[-3]) > 0 for row in rows), \
        "some step must fit its budget by recomputing"


def test_demo_takes_a_subset_and_custom_settings():
    out = run("demo", "--trace", "mlp", "--conf", "", "--conf", "max_split_size_mb:64",
              "--policy", "dtralloc", "--budget", "0.99").stdout
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


def test_replay_policies_bench_runs_on_one_trace(tmp_path):
    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    proc = subprocess.run([sys.executable, "bench/replay_policies.py", "--traces", "mlp", "--out-dir",
                           str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "## Minimum feasible budget" in proc.stdout and "| mlp |" in proc.stdout
    assert any(p.name.startswith("replay_policies-") and p.suffix == ".md" for p in tmp_path.iterdir())
