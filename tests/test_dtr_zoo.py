"""Every zoo model at its small size trains bit-exactly under dtr(chaos=True):
one whole step (forward, backward, the foreach AdamW/SGD update), compared
with the same step run plainly: parameters, buffers, optimizer state, and the
global RNG state."""
from __future__ import annotations

import pytest
import torch

from dtralloc.dtr import dtr
from dtralloc.zoo import MODELS, build
from dtralloc.zoo.registry import NEEDS_TRANSFORMERS


def _state(w):
    tensors = [p.detach().clone() for p in w.model.parameters()] + [b.clone() for b in w.model.buffers()]
    for state in w.optimizer.state.values():
        tensors += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _one_step(name, session=None):
    torch.manual_seed(0)
    w = build(name, small=True)
    w.step()  # a first step outside, so optimizer state exists as in any later step
    torch.manual_seed(1)
    if session is None:
        w.step()
    else:
        with session:
            w.step()
    return _state(w), torch.get_rng_state()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zoo_model_is_bit_exact_under_chaos(name):
    if name in NEEDS_TRANSFORMERS:
        pytest.importorskip("transformers")
    want, want_rng = _one_step(name)
    session = dtr(device="cpu", chaos=True)
    got, got_rng = _one_step(name, session)
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"{name}: tensor {i} of the model/optimizer state differs"
    assert torch.equal(got_rng, want_rng)
    stats = session.stats()
    assert stats["evictions"] > 0 and stats["remats"] > 0
