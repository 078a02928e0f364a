"""transformers architectures outside the zoo (tests/_hf_models.py says what
each brings) train bit-exactly under dtr(chaos=True): one AdamW step (after a
first one outside the session, so optimizer state exists), with the whole
step in the block and with the forward alone in it, checked with
Session.verify() against the same step run plainly (twice, so that a model
that is not deterministic by itself is not blamed on the session): the
model's output, parameters, gradients, buffers, optimizer state and the
generators."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from dtralloc.dtr import dtr

pytest.importorskip("transformers")

from _hf_models import MODELS  # noqa: E402  (needs transformers)

_seeds = iter(())


def _seed():
    """torch.seed() made reproducible: Reformer's layers draw the seed of
    their dropout with it at each forward (and reseed the global generator
    with it, as torch.seed does), which differs from run to run by design.
    The n-th draw of a step gets the same seed in every run of it."""
    seed = next(_seeds)
    torch.manual_seed(seed)
    return seed


def _reproducible_seeds():
    global _seeds
    _seeds = iter(range(1000, 2000))


@pytest.fixture(autouse=True)
def _torch_seed(monkeypatch):
    monkeypatch.setattr(torch, "seed", _seed)


@pytest.mark.parametrize("where", ["step", "forward"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers_model_is_bit_exact_under_chaos(name, where, one_thread):
    torch.manual_seed(0)
    np.random.seed(0)  # wav2vec2's time masking draws its spans from numpy
    model, batch = MODELS[name]()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7)
    first, second = batch(g), batch(g)

    def step(ctx, inputs=second):
        _reproducible_seeds()
        optimizer.zero_grad(set_to_none=True)
        with ctx:
            out = model(**inputs)
            if where == "step":
                out.loss.backward()
        if where == "forward":  # the backward after the block (docs/live.md, "The forward alone in the block")
            out.loss.backward()
        optimizer.step()
        return out

    step(contextlib.nullcontext(), first)  # plainly: the optimizer has state from here on
    result = dtr(device="cpu", chaos=True).verify(step, model, optimizer, pass_session=True)
    assert result.deterministic, str(result)
    assert result, str(result)
    assert result.compared > 3 * len(list(model.parameters()))
    stats = result.stats
    assert stats["evictions"] > 0 and stats["remats"] > 0
    if name != "mamba":  # every other model here has dropout, replayed from its RNG state
        assert stats["rng_replays"] > 0
