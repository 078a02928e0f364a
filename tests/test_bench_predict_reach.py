"""bench/predict_reach.py: the budget bench's reach predicted by replaying
steps recorded at a base batch and its multiples under M, the base step's
peak. On the zoo's small models: the report's shape, the budget being M (the
base batch evicts nothing, a larger one that fits evicts), and the refusals."""
from __future__ import annotations

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import predict_reach as pr  # noqa: E402


def _rows(text: str, model: str) -> list[list[str]]:
    section = text.split(f"## {model}", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.split("|")[1:-1]] for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| batch")]


def test_small_resnet_fits_three_times_its_batch_in_its_base_peak(tmp_path):
    out = tmp_path / "reach.md"
    traces = tmp_path / "traces"
    assert pr.main(["--smoke", "--models", "resnet50", "--multiples", "1", "3", "--policies", "dtralloc", "msps",
                    "--save-traces", str(traces), "--out", str(out)]) == 0
    text = out.read_text()
    assert "command: `python bench/predict_reach.py --smoke --models resnet50 --multiples 1 3" in text
    assert "recorded on cpu (wall clock)" in text
    rows = _rows(text, "resnet50")
    assert [(r[0], r[3]) for r in rows] == [("8", "dtralloc"), ("8", "msps"), ("24", "dtralloc"), ("24", "msps")]
    base, big = rows[0], rows[2]
    assert base[4] == "yes" and base[5] == "0" and base[7] == "0.000", base  # M is the base step's own peak
    assert float(big[2]) > float(base[2]), big  # the larger batch's plain peak is over M ...
    assert big[4] == "yes" and int(big[5]) > 0 and float(big[7]) > 0, big  # ... and it fits by evicting
    assert all(len(r[6].split(" / ")) == 2 for r in rows), rows  # segments made / given back
    assert "Reach: dtralloc 3.00x B; msps 3.00x B\n" in text
    assert sorted(os.listdir(traces)) == ["resnet50-b24.dtrace", "resnet50-b8.dtrace"]


def test_gpt2_attention_dropout_is_switched_off_in_both_layouts():
    import torch

    from bench_gpu_budget import Model, _gpt2_torch

    m = Model("gpt2", True, torch.device("cpu"))
    assert pr.attention_dropout_off(m.model) == 2  # transformers' GPT2Attention.attn_dropout, two layers
    assert all(mod.attn_dropout.p == 0.0 for mod in m.model.modules() if hasattr(mod, "attn_dropout"))
    model, blocks = _gpt2_torch(2, 32, 4, 64, 16, 1)
    assert pr.attention_dropout_off(model) == 2 and all(b.attn_dropout == 0.0 for b in blocks)


def test_reach_stops_at_the_first_batch_that_does_not_fit():
    rows = [{"policy": "p", "recording": 0, "batch": b, "multiple": b / 2, "fits": fits}
            for b, fits in ((2, True), (4, True), (5, False), (6, True))]
    other = [dict(r, recording=1, fits=True) for r in rows]
    assert pr.reach({"rows": rows + other}, "p") == 2.0
    assert pr.reach({"rows": rows + other}, "p", recording=1) == 3.0
    assert pr.reach({"rows": rows[2:3]}, "p") is None
    assert pr.batches_for(2, (1, 2.5, 3, 3.2)) == [2, 5, 6]


@pytest.mark.parametrize("args, error", [(["--base", "gpt2=0"], "MODEL=N"),
                                         (["--base", "bert=4"], "MODEL=N"),
                                         (["--policies", "none"], "not an evicting policy"),
                                         (["--multiples", "-1"], "--multiples must be positive"),
                                         (["--gpt2-loss-chunks", "0"], "at least 1"),
                                         (["--recordings", "0"], "--recordings must be at least 1"),
                                         (["--confs", "arena:maybe"], "--confs 'arena:maybe'"),
                                         (["--confs", "budget:1G"], "the budget is M"),
                                         (["--traces", "/nonexistent"], "is not a directory")])
def test_bad_arguments_are_refused(args, error, capsys):
    with pytest.raises(SystemExit) as e:
        pr.main(["--smoke"] + args)
    assert error in str(e.value) + capsys.readouterr().err


def test_a_batch_that_cannot_be_recorded_ends_the_ladder_and_is_reported(tmp_path, monkeypatch):
    import torch

    import dtralloc.trace

    real = dtralloc.trace.record
    tried = []

    def record(fn, name=None, **kwargs):  # the device's memory runs out at batch 16, as a GPU's would
        tried.append(name)
        if name.endswith("-b16"):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(fn, name=name, **kwargs)

    monkeypatch.setattr(dtralloc.trace, "record", record)
    out = tmp_path / "reach.md"
    assert pr.main(["--smoke", "--models", "resnet50", "--multiples", "1", "2", "3", "--policies", "dtralloc",
                    "--out", str(out)]) == 0
    assert tried == ["resnet50-b8", "resnet50-b16"]  # nothing larger is tried after the first refusal
    text = out.read_text()
    assert [r[0] for r in _rows(text, "resnet50")] == ["8"]
    assert "- batch 16: out of memory while recording: CUDA out of memory. Tried to allocate 2.00 GiB" in text
    assert "- batch 24: not tried: a smaller batch ran out of memory" in text

    tried.clear()
    monkeypatch.setattr(dtralloc.trace, "record", lambda fn, name=None, **kw: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory.")))
    with pytest.raises(SystemExit, match="at the base batch 8 could not be recorded .*--base resnet50=N"):
        pr.main(["--smoke", "--models", "resnet50", "--multiples", "1", "2"])


def test_several_recordings_are_replayed_each_and_summed_up(tmp_path):
    out = tmp_path / "reach.md"
    traces = tmp_path / "traces"
    assert pr.main(["--smoke", "--models", "resnet50", "--multiples", "1", "3", "--policies", "dtralloc",
                    "--recordings", "2", "--save-traces", str(traces), "--out", str(out)]) == 0
    text = out.read_text()
    assert "recorded on cpu (wall clock), 2 recordings" in text
    assert "Reach: dtralloc 3.00x B, 3.00x B (one per recording)" in text
    rows = _rows(text, "resnet50")
    assert [r[0] for r in rows] == ["8", "24"] and all(r[4] == "yes" for r in rows), rows
    assert rows[0][5] == "0" and rows[0][7] == "0.000"  # no spread where both recordings agree
    assert sorted(os.listdir(traces)) == ["resnet50-b24-r1.dtrace", "resnet50-b24-r2.dtrace",
                                          "resnet50-b8-r1.dtrace", "resnet50-b8-r2.dtrace"]
    assert pr._spread([0.2, 0.1, 0.4], "{:.3f}") == "0.200 (0.100-0.400)"
    assert pr._spread([3, 3], "{:.0f}") == "3"


def test_saved_steps_replay_as_recorded_and_side_by_side_on_other_settings(tmp_path):
    traces = tmp_path / "traces"
    first = tmp_path / "first.md"
    assert pr.main(["--smoke", "--models", "resnet50", "--multiples", "1", "3", "--policies", "dtralloc",
                    "--save-traces", str(traces), "--out", str(first)]) == 0
    again = tmp_path / "again.md"
    assert pr.main(["--traces", str(traces), "--models", "resnet50", "--policies", "dtralloc",
                    "--confs", "", "arena:on", "--out", str(again)]) == 0
    text = again.read_text()
    assert f"steps saved in {traces}, replayed here" in text
    assert "resnet50-b8 and its other batches, recorded " in text and "on cpu under torch" in text
    rows = _rows(text, "resnet50")
    assert [(r[0], r[3]) for r in rows] == [("8", "defaults"), ("8", "arena:on"), ("24", "defaults"),
                                           ("24", "arena:on")]
    # The defaults' rows are the recording run's, replayed from the files.
    recorded = _rows(first.read_text(), "resnet50")
    assert [r[:3] + r[4:] for r in rows if r[3] == "defaults"] == recorded
    assert "Reach: dtralloc [defaults] 3.00x B; dtralloc [arena:on] " in text
    with pytest.raises(SystemExit, match="no saved step at that batch"):
        pr.main(["--traces", str(traces), "--base", "resnet50=16"])
    with pytest.raises(SystemExit, match="no saved steps in"):
        pr.main(["--traces", str(tmp_path)])


def test_a_batch_refused_in_a_later_round_leaves_every_round_with_the_same_batches(tmp_path, monkeypatch):
    import torch

    import dtralloc.trace

    real = dtralloc.trace.record

    def record(fn, name=None, **kwargs):  # batch 16 fits the device in the first round only
        if name == "resnet50-b16-r2":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(fn, name=name, **kwargs)

    monkeypatch.setattr(dtralloc.trace, "record", record)
    out = tmp_path / "reach.md"
    assert pr.main(["--smoke", "--models", "resnet50", "--multiples", "1", "2", "3", "--policies", "dtralloc",
                    "--recordings", "2", "--out", str(out)]) == 0
    text = out.read_text()
    assert "2 recordings" in text
    assert [r[0] for r in _rows(text, "resnet50")] == ["8"]  # 16 and 24 were recorded once: dropped
    assert "- batch 16: out of memory while recording" in text
    assert "- batch 24: not tried: a smaller batch ran out of memory" in text


def test_full_size_steps_at_three_times_b_on_three_pool_settings(tmp_path):
    """The committed full-size steps (bench/recordings/full-cpu-2026-11-30),
    replayed: at 3x B the default pool gives segments back, some where
    nothing was evicted (the ladder remaking segments of another size);
    max_split_size_mb:none gives back fewer; the arena none."""
    import re

    out = tmp_path / "reach.md"
    assert pr.main(["--traces", os.path.join(ROOT, "bench", "recordings", "full-cpu-2026-11-30"),
                    "--policies", "dtralloc", "--confs", "", "max_split_size_mb:none", "arena:on",
                    "--out", str(out)]) == 0
    text = out.read_text()
    for model in ("resnet50", "gpt2, loss in 8 pieces"):
        rows = {r[3]: r for r in _rows(text, model) if r[1] == "3.00"}
        assert set(rows) == {"defaults", "max_split_size_mb:none", "arena:on"}, rows
        assert all(r[5] == "yes" for r in rows.values()), rows

        def frees(cell):  # the median of the cudaFree column
            return int(re.match(r"\d+(?: \([\d-]+\))? / (\d+)", cell).group(1))

        default = rows["defaults"][7]
        quiet = int(re.search(r"\((\d+)(?: \([\d-]+\))? where nothing was evicted\)", default).group(1))
        assert 0 < quiet < frees(default), default
        assert frees(rows["max_split_size_mb:none"][7]) < frees(default)
        assert rows["arena:on"][7] == "0 / 0"
