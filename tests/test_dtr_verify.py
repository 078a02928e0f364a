"""Session.verify(): a step in a session against the same step run plainly,
from the same state, bit for bit (python/dtralloc/dtr/verify.py)."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import dtralloc
from dtralloc.dtr import VerifyResult, dtr

pytestmark = pytest.mark.usefixtures("one_thread")


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(8, 16)
    return model, opt, x


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
             for k, s in opt.state.items()},
            torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())


def _same_snapshot(a, b):
    params_a, grads_a, state_a, rng_a, np_a, py_a = a
    params_b, grads_b, state_b, rng_b, np_b, py_b = b
    assert all(torch.equal(x, y) for x, y in zip(params_a, params_b))
    assert all((x is None and y is None) or torch.equal(x, y) for x, y in zip(grads_a, grads_b))
    assert len(state_a) == len(state_b)
    for sa, sb in zip(state_a.values(), state_b.values()):
        assert all(torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k] for k in sa)
    assert torch.equal(rng_a, rng_b) and np.array_equal(np_a, np_b) and py_a == py_b


def test_a_training_step_is_bit_exact_under_chaos_and_the_state_is_put_back():
    model, opt, x = _setup()
    # One step first, so the optimizer has state and the parameters gradients.
    model(x).pow(2).mean().backward()
    opt.step()
    calls = []

    def step():
        calls.append(np.random.rand() + random.random())  # draws the step makes outside torch
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return {"loss": loss, "scale": 2.0}

    before = _snapshot(model, opt)
    session = dtr(device="cpu", chaos=True)
    result = session.verify(step, model, opt)
    assert isinstance(result, VerifyResult)
    assert result and result.exact and result.deterministic is True
    assert not result.differences and not result.nondeterminism
    # The loss, the scalar, 6 parameters and 6 gradients, AdamW's three
    # tensors per parameter, and the three generators at least.
    assert result.compared >= 2 + 12 + 18 + 3
    assert result.stats["evictions"] > 0 and result.stats["remats"] > 0 and result.stats["rng_replays"] > 0
    assert result.stats == session.stats()
    assert str(result).startswith(f"bit-exact: {result.compared:,} values equal to the plain run's")
    _same_snapshot(before, _snapshot(model, opt))
    assert len(calls) == 3 and calls[0] == calls[1] == calls[2]  # each run from the same generators


def test_the_forward_alone_in_the_session_with_pass_session():
    model, opt, x = _setup()
    contexts = []

    def step(ctx):
        contexts.append(ctx)
        opt.zero_grad()
        with ctx:
            loss = model(x).pow(2).mean()
        loss.backward()  # after the block: recomputes what chaos evicted
        opt.step()
        return loss

    session = dtr(device="cpu", chaos=True)
    result = session.verify(step, model, opt, pass_session=True)
    assert result, str(result)
    assert contexts[2] is session and all(c is not session for c in contexts[:2])
    assert result.stats["remats"] > 0


def test_a_difference_is_found_and_named():
    # Under any dispatch mode torch's derivative of prod takes its
    # tensor-subclass branch, which rounds differently from plain eager
    # (docs/live.md, Known limits): a real difference for verify() to find.
    torch.manual_seed(0)
    w = torch.randn(6, 7, requires_grad=True)

    def step():
        loss = torch.tanh(w).prod(dim=1).sum()
        loss.backward()
        return loss

    result = dtr(device="cpu", chaos=True).verify(step, w)
    assert not result and not result.exact and result.deterministic is True
    assert len(result.differences) == 1
    assert result.differences[0].startswith("Tensor's gradient: ")
    assert "elements differ (largest difference" in result.differences[0]
    text = str(result)
    assert text.startswith("NOT bit-exact: 1 of ") and "Tensor's gradient" in text
    # A dispatch mode that only calls each op computes what the session did:
    # torch's doing, said so.
    assert result.same_as_any_mode is True
    assert "under any dispatch mode" in text and "Please report" not in text
    assert w.grad is None  # put back as it was


def test_a_difference_of_the_sessions_own_is_told_apart_from_torchs():
    # A step that computes otherwise inside a session (and only there): what
    # a bug of the session would look like to verify().
    from dtralloc.dtr import session as session_module

    w = torch.randn(5, requires_grad=True)

    def step():
        scale = 2.0 if getattr(session_module._active, "session", None) is not None else 1.0
        loss = (torch.tanh(w) * scale).sum()
        loss.backward()
        return loss

    result = dtr(device="cpu", chaos=True).verify(step, w)
    assert not result and result.same_as_any_mode is False
    assert "the difference is the session's" in str(result) and "Please report" in str(result)


def test_a_step_that_is_not_deterministic_by_itself_is_not_blamed_on_the_session():
    model, opt, x = _setup()
    runs = []

    def step():
        runs.append(1)
        return model(x).sum() + len(runs)

    result = dtr(device="cpu", chaos=True).verify(step, model)
    assert not result and result.deterministic is False
    assert result.nondeterminism == ["the step's return value: 1 of 1 elements differ (largest difference 1)"]
    assert "not deterministic by itself" in str(result) and "torch.set_num_threads(1)" in str(result)
    # Without the control run the step's own noise reads as a difference,
    # and the run under a dispatch mode alone differs from both.
    unchecked = dtr(device="cpu", chaos=True).verify(step, model, control=False)
    assert unchecked.deterministic is None and len(runs) == 6
    assert unchecked.same_as_any_mode is False
    assert unchecked.differences == ["the step's return value: 1 of 1 elements differ (largest difference 1)"]


def test_nothing_evicted_says_so():
    model, opt, x = _setup()

    def step():
        loss = model(x).sum()
        loss.backward()
        return loss

    result = dtr(device="cpu").verify(step, model)
    assert result and result.stats["evictions"] == 0
    assert "nothing was evicted" in str(result) and "chaos=True" in str(result)


def test_nan_where_nan_is_equal_and_other_values_are_compared():
    x = torch.tensor([1.0, float("nan"), 3.0], requires_grad=True)

    def step():
        y = (x * 2).tanh().exp()  # tanh's output is saved, evicted, and recomputed with its NaN
        y.sum().backward()
        return y, float("nan"), [1, "text", None], (y > 2)

    result = dtr(device="cpu", chaos=True).verify(step, x)
    assert result, str(result)
    assert result.stats["remats"] > 0
    # The return value's six leaves, the tensor and its gradient, three generators.
    assert result.compared == 6 + 2 + 3


def test_an_error_in_the_session_run_propagates_with_the_state_put_back():
    model, opt, x = _setup()
    before = _snapshot(model, opt)

    def step():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    with pytest.raises(dtralloc.OutOfMemoryError):
        dtr(device="cpu", budget=1).verify(step, model, opt)
    _same_snapshot(before, _snapshot(model, opt))


def test_misuse_is_refused_with_the_reason():
    model, opt, x = _setup()
    with pytest.raises(TypeError, match=r"verify\(\) takes the step's state as modules, optimizers .* argument 2 "
                                        r"is a list"):
        dtr(device="cpu").verify(lambda: model(x).sum(), model, [1, 2])
    with pytest.raises(TypeError, match=r"the step to run first \(a callable\)"):
        dtr(device="cpu").verify(model(x), model)
    session = dtr(device="cpu")
    with session:
        pass
    with pytest.raises(RuntimeError, match="already entered; make a new one"):
        session.verify(lambda: model(x).sum(), model)


def test_a_scheduler_and_the_optimizer_are_state_too():
    model, opt, x = _setup()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        scheduler.step()
        return loss

    result = dtr(device="cpu", chaos=True).verify(step, model, opt, scheduler)
    assert result, str(result)
    assert scheduler.last_epoch == 0 and opt.param_groups[0]["lr"] == 1e-2  # put back
    assert not opt.state


# torch warns once a process at its first strided nested tensor: in a run of
# this file alone, here.
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_returned_objects_other_than_tensors_and_plain_values():
    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        note: str

    class Opaque:  # its repr holds its address, which differs from run to run
        pass

    w = torch.randn(4, 4, requires_grad=True)

    def step():
        loss = torch.tanh(w).sum()
        loss.backward()
        return Out(loss, "ok"), Opaque(), torch.nested.nested_tensor([torch.tanh(w)[0].detach(), w[1, :2].detach()])

    result = dtr(device="cpu", chaos=True).verify(step, w)
    assert result, str(result)
    assert result.unchecked == ["the step's return value[1] (a Opaque)"]
    assert result.compared == 2 + 1 + 2 + 3  # the dataclass's fields, the nested tensor, w and its gradient, generators
    assert "not compared: the step's return value[1] (a Opaque)" in str(result)


def test_a_run_that_leaves_other_values_is_named():
    from dtralloc.dtr import session as session_module

    w = torch.randn(3, requires_grad=True)

    def step():
        loss = torch.tanh(w).sum()
        loss.backward()
        if getattr(session_module._active, "session", None) is not None:
            return loss, loss * 2  # one more value, in the session only
        return (loss,)

    result = dtr(device="cpu", chaos=True).verify(step, w)
    assert not result and result.same_as_any_mode is None
    assert result.differences == ["the runs left different things to compare (the step returned or made other "
                                  "values): the step's return value[1]"]
