"""transformers architectures outside the zoo (tests/_hf_models.py says what
each brings) train bit-exactly under dtr(chaos=True): one AdamW step (after a
first one outside the session, so optimizer state exists), with the whole
step in the block and with the forward alone in it, compared with the same
step run plainly: parameters, buffers, optimizer state, the loss and the
global RNG state."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from dtralloc.dtr import dtr

pytest.importorskip("transformers")

from _hf_models import MODELS  # noqa: E402  (needs transformers)


def _train(name, session=None, forward_alone=False):
    """Two AdamW steps, the second inside `session` where one is given
    (around its forward alone, the backward after the block, where
    `forward_alone`: docs/live.md, "The forward alone in the block").
    Returns the second step's loss, then every parameter, buffer and
    optimizer state tensor after it, and the global RNG state."""
    _reproducible_seeds()
    torch.manual_seed(0)
    model, batch = MODELS[name]()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(7)
    loss = None
    for step in range(2):
        inputs = batch(g)
        torch.manual_seed(1 + step)
        np.random.seed(step)  # wav2vec2's time masking draws its spans from numpy
        optimizer.zero_grad(set_to_none=True)
        if step == 1 and session is not None:
            with session:
                loss = model(**inputs).loss
                if not forward_alone:
                    loss.backward()
            if forward_alone:
                loss.backward()
        else:
            loss = model(**inputs).loss
            loss.backward()
        optimizer.step()
    state = [loss.detach().clone()] + [p.detach().clone() for p in model.parameters()]
    state += [b.clone() for b in model.buffers()]
    for per_param in optimizer.state.values():
        state += [v.clone() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return state, torch.get_rng_state()


_seeds = iter(())


def _seed():
    """torch.seed() made reproducible: Reformer's layers draw the seed of
    their dropout with it at each forward (and reseed the global generator
    with it, as torch.seed does), which differs from run to run by design.
    The n-th draw of a run gets the same seed in every run."""
    seed = next(_seeds)
    torch.manual_seed(seed)
    return seed


def _reproducible_seeds():
    global _seeds
    _seeds = iter(range(1000, 2000))


@pytest.fixture(autouse=True)
def _torch_seed(monkeypatch):
    monkeypatch.setattr(torch, "seed", _seed)


@pytest.fixture
def one_thread():
    """One intra-op thread: MKL promises the same bits from run to run only
    so (docs/live.md, Known limits)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("where", ["step", "forward"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_transformers_model_is_bit_exact_under_chaos(name, where, one_thread):
    want, want_rng = _train(name)
    session = dtr(device="cpu", chaos=True)
    got, got_rng = _train(name, session, forward_alone=where == "forward")
    assert len(got) == len(want)
    assert torch.equal(got[0], want[0]), f"{name}: loss {got[0].item()} != {want[0].item()}"
    for i, (a, b) in enumerate(zip(got[1:], want[1:])):
        assert torch.equal(a, b), f"{name}: tensor {i} of the model/optimizer state differs"
    assert torch.equal(got_rng, want_rng)
    stats = session.stats()
    assert stats["evictions"] > 0 and stats["remats"] > 0
    if name != "mamba":  # every other model here has dropout, replayed from its RNG state
        assert stats["rng_replays"] > 0
