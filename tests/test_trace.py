"""Recording a training step (dtralloc.trace.record) and the trace file format.

The promise: the storages a recording sees are the ones torch allocates. The
first tests hold the recording against torch's own memory profiler on real
steps (forward, backward, optimizer) of three small models; the rest check,
op by op, the tags a replay or a rematerialization relies on: views, in-place
writes, randomness, FLOPs, multi-output ops, no_grad, backward, autocast,
deaths, and which storages existed before the step and which outlive it.
Then save/load: exact round trips and clear errors for bad files.
"""
from __future__ import annotations

import json
import lzma
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dtralloc
from dtralloc.trace import FORMAT_NAME, FORMAT_VERSION, Op, Storage, Trace

from _steps import training_step

torch = pytest.importorskip("torch")
nn = torch.nn

MIN_BLOCK = 512  # the pool's rounding: replayed bytes exceed recorded ones by < 512 per storage


# -- models: one training step each, several MB of activations ------------------

def _mlp_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(512, 512), torch.randint(0, 10, (512,))
    return training_step(model, opt, nn.functional.cross_entropy, x, y)


def _convnet_step():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
    return training_step(model, opt, nn.functional.cross_entropy, x, y)


class _Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention with dropout, MLP."""

    def __init__(self, d: int = 128, heads: int = 4):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d), nn.Dropout(0.1))

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.ff(self.ln2(x))


def _transformer_step():
    torch.manual_seed(0)
    model = _Block()
    opt = torch.optim.AdamW(model.parameters())
    x, y = torch.randn(16, 64, 128), torch.randn(16, 64, 128)
    return training_step(model, opt, nn.functional.mse_loss, x, y)


MODELS = {"mlp": _mlp_step, "convnet": _convnet_step, "transformer": _transformer_step}


@pytest.fixture(scope="module")
def model_steps():
    """{name: step}, each warmed up once so optimizer state exists."""
    steps = {}
    for name, make in MODELS.items():
        steps[name] = make()
        steps[name]()
    return steps


@pytest.fixture(scope="module")
def model_traces(model_steps):
    return {name: dtralloc.trace.record(step, name=name) for name, step in model_steps.items()}


# -- the step's own memory, two ways ---------------------------------------------

def _profiler_peak_bytes(step) -> int:
    """Peak of live CPU bytes allocated during `step`, from torch's profiler.

    Each allocation event carries its pointer and size; a free counts only if
    its block was allocated inside this run (frees of older blocks are the
    profiler's "unknown size" case, and its running total carries stale sizes
    across sessions, so the level is rebuilt here from the events).
    """
    profiler_api = pytest.importorskip("torch._C._profiler")
    if not hasattr(profiler_api, "_EventType"):
        pytest.skip("this torch's profiler does not expose allocation events")
    # One cycle, so acc_events changes nothing but torch 2.11's warning that
    # later cycles would clear this one's events (torch 2.13 does not warn).
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True, record_shapes=False, acc_events=True) as prof:
        step()
    events = []

    def walk(node):
        if node.tag == profiler_api._EventType.Allocation and str(node.extra_fields.device) == "cpu":
            events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
        for child in node.children:
            walk(child)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    assert events, "the profiler recorded no CPU allocations"
    live: dict[int, int] = {}
    level = peak = 0
    for _, ptr, size in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
            level += size
        elif ptr in live:
            level -= live.pop(ptr)
        peak = max(peak, level)
    return peak


def _recorded_peak_bytes(trace: Trace) -> int:
    """The same quantity from a trace: peak of storages created in the step."""
    level = peak = 0
    for op in trace.ops:
        level += sum(trace.storages[s].nbytes for s in op.created)
        peak = max(peak, level)
        level -= sum(trace.storages[s].nbytes for s in op.frees if not trace.storages[s].initial)
    return peak


def _rounded(nbytes: int) -> int:
    return -(-nbytes // MIN_BLOCK) * MIN_BLOCK


@pytest.mark.parametrize("name", MODELS)
def test_recorded_peak_matches_torch_profiler(model_steps, name):
    # Measured with torch 2.13 on CPU: the recording is 0 B (transformer),
    # 12 B (mlp) and 256 B (convnet) below the profiler's 10-16 MB peaks. The
    # profiler also sees allocations no dispatch mode sees: the 4-8 B tensors
    # torch wraps Python scalars in, and temporaries that kernels make and drop
    # inside one op (mkldnn convolution buffers). Neither matters at the peak.
    # Known divergence that does not show here either: under any dispatch mode
    # torch takes "subclass-friendly" out-of-place paths (linear's bias add on
    # non-contiguous input, autograd's gradient accumulation), so a recording
    # can hold an extra buffer where eager adds in place. 5% is the issue's
    # "a few percent".
    step = model_steps[name]
    profiled = _profiler_peak_bytes(step)
    trace = dtralloc.trace.record(step, name=name)
    recorded = _recorded_peak_bytes(trace)
    assert profiled > 4_000_000, "the step should allocate several MB, well above noise"
    assert recorded == pytest.approx(profiled, rel=0.05), (name, recorded, profiled)

    # No parameter or optimizer state dies in these steps, so the issue's
    # formula (peak live minus the initial bytes) is the same number...
    initial = trace.initial_storages()
    assert not any(trace.storages[s].initial for op in trace.ops for s in op.frees)
    assert trace.peak_live_bytes() - sum(trace.storages[s].nbytes for s in initial) == recorded
    # ... and replay's peak allocated equals it up to the pool's 512-B rounding.
    result = dtralloc.replay(trace)
    above_initial = result.peak_allocated_bytes - sum(_rounded(trace.storages[s].nbytes) for s in initial)
    assert recorded <= above_initial <= recorded + MIN_BLOCK * len(trace.storages)
    assert above_initial == pytest.approx(profiled, rel=0.05)


@pytest.mark.parametrize("name", MODELS)
def test_model_traces_are_consistent(model_traces, name):
    trace = model_traces[name]
    trace.validate()
    _assert_deaths_consistent(trace)
    assert any(op.backward for op in trace.ops) and not trace.ops[0].backward
    # Autograd's backward kernels run inside the backward pass and only there.
    for op in trace.ops:
        if "_backward" in op.name:
            assert op.backward, op.name
    # One backward pass: a contiguous run of ops, between forward and optimizer.
    first_bwd = next(i for i, op in enumerate(trace.ops) if op.backward)
    last_bwd = max(i for i, op in enumerate(trace.ops) if op.backward)
    assert all(op.backward for op in trace.ops[first_bwd:last_bwd + 1])
    assert any(op.mutated for op in trace.ops[last_bwd + 1:]), "the optimizer updates in place"
    if name != "convnet":
        assert any(op.random for op in trace.ops), "dropout is random"
    else:  # two BatchNorm2d layers, each updating its running statistics in place
        bn = [op for op in trace.ops if op.name == "aten::native_batch_norm"]
        assert len(bn) == 2
        assert all(len(op.mutated) == 2 and all(trace.storages[s].initial for s in op.mutated) for op in bn)
    assert trace.total_duration_ns() > 0
    assert all(op.flops >= 0 and op.bytes_moved >= 0 for op in trace.ops)
    assert trace.meta["name"] == name and trace.meta["devices"] == ["cpu"]
    assert name in trace.summary()


def _assert_deaths_consistent(trace: Trace) -> None:
    """Every storage dies at most once, exactly once unless it outlives the
    step, and is never used by an op after its death."""
    died_at: dict[int, int] = {s: -1 for s in trace.frees_before}
    for i, op in enumerate(trace.ops):
        for s in op.frees:
            assert s not in died_at, f"storage {s} dies twice"
            died_at[s] = i
    for s, storage in enumerate(trace.storages):
        assert (s in died_at) != storage.outlives, s
    for i, op in enumerate(trace.ops):
        for s in op.inputs + op.outputs + op.mutated:
            assert died_at.get(s, math.inf) >= i, f"op {i} ({op.name}) uses storage {s} after its death"
        for s in op.created:
            assert died_at.get(s, math.inf) >= i


# -- tags on ops with known schemas ----------------------------------------------

def _record(fn, **kw) -> Trace:
    trace = dtralloc.trace.record(fn, **kw)
    trace.validate()
    _assert_deaths_consistent(trace)
    return trace


def _ops(trace: Trace, name: str) -> list[Op]:
    found = [op for op in trace.ops if op.name == name]
    assert found, f"no {name} in {[op.name for op in trace.ops]}"
    return found


def test_view_ops_alias_their_input_storage():
    x = torch.randn(16, 64)

    def step():
        return x.view(64, 16).t().transpose(0, 1).expand(2, 64, 16)[:, 1:3]

    trace = _record(step)
    names = [op.name for op in trace.ops]
    assert names[:4] == ["aten::view", "aten::t", "aten::transpose.int", "aten::expand"]
    # torch before 2.9 also dispatches the whole-dimension slice `:`.
    assert names[4:] in (["aten::slice.Tensor"], ["aten::slice.Tensor"] * 2), names
    (sid,) = trace.initial_storages()
    for op in trace.ops:
        assert op.inputs == [sid] and op.outputs == [sid] and op.aliased == [sid]
        assert op.created == [] and op.mutated == [] and op.frees == []
    assert trace.storages[sid].outlives and len(trace.storages) == 1


def test_in_place_ops_mark_the_mutated_storage():
    x = torch.randn(32, 32)

    def step():
        g = x.clone()
        g.add_(1)
        g.mul_(2)
        g.copy_(x)
        g.zero_()
        return g

    trace = _record(step)
    clone, *writes = trace.ops
    assert clone.name == "aten::clone" and clone.mutated == [] and len(clone.created) == 1
    g = clone.created[0]
    assert [op.name for op in writes] == ["aten::add_.Tensor", "aten::mul_.Tensor", "aten::copy_", "aten::zero_"]
    for op in writes:
        assert op.mutated == [g] and op.outputs == [g]
        assert op.created == [] and op.aliased == [], "an in-place result is the written storage, not a view"
    x_sid = trace.initial_storages()
    assert _ops(trace, "aten::copy_")[0].inputs == [g] + x_sid


def test_foreach_and_optimizer_updates_mark_every_written_storage():
    params = [torch.randn(37, 53), torch.randn(53)]

    def step():
        torch._foreach_add_(params, [torch.ones_like(p) for p in params], alpha=0.5)

    trace = _record(step)
    (op,) = _ops(trace, "aten::_foreach_add_.List")
    assert sorted(trace.storages[s].nbytes for s in op.mutated) == [53 * 4, 37 * 53 * 4]
    assert all(trace.storages[s].initial for s in op.mutated)
    assert op.created == []


@pytest.mark.parametrize("foreach", [False, True])
def test_initial_storages_include_parameters_and_optimizer_state(foreach):
    # Sizes no other tensor has: 37x53 weights, 53 biases, batch 29.
    model = nn.Sequential(nn.Linear(41, 53), nn.Tanh(), nn.Linear(53, 37))
    opt = torch.optim.Adam(model.parameters(), foreach=foreach)
    x = torch.randn(29, 41)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    step()  # optimizer state exists from here on
    trace = _record(step)
    initial = [trace.storages[s] for s in trace.initial_storages()]
    for p in model.parameters():
        # The parameter, Adam's exp_avg and exp_avg_sq: alive before, alive after.
        same = [s for s in initial if s.nbytes == p.numel() * 4 and s.outlives]
        assert len(same) >= 3, (tuple(p.shape), len(same))
    steps = [s for s in initial if s.nbytes == 4 and s.outlives]
    assert len(steps) >= 4, "Adam keeps one step counter per parameter"
    # What the optimizer writes and keeps (parameters, state) existed before the
    # step; what it writes and drops are its temporaries (Adam's denominator).
    # The gradients it reads were made in the backward pass and are kept by .grad.
    last_bwd = max(i for i, op in enumerate(trace.ops) if op.backward)
    written = {s for op in trace.ops[last_bwd + 1:] for s in op.mutated}
    kept = {s for s in written if trace.storages[s].outlives}
    assert len(kept) == 4 * 4, "4 parameters, each with exp_avg, exp_avg_sq and step"
    assert all(trace.storages[s].initial for s in kept)
    assert all(trace.storages[s].producer > last_bwd for s in written - kept)
    for p in model.parameters():  # its gradient, made in backward, kept by .grad
        grads = [s for s in trace.storages if not s.initial and s.outlives and s.nbytes == p.numel() * 4]
        assert len(grads) == 1, tuple(p.shape)
    if foreach:
        assert any(op.name.startswith("aten::_foreach_") and op.mutated for op in trace.ops)


def test_random_ops_are_tagged():
    x = torch.randn(16, 64)

    def step():
        nn.functional.dropout(x, 0.5, training=True)
        torch.empty(10).bernoulli_(0.3)
        torch.randn(10)
        torch.rand_like(x)
        torch.empty(5).normal_()
        torch.randint(0, 5, (3,))
        return x.exp() + x.t().sum()

    trace = _record(step)
    random = {op.name for op in trace.ops if op.random}
    assert {"aten::bernoulli_.float", "aten::randn", "aten::rand_like", "aten::normal_",
            "aten::randint.low"} <= random
    for name in ("aten::exp", "aten::add.Tensor", "aten::sum", "aten::t", "aten::empty.memory_format"):
        assert not any(op.random for op in _ops(trace, name)), name


@pytest.mark.parametrize("m,k,n", [(16, 64, 8), (7, 3, 129)])
def test_matmul_flops_follow_torch_formulas(m, k, n):
    a, b, bias = torch.randn(m, k), torch.randn(k, n), torch.randn(n)

    def step():
        return a @ b, torch.addmm(bias, a, b)

    trace = _record(step)
    (mm,) = _ops(trace, "aten::mm")
    (addmm,) = _ops(trace, "aten::addmm")
    assert mm.flops == addmm.flops == 2 * m * n * k
    assert mm.bytes_moved == 4 * (m * k + k * n + m * n)
    assert addmm.bytes_moved == 4 * (n + m * k + k * n + m * n)


def test_multi_output_ops_record_every_output():
    x = torch.randn(16, 64)
    mean, var = torch.zeros(64), torch.ones(64)

    def step():
        torch.max(x, dim=1)
        torch.topk(x, 3)
        torch.split(x, 5, dim=0)
        torch.chunk(x, 3, dim=1)
        nn.functional.layer_norm(x, (64,))
        nn.functional.batch_norm(x, mean, var, training=True)
        nn.functional.batch_norm(x, mean, var, training=False)

    trace = _record(step)
    dtypes = lambda sids: [trace.storages[s].dtype for s in sids]  # noqa: E731
    sizes = lambda sids: [trace.storages[s].nbytes for s in sids]  # noqa: E731
    (op,) = _ops(trace, "aten::max.dim")
    assert op.outputs == op.created and dtypes(op.outputs) == ["float32", "int64"]
    assert sizes(op.outputs) == [16 * 4, 16 * 8]
    (op,) = _ops(trace, "aten::topk")
    assert op.outputs == op.created and sizes(op.outputs) == [16 * 3 * 4, 16 * 3 * 8]
    (x_sid,) = _ops(trace, "aten::max.dim")[0].inputs
    for op in _ops(trace, "aten::split.Tensor"):  # split and chunk: views, one per piece
        assert op.created == [] and op.outputs == op.aliased and set(op.outputs) == {x_sid}
    assert [len(op.outputs) for op in _ops(trace, "aten::split.Tensor")] == [4, 3]
    (op,) = _ops(trace, "aten::native_layer_norm")
    assert len(op.outputs) == 3 and op.outputs == op.created
    assert sizes(op.outputs) == [16 * 64 * 4, 16 * 4, 16 * 4]  # output, mean, rstd
    train, evaluate = _ops(trace, "aten::native_batch_norm")
    assert len(train.outputs) == 3 and train.outputs == train.created
    # Training batch norm updates the running statistics in place (its schema
    # does not say so); evaluation only reads them.
    assert sorted(train.mutated) == sorted(trace.initial_storages()[1:])
    assert evaluate.mutated == [] and set(train.mutated) <= set(evaluate.inputs)


def test_no_grad_autograd_and_backward_flags():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(8, 64)

    def step():
        with torch.no_grad():
            scaled = x * 2
        loss = (scaled @ w).relu().sum()
        loss.backward()
        return loss

    trace = _record(step)
    first = trace.ops[0]
    assert first.name == "aten::mul.Tensor" and not first.backward, "no_grad ops are recorded, as forward"
    (bwd,) = _ops(trace, "aten::threshold_backward")
    assert bwd.backward
    forward_mm, *backward_mm = _ops(trace, "aten::mm")
    assert not forward_mm.backward
    assert backward_mm and all(op.backward for op in backward_mm)
    # The gradient lands in w.grad and outlives the step.
    grad_nbytes = 64 * 64 * 4
    assert any(s.nbytes == grad_nbytes and s.outlives and not s.initial for s in trace.storages)


def test_autocast_records_casts_and_bf16_storages():
    lin = nn.Linear(64, 32)
    x = torch.randn(16, 64)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lin(x)
        return y.float().sum()

    trace = _record(step)
    casts = _ops(trace, "aten::_to_copy")
    bf16 = [s for op in casts for s in op.created if trace.storages[s].dtype == "bfloat16"]
    assert len(bf16) >= 3, "weight, bias and input are cast to bf16"
    (addmm,) = _ops(trace, "aten::addmm")
    assert set(bf16) & set(addmm.inputs)
    assert [trace.storages[s].dtype for s in addmm.created] == ["bfloat16"]
    assert trace.storages[addmm.created[0]].nbytes == 16 * 32 * 2


def test_deaths_are_attached_to_the_op_after_which_they_happen():
    x = torch.randn(1000)
    kept = []

    def step():
        tmp = x * 5           # op 0: made and dropped at once
        del tmp
        a = x + 1             # op 1
        b = a * 2             # op 2
        del a                 # dies after op 2
        kept.append(b * 3)    # op 3, kept by the caller
        c = b.sum()           # op 4; b dies on return, c is returned
        return c

    trace = _record(step)
    assert [op.name for op in trace.ops] == [
        "aten::mul.Tensor", "aten::add.Tensor", "aten::mul.Tensor", "aten::mul.Tensor", "aten::sum"]
    made = [op.created[0] for op in trace.ops]
    assert trace.ops[0].frees == [made[0]]
    assert trace.ops[1].frees == []
    assert trace.ops[2].frees == [made[1]]
    assert trace.ops[4].frees == [made[2]]
    assert [trace.storages[s].outlives for s in made] == [False, False, False, True, True]
    assert trace.storages[0].initial and trace.storages[0].outlives  # x
    kept.clear()


def test_storages_kept_by_autograd_die_in_backward():
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(64, 256)

    def step():
        h = (x @ w).tanh()     # tanh's output is saved for backward
        loss = h.sum()
        del h
        loss.backward()
        return loss

    trace = _record(step)
    (tanh,) = _ops(trace, "aten::tanh")
    (saved,) = tanh.created
    died = next(i for i, op in enumerate(trace.ops) if saved in op.frees)
    assert trace.ops[died].backward, "freed by autograd once the backward pass no longer needs it"


def test_tensors_made_from_data_in_the_step_are_not_initial():
    np = pytest.importorskip("numpy")
    x = torch.randn(100, 100)

    def step():
        a = torch.tensor([1.0, 2.0, 3.0])
        b = torch.as_tensor([4.0] * 1000)
        c = torch.from_numpy(np.ones(2000, dtype="float32"))
        return a * 2, b + 1, c * x.sum()

    trace = _record(step)
    lifts = _ops(trace, "aten::lift_fresh")
    assert len(lifts) == 3
    for op, nbytes in zip(lifts, (12, 4000, 8000)):
        assert op.inputs == [] and len(op.created) == 1 and op.outputs == op.created
        assert trace.storages[op.created[0]].nbytes == nbytes
    assert [trace.storages[s].nbytes for s in trace.initial_storages()] == [40000]  # only x


def test_durations_and_names():
    x = torch.randn(64, 64)

    def my_step():
        return (x @ x).sum()

    timed = _record(my_step)
    assert timed.meta["name"] == "my_step" and timed.meta["durations"] == "wall clock"
    assert all(op.duration_ns > 0 for op in timed.ops)
    untimed = _record(my_step, name="other", time_ops=False)
    assert untimed.meta["name"] == "other" and untimed.meta["durations"] == "none"
    assert untimed.total_duration_ns() == 0
    assert [op.name for op in untimed.ops] == [op.name for op in timed.ops] == ["aten::mm", "aten::sum"]
    assert untimed.meta["torch"] == torch.__version__


def test_record_function_markers_are_not_ops():
    x = torch.randn(8)

    def step():
        with torch.profiler.record_function("my region"):
            return x + 1

    assert [op.name for op in _record(step).ops] == ["aten::add.Tensor"]


def test_step_errors_propagate_and_leave_no_mode_behind():
    def step():
        torch.randn(2) @ torch.randn(3)

    with pytest.raises(RuntimeError):
        dtralloc.trace.record(step)
    # The dispatch mode is gone: a later recording starts from an empty trace.
    assert [op.name for op in _record(lambda: torch.ones(2) * 2).ops] == ["aten::ones", "aten::mul.Tensor"]


# -- validate -----------------------------------------------------------------

def _tiny_trace() -> Trace:
    """Initial storage 0; op 0 makes 1 from 0; op 1 makes 2 from 1 and frees 1."""
    storages = [Storage(4096, "cpu", "float32", True, outlives=True),
                Storage(4096, "cpu", "float32", False, producer=0),
                Storage(64, "cpu", "float32", False, outlives=True, producer=1)]
    ops = [Op("aten::exp", inputs=[0], outputs=[1], created=[1]),
           Op("aten::sum", inputs=[1], outputs=[2], created=[2], frees=[1])]
    return Trace(storages, ops, meta={"name": "tiny"})


def test_validate_and_timeline_of_a_hand_made_trace():
    t = _tiny_trace()
    t.validate()
    assert t.live_bytes_timeline() == [8192, 4096 + 4096 + 64]
    assert t.peak_live_bytes() == 8256
    assert t.initial_storages() == [0]


@pytest.mark.parametrize("damage,message", [
    (lambda t: t.ops[1].inputs.append(7), "out of range"),
    (lambda t: t.ops[1].created.append(9), "out of range"),
    (lambda t: t.ops[0].frees.append(1), "reads dead storage"),
    (lambda t: t.ops[1].frees.append(1), "dies while not alive"),
    (lambda t: t.ops[1].created.append(1), "created twice"),
    (lambda t: setattr(t.storages[2], "producer", 0), "names another producer"),
    (lambda t: setattr(t.storages[2], "outlives", False), "outlives=False"),
    (lambda t: t.frees_before.append(1), "dies while not alive"),
])
def test_validate_names_the_inconsistency(damage, message):
    t = _tiny_trace()
    damage(t)
    with pytest.raises(ValueError, match=message):
        t.validate()


# -- files --------------------------------------------------------------------

XZ_MAGIC = b"\xfd7zXZ\x00"


@pytest.mark.parametrize("name", MODELS)
def test_save_load_round_trips_recorded_traces_exactly(model_traces, tmp_path, name):
    trace = model_traces[name]
    path = tmp_path / f"{name}.dtrace"
    trace.save(str(path))
    assert path.read_bytes()[:6] == XZ_MAGIC
    loaded = dtralloc.trace.load(str(path))
    assert loaded == trace
    loaded.validate()
    # Compact: well under 100 bytes per op for these traces.
    assert path.stat().st_size < 100 * len(trace.ops)
    assert dtralloc.replay(loaded) == dtralloc.replay(trace)


_names = st.text(min_size=1, max_size=12)
_sids = st.lists(st.integers(0, 50), max_size=4)


@st.composite
def _traces(draw):
    storages = draw(st.lists(st.builds(
        Storage, nbytes=st.integers(0, 1 << 40), device=st.sampled_from(["cpu", "cuda:0", "cuda:1"]),
        dtype=st.sampled_from(["float32", "bfloat16", "int64", "unknown"]), initial=st.booleans(),
        outlives=st.booleans(), producer=st.integers(-1, 100)), max_size=20))
    ops = draw(st.lists(st.builds(
        Op, name=_names, inputs=_sids, outputs=_sids, created=_sids, mutated=_sids, aliased=_sids,
        random=st.booleans(), backward=st.booleans(), duration_ns=st.integers(0, 1 << 50),
        flops=st.integers(0, 1 << 60), bytes_moved=st.integers(0, 1 << 50), frees=_sids), max_size=20))
    meta = draw(st.dictionaries(_names, st.one_of(st.integers(), _names), max_size=3))
    return Trace(storages, ops, draw(_sids), meta)


@settings(max_examples=25)  # each save runs xz at preset 9 (~0.1 s)
@given(_traces())
def test_save_load_round_trips_any_trace(tmp_path_factory, trace):
    path = tmp_path_factory.mktemp("rt") / "t.dtrace"
    trace.save(str(path))
    assert dtralloc.trace.load(str(path)) == trace


def _write_xz_json(path, doc) -> str:
    with lzma.open(path, "wt", encoding="utf-8") as f:
        json.dump(doc, f)
    return str(path)


def _document(trace: Trace, tmp_path) -> dict:
    path = tmp_path / "good.dtrace"
    trace.save(str(path))
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def test_load_rejects_files_that_are_not_traces(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("hello, not a trace")
    with pytest.raises(ValueError, match="not a dtralloc trace.*xz"):
        dtralloc.trace.load(str(plain))
    not_json = tmp_path / "nojson.dtrace"
    with lzma.open(not_json, "wt") as f:
        f.write("{this is not json")
    with pytest.raises(ValueError, match="bad JSON"):
        dtralloc.trace.load(str(not_json))
    for doc in ({"format": "something-else", "version": 1}, [1, 2, 3], {"version": FORMAT_VERSION}):
        with pytest.raises(ValueError, match=f"no '{FORMAT_NAME}' header"):
            dtralloc.trace.load(_write_xz_json(tmp_path / "other.dtrace", doc))


def test_load_rejects_other_format_versions(tmp_path):
    doc = _document(_tiny_trace(), tmp_path)
    for version in (FORMAT_VERSION + 1, 0, None):
        doc["version"] = version
        with pytest.raises(ValueError, match=f"version {version}.*reads version {FORMAT_VERSION}"):
            dtralloc.trace.load(_write_xz_json(tmp_path / "v.dtrace", doc))


def test_load_rejects_truncated_and_damaged_files(tmp_path):
    good = tmp_path / "good.dtrace"
    _tiny_trace().save(str(good))
    data = good.read_bytes()
    cut = tmp_path / "cut.dtrace"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        dtralloc.trace.load(str(cut))
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    bad = tmp_path / "flipped.dtrace"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(ValueError, match="dtralloc trace"):
        dtralloc.trace.load(str(bad))
    doc = _document(_tiny_trace(), tmp_path)
    del doc["ops"]["inputs"]
    with pytest.raises(ValueError, match="damaged.*inputs"):
        dtralloc.trace.load(_write_xz_json(tmp_path / "body.dtrace", doc))
    with pytest.raises(FileNotFoundError):
        dtralloc.trace.load(str(tmp_path / "missing.dtrace"))
