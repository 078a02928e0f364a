"""bench/bench_gpu_budget.py and bench/gpu_session.sh work end to end without a
GPU: the bench's smoke mode runs its whole logic (M measured, a batch search
per configuration, the bit-exactness check, the report) on tiny models over
CPU tensors, with dtr(device="cpu")'s virtual pool as the memory that is
capped. The GPU figures themselves come from bench/gpu_session.sh on a GPU
machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_run_on_cpu(tmp_path):
    out = tmp_path / "budget.md"
    proc = subprocess.run(
        [sys.executable, "bench/bench_gpu_budget.py", "--smoke", "--device", "cpu", "--in-process",
         "--models", "resnet50", "--time-limit", "60", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    (res,) = data["results"]
    base, cap = res["base"], res["measure"]["cap_bytes"]
    assert cap > 0
    largest = {}
    for config in ("plain", "checkpoint", "dtr"):
        probes = [r for r in res["configs"][config] if r["event"] == "probe"]
        assert probes and probes[0]["batch"] == base, (config, res["configs"][config])
        assert probes[0]["ok"], f"{config} does not fit at B in plain's own peak: {probes[0]}"
        fits = [r for r in probes if r["ok"]]
        assert all(r["peak_bytes"] <= cap for r in fits), (config, fits)
        assert any(not r["ok"] for r in probes), f"{config}: the search never found a batch that does not fit"
        largest[config] = max(r["batch"] for r in fits)
    assert largest["plain"] < 2 * base  # M is plain's peak at B: 2B cannot fit in it
    assert largest["dtr"] >= largest["plain"]
    (check,) = [r for r in res["configs"]["dtr"] if r["event"] == "check"]
    # A batch that fitted in its probe may run out in the check (eviction
    # choices follow measured op times); the check then moves down.
    assert all(r["batch"] > check["batch"] for r in res["configs"]["dtr"] if r["event"] == "check_oom")
    assert check["batch"] in [r["batch"] for r in res["configs"]["dtr"] if r["event"] == "probe" and r["ok"]]
    assert check["plain_vs_plain"] and check["dtr_vs_plain"], check
    report = out.read_text()
    assert report.startswith("# Largest batch in a fixed memory") and "command: `python bench/bench_gpu_budget.py" in report
    assert "| dtr |" in report and "bit-exact" in report


def test_gpu_session_script_parses():
    assert subprocess.run(["bash", "-n", "bench/gpu_session.sh"], cwd=ROOT).returncode == 0


def _bench():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import bench_gpu_budget

    return bench_gpu_budget


def test_a_search_probes_at_least_once_whatever_its_deadline():
    """On the first GPU run GPT-2's plain and checkpoint searches ran no probe
    (building the model ate their share of the time) and the report said
    "none fits"."""
    bench = _bench()
    common = {"model": "resnet50", "device": "cpu", "smoke": True, "base": 4}
    (m,) = [r for r in bench.run_config({**common, "config": "measure", "deadline_s": 60}, 60, True)
            if r["event"] == "measure"]
    records = bench.run_config({**common, "config": "plain", "cap_bytes": m["cap_bytes"], "deadline_s": 0.0},
                               60, True)
    probes = [r for r in records if r["event"] == "probe"]
    assert len(probes) == 1 and probes[0]["batch"] == 4 and probes[0]["ok"], records


def test_a_search_that_ran_no_probe_is_not_reported_as_none_fits():
    bench = _bench()
    res = {"model": "gpt2", "base": 8, "configs": {"plain": []}, "measure_records": [],
           "measure": {"cap_bytes": 1 << 30, "peak_allocated": None, "step_s": 0.1, "description": "d",
                       "device": "cpu", "torch": "x"}}
    args = bench.argparse.Namespace(device="cuda", smoke=False)
    report = bench.report([res], args, "python bench/bench_gpu_budget.py", 1.0)
    assert "| plain | not measured (no probe ran) |" in report, report


def test_a_crashed_worker_is_reported_by_its_fatal_error_and_frame():
    stderr = ("Fatal Python error: Segmentation fault\n\nCurrent thread 0x1 (most recent call first):\n"
              '  File "/x/torch/_ops.py", line 1402 in _get_packet\n  File "/x/y.py", line 3 in <module>\n\n'
              "Extension modules: numpy, torch._C (total: 2)\n")
    reason = _bench().death_reason(stderr)
    assert reason == 'Fatal Python error: Segmentation fault; File "/x/torch/_ops.py", line 1402 in _get_packet'
    assert _bench().death_reason("a\nValueError: bad\n") == "ValueError: bad"
    assert _bench().death_reason("") == "(no output)"


def test_a_check_that_runs_out_of_memory_moves_down_to_the_next_batch_that_fitted(monkeypatch):
    """CI once saw the check at 2B run out where the probe at 2B had fitted:
    which values dtr evicts follows the op times it measures."""
    bench = _bench()
    import dtralloc

    calls = []

    class Worker:
        def __init__(self, spec, emit):
            self.fitted = set()

        def search(self, base, known, deadline):
            self.fitted = {4, 6, 8, 12}
            return 12

        def check(self, size):
            calls.append(size)
            if size > 6:
                raise dtralloc.OutOfMemoryError(f"dtralloc.dtr: out of memory at {size}")
            return {"event": "check", "batch": size}

        def _clean(self):
            pass

    monkeypatch.setattr(bench, "Worker", Worker)
    records = []
    bench.worker_main({"config": "dtr", "base": 4, "deadline_s": 1.0, "check": 8}, records.append)
    assert calls == [8, 6]
    assert [(r["event"], r["batch"]) for r in records[:-1]] == [("check_oom", 8), ("check", 6)]
    res = {"model": "resnet50", "base": 4, "measure_records": [],
           "measure": {"cap_bytes": 1 << 20, "peak_allocated": None, "step_s": 0.1, "description": "d",
                       "device": "cpu", "torch": "x"},
           "configs": {"dtr": [{"event": "probe", "batch": 4, "ok": True, "step_s": 0.1, "peak_bytes": 1,
                                "evictions": 0, "remats": 0}, records[0]]}}
    report = bench.report([res], bench.argparse.Namespace(device="cpu", smoke=True), "cmd", 1.0)
    assert "ran out of memory at batch 8" in report, report


def _refused(*args) -> str:
    """The bench's argument error for `args` (exit 2, nothing run): its stderr."""
    proc = subprocess.run([sys.executable, "bench/bench_gpu_budget.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    return proc.stderr


def test_conf_is_checked_before_anything_runs():
    assert "install nothing" in _refused("--device", "cpu", "--conf", "unmap_pages:off")
    assert "unknown key 'unmap_pagez'" in _refused("--device", "cuda", "--conf", "unmap_pagez:off")


def test_the_dtralloc_configurations_install_the_dtralloc_policy():
    """The installed CUDA pool's auto settings follow its policy: without
    policy:dtralloc the dtr configuration's pool made cudaMalloc'd segments
    and could give no page back (Allocator::override_session, make_cuda_backend_for)."""
    bench = _bench()
    assert bench.with_policy("") == "policy:dtralloc"
    assert bench.with_policy("unmap_pages:off") == "policy:dtralloc,unmap_pages:off"
    assert bench.with_policy("budget:1G, policy:dtr") == "budget:1G, policy:dtr"


def test_also_conf_runs_the_dtr_search_again_on_its_settings(monkeypatch):
    """--also-conf CONF: configuration "dtr [CONF]" is dtr's search on
    install("policy:dtralloc,CONF"), in the same run, reported and judged
    against the goal beside dtr's (without a second bit-exactness check)."""
    bench = _bench()
    specs = []

    def run_config(spec, hard_timeout, in_process=False):
        specs.append(spec)
        if spec["config"] == "measure":
            return [{"event": "measure", "cap_bytes": 1 << 30, "peak_allocated": None, "step_s": 0.8,
                     "description": "d", "device": "cuda", "torch": "x"}]
        per_sample = 0.1 if spec.get("conf") == "arena:on" else 0.12
        # Worker.probe records the pool's device calls only where dtralloc's pool serves.
        calls = {"device_calls": 0.0, "device_ms": 0.0} if spec.get("conf") == "arena:on" else (
            {"device_calls": 151.5, "device_ms": 212.25} if spec["config"] == "dtr" else {})
        return [{"event": "probe", "batch": b, "ok": True, "step_s": per_sample * b, "peak_bytes": 1 << 30,
                 "evictions": 1, "remats": 1, **calls} for b in (8, 24)]

    monkeypatch.setattr(bench, "run_config", run_config)
    args = bench.argparse.Namespace(device="cuda", smoke=False, base=None, conf="", in_process=False,
                                    also_conf=["arena:on"])
    result = {}
    bench.bench_model("gpt2", args, 100.0, result, lambda: None)
    # The dtr searches run first (the figures the bench is for); the report keeps the configurations' order.
    labels = ["measure", "dtr", "dtr-forward", "dtr [arena:on]", "plain", "checkpoint", "plain-dtralloc"]
    by_label = dict(zip(labels, specs))
    assert [spec["config"] for spec in specs] == ["measure", "dtr", "dtr-forward", "dtr", "plain", "checkpoint",
                                                  "plain-dtralloc"]
    assert list(result["configs"]) == ["plain", "checkpoint", "plain-dtralloc", "dtr", "dtr-forward",
                                       "dtr [arena:on]"]
    assert by_label["dtr-forward"]["check"] == 16  # its own bit-exactness check, backward after the block
    assert by_label["dtr [arena:on]"]["config"] == "dtr" and by_label["dtr [arena:on]"]["conf"] == "arena:on"
    assert "check" not in by_label["dtr [arena:on]"] and by_label["dtr"]["check"] == 16
    assert by_label["dtr"]["conf"] == ""
    report = bench.report([result], args, "python bench/bench_gpu_budget.py --also-conf arena:on", 1.0)
    assert "| dtr [arena:on] | 24 | 3.00 |" in report, report
    assert "| 1 / 1 | 0 (0.0 ms) |" in report and "| 1 / 1 | 152 (212.2 ms) |" in report, report
    assert "| plain | 24 | 3.00 | 120.00 | +0.0% | +0.0% | 1 / 1 | - |" in report, report
    assert "Goal (>= 3x B at <= 25% overhead), dtr [arena:on]: **met** (at 24: -16.7%)" in report, report


def test_also_conf_is_checked_before_anything_runs():
    proc = subprocess.run([sys.executable, "bench/bench_gpu_budget.py", "--device", "cpu", "--also-conf", "arena:on"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "exist on a GPU only" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "bench/bench_gpu_budget.py", "--device", "cuda", "--also-conf",
                           "arena:on,max_split_size_mb:64"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "arena:on needs max_split_size_mb:none" in proc.stderr, proc.stderr


def test_gpt2_loss_in_pieces_is_the_same_loss_and_its_count_is_checked():
    pytest.importorskip("transformers")
    import torch

    bench = _bench()
    losses = []
    for chunks in (1, 4):
        m = bench.Model("gpt2", True, "cpu", chunks)
        assert ("loss in 4 pieces" in m.description) == (chunks == 4), m.description
        torch.manual_seed(0)  # dropout draws the same masks in both
        losses.append(m.loss_fn(m.model, *m.batch(2)).detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    proc = subprocess.run([sys.executable, "bench/bench_gpu_budget.py", "--gpt2-loss-chunks", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--gpt2-loss-chunks is a number of pieces >= 1" in proc.stderr, proc.stderr


def test_gpt2_seq_sets_the_sequence_length_and_is_checked():
    pytest.importorskip("transformers")
    m = _bench().Model("gpt2", True, "cpu", 1, 48)
    assert m.seq == 48 and "seq 48" in m.description and m.batch(3)[0].shape == (3, 48)
    assert "--gpt2-seq is a sequence length >= 2" in _refused("--gpt2-seq", "1")


def test_configs_are_checked_before_anything_runs():
    err = _refused("--device", "cpu", "--configs", "plain,dtr-fwd")
    assert "unknown configuration 'dtr-fwd'" in err and "dtr-forward" in err, err
    assert "(none given)" in _refused("--device", "cpu", "--configs", ",")
    assert "GPU only" in _refused("--device", "cpu", "--configs", "plain-dtralloc")


def test_dtr_forward_runs_the_forward_alone_in_the_session(tmp_path):
    """dtr-forward: the session around the forward and the loss; backward and
    the optimizer step after the block (on CPU the mirror counts the block
    alone); it runs and is reported beside dtr."""
    out = tmp_path / "budget.md"
    proc = subprocess.run(
        [sys.executable, "bench/bench_gpu_budget.py", "--smoke", "--device", "cpu", "--in-process",
         "--models", "resnet50", "--configs", "dtr,dtr-forward", "--time-limit", "40", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (res,) = json.loads(out.with_suffix(".json").read_text())["results"]
    assert list(res["configs"]) == ["dtr", "dtr-forward"]
    fits = {c: max((r["batch"] for r in res["configs"][c] if r["event"] == "probe" and r["ok"]), default=0)
            for c in res["configs"]}
    assert fits["dtr"] >= res["base"] and fits["dtr-forward"] >= res["base"], fits
    (check,) = [r for r in res["configs"]["dtr-forward"] if r["event"] == "check"]
    assert check["plain_vs_plain"] and check["dtr_vs_plain"], check
    assert check["remats"] > 0 or check["batch"] == res["base"], check  # at 2B the forward alone outgrows M
    report = out.read_text()
    assert "| dtr-forward |" in report and "Goal (>= 3x B at <= 25% overhead), dtr-forward:" in report, report
    assert "(dtr-forward: the forward in the session, backward after it) (dtr with budget M" in report, report
    assert "dtr-forward's mirror counts its block only" in report


def test_model_step_runs_only_the_forward_in_forward_in():
    import torch

    bench = _bench()
    m = bench.Model("resnet50", True, torch.device("cpu"))
    batch = m.batch(2)
    seen = []

    class Spy:
        def __enter__(self):
            seen.append(("enter", any(p.grad is not None for p in m.model.parameters())))

        def __exit__(self, *exc):
            seen.append(("exit", any(p.grad is not None for p in m.model.parameters())))

    loss = m.step(batch, forward_in=Spy())
    assert seen == [("enter", False), ("exit", False)]  # no gradient yet when the block ends: backward runs after
    assert loss.requires_grad is False and all(p.grad is not None for p in m.model.parameters())


def test_a_cuda_probe_whose_device_held_more_than_m_does_not_fit(monkeypatch):
    """async_segments: the budget holds dtralloc's pool within M, but the
    driver's pool may hold freed segments beyond it until a synchronize
    (docs/allocator.md, Note [async segments]). run_steps counts that in the
    probe's peak, and a probe over M does not fit, whatever its config."""
    bench = _bench()

    class M:
        class optimizer:  # noqa: N801 - stands in for the model's optimizer
            @staticmethod
            def zero_grad(set_to_none=True):
                pass

        @staticmethod
        def batch(size):
            return size

    cap = 100 << 20
    for config, on, peak, fits in (("dtr", True, cap, True), ("dtr", True, cap + (40 << 20), False),
                                   ("dtr", False, cap + (2 << 20), False),
                                   ("plain-dtralloc", True, cap + (40 << 20), False), ("plain", False, cap, True)):
        worker = object.__new__(bench.Worker)
        worker.cuda, worker.config, worker.cap, worker.timed_steps, worker.m = True, config, cap, 2, M
        worker.async_segments = on
        monkeypatch.setattr(worker, "_clean", lambda: None, raising=False)
        monkeypatch.setattr(worker, "run_steps", lambda batch, steps, peak=peak: {
            "times": [0.3, 0.2, 0.2], "peak": peak, "evictions": 0, "remats": 0, "calls": []}, raising=False)
        record = worker.probe(8)
        assert record["ok"] is fits, (config, peak, record)
        if not fits:
            assert "over the cap" in record["error"], record
            # The driver's pool is named only where it served.
            assert ("driver's pool held counts" in record["error"]) is on, record


def test_budget_m_in_a_conf_installs_the_pool_with_the_cap(monkeypatch):
    """`--also-conf 'arena:on,budget:M'`: the pool's own budget is M too, as
    the README installs it, beside each session's dtr(budget=M)."""
    bench = _bench()
    assert bench.with_cap("arena:on,budget:M", 123 << 20) == f"arena:on,budget:{123 << 20}B"
    assert bench.with_cap("arena:on", 123 << 20) == "arena:on"
    assert bench.with_cap("", None) == ""
    with pytest.raises(ValueError, match="budget:M needs the cap"):
        bench.with_cap("budget:M", None)
    from dtralloc import _core

    _core.describe_config(bench.with_cap("arena:on,budget:M", 1 << 30))  # what main() checks: a valid setting

    import dtralloc

    installed = []

    class Stop(Exception):
        pass

    def install(conf=None):
        installed.append(conf)
        raise Stop

    monkeypatch.setattr(dtralloc, "install", install)
    with pytest.raises(Stop):
        bench.Worker({"smoke": True, "config": "dtr", "device": "cuda", "cap_bytes": 64 << 20,
                      "conf": "arena:on,budget:M", "model": "resnet50"})
    assert installed == [f"policy:dtralloc,arena:on,budget:{64 << 20}B"]
    # plain-dtralloc installs the budget M itself: once, not twice (a ConfigError).
    with pytest.raises(Stop):
        bench.Worker({"smoke": True, "config": "plain-dtralloc", "device": "cuda", "cap_bytes": 64 << 20,
                      "conf": "arena:on,budget:M", "model": "resnet50"})
    with pytest.raises(Stop):
        bench.Worker({"smoke": True, "config": "plain-dtralloc", "device": "cuda", "cap_bytes": 64 << 20,
                      "conf": "arena:on", "model": "resnet50"})
    assert installed[1:] == [f"policy:dtralloc,arena:on,budget:{64 << 20}B"] * 2
    for conf in installed:
        _core.describe_config(conf)
    del installed[1:]
    # M's measurement has no cap yet and installs nothing: budget:M is no error there.
    worker = bench.Worker({"smoke": True, "config": "measure", "device": "cpu", "conf": "arena:on,budget:M",
                           "model": "resnet50"})
    assert installed == [f"policy:dtralloc,arena:on,budget:{64 << 20}B"] and not worker.async_segments
