"""bench/bench_live_ablation.py: one model's step under plain eager and under
each layer a dtr() session adds, side by side. On CPU (--smoke) its plumbing:
every configuration runs and is reported, and the GPU-timing ablation's
session really has no stream to mark (and the patch is undone after)."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import bench_live_ablation as ab  # noqa: E402


def _tables(text: str) -> dict:
    """{section heading: [rows, each a list of cells]} for the report's tables."""
    tables, heading = {}, None
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line.lstrip("# ")
        elif line.startswith("| ") and not line.startswith("|---"):
            tables.setdefault(heading, []).append([c.strip() for c in line.split("|")[1:-1]])
    return tables


def test_smoke_report_has_every_cpu_configuration_at_each_batch_and_the_profile(tmp_path):
    out = tmp_path / "ablation.md"
    assert ab.main(["--smoke", "--device", "cpu", "--rounds", "1", "--models", "resnet50", "--multiples", "1,2",
                    "--profile", "--out", str(out)]) == 0
    text = out.read_text()
    tables = _tables(text)
    b = ab.SMOKE_BATCH["resnet50"]
    assert list(tables) == [f"batch {b} (1 B)", f"batch {2 * b} (2 B)", f"Under torch.profiler, batch {2 * b}"]
    cpu_configs = [c for c in ab.CONFIGS if c != "dtr, no GPU op timing"]
    for heading in list(tables)[:2]:
        header, *rows = tables[heading]
        assert header[:3] == ["config", "host ms", "wall ms"]
        assert [r[0] for r in rows] == cpu_configs
        for r in rows:
            if r[1] == "OOM":  # the budget M of batch B may not hold 2 B; the reason is listed
                assert f"- {r[0]}: dtralloc.dtr: out of memory" in text
                continue
            host, wall = float(r[1]), float(r[2])
            assert 0 < host <= wall
    header, *rows = tables[f"Under torch.profiler, batch {2 * b}"]
    assert [r[0] for r in rows] == list(ab.PROFILED)
    plain = rows[0]
    assert float(plain[1]) > 0 and plain[5:] == ["0.0%", "0", "0"]  # CPU: no GPU events, no CUDA calls
    assert "ATen ops a step" in text and "M = " in text


def test_oom_of_a_configuration_is_reported_not_raised(tmp_path):
    b = ab.Bench("resnet50", ab.SMOKE_BATCH["resnet50"], smoke=True, cuda=False)
    b.budget = 1 << 20  # far below what one step needs
    r = b.step("dtr, budget M")
    assert r["oom"].startswith("dtralloc.dtr: out of memory") and not r["oom"].endswith(":")
    assert "host" in b.step("dtr")  # the model and optimizer are usable after it


def test_calls_that_wait_for_the_device():
    for name in ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaFree",
                 "cuMemFree_v2", "cudaMemcpy"):
        assert ab.waits(name), name
    for name in ("cudaMemcpyAsync", "cudaLaunchKernel", "cudaEventRecord", "cudaEventQuery", "cudaMalloc",
                 "cudaStreamIsCapturing", "cuLaunchKernel"):
        assert not ab.waits(name), name


def test_without_gpu_timing_gives_sessions_no_stream_and_restores():
    from dtralloc.dtr import runner, session

    assert session.helpers("cpu")["current_stream"] is runner.helpers("cpu")["current_stream"]
    with ab._without_gpu_timing():
        assert session.helpers("cpu")["current_stream"] is None
    assert session.helpers is runner.helpers


def test_cuda_without_a_gpu_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as e:
        ab.main(["--device", "cuda"])
    assert e.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_unknown_model_is_named(capsys):
    with pytest.raises(SystemExit):
        ab.main(["--smoke", "--device", "cpu", "--models", "resnet50,vgg"])
    assert "unknown model(s) vgg" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1,x", "0,3", "-1", ","])
def test_bad_multiples_are_named(capsys, value):
    with pytest.raises(SystemExit) as e:
        ab.main(["--smoke", "--device", "cpu", "--multiples", value])
    assert e.value.code == 2
    assert "--multiples" in capsys.readouterr().err


def test_configurations_without_a_budget_are_timed_apart_from_those_with_one():
    configs = list(ab.CONFIGS)
    unbudgeted, budgeted = ab.groups(configs)
    assert sorted(unbudgeted + budgeted) == sorted(configs)
    assert budgeted == ["dtr, budget M", "dtr, budget M, no series", "dtr, budget M, forward in the block"]
    assert "plain" in unbudgeted and "dtr" in unbudgeted and "dtr, forward in the block" in unbudgeted


def test_forward_in_the_block_records_the_forward_only_and_the_step_still_trains():
    import torch

    b = ab.Bench("resnet50", ab.SMOKE_BATCH["resnet50"], smoke=True, cuda=False)
    with b.context("dtr") as whole:
        b.m.step(b.batch)
    before = [p.detach().clone() for p in b.m.model.parameters()]
    forward = b.context("dtr, forward in the block")
    b.m.step(b.batch, forward_in=forward)
    # backward and the optimizer's step ran after the block: every parameter
    # has a gradient and moved, and the session recorded about a third of the ops
    assert all(p.grad is not None for p in b.m.model.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(b.m.model.parameters(), before))
    assert 0 < forward.stats()["ops"] < whole.stats()["ops"] / 2, (forward.stats()["ops"], whole.stats()["ops"])
    b.budget = 1 << 20  # far below what the forward alone needs: reported, and the next step runs
    assert b.step("dtr, budget M, forward in the block")["oom"].startswith("dtralloc.dtr: out of memory")
    assert "host" in b.step("dtr, forward in the block")


def test_steps_run_group_by_group_and_the_report_keeps_the_configurations_order(monkeypatch):
    ran = []
    original = ab.Bench.step

    def step(self, config):
        ran.append(config)
        return original(self, config)

    monkeypatch.setattr(ab.Bench, "step", step)
    progress = []
    result = ab.run("resnet50", ab.SMOKE_BATCH["resnet50"], (1.0,), 2, smoke=True, cuda=False, profile=False,
                    progress=lambda r: progress.append([run_["batch"] for run_ in r["runs"]]))
    cpu_configs = [c for c in ab.CONFIGS if c != "dtr, no GPU op timing"]
    unbudgeted, budgeted = ab.groups(cpu_configs)
    timed = ran[-(3 * len(cpu_configs)):]  # after the budget's and the op count's steps: warm-up + 2 rounds a group
    assert timed == unbudgeted * 3 + budgeted * 3
    assert list(result["runs"][0]["rows"]) == cpu_configs
    assert progress == [[ab.SMOKE_BATCH["resnet50"]]]


def test_a_run_cut_short_keeps_the_batches_it_measured(tmp_path, monkeypatch):
    def interrupted(self, config):
        raise KeyboardInterrupt  # as the session's time limit would stop it, in the profile

    monkeypatch.setattr(ab.Bench, "profile", interrupted)
    out = tmp_path / "ablation.md"
    with pytest.raises(KeyboardInterrupt):
        ab.main(["--smoke", "--device", "cpu", "--rounds", "1", "--models", "resnet50", "--multiples", "1,2",
                 "--profile", "--out", str(out)])
    b = ab.SMOKE_BATCH["resnet50"]
    assert list(_tables(out.read_text())) == [f"batch {b} (1 B)", f"batch {2 * b} (2 B)"]


def test_the_untimed_configuration_reports_its_sessions_stats():
    b = ab.Bench("resnet50", ab.SMOKE_BATCH["resnet50"], smoke=True, cuda=False)
    with b.context("dtr, no GPU op timing") as s:
        b.m.step(b.batch)
    assert s.stats()["ops"] > 0
