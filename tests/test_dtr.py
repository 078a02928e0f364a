"""Live DTR on eager PyTorch (dtralloc.dtr), on CPU tensors with the virtual
mirror pool: bit-exact training under chaos and under budgets, invariants after
every op, OOM and recovery, backward after the block, a 1,000-layer chain,
misuse errors as in plain eager, no leaks."""
from __future__ import annotations

import contextlib
import copy
import gc
import re
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import dtralloc
from dtralloc import _core
from dtralloc.dtr import dtr

from _amp_steps import scaled_steps
from _live_models import NAMES, build

MiB = 1 << 20


def train(model, loss_fn, steps, session=None, sessions=None):
    """`steps` AdamW steps; each forward+backward inside a fresh `session()`
    when given. Returns (losses, parameters, buffers)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        if session is None:
            loss = loss_fn(model)
            loss.backward()
        else:
            with session() as s:
                loss = loss_fn(model)
                loss.backward()
            if sessions is not None:
                sessions.append(s)
        losses.append(loss.detach())
        opt.step()
    return losses, [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


def assert_identical(got, want):
    for kind, a_list, b_list in zip(("loss", "parameter", "buffer"), got, want):
        assert len(a_list) == len(b_list)
        for i, (a, b) in enumerate(zip(a_list, b_list)):
            assert torch.equal(a, b), f"{kind} {i} differs"


# Batch scale for budget sweeps: activations of 1 MiB or more (large-pool
# blocks, where eviction windows form) and peaks of 26-64 MiB, well above the
# pool's 2 MiB granularity.
SWEEP_BATCH = {"mlp_inplace_dropout": 32, "transformer_sdpa_dropout": 64, "convnet_batchnorm": 64, "lstm": 256}


def run_plain_and_live(name, steps, batch=1, **session_kwargs):
    model, loss_fn = build(name, batch)
    init = copy.deepcopy(model.state_dict())
    torch.manual_seed(7)
    want = train(model, loss_fn, steps)
    want_rng = torch.get_rng_state()
    model.load_state_dict(init)
    torch.manual_seed(7)
    sessions = []
    got = train(model, loss_fn, steps, lambda: dtr(device="cpu", **session_kwargs), sessions)
    assert_identical(got, want)
    assert torch.equal(torch.get_rng_state(), want_rng), "the global RNG state differs after the steps"
    return sessions


@pytest.mark.parametrize("name", NAMES)
def test_chaos_is_bit_exact(name):
    sessions = run_plain_and_live(name, steps=2, chaos=True, check_invariants=True)
    stats = sessions[-1].stats()
    assert stats["evictions"] > 0 and stats["remats"] > 0
    if name in ("mlp_inplace_dropout", "transformer_sdpa_dropout"):
        assert stats["rng_replays"] > 0, "dropout was never recomputed"


def no_eviction_peak(name, batch):
    """The mirror pool's peak for one forward+backward with no budget, after a
    first one (kernels allocate more on their first call)."""
    model, loss_fn = build(name, batch)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with dtr(device="cpu") as s:
            loss_fn(model).backward()
    return s.stats()["peak_bytes"]


@pytest.mark.parametrize("name", NAMES)
def test_budget_sweep_with_invariants_after_every_op(name):
    peak = no_eviction_peak(name, SWEEP_BATCH[name])
    feasible = []
    for fraction in (0.75, 0.5, 0.35):
        budget = int(peak * fraction)
        try:
            sessions = run_plain_and_live(name, 1, SWEEP_BATCH[name], budget=budget, check_invariants=True)
        except dtralloc.OutOfMemoryError as e:
            assert "budget of" in str(e) and "To fit" in str(e)
            continue
        stats = sessions[-1].stats()
        assert stats["peak_bytes"] <= budget
        feasible.append((fraction, stats["evictions"]))
    assert feasible and feasible[0][0] == 0.75, f"{name}: 3/4 of its peak should fit"
    assert any(evictions > 0 for _, evictions in feasible), f"{name}: no budget forced an eviction"


def test_five_adamw_steps_under_a_budget_are_identical_to_plain():
    name = "transformer_sdpa_dropout"
    budget = no_eviction_peak(name, SWEEP_BATCH[name]) // 2
    sessions = run_plain_and_live(name, 5, SWEEP_BATCH[name], budget=budget)
    assert sum(x.stats()["evictions"] for x in sessions) > 0


def test_a_step_places_what_the_step_before_kept_at_the_high_end():
    # long_lived (docs/live.md, "What outlives the step"): each session notes
    # which of its ops' outputs were still alive when the block ended (the
    # gradients), and the next session on the device announces them to the
    # pool when the same op comes round again. Placement only: still bit-exact.
    name = "convnet_batchnorm"
    lstm_budget = no_eviction_peak("lstm", SWEEP_BATCH["lstm"])  # first: its session teaches lstm's
    budget = int(no_eviction_peak(name, SWEEP_BATCH[name]) * 0.75)
    sessions = run_plain_and_live(name, 3, SWEEP_BATCH[name], budget=budget, check_invariants=True)
    placed = [x.stats()["long_lived"] for x in sessions]
    # Every parameter's gradient and the loss (train() keeps it), nothing else.
    n_params = len(list(build(name)[0].parameters()))
    assert placed[1:] == [n_params + 1] * 2, placed
    # A step without a budget (one that measures the peak) places nothing,
    # and teaches the step after it, the first with a budget. (Another
    # model's step first: what the device knew before is not this one's.)
    other, other_loss = build("lstm", SWEEP_BATCH["lstm"])
    with dtr(budget=lstm_budget, device="cpu"):
        other_loss(other).backward()
    model, loss_fn = build(name, SWEEP_BATCH[name])
    with dtr(device="cpu") as free:
        loss_fn(model).backward()
    model.zero_grad(set_to_none=True)
    with dtr(budget=budget, device="cpu") as first:
        loss_fn(model).backward()
    assert (free.stats()["long_lived"], first.stats()["long_lived"]) == (0, n_params), placed
    # The device keeps the lifetimes of its last few kinds of step (Note
    # [recent steps], recent_steps.h): the lstm's, taught before convnet's
    # steps, still serve an lstm step after them.
    budget = lstm_budget
    model, loss_fn = build("lstm", SWEEP_BATCH["lstm"])
    with dtr(budget=budget, device="cpu") as s:
        loss_fn(model).backward()
    assert s.stats()["long_lived"] > 0  # learning from the step before alone: 0
    # A step whose ops match no kind's from its first on: nothing announced.
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Softsign(), nn.Linear(64, 64))
    x = torch.randn(4096, 64)
    with dtr(budget=budget, device="cpu") as s:
        fresh(x.cosh()).logsumexp(1).mean().backward()
    assert s.stats()["long_lived"] == 0
    # With backward after the block, what the block made is all still alive
    # when it ends (autograd holds it): such lifetimes are not used.
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with dtr(budget=budget, device="cpu") as s:
            loss = loss_fn(model)
        loss.backward()
        assert s.stats()["long_lived"] == 0
    # Policies other than dtralloc keep torch's placement (long_lived:auto).
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with dtr(budget=budget, device="cpu", policy="dtr") as s:
            loss_fn(model).backward()
        assert s.stats()["long_lived"] == 0


def test_a_session_too_long_to_be_a_step_teaches_no_lifetimes():
    # A session notes its first 2**17 recorded ops only; one that records
    # more (a whole loop in one block) teaches the next session nothing.
    b = torch.ones(256)

    def loop(n):
        with dtr(budget=1 << 40, device="cpu") as s:
            x = torch.zeros(256)
            for _ in range(n):
                x = x + b
            # What outlives the block: the last x, which fills the hole an x
            # before it left (no end to take: not counted), and y, which
            # splits such a hole and so takes its high end.
            y = x[:8].clone()
        return s, (x, y)

    short, kept = loop(8)
    again, kept = loop(8)
    assert again.stats()["long_lived"] == 1
    long_, kept = loop((1 << 17) + 8)
    after, kept = loop((1 << 17) + 8)
    assert after.stats()["long_lived"] == 0


def test_explicit_generator_is_replayed():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 64, requires_grad=True)

    def step():
        noise = torch.randn(64, 64, generator=gen)
        y = torch.nn.functional.dropout(x * noise, 0.5, generator=None) if False else x * noise
        mask = torch.rand(64, 64, generator=gen) > 0.5
        return (y * mask).tanh().sum()

    gen.manual_seed(3)
    x.grad = None
    step().backward()
    want, want_state = x.grad.clone(), gen.get_state()
    gen.manual_seed(3)
    x.grad = None
    with dtr(device="cpu", chaos=True) as s:
        step().backward()
    assert torch.equal(x.grad, want)
    assert torch.equal(gen.get_state(), want_state)
    assert s.stats()["rng_replays"] > 0


_DEFAULT_DEVICE_PROGRAM = """
import collections, contextlib, json, torch
from torch.overrides import TorchFunctionMode

# Not the device the session's tensors are on, as torch.set_default_device("cuda")
# is not the CPU: the session's one-time probes of torch must not follow it.
torch.set_default_device("meta")


class Count(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls[getattr(func, "__name__", repr(func))] += 1
        return func(*args, **(kwargs or {}))


from dtralloc.dtr import dtr  # (its import runs a probe too)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16, device="cpu"), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                            torch.nn.Linear(16, 1, device="cpu"))
x = torch.randn(8, 16, device="cpu")


def step(make_session):
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    counter = Count()
    with counter:
        session = make_session()  # the process's first session: the probes run here, inside the user's mode
        with session:
            loss = model(x).sum()
            loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()], dict(counter.calls), session


want, plain_calls, _ = step(contextlib.nullcontext)
got, session_calls, s = step(lambda: dtr(device="cpu", chaos=True))
print(json.dumps({"exact": all(torch.equal(a, b) for a, b in zip(want, got)), "plain": plain_calls,
                  "session": session_calls, "evictions": s.stats()["evictions"]}))
"""


def test_a_default_device_and_a_users_torch_function_mode_leave_the_sessions_probes_alone():
    # torch.set_default_device (and `with torch.device(...)`) is a torch
    # function mode that fills in factories' device: the probes a process's
    # first session makes of torch (runner.probing) made their CPU tensors on
    # it, and set_() a CPU storage into a tensor on the default device
    # failed ("the devices must match"), so no session could start under
    # torch.set_default_device("cuda"). A mode of the user's saw those calls
    # too. Checked in a process of its own: the probes run once a process.
    import json
    import subprocess

    out = subprocess.run([sys.executable, "-c", _DEFAULT_DEVICE_PROGRAM], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["exact"]
    assert result["evictions"] > 0
    assert result["session"] == result["plain"], (result["session"], result["plain"])


def _to_bfloat16(t):
    return t.to(torch.bfloat16), t.dtype


def _back(packed):
    return packed[0].to(packed[1])


def _step_with_hooks(session_outside):
    """One forward+backward whose saved tensors a user's hooks store in
    bfloat16 (a lossy compression), inside a session where one is given."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(32, 16)
    with session_outside if session_outside is not None else contextlib.nullcontext():
        with torch.autograd.graph.saved_tensors_hooks(_to_bfloat16, _back):
            m(x).sum().backward()
    return [p.grad for p in m.parameters()]


def test_a_session_is_refused_inside_saved_tensor_hooks_or_where_they_are_disabled_and_outside_them_leaves_them_be():
    # torch applies only the innermost saved-tensor hooks: a session entered
    # inside a user's would replace them for everything in its block (here a
    # bfloat16 compression: the gradients moved by 5e-3 against the same
    # code without the session). The session refuses to start there, and
    # says how to nest the two instead.
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    x = torch.randn(32, 16)
    s = dtr(device="cpu", chaos=True)
    with torch.autograd.graph.saved_tensors_hooks(_to_bfloat16, _back):
        with pytest.raises(RuntimeError, match=r"saved-tensor hooks are already active in this thread "
                                               r"\(test_dtr\._to_bfloat16: .*Enter the session outside them"):
            with s:
                m(x).sum().backward()
    # Where hooks are disabled (torch.func's transforms do it), refused
    # before anything starts too (it used to start, fail at torch's check
    # with torch's message alone, and be spent).
    with torch.autograd.graph.disable_saved_tensors_hooks("no hooks in here"):
        with pytest.raises(RuntimeError, match=r"saved-tensor hooks are disabled here .*'no hooks in here'"):
            with s:
                pass
    with s:  # refused twice, not spent: it runs out of both
        m(x).sum().backward()
    assert s.stats()["evictions"] > 0
    # Outside them, the user's hooks apply to what they wrap, as without the session.
    want = _step_with_hooks(None)
    got = _step_with_hooks(dtr(device="cpu", chaos=True))
    assert all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(budget="abc"), ValueError, "bad budget 'abc': expected a size with a unit"),
    (dict(budget=-5), ValueError, "budget must be positive, got -5"),
    # A bare number is bytes: "0.5" was a 1-byte budget, "0" none at all.
    (dict(budget="0.5"), ValueError, "bad budget '0.5': a number without a unit is a count of bytes"),
    (dict(budget="0"), ValueError, "budget must be positive, got '0'"),
    (dict(budget=1.5), TypeError, r"budget must be bytes \(an int\) or a size"),
    (dict(budget=True), TypeError, r"budget must be bytes \(an int\) or a size"),
    (dict(policy="nope"), ValueError, "unknown policy 'nope'; available: .*dtralloc"),
    (dict(device="mps"), ValueError, r"device must be 'cpu' or 'cuda\[:N\]', not 'mps'"),
    (dict(device="cuda:x"), ValueError, r"device must be 'cpu' or 'cuda\[:N\]', not 'cuda:x' \("),
    (dict(chaos="yes"), TypeError, "chaos is True or False, not 'yes'"),
    (dict(check_invariants=1), TypeError, "check_invariants is True or False, not 1"),
    (dict(series=-1), TypeError, "series is a number of ops"),
    (dict(history=-3), ValueError, "history is True, False or a number of events"),
])
def test_a_bad_argument_is_named_with_what_it_takes(kwargs, error, match):
    # (chaos="yes" reached the C++ constructor and came back as pybind11's
    # list of its overloads; a device torch cannot parse, as torch's own words.)
    with pytest.raises(error, match=f"^dtralloc.dtr: {match}"):
        dtr(**{"device": "cpu", **kwargs})


def test_backward_after_the_block():
    model, loss_fn = build("mlp_inplace_dropout")
    torch.manual_seed(1)
    loss_fn(model).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with dtr(device="cpu", chaos=True) as s:
        loss = loss_fn(model)
    s.evict_all()
    loss.backward()
    assert all(torch.equal(p.grad, w) for p, w in zip(model.parameters(), want))
    assert s.stats()["remats"] > 0


def test_a_session_decorates_a_function_each_call_in_a_session_of_its_own():
    model, loss_fn = build("mlp_inplace_dropout", SWEEP_BATCH["mlp_inplace_dropout"])
    init = copy.deepcopy(model.state_dict())
    torch.manual_seed(3)
    want = train(model, loss_fn, 3)

    @dtr(device="cpu", chaos=True)
    def step(model):
        """The whole step."""
        loss = loss_fn(model)
        loss.backward()
        return loss

    @dtr(device="cpu", chaos=True)
    def forward(model):
        return loss_fn(model)

    assert (step.__name__, step.__doc__, step.last_session) == ("step", "The whole step.", None)
    for run, backward_after in ((step, False), (forward, True)):
        model.load_state_dict(init)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(3)
        losses, sessions = [], []
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss = run(model)
            sessions.append(run.last_session)
            in_call = sessions[-1].stats()["remats"]
            if backward_after:
                loss.backward()
                assert sessions[-1].stats()["remats"] > in_call  # the backward after the call recomputed
            losses.append(loss.detach())
            opt.step()
        got = losses, [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]
        assert_identical(got, want)
        assert len({id(s) for s in sessions}) == 3, "each call runs in a session of its own"
        assert all(s.chaos and s.device == "cpu" and s.stats()["evictions"] > 0 for s in sessions)
        last = weakref.ref(run.last_session)
        del sessions, loss
        run.last_session = None
        gc.collect()
        assert last() is None, "the wrapper drops its last session when told to"

    def steps():
        yield

    with pytest.raises(TypeError, match="a generator or coroutine function: its body runs after the call"):
        dtr(device="cpu")(steps)
    with pytest.raises(TypeError, match="a session decorates a function, not 3"):
        dtr(device="cpu")(3)
    with pytest.raises(TypeError, match=r"to decorate '.*steps', call dtr first: @dtralloc.dtr\(\) or"):
        dtr(steps)
    with dtr(device="cpu") as s:
        pass
    with pytest.raises(RuntimeError, match="already entered; decorate with a new one"):
        s(forward)


def _forward_alone(model, loss_fn, steps, **session):
    """`steps` AdamW steps with the forward alone in a dtr(**session) block;
    backward and the step after it. Returns (losses, parameters, buffers),
    the global RNG state, and per step (ops recorded, remats at the block's
    end, remats after the backward)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, counts = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        with dtr(device="cpu", **session) as s:
            loss = loss_fn(model)
        in_block = s.stats()["remats"]
        loss.backward()
        counts.append((s.stats()["ops"], in_block, s.stats()["remats"]))
        losses.append(loss.detach())
        opt.step()
    state = [p.detach().clone() for p in model.parameters()], [b.clone() for b in model.buffers()]
    return (losses, *state), torch.get_rng_state(), counts


@pytest.mark.parametrize("name", ["transformer_sdpa_dropout", "convnet_batchnorm"])
def test_the_forward_alone_in_the_block_trains_bit_exactly_recomputing_in_the_backward(name):
    """docs/live.md, "The forward alone in the block": backward and the
    optimizer's step after the block pass no mode; what the forward saved
    is still the session's, brought back at its unpack, under chaos and
    under a budget, and three AdamW steps equal plain eager's."""
    model, loss_fn = build(name, SWEEP_BATCH[name])
    torch.manual_seed(3)
    want = train(copy.deepcopy(model), loss_fn, 3)
    want_rng = torch.get_rng_state()
    torch.manual_seed(3)
    _, _, whole = _forward_alone(copy.deepcopy(model), loss_fn, 1)
    with dtr(device="cpu") as s:  # the same step with the backward inside, for its op count
        loss_fn(copy.deepcopy(model)).backward()
    assert whole[0][0] < s.stats()["ops"] / 2
    with dtr(device="cpu") as s:
        loss = loss_fn(copy.deepcopy(model))
    peak = s.stats()["peak_bytes"]
    del loss
    for session in ({"chaos": True}, {"budget": int(0.5 * peak)}):
        torch.manual_seed(3)
        got, rng, counts = _forward_alone(copy.deepcopy(model), loss_fn, 3, **session)
        assert_identical(got, want)
        assert torch.equal(rng, want_rng)
        assert any(after > in_block for _, in_block, after in counts), (session, counts)


def test_a_thousand_layer_chain_recomputes_without_recursion():
    torch.manual_seed(0)
    chain = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(1000)])
    x = torch.randn(4, 16)
    params = list(chain.parameters())[:2]
    want = torch.autograd.grad(chain(x).sum(), params)
    with dtr(device="cpu"):
        chain(x)  # first-call setup happens at the normal recursion limit
    limit = sys.getrecursionlimit()
    with dtr(device="cpu") as s:
        loss = chain(x).sum()
        s.evict_all()  # the first unpack must bring back all 2,000 values, end to end
        sys.setrecursionlimit(250)
        try:
            got = torch.autograd.grad(loss, params)
        finally:
            sys.setrecursionlimit(limit)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert s.stats()["remats"] >= 1999


def _error_of(fn):
    try:
        fn()
    except RuntimeError as e:
        return type(e), str(e)
    return None


def _modify_saved_output():
    a = torch.randn(4, requires_grad=True)
    y = a.exp()
    y.add_(1)
    y.sum().backward()


def _modify_saved_output_then_drop_it():
    # Under chaos y's storage is evicted once the program lets go of it:
    # the error names the sizes the handle kept when its alias went.
    a = torch.randn(4, requires_grad=True)
    x = a * 2
    y = x.exp()
    y.add_(1)
    loss = (y * 3).sum()
    del x, y
    loss = loss * 1
    loss.backward()


def _modify_parameter_outside():
    w = torch.randn(4, requires_grad=True)
    y = w.sin().sum()  # saves w, a leaf made outside the session
    with torch.no_grad():
        w.add_(1)
    y.backward()


def _backward_twice():
    a = torch.randn(4, requires_grad=True)
    y = (a * a).sum()
    y.backward()
    y.backward()


def _shape_error():
    torch.randn(3, 4, requires_grad=True) @ torch.randn(5, 6)


def _modify_saved_input_through_a_view():
    # Torch names the input's grad_fn at the backward: CopySlices, which the
    # in-place op on its view made.
    a = torch.randn(4, requires_grad=True)
    x = a * 2
    y = x.sin()
    x[:2].mul_(3)
    y.sum().backward()


def _modify_saved_input_then_drop_it():
    # Autograd would keep x; the session's handle only watches it.
    a = torch.randn(4, requires_grad=True)
    x = a * 2
    y = x.sin()
    x.sigmoid_()
    del x
    y.sum().backward()


def _modify_the_base_of_a_saved_view():
    # The saved view x[::2] dies at once; its base tells the write.
    a = torch.randn(6, requires_grad=True)
    x = a * 2
    y = x[::2].sin()
    x.mul_(3)
    y.sum().backward()


def _modify_saved_output_of_a_numbered_node():
    # PowBackward2: torch 2.13 names it Pow2.
    a = torch.randn(4, requires_grad=True)
    y = torch.pow(2, a)
    y.add_(1)
    y.sum().backward()


def _optimizer_step_between_forward_and_backward():
    # A GAN's generator loss reads the discriminator's weights; stepping the
    # discriminator's optimizer (foreach) first writes them. Under any
    # dispatch mode torch's CPU foreach ops bump no version counter; the
    # session bumps them.
    torch.manual_seed(0)
    d, g = nn.Linear(4, 1), nn.Linear(2, 4)
    opt = torch.optim.SGD(d.parameters(), lr=0.1, foreach=True)
    fake = g(torch.randn(3, 2))
    d(fake.detach()).mean().backward()
    loss = -d(fake).mean()
    opt.step()
    loss.backward()


def _write_through_a_detach_of_a_dropped_saved_output():
    # Only the detach() shares the saved tensor's counter once y is gone:
    # the handle's alias (Note [saved alias]) tells the write.
    a = torch.randn(4, requires_grad=True)
    y = a.exp()
    alias = y.detach()
    loss = y.sum()
    del y
    alias.add_(1)
    loss.backward()


@pytest.mark.parametrize("misuse", [_modify_saved_output, _modify_saved_output_then_drop_it, _modify_parameter_outside,
                                    _backward_twice, _shape_error, _optimizer_step_between_forward_and_backward,
                                    _modify_saved_input_through_a_view, _modify_saved_input_then_drop_it,
                                    _modify_the_base_of_a_saved_view, _modify_saved_output_of_a_numbered_node,
                                    _write_through_a_detach_of_a_dropped_saved_output])
@pytest.mark.parametrize("chaos", [False, True], ids=["resident", "chaos"])
def test_misuse_gives_the_same_error_as_plain_eager(misuse, chaos):
    # Under chaos a saved value the program dropped is evicted, and the
    # error's sizes come from what its handle kept, not from its alias
    # (Note [saved alias]; _modify_saved_output_then_drop_it).
    plain = _error_of(misuse)
    assert plain is not None
    with dtr(device="cpu", chaos=chaos):
        live = _error_of(misuse)
    assert live == plain


def _forward(ctx, saves):
    """A forward in `ctx`; returns the loss and the tensor autograd saved,
    which the caller writes in place after the block and drops."""
    torch.manual_seed(0)
    a = torch.randn(4, requires_grad=True)
    with ctx:
        h = a * 2
        y = h.exp() if saves == "output" else h.sin()
        loss = y.sum()
    return loss, (y if saves == "output" else h)


@pytest.mark.parametrize("saves, through", [("output", "itself"), ("output", "detach"), ("input", "detach")])
@pytest.mark.parametrize("evict", [False, True])
def test_a_write_after_the_block_to_a_dropped_saved_tensor_raises_as_in_plain_eager(saves, through, evict):
    # The write happens outside the session, where no op is recorded, and
    # every other reference to the saved tensor is gone by the backward:
    # before the saved alias the unpack read the written bytes silently (or,
    # `evict`, recomputed the saved ones).
    errors = []
    for ctx in (contextlib.nullcontext(), dtr(device="cpu")):
        loss, saved = _forward(ctx, saves)
        target = saved if through == "itself" else saved.detach()
        del saved
        with torch.no_grad():
            target.add_(1)
        del target
        if evict and not isinstance(ctx, contextlib.nullcontext):
            assert ctx.evict_all() > 0
        errors.append(_error_of(loss.backward))
    assert errors[0] is not None and errors[1] == errors[0]


def test_without_saved_aliases_a_session_still_runs_exactly(monkeypatch):
    # On a torch whose references to a shared storage's object the probe
    # cannot count (runner.shared_storage_pyrefs: -1) the pack keeps no
    # alias: sessions evict and recompute exactly as before the alias
    # existed, and only the writes it alone sees go unseen.
    from dtralloc.dtr import runner

    monkeypatch.setattr(runner, "_shared_pyrefs", -1)
    sessions = run_plain_and_live("transformer_sdpa_dropout", steps=2, chaos=True, check_invariants=True)
    assert sessions[-1].stats()["evictions"] > 0
    loss, saved = _forward(dtr(device="cpu"), "output")
    alias = saved.detach()
    del saved
    alias.add_(1)
    loss.backward()  # plain eager raises here


def test_a_write_after_the_block_to_a_dropped_saved_input_raises_torchs_error():
    # As above, through the input itself: torch names its grad_fn after the
    # write (Add), which the session cannot reach once the tensor is
    # gone; it names the one it had when saved (docs/live.md, Known limits).
    errors = []
    for ctx in (contextlib.nullcontext(), dtr(device="cpu")):
        loss, h = _forward(ctx, "input")
        h.add_(1)
        del h
        errors.append(_error_of(loss.backward))
    assert errors[0] is not None and errors[1][0] is errors[0][0]
    # (torch 2.13 names the node "Add", torch 2.11 "AddBackward0")
    assert errors[1][1] == re.sub(r"output 0 of Add(Backward0)?,", r"output 0 of Mul\1,", errors[0][1])


def test_a_recompute_reads_external_inputs_as_they_were_or_raises():
    # A recipe keeps an external tensor it read directly (no geometry copied):
    # the recompute must see the same data, and an in-place change made
    # outside the session must raise torch's version error, not be read.
    def step(change_outside):
        torch.manual_seed(0)
        x = torch.randn(64, 64)
        b = torch.randn(64)
        w = torch.randn(64, requires_grad=True)
        with dtr(device="cpu", chaos=True) as s:
            # addcmul reads b, x and w themselves; sin saves its output,
            # which nothing else holds: chaos evicts it at once.
            loss = torch.addcmul(b, x, w).sin().sum()
        if change_outside:
            with torch.no_grad():
                x.mul_(2)  # not seen by the session: only x's version tells
        loss.backward()
        return w.grad, s.stats()

    torch.manual_seed(0)
    x, b, w = torch.randn(64, 64), torch.randn(64), torch.randn(64, requires_grad=True)
    torch.addcmul(b, x, w).sin().sum().backward()
    grad, stats = step(False)
    assert torch.equal(grad, w.grad)
    assert stats["remats"] > 0
    with pytest.raises(RuntimeError, match="modified in place outside the dtr session"):
        step(True)


@pytest.mark.parametrize("through", ["unsafe_chunk", "data"])
def test_an_external_tensor_read_through_one_with_its_own_version_counter_recomputes(through):
    # unsafe_chunk's outputs and `.data` share x's storage but count their own
    # versions from 0, while x had been written once before the session. A
    # recipe reading them is guarded by the storage's external tensor's
    # version; the guard once recorded theirs (0) and compared x's (1), so
    # every recompute raised a false "modified in place outside" error
    # (found by tests/test_dtr_opinfo.py's sweep in float64).
    def run(session):
        torch.manual_seed(0)  # x and w made outside the session: external
        x = torch.randn(6, 4, dtype=torch.float64).add_(1).requires_grad_()
        w = torch.randn(4, dtype=torch.float64, requires_grad=True)
        with session:
            if through == "data":
                loss = (x.data * w).exp().sum() + (x * w).exp().sum()
            else:
                loss = sum((c * w).exp().sum() for c in torch.unsafe_chunk(x, 3))
            loss.backward()
        return w.grad, x.grad

    want = run(contextlib.nullcontext())
    s = dtr(device="cpu", chaos=True)
    got = run(s)
    assert s.stats()["remats"] > 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_views_are_not_recorded_but_composite_aliases_that_copy_are():
    # Views make no storage: the session runs them without a record. A
    # composite op whose schema says alias (contiguous, reshape) reaches the
    # mode as itself under inference_mode, and there it may copy: that copy
    # is the session's like any op's output.
    x = torch.randn(64, 64)
    with dtr(device="cpu") as s:
        with torch.inference_mode():
            before = s.stats()["allocated_bytes"]
            v = x.t()
            assert s.stats()["allocated_bytes"] == before
            c = v.contiguous()  # a copy: x.t() is not contiguous
            assert c.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
            assert s.stats()["allocated_bytes"] == before + 64 * 64 * 4
            r = v.reshape(-1)  # a copy too
            assert s.stats()["allocated_bytes"] == before + 2 * 64 * 64 * 4
    s.check_invariants()
    del c, r


def test_an_unmeetable_budget_raises_and_everything_stays_usable():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(6)])
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(512, 256)
    kept = []
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        with dtr(budget="2M", device="cpu") as s:
            for i in range(6):
                kept.append(model[: i + 1](x))  # every output held: nothing can be evicted
    message = str(info.value)
    assert "budget of 2 MiB" in message and "held by the program" in message and "To fit" in message
    assert "largest free block" in message
    s.check_invariants()
    del kept
    # The model, the optimizer and a new session all work, and exactly as plain.
    init = copy.deepcopy(model.state_dict())
    loss_fn = lambda m: m(x).square().mean()  # noqa: E731
    want = train(model, loss_fn, 2)
    model.load_state_dict(init)
    opt.state.clear()
    got = train(model, loss_fn, 2, lambda: dtr(budget="4M", device="cpu"))
    assert_identical(got, want)


def test_the_oom_report_names_a_budget_below_one_segment():
    # The pool reserves in segments of at least 2 MiB: a smaller budget can
    # hold nothing, and the report says that rather than list nothing.
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        with dtr(budget="1M", device="cpu"):
            torch.ones(1000)
    message = str(info.value)
    assert "smaller than the smallest segment this request can get (2 MiB" in message, message
    assert "Raise the budget to at least 2 MiB" in message
    assert "What no eviction can free now: nothing." in message


def test_the_oom_report_counts_block_tails_and_the_segment_it_lacks():
    # 1.2 MB tensors under an 8 MiB budget: a 20 MiB segment does not fit,
    # so each gets its own 2 MiB one. Four fit; the fifth finds no room for a
    # segment. Under `dtr` (small_in_large off, torch's rule) each block keeps
    # its 0.86 MiB tail, as a large block splits only where over 1 MiB would
    # be left; the report accounts for every allocated byte: the tensors and
    # the tails.
    tail = 2 * 2**20 - 1_200_000
    kept = []
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        with dtr(budget="8M", device="cpu", policy="dtr"):
            for _ in range(5):
                kept.append(torch.ones(300_000))
    assert len(kept) == 4
    message = str(info.value)
    assert "Reserved 8 MiB, allocated 8 MiB" in message, message
    assert "A new segment for it takes 2 MiB; the budget has 0 B left." in message
    assert f"{_core.format_bytes(4 * 1_200_000)}: held by the program" in message
    assert f"{_core.format_bytes(4 * tail)}: allocated beyond the tensors' own bytes" in message
    del kept


def test_small_requests_take_the_tails_large_blocks_split_off():
    # The same four tensors under the dtralloc policy (small_in_large on):
    # each block splits its tail off (Note [large tails]), the report shows
    # the tails as free memory, and small tensors that no 2 MiB small segment
    # has room for under the budget fit in them: four of 800 KB. Under
    # `dtr` the same program runs out of memory at its first small tensor.
    tail = 2 * 2**20 - 1_200_128
    rounding = 4 * (1_200_128 - 1_200_000)
    kept = []
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        with dtr(budget="8M", device="cpu"):
            for _ in range(5):
                kept.append(torch.ones(300_000))
    assert len(kept) == 4
    message = str(info.value)
    assert (f"Reserved 8 MiB, allocated {_core.format_bytes(4 * 1_200_128)}, largest free block "
            f"{_core.format_bytes(tail)} of {_core.format_bytes(4 * tail)} free") in message, message
    assert f"{_core.format_bytes(rounding)}: allocated beyond the tensors' own bytes" in message
    del kept

    def fill(policy):
        with dtr(budget="8M", device="cpu", policy=policy) as session:
            big = [torch.ones(300_000) for _ in range(4)]  # held: their segments stay full
            small = [torch.full((200_000,), float(i)) for i in range(4)]  # 800 KB each
        assert all(bool((t == i).all()) for i, t in enumerate(small)) and len(big) == 4
        return session.stats()

    stats = fill("dtralloc")
    assert stats["peak_bytes"] <= stats["budget_bytes"] == 8 * 2**20
    with pytest.raises(dtralloc.OutOfMemoryError, match="Tried to allocate 781.2 KiB"):
        fill("dtr")


def test_a_hold_that_starts_over_and_still_runs_out_leaves_everything_usable():
    # The conv net at 0.45 of its peak under the `size` policy (it reads no
    # op cost, so every run makes the same choices): backward's hold runs
    # out, starts over twice from an emptied pool (RematEngine::restart_hold:
    # every evictable value evicted, then segments cut to size), and runs out
    # again. Values were unlocked, evicted and freed for real in between, and
    # the failed session must still hold its invariants; the model, a new
    # session and plain eager must all work as before.
    name, batch = "convnet_batchnorm", SWEEP_BATCH["convnet_batchnorm"]
    peak = no_eviction_peak(name, batch)
    model, loss_fn = build(name, batch)
    init = copy.deepcopy(model.state_dict())
    torch.manual_seed(7)
    with pytest.raises(dtralloc.OutOfMemoryError) as info:
        with dtr(budget=int(0.45 * peak), policy="size", device="cpu") as s:
            loss_fn(model).backward()
    assert "budget of" in str(info.value) and "To fit" in str(info.value)
    stats = s.stats()
    assert stats["hold_restarts"] == 2 and stats["remats"] > 0, stats
    s.check_invariants()
    del info, s
    gc.collect()
    # A partial backward left gradients behind, as it would in plain eager:
    # start both runs from the same parameters, with none.
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    want = train(model, loss_fn, 2)
    model.load_state_dict(init)
    torch.manual_seed(7)
    sessions = []
    got = train(model, loss_fn, 2, lambda: dtr(budget=int(0.6 * peak), policy="size", device="cpu",
                                               check_invariants=True), sessions)
    assert_identical(got, want)
    assert sessions[-1].stats()["evictions"] > 0 and sessions[-1].stats()["hold_restarts"] == 0


def _small_request_beside_a_held_large_block(session=None):
    """A 512 KiB output when the small pool's one segment is held but for 256
    KiB, the budget has no headroom for another, and the large pool's one
    segment holds a saved 2 MiB value beside a held one (so it cannot be
    released): the saved value's block is the only room there is."""
    torch.manual_seed(0)
    t = torch.randn(MiB // 2)  # 2 MiB, made outside
    a = torch.randn((), requires_grad=True)
    xs = [torch.randn(MiB // 16) for _ in range(7)] + [torch.randn(MiB // 8)]
    big = torch.randn(MiB)

    def body():
        h = big * 2  # a 4 MiB large segment, then cached free
        del h
        c = t.sin()  # 2 MiB
        part = (c * a).sum()  # c saved for a's gradient
        del c  # only autograd's handle keeps c: evictable
        d = t.cos()  # 2 MiB, held, beside c
        smalls = [x * 2 for x in xs[:7]]  # 1.75 MiB of the small segment, held
        e = xs[7] * 3  # 512 KiB
        loss = part + e.sum() + d.sum() + sum(s.sum() for s in smalls)
        del e, smalls, d
        loss.backward()  # brings c back
        return loss.detach()

    if session is None:
        loss = body()
    else:
        with session:
            loss = body()
    return loss, a.grad.clone()


def test_a_small_request_evicts_a_window_in_the_large_pool():
    # small_in_large (on under a dtralloc budget) lets a small request take a
    # large-pool block when the small pool can neither serve it nor grow; the
    # evictor makes such a block where nothing else would make room.
    want = _small_request_beside_a_held_large_block()
    s = dtr(device="cpu", budget=6 * MiB, policy="dtralloc")
    got = _small_request_beside_a_held_large_block(s)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    stats = s.stats()
    assert stats["large_windows"] == 1 and stats["evictions"] == 1 and stats["remats"] == 1, stats
    assert stats["peak_bytes"] == 6 * MiB
    # With the pools kept apart (torch's way) no eviction can make that room.
    saved = dtralloc._core.config_text()
    dtralloc._core.configure("small_in_large:off")
    try:
        s = dtr(device="cpu", budget=6 * MiB, policy="dtralloc")
        with pytest.raises(dtralloc.OutOfMemoryError, match="Tried to allocate 512 KiB"):
            _small_request_beside_a_held_large_block(s)
        assert s.stats()["large_windows"] == 0
    finally:
        dtralloc._core.configure(saved)


def test_no_leak_after_the_graph_is_dropped():
    model, loss_fn = build("transformer_sdpa_dropout")
    with dtr(budget="2M", device="cpu", chaos=False) as s:
        out = model[0](torch.randn(2, 32, 64))
        loss = out.square().mean()
        watched = weakref.ref(out.untyped_storage())
    loss.backward()
    assert s.stats()["allocated_bytes"] > 0  # out and loss are still held
    del out, loss
    gc.collect()
    s._core.flush_deaths()
    assert watched() is None
    # Gradients live in the parameters (made inside the session, still held).
    grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    assert s.stats()["allocated_bytes"] <= grads + 4096
    model.zero_grad(set_to_none=True)
    gc.collect()
    s._core.flush_deaths()
    assert s.stats()["allocated_bytes"] == 0
    session = weakref.ref(s)
    del s
    gc.collect()
    assert session() is None, "the session outlived every value it managed"


def test_a_session_dies_with_its_last_reference():
    # No reference cycle keeps it for the collector: on CUDA a session's
    # budget holds the shared pool for as long as the session lives.
    x = torch.randn(8, 8, requires_grad=True)
    enabled = gc.isenabled()
    gc.disable()
    try:
        with dtr(device="cpu") as s:
            y = x.exp().sum()
        y.backward()
        del y
        session = weakref.ref(s)
        del s
        assert session() is None, "the session outlived its last reference (a cycle?)"
    finally:
        if enabled:
            gc.enable()


def test_data_leaving_the_dispatcher_is_pinned():
    # Code outside torch's dispatch (numpy here) writes y's memory: a recompute
    # of y would not see that, so y must never be evicted; the gradient then
    # matches plain eager, which used the modified values too.
    def step():
        x = torch.linspace(-1, 1, 64 * 64).reshape(64, 64).requires_grad_()
        y = x.exp()
        y.detach().numpy()[:] += 1.0
        loss = (y.tanh() * y).sum()
        loss.backward()
        return x.grad

    want = step()
    with dtr(device="cpu", chaos=True) as s:
        got = step()
    assert torch.equal(got, want)
    assert s.stats()["evictions"] > 0  # chaos evicted what it could, but not y
    s.check_invariants()


def test_stats_and_arguments():
    with dtr(budget="64M", device="cpu", policy="dtr") as s:
        a = torch.randn(32, 32, requires_grad=True)
        a.exp().sum().backward()
    stats = s.stats()
    for key in ("evictions", "remats", "rng_replays", "hold_restarts", "peak_bytes", "budget_bytes", "recompute_seconds",
                "ops", "compute_overhead", "op_seconds", "gpu_timed_ops", "policy", "device"):
        assert key in stats
    assert stats["budget_bytes"] == 64 * MiB and stats["policy"] == "dtr" and stats["device"] == "cpu"
    assert stats["ops"] > 0
    assert repr(s).startswith("<dtralloc.dtr session device=cpu policy=dtr budget=64 MiB evictions=")
    # Without a budget a CPU session has none (its mirror's capacity is no one's budget).
    with dtr(device="cpu") as free:
        torch.randn(32, 32, requires_grad=True).exp().sum().backward()
    assert free.stats()["budget_bytes"] == 0 and " budget=none " in repr(free)
    assert free.stats()["peak_bytes"] > 0
    # On a CPU the ops ran when called: the clock prices them, no GPU does.
    assert stats["op_seconds"] > 0 and stats["gpu_timed_ops"] == 0
    # The mirror made its segments in the session (the first of each pool).
    assert stats["device_calls"] >= 1 and stats["device_call_seconds"] >= 0
    assert stats["device_pool_waits"] == 0  # async_segments: CUDA only
    with pytest.raises(TypeError, match="512M"):
        dtr(budget=0.5, device="cpu")
    with pytest.raises(ValueError, match="positive"):
        dtr(budget=-1, device="cpu")
    with pytest.raises(ValueError, match="belady"):
        dtr(policy="belady", device="cpu")
    with pytest.raises(ValueError, match="'cpu' or 'cuda"):
        dtr(device="meta")
    with pytest.raises(RuntimeError, match="dtralloc.install"):
        dtr(device="cuda")
    with dtr(device="cpu"):
        with pytest.raises(RuntimeError, match="do not nest"):
            with dtr(device="cpu"):
                pass
    s = dtr(device="cpu")
    with s:
        pass
    with pytest.raises(RuntimeError, match="entered once"):
        with s:
            pass


def _same_as_plain(step, chaos):
    """`step()` plainly, then inside dtr(device="cpu", chaos=chaos): what it
    returns (a tensor or a list of them) identical. Returns the session."""
    want = step()
    with dtr(device="cpu", chaos=chaos, check_invariants=True) as s:
        got = step()
    want, got = (want, got) if isinstance(want, (list, tuple)) else ([want], [got])
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    return s


def _complex_step():
    """Complex math whose saved tensors and op inputs are lazy views that
    only flag their data: x.conj() (the conjugate bit), x.conj().imag (the
    negative bit), and an FFT round trip."""
    torch.manual_seed(0)
    x = torch.randn(16, dtype=torch.complex64, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    y = x * x.conj()
    z = x.conj().imag * w
    f = torch.fft.ifft(torch.fft.fft(x) * w).real
    loss = y.real.sum() + (z * z).sum() + (f * f).sum()
    loss.backward()
    return x.grad, w.grad


@pytest.mark.parametrize("chaos", [False, True], ids=["kept", "chaos"])
def test_complex_conjugate_and_negative_views_come_back_as_they_were_saved(chaos):
    s = _same_as_plain(_complex_step, chaos)
    if chaos:
        assert s.stats()["remats"] > 0


def _sparse_step():
    """Sparse tensors have no storage the session can own: an embedding with
    sparse gradients and its SGD step, and a sparse-dense product whose
    dense output reads the sparse tensor."""
    torch.manual_seed(0)
    emb = nn.Embedding(50, 8, sparse=True)
    idx = torch.randint(0, 50, (6, 4))
    s = torch.sparse_coo_tensor(torch.tensor([[0, 1, 1], [2, 0, 2]]), torch.tensor([3.0, 4.0, 5.0]), (2, 3),
                                check_invariants=True)
    w = torch.randn(3, 8, requires_grad=True)
    h = torch.sparse.mm(s, w)                  # dense, read from a sparse tensor: pinned
    loss = (emb(idx).sum(1)[:2] * h.tanh()).square().sum()
    loss.backward()
    torch.optim.SGD(emb.parameters(), lr=0.1).step()  # a sparse gradient added into the weight
    return emb.weight.detach().clone(), w.grad


@pytest.mark.parametrize("chaos", [False, True], ids=["kept", "chaos"])
def test_sparse_tensors_run_as_in_plain_eager(chaos):
    _same_as_plain(_sparse_step, chaos)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_a_nested_tensor_runs_as_in_plain_eager():
    """A (legacy) nested tensor has a storage but no sizes: nothing can
    rebuild it as a view, so it is kept, not recomputed, and autograd keeps
    the ones it saves itself (b * b saves b twice)."""
    def step():
        torch.manual_seed(0)
        a = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)
        b = a * 2 + 1
        (b * b).to_padded_tensor(0.0).sum().backward()
        return a.grad.to_padded_tensor(0.0)

    assert _same_as_plain(step, chaos=True).stats()["saved"] == 0


@pytest.mark.parametrize("chaos", [False, True], ids=["kept", "chaos"])
def test_a_tensor_subclass_with_its_own_dispatch_runs_as_in_plain_eager(chaos):
    """A jagged NestedTensor wraps its data (sizes with a symbolic length, a
    storage that is not its data's): it is not the session's value, and
    autograd keeps it whole."""
    def step():
        torch.manual_seed(0)
        a = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged,
                                       requires_grad=True)
        b = (a * a).sin()
        b.values().sum().backward()
        return a.grad.values()

    _same_as_plain(step, chaos)


def _reentrant_checkpoint_step():
    """torch.utils.checkpoint(use_reentrant=True): the backward reruns the
    block on detached copies of the inputs it saved, which autograd saves
    again. Those copies are views the unpack rebuilt, each with a version
    counter of its own."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16), nn.LayerNorm(16))
    x = torch.randn(8, 16, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
    y.square().sum().backward()
    return [p.grad for p in block.parameters()] + [x.grad]


@pytest.mark.parametrize("chaos", [False, True], ids=["kept", "chaos"])
def test_reentrant_checkpoint_inside_the_session_raises_no_false_version_error(chaos):
    _same_as_plain(_reentrant_checkpoint_step, chaos)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1), nn.Linear(32, 16), nn.LayerNorm(16))


def _checkpointed():
    m, x = _mlp(), torch.randn(8, 16, requires_grad=True)
    y = torch.utils.checkpoint.checkpoint(m, x, use_reentrant=False)
    torch.utils.checkpoint.checkpoint(m, y, use_reentrant=False).square().sum().backward()
    return [p.grad for p in m.parameters()] + [x.grad]


def _autocast():
    m, x = _mlp(), torch.randn(8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = m(x).float().square().sum()
    loss.backward()
    return [p.grad for p in m.parameters()]


def _double_backward():
    m, x = _mlp(), torch.randn(8, 16, requires_grad=True)
    g, = torch.autograd.grad(m(x).tanh().sum(), x, create_graph=True)
    g.square().sum().backward()
    return [p.grad for p in m.parameters()] + [x.grad]


def _vmap():
    torch.manual_seed(0)
    w, xs = torch.randn(4, 4, requires_grad=True), torch.randn(3, 4)
    torch.vmap(lambda x: (w @ x).tanh())(xs).square().sum().backward()
    return [w.grad]


def _jacobian():
    torch.manual_seed(0)
    return [torch.autograd.functional.jacobian(lambda x: x.exp() * x.sin(), torch.randn(4))]


def _packed_rnns():
    """LSTM and GRU over a packed batch: torch's CPU cells split the gates
    with unsafe_split (views of one storage, each with a version counter of
    its own) and apply sigmoid_/tanh_ to each in place, so the storage a
    saved gate is on is written again after the save."""
    torch.manual_seed(0)
    lstm, gru = nn.LSTM(6, 8, batch_first=True), nn.GRU(6, 8, batch_first=True)
    x = torch.randn(3, 5, 6)
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
    loss = sum(nn.utils.rnn.pad_packed_sequence(rnn(packed)[0], batch_first=True)[0].square().sum()
               for rnn in (lstm, gru))
    loss.backward()
    return [p.grad for p in lstm.parameters()] + [p.grad for p in gru.parameters()]


class _Square(torch.autograd.Function):
    """Saves its input and its output."""
    @staticmethod
    def forward(ctx, x):
        y = x * x
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, g):
        x, y = ctx.saved_tensors
        return 2 * x * g + y * 0


class _DoubleInPlace(torch.autograd.Function):
    """Writes its input in place (mark_dirty) and saves the result."""
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        x.mul_(2)
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * 2 + y * 0


class _ExpScale(torch.autograd.Function):
    """forward without ctx, setup_context saving inputs and output."""
    @staticmethod
    def forward(x, w):
        return x.exp() * w

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs, output)

    @staticmethod
    def backward(ctx, g):
        x, w, out = ctx.saved_tensors
        return g * out, (g * x.exp()).sum(0)


def _custom_functions():
    m, x = _mlp(), torch.randn(8, 16)
    w = torch.ones(32, requires_grad=True)
    h = _Square.apply(m[0](x))
    h = _DoubleInPlace.apply(m[1](h) + 0)
    m[2:](_ExpScale.apply(h, w)).square().sum().backward()
    return [p.grad for p in m.parameters()] + [w.grad]


def _retain_graph():
    m, x = _mlp(), torch.randn(8, 16)
    loss = m(x).tanh().sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return [p.grad for p in m.parameters()]


def _hooks():
    """Module pre-, forward and full backward hooks that change what flows,
    a tensor hook and a post-accumulate-grad hook."""
    m, x = _mlp(), torch.randn(8, 16)

    def triple_grad(p):
        p.grad.mul_(3)

    handles = [m[0].register_forward_pre_hook(lambda mod, i: (i[0] * 2,)),
               m[1].register_forward_hook(lambda mod, i, out: out * 1.5),
               m[3].register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,)),
               m[0].weight.register_post_accumulate_grad_hook(triple_grad)]
    h = m[0](x)
    h.register_hook(lambda g: g * 0.25)
    m[1:](h).square().sum().backward()
    for handle in handles:
        handle.remove()
    return [p.grad for p in m.parameters()]


def _channels_last_conv():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2),
                      nn.Conv2d(8, 8, 3, groups=2), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    m = m.to(memory_format=torch.channels_last)
    m(torch.randn(2, 3, 8, 8).to(memory_format=torch.channels_last)).square().sum().backward()
    return [p.grad for p in m.parameters()] + [m[1].running_mean, m[1].running_var]


def _embeddings():
    torch.manual_seed(0)
    bag, sparse = nn.EmbeddingBag(50, 8, mode="max"), nn.Embedding(50, 8, sparse=True, padding_idx=0)
    i = torch.randint(0, 50, (20,))
    (bag(i, torch.arange(0, 20, 5)).square().sum() + sparse(i).sum()).backward()
    return [bag.weight.grad, sparse.weight.grad.to_dense()]


def _gru_cell_loop():
    torch.manual_seed(0)
    cell, x, h = nn.GRUCell(4, 8), torch.randn(10, 2, 4), torch.zeros(2, 8)
    for t in range(10):
        h = cell(x[t], h)
    h.square().sum().backward()
    return [p.grad for p in cell.parameters()]


def _indexing_writes():
    """Slice assignment, index_add_, index_put_ through advanced indexing,
    scatter, masked_fill_ and gather on values autograd saved."""
    torch.manual_seed(0)
    w = torch.randn(8, 6, requires_grad=True)
    h = w.tanh()
    z = torch.zeros_like(h)
    z[:, ::2] = h[:, ::2]
    z.index_add_(0, torch.tensor([0, 1]), h[:2])
    z[torch.tensor([3, 5])] += 1
    z = z.scatter(1, torch.zeros(8, 1, dtype=torch.long), h[:, :1])
    z.masked_fill_(z > 1, 0)
    (z.square().sum() + torch.gather(z, 1, torch.ones(8, 2, dtype=torch.long)).sum()).backward()
    return [w.grad]


def _jacfwd():
    torch.manual_seed(0)
    return [torch.func.jacfwd(lambda x: x.exp() * x.sin())(torch.randn(4))]


@pytest.mark.parametrize("step", [_checkpointed, _autocast, _double_backward, _vmap, _jacobian, _packed_rnns,
                                  _custom_functions, _retain_graph, _hooks, _channels_last_conv, _embeddings,
                                  _gru_cell_loop, _indexing_writes, _jacfwd],
                         ids=["checkpoint", "autocast-bf16", "double-backward", "vmap", "jacobian", "packed-rnns",
                              "custom-functions", "retain-graph", "hooks", "channels-last", "embeddings",
                              "gru-cell-loop", "indexing-writes", "jacfwd"])
@pytest.mark.parametrize("chaos", [False, True], ids=["kept", "chaos"])
# forward-mode AD's first dual tensor in a process loads torch's jvp
# decompositions, which call torch.jit.script.
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_autograd_features_run_as_in_plain_eager(step, chaos):
    _same_as_plain(step, chaos)


def test_compiled_code_runs_eagerly_inside_a_session():
    # Dynamo skips every frame while a non-infra dispatch mode is active
    # (torch/_dynamo/convert_frame.py: "non-infra torch dispatch mode present"),
    # compiled before the session or not: inside one a torch.compile'd module
    # runs op by op, each op recorded as in eager, and bit-exact with eager.
    x = torch.randn(8, 16)

    def grads(model, fn):
        torch.manual_seed(1)  # the dropout's mask
        for p in model.parameters():
            p.grad = None
        fn(x).square().sum().backward()
        return [p.grad for p in model.parameters()]

    eager = _mlp()
    want = grads(eager, eager)
    model = _mlp()  # the same weights
    compiled = torch.compile(model, backend="aot_eager")
    assert all(torch.equal(a, b) for a, b in zip(grads(model, compiled), want))  # compiled here, outside
    with dtr(device="cpu", chaos=True, series=1000) as inside:
        got = grads(model, compiled)
    with dtr(device="cpu", chaos=True, series=1000) as reference:
        grads(eager, eager)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert inside.stats()["remats"] == reference.stats()["remats"] > 0
    assert len(inside.series()["op"]) == len(reference.series()["op"])


AMP_INIT_SCALE = 2.0 ** 32


def _skipped_and_applied(scales, init) -> tuple:
    """Whether a GradScaler skipped a step (its scale halved) and applied one
    (kept or grew it), from its scale after each step."""
    pairs = list(zip([init] + scales, scales))
    return any(b < a for a, b in pairs), any(b >= a for a, b in pairs)


def _amp_run(recipe, session=None):
    """Five steps of float16 autocast with a GradScaler (the usual GPU recipe,
    on CPU: _amp_steps.scaled_steps): the whole step in `session()`, or
    (`recipe` "forward") the forward alone. The first scale overflows
    float16's gradients, so the first steps are skipped (three) and the
    scale comes down before steps apply. Returns (losses, parameters,
    scales, growth trackers) and the sessions."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)])
    x = torch.randn(1024, 512)
    return scaled_steps(torch, model, x, "cpu", 5, AMP_INIT_SCALE, recipe, session)


@pytest.mark.parametrize("recipe", ["whole", "forward"])
@pytest.mark.parametrize("pressure", ["chaos", "budget"])
def test_float16_autocast_with_a_grad_scaler_trains_as_plain(recipe, pressure):
    # The scaler unscales and checks the gradients for inf in place
    # (_amp_foreach_non_finite_check_and_unscale_), reads found_inf with
    # .item() to skip the step, and rewrites its scale in place
    # (_amp_update_scale_), the scale being a tensor the first session made.
    want, _ = _amp_run(recipe)
    scales = want[2]
    assert _skipped_and_applied(scales, AMP_INIT_SCALE) == (True, True), f"a step must skip and one apply: {scales}"
    if pressure == "chaos":
        session = lambda: dtr(device="cpu", chaos=True)  # noqa: E731
    else:
        _, unbounded = _amp_run(recipe, lambda: dtr(device="cpu"))
        peak = max(s.stats()["peak_bytes"] for s in unbounded)
        session = lambda: dtr(device="cpu", budget=peak // 2)  # noqa: E731
    got, sessions = _amp_run(recipe, session)
    for kind, a, b in zip(("loss", "parameter"), got[:2], want[:2]):
        for i, (u, v) in enumerate(zip(a, b)):
            assert torch.equal(u, v), f"{kind} {i} differs"
    assert got[2:] == want[2:], "the scaler's scale or growth tracker differs"
    assert all(s.stats()["evictions"] > 0 and s.stats()["remats"] > 0 for s in sessions)
    if pressure == "chaos":
        assert all(s.stats()["rng_replays"] > 0 for s in sessions), "no dropout mask was recomputed"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes are Python 3.11+")
def test_torch_func_grad_inside_a_session_says_the_sessions_hooks_are_why_it_refuses():
    x = torch.randn(4)
    with pytest.raises(RuntimeError, match="saved tensor hooks") as info:
        with dtr(device="cpu"):
            torch.func.grad(lambda a: a.exp().sum())(x)
    assert any("outside the dtr() block" in note for note in info.value.__notes__)
    # Outside the block the same call runs.
    assert torch.equal(torch.func.grad(lambda a: a.exp().sum())(x), x.exp())
