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


def test_smoke_report_has_every_cpu_configuration(tmp_path):
    out = tmp_path / "ablation.md"
    assert ab.main(["--smoke", "--device", "cpu", "--rounds", "1", "--models", "resnet50", "--out", str(out)]) == 0
    text = out.read_text()
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| config")]
    configs = [line.split("|")[1].strip() for line in table]
    assert configs == [c for c in ab.CONFIGS if c != "dtr, no GPU op timing"]
    for line in table:
        cells = [c.strip() for c in line.split("|")[2:-1]]
        host, wall = float(cells[0]), float(cells[1])
        assert 0 < host <= wall
    assert "ATen ops a step" in text and "M = " in text


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
