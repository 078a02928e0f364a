"""The model zoo (dtralloc.zoo) and the traces bundled from it (dtralloc.traces).

Every zoo model is built at its tiny size and one step is recorded, as
bench/record_zoo.py does at full size; every bundled trace must load, be
self-consistent and stay small enough to commit.
"""
from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

import dtralloc  # noqa: E402
import dtralloc.trace  # noqa: E402
from dtralloc import traces  # noqa: E402
from dtralloc import zoo  # noqa: E402
from dtralloc.zoo import COMPACT_SIZES, MODELS, NEEDS_TRANSFORMERS, SMALL_SIZES  # noqa: E402

ZOO = ["gpt2", "bert", "llama", "resnet50", "unet", "mlp", "lstm", "vit", "encdec", "convbn", "moe"]
COMPACT = ["lstm", "vit", "encdec", "convbn", "moe"]
# Llama's config has none; the CNNs have none
WITH_DROPOUT = {"gpt2", "bert", "mlp", "lstm", "vit", "encdec", "moe"}
WITH_BATCHNORM = {"resnet50", "unet", "convbn"}
BUNDLED = sorted(ZOO + [name + "-compact" for name in COMPACT])
MAX_TRACE_BYTES = 100 * 1024             # small enough to commit (the largest is ~30 KB)
try:
    import transformers  # noqa: F401  (lazy: cheap until a model class is used)
    HAVE_TRANSFORMERS = True
except ImportError:
    HAVE_TRANSFORMERS = False


def _needs(name: str):
    if name in NEEDS_TRANSFORMERS and not HAVE_TRANSFORMERS:
        pytest.skip(f"{name} is built from a transformers config; pip install transformers")


def _is_inplace(op_name: str) -> bool:
    base = op_name.split("::", 1)[1].split(".", 1)[0]  # "aten::add_.Tensor" -> "add_"
    return base.endswith("_") and not base.endswith("__")


@pytest.fixture(scope="module")
def small_traces():
    """name -> (workload, trace) for one recorded step after a warm-up step."""
    cache = {}

    def get(name):
        if name not in cache:
            _needs(name)
            workload = MODELS[name](**SMALL_SIZES[name])
            workload.step()  # optimizer state exists from here on
            cache[name] = workload, dtralloc.trace.record(workload.step, name=name)
        return cache[name]

    return get


def test_registry_has_every_model():
    assert sorted(MODELS) == sorted(ZOO)
    assert sorted(SMALL_SIZES) == sorted(ZOO)
    assert sorted(COMPACT_SIZES) == sorted(COMPACT)
    assert not NEEDS_TRANSFORMERS & set(COMPACT), "the compact models run without the zoo extra"
    with pytest.raises(ValueError, match="unknown zoo model 'gpt3'; available: gpt2, bert"):
        zoo.build("gpt3")


def test_scales_are_named_and_exclusive():
    assert zoo.scale_sizes("vit") == {}
    assert zoo.scale_sizes("vit", compact=True) == COMPACT_SIZES["vit"]
    assert zoo.scale_sizes("vit", small=True) == SMALL_SIZES["vit"]
    with pytest.raises(ValueError, match="choose one scale"):
        zoo.build("vit", small=True, compact=True)
    with pytest.raises(ValueError, match="'gpt2' has no compact size; models with one: lstm, vit"):
        zoo.build("gpt2", compact=True)


def test_compact_recording_is_named_for_its_scale():
    trace = zoo.record_model("convbn", compact=True, sizes={"batch": 1, "image": 32})
    assert trace.meta["name"] == "convbn-compact"
    assert trace.meta["sizes"] == {**zoo.effective_sizes("convbn", {}), **COMPACT_SIZES["convbn"],
                                   "batch": 1, "image": 32}


def test_moe_routes_a_data_dependent_number_of_tokens():
    # Each expert gets the tokens the router sends it: nonzero's output, and
    # so the gathered batch and every expert tensor, changes size with the data.
    sizes = {}
    for seed in (0, 1):
        workload = zoo.build("moe", small=True, seed=seed)
        workload.step()
        trace = dtralloc.trace.record(workload.step, name="moe")
        nonzero = [op for op in trace.ops if op.name.startswith("aten::nonzero")]
        assert len(nonzero) >= 2 * SMALL_SIZES["moe"]["experts"], "one per expert and block"
        assert any(op.name.startswith("aten::index_add") for op in trace.ops), "results scattered back"
        sizes[seed] = [trace.storages[op.created[0]].nbytes for op in nonzero]
    assert sizes[0] != sizes[1], "another batch routes differently"


def test_without_transformers_its_models_name_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    for name in sorted(NEEDS_TRANSFORMERS):
        with pytest.raises(ImportError, match=rf'the {name} zoo model .* pip install "dtralloc\[zoo\]"'):
            zoo.build(name, small=True)
    assert zoo.build("mlp", small=True).description  # the others need only torch
    from dtralloc.cli import main

    with pytest.raises(SystemExit, match=r'^error: the gpt2 zoo model .*"dtralloc\[zoo\]"'):
        main(["record", "gpt2", "--small", "-o", str(tmp_path / "gpt2.dtrace")])
    assert not (tmp_path / "gpt2.dtrace").exists()


def test_record_model_warms_up_and_describes_the_step():
    messages = []
    trace = zoo.record_model("mlp", small=True, sizes={"batch": 4}, echo=messages.append)
    trace.validate()
    assert trace.meta["name"] == "mlp" and trace.meta["description"].startswith("MLP")
    assert trace.meta["sizes"] == {**zoo.effective_sizes("mlp", {}), **SMALL_SIZES["mlp"], "batch": 4}
    assert "warm-up step done" in messages
    # After the warm-up, Adam's moments exist before the recorded step: initial storages.
    params = sum(1 for s in trace.storages if s.initial and s.outlives)
    cold = zoo.record_model("mlp", small=True, warmup=False)
    assert params > sum(1 for s in cold.storages if s.initial and s.outlives)


@pytest.mark.parametrize("name", ZOO)
def test_small_step_records_a_valid_trace(name, small_traces):
    workload, trace = small_traces(name)
    trace.validate()
    assert workload.description
    backward = [op for op in trace.ops if op.backward]
    assert backward and len(backward) < len(trace.ops), "forward and backward ops both appear"
    assert trace.peak_live_bytes() > sum(s.nbytes for s in trace.storages if s.initial)


@pytest.mark.parametrize("name", ZOO)
def test_small_step_survives_a_save_and_load(name, small_traces, tmp_path):
    _, trace = small_traces(name)
    path = tmp_path / f"{name}.dtrace"
    trace.save(str(path))
    again = dtralloc.trace.load(str(path))
    again.validate()
    assert [o.name for o in again.ops] == [o.name for o in trace.ops]
    assert again.peak_live_bytes() == trace.peak_live_bytes()


@pytest.mark.parametrize("name", sorted(WITH_DROPOUT))
def test_dropout_shows_as_random_ops(name, small_traces):
    _, trace = small_traces(name)
    random = [op for op in trace.ops if op.random]
    assert random, "dropout draws random numbers"
    assert any(op.name.startswith("aten::bernoulli") or "dropout" in op.name for op in random)


@pytest.mark.parametrize("name", ZOO)
def test_optimizer_updates_every_parameter_in_place(name, small_traces):
    workload, trace = small_traces(name)
    for op in trace.ops:
        if _is_inplace(op.name):
            assert op.mutated, f"{op.name} writes in place but names no mutated storage"
    last_backward = max(i for i, op in enumerate(trace.ops) if op.backward)
    written = {sid for op in trace.ops[last_backward + 1:] for sid in op.mutated}
    persistent = {i for i, s in enumerate(trace.storages) if s.initial and s.outlives}
    params = {p.untyped_storage()._cdata for p in workload.model.parameters()}
    # Each parameter and at least one optimizer-state tensor per parameter are
    # written in place after backward, and all of them outlive the step.
    assert len(written & persistent) >= 2 * len(params)


@pytest.mark.parametrize("name", sorted(WITH_BATCHNORM))
def test_batchnorm_running_stats_are_marked_mutated(name, small_traces):
    # aten::native_batch_norm's schema does not declare its running-stat writes.
    _, trace = small_traces(name)
    bn = [op for op in trace.ops if "batch_norm" in op.name and not op.backward]
    assert bn
    for op in bn:
        assert len(op.mutated) == 2, f"{op.name}: running_mean and running_var are written"
        assert all(trace.storages[sid].initial and trace.storages[sid].outlives for sid in op.mutated)


# -- bundled traces ---------------------------------------------------------------

def test_list_bundled_names_every_model_and_scale():
    assert traces.list_bundled() == BUNDLED


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_trace_loads_and_validates(name):
    path = traces.bundled_path(name)
    assert os.path.getsize(path) <= MAX_TRACE_BYTES
    trace = traces.load_bundled(name)
    trace.validate()
    assert trace.meta["name"] == name
    assert trace.meta["description"]
    assert any(op.backward for op in trace.ops)
    model = name.removesuffix("-compact")
    if model in WITH_DROPOUT:
        assert any(op.random for op in trace.ops)
    # Recorded by the current recorder: in-place writes, declared or not, are marked.
    assert all(op.mutated for op in trace.ops if _is_inplace(op.name))
    if model in WITH_BATCHNORM:
        assert all(op.mutated for op in trace.ops if op.name == "aten::native_batch_norm")


@pytest.mark.parametrize("name", COMPACT)
def test_bundled_scales(name):
    # GPU scale: 0.8-4 GiB a step; compact: 70-150 MiB (the no-eviction peak reserved).
    gib = dtralloc.replay(traces.load_bundled(name)).peak_reserved_bytes / 2**30
    mib = dtralloc.replay(traces.load_bundled(name + "-compact")).peak_reserved_bytes / 2**20
    assert 0.8 <= gib <= 4 and 70 <= mib <= 150, (gib, mib)


def test_unknown_bundled_name_lists_the_choices():
    with pytest.raises(ValueError, match="available: bert, convbn, convbn-compact, encdec"):
        traces.bundled_path("gpt3")
    with pytest.raises(ValueError, match="no bundled trace"):
        traces.load_bundled("../traces/gpt2")


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_chunked_lm_loss_is_transformers_causal_lm_loss(chunks):
    """The bench's GPT-2 loss in pieces (bench_gpu_budget --gpt2-loss-chunks)
    computes transformers' own causal-LM loss: same value and gradients, up
    to the order of float sums (uneven pieces too: 2 x 31 tokens in 8)."""
    pytest.importorskip("transformers")
    from dtralloc.zoo.workload import causal_lm_loss, chunked_causal_lm_loss

    w = zoo.build("gpt2", **{**SMALL_SIZES["gpt2"], "seq": 32})
    w.model.eval()  # no dropout: the two runs must see the same function
    tokens = w.batch[0]
    grads = []
    for fn in (lambda: causal_lm_loss(w.model, tokens), lambda: chunked_causal_lm_loss(w.model, tokens, chunks)):
        w.model.zero_grad(set_to_none=True)
        loss = fn()
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in w.model.parameters()]))
    (ref, ref_grads), (got, got_grads) = grads
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_chunked_lm_loss_pieces_are_evicted_and_brought_back_one_at_a_time():
    """Under a dtr budget the pieces' log-softmaxes are values of their own:
    evicted in the forward, recomputed in the backward, and the result is
    the plain run's bit for bit."""
    from dtralloc.zoo.workload import chunked_lm_loss

    torch.manual_seed(0)
    vocab, dim = 16384, 16
    hidden = torch.randn(4, 65, dim, requires_grad=True)
    weight = torch.randn(vocab, dim, requires_grad=True)
    tokens = torch.randint(0, vocab, (4, 65))

    def run(chunks=8, **session):
        hidden.grad = weight.grad = None
        with dtralloc.dtr(device="cpu", **session) as s:
            loss = chunked_lm_loss(hidden * 1, weight, None, tokens, chunks)
            loss.backward()
        return loss.detach(), hidden.grad.clone(), weight.grad.clone(), s.stats()

    *plain, free = run()
    # One piece's logits are 32 x 16384 floats (2 MiB); all of them 16 MiB,
    # and unchunked the log-softmax's backward holds three such.
    budget = free["peak_bytes"] // 2
    *tight, budgeted = run(budget=budget)
    assert budgeted["evictions"] > 0 and budgeted["remats"] > 0
    assert budgeted["peak_bytes"] <= budget
    for a, b in zip(tight, plain):
        assert torch.equal(a, b)
    with pytest.raises(dtralloc.OutOfMemoryError):
        run(chunks=1, budget=budget)
    with pytest.raises(ValueError, match="chunks is a number of pieces >= 1"):
        chunked_lm_loss(hidden, weight, None, tokens, 0)
