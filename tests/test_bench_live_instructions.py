"""bench/bench_live_instructions.py: its measured process runs the workload
it names in the context it names and says how many ops a step has; the
parent reads callgrind's totals and reports per-op differences. (Running
valgrind itself takes minutes a cell: not here.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_live_instructions as bench  # noqa: E402


needs_operator_call = pytest.mark.skipif(not hasattr(__import__("operator"), "call"),
                                         reason="the measured steps run inside operator.call (Python 3.11+)")


@needs_operator_call
@pytest.mark.parametrize("config", ["plain", "dtr"])
def test_the_measured_process_runs_the_workload_and_counts_its_ops(config, capsys):
    import torch

    threads = torch.get_num_threads()
    try:
        assert bench.child("adds", config, 1, None) == 0
    finally:
        torch.set_num_threads(threads)  # the measured process runs on one
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["ops"] == 2000  # 2000 x torch.add
    assert os.path.isfile(os.path.join(info["dtralloc"], "__init__.py"))


@needs_operator_call
def test_the_measured_process_waits_for_its_go_file(tmp_path):
    # The parent turns callgrind's instrumentation on between READY and the file.
    go = tmp_path / "go"
    p = subprocess.Popen([sys.executable, bench.__file__, "--child", "adds", "plain", "1", "--child-go", str(go)],
                         stdout=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.split() == ["READY", str(p.pid)], line
        time.sleep(0.5)
        assert p.poll() is None  # still waiting
        go.touch()
        out, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 0
    assert json.loads(out.strip().splitlines()[-1])["ops"] == 2000


def test_totals_are_read_from_callgrind_output(tmp_path):
    out = tmp_path / "x.callgrind"
    out.write_text("version: 1\ncreator: callgrind-3.19.0\nevents: Ir\nfn=(1) main\n3 5\nsummary: 123456\ntotals: 123456\n")
    assert bench.instructions_of(str(out)) == 123456
    out.write_text("events: Ir\n")
    with pytest.raises(RuntimeError, match="no totals"):
        bench.instructions_of(str(out))


def test_report_gives_per_op_counts_and_differences_per_build():
    rows = []
    for config, per_op in (("plain", 10_000), ("hooks", 30_000), ("dtr", 45_000)):
        rows.append({"workload": "chain", "config": config, "package": None, "ops": 2000, "per_op": per_op})
    rows.append({"workload": "chain", "config": "dtr", "package": "before", "ops": 2000, "per_op": 47_500})
    text = bench.report(rows, ["chain"], ["plain", "hooks", "dtr"], 3, [("before", "/x")], "cmd",
                        lambda title, command: f"# {title}\n")
    assert "| plain | noop mode + hooks | dtr | dtr [before] | dtr over plain | dtr over noop mode + hooks | " \
           "dtr [before] over plain | dtr [before] over noop mode + hooks |" in text, text
    assert "| 2000 | 10,000 | 30,000 | 45,000 | 47,500 | 35,000 | 15,000 | 37,500 | 17,500 |" in text, text


def test_a_python_without_operator_call_is_named(monkeypatch):
    import operator

    monkeypatch.delattr(operator, "call", raising=False)
    with pytest.raises(SystemExit, match="needs Python 3.11 or newer"):
        bench.main([])


@needs_operator_call
def test_bad_arguments_are_named(monkeypatch):
    monkeypatch.setattr(bench.shutil, "which", lambda name: "/usr/bin/" + name)
    with pytest.raises(SystemExit, match="unknown nope; choose from adds"):
        bench.main(["--workloads", "nope"])
    with pytest.raises(SystemExit, match="NAME=DIR"):
        bench.main(["--package", "nodir"])
    with pytest.raises(SystemExit, match="holds no dtralloc"):
        bench.main(["--package", f"x={ROOT}/bench"])
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match=r"valgrind \(with callgrind_control\) is not on PATH"):
        bench.main([])


@needs_operator_call
def test_the_forward_alone_configuration_records_the_forward_only(capsys):
    """'forward': the session holds the forward and the loss, backward runs
    after its block; the step still counts all its ops."""
    import torch

    import bench_live_overhead as overhead

    threads = torch.get_num_threads()
    try:
        assert bench.child("mlp", "forward", 1, None) == 0
    finally:
        torch.set_num_threads(threads)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ops"] == overhead.ops_of(
        overhead.workloads()[bench.WORKLOADS["mlp"]])
    fn = overhead.workloads()[bench.WORKLOADS["resnet"]]
    sessions = []

    class Spy(overhead.ForwardAlone):
        def __call__(self):
            sessions.append(super().__call__())
            return sessions[-1]

    overhead.run(fn, Spy())
    forward_ops = sessions[-1].stats()["ops"]
    overhead.run(fn, lambda: sessions.append(overhead.dtr(device="cpu")) or sessions[-1])
    assert 0 < forward_ops < sessions[-1].stats()["ops"] / 2, (forward_ops, sessions[-1].stats()["ops"])
    adds = overhead.workloads()[bench.WORKLOADS["adds"]]  # no backward: whole inside, as under dtr
    overhead.run(adds, Spy())
    assert sessions[-1].stats()["ops"] > 0


def test_report_gives_the_forward_alone_over_plain():
    rows = [{"workload": "mlp", "config": c, "package": None, "ops": 513, "per_op": n}
            for c, n in (("plain", 17_000), ("dtr", 53_000), ("forward", 30_000))]
    text = bench.report(rows, ["mlp"], ["plain", "dtr", "forward"], 3, [], "cmd", lambda title, command: f"# {title}\n")
    assert "| dtr over plain | dtr, forward in the block over plain |" in text, text
    assert "| 513 | 17,000 | 53,000 | 30,000 | 36,000 | 13,000 |" in text, text
