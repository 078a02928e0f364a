"""Live DTR with torch.distributed on CPU (gloo): collectives and FSDP.

A collective must never be rerun by a recompute (on one rank alone it would
hang the others or pair with another collective), and FSDP frees and refills
its unsharded parameters by resizing their storages outside the dispatcher,
which no recipe may read across. Most tests run a one-rank gloo group in this
process (real c10d ops, real FSDP2 hooks); one spawns two ranks.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys

import pytest
import torch
import torch.nn as nn

import dtralloc

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)


@pytest.fixture(scope="module")
def world():
    """A one-rank gloo group for this module (an in-process store: no port)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _collectives() -> int:
    """How many collectives the default group has launched."""
    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def _in_place_collective_loss(how, group, w):
    h = w * 2
    with torch.no_grad():
        if how == "functional":  # _c10d_functional.all_reduce_ writes h; wait_tensor lets the work go
            torch.ops._c10d_functional.all_reduce_(h, "sum", group.group_name)
            torch.ops._c10d_functional.wait_tensor(h)
        else:  # c10d::allreduce_
            dist.all_reduce(h, group=group)
    # mul saves the written h; exp's backward is an op before mul's, where
    # chaos evicts whatever it can (h is no longer the program's)
    return (h * h).exp().sum()


def _collective_step(how, group, w, session=None):
    """A backward through _in_place_collective_loss, inside a fresh
    `session()` when given: (collectives launched, w's gradient, the
    session's stats or None). Also the CUDA scenario's."""
    before = _collectives()
    stats = None
    if session is None:
        _in_place_collective_loss(how, group, w).backward()
    else:
        with session() as s:
            _in_place_collective_loss(how, group, w).backward()
        stats = s.stats()
    if w.is_cuda:
        torch.cuda.synchronize()
    grad, w.grad = w.grad, None
    return _collectives() - before, grad, stats


@pytest.mark.parametrize("how", ["functional", "c10d"])
def test_a_value_written_in_place_by_a_collective_is_pinned_never_recomputed(world, how):
    torch.manual_seed(0)
    w = torch.randn(64, requires_grad=True)
    launched_plain, plain, _ = _collective_step(how, world, w)
    launched, got, stats = _collective_step(
        how, world, w, lambda: dtralloc.dtr(device="cpu", chaos=True, check_invariants=True))
    assert launched == launched_plain == 1
    assert torch.equal(got, plain)
    assert stats["evictions"] > 0 and stats["remats"] > 0  # what does not read the collective still is


def _free_and_refill(w, refill):
    """FSDP's reshard and unshard on w's storage: resized to nothing, then
    back (what a fresh allocation holds is garbage: NaNs here, written
    outside the dispatcher), and refilled with `refill` under
    _unsafe_preserve_version_counter."""
    storage = w.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    storage.resize_(nbytes)
    ctypes.memset(storage.data_ptr(), 0xFF, nbytes)
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(w):
        w.copy_(refill)


def _resized_parameter_loss(w, x):
    """FSDP's pattern on one parameter: use it, free its storage, allocate it
    again (what a fresh allocation holds is garbage: written here outside the
    dispatcher), refill it with the same values under
    _unsafe_preserve_version_counter, use it again."""
    a = x @ w
    h = a.sin()  # saves a, which is no longer the program's: chaos evicts it
    del a
    _free_and_refill(w, w.detach().clone())
    return ((h @ w.t()).sigmoid() * h).sum()


def test_a_storage_resized_outside_the_dispatcher_is_never_read_by_a_recompute():
    torch.manual_seed(0)
    x = torch.randn(16, 32)
    w = torch.randn(32, 32, requires_grad=True)
    loss = _resized_parameter_loss(w, x)
    loss.backward()
    plain = (loss.detach(), w.grad)
    w.grad = None
    with dtralloc.dtr(device="cpu", chaos=True, check_invariants=True) as s:
        loss = _resized_parameter_loss(w, x)
        loss.backward()
    assert torch.equal(loss.detach(), plain[0]) and torch.equal(w.grad, plain[1])
    assert s.stats()["evictions"] > 0


def _refilled_otherwise_loss(w, x, refill, keep=None):
    """A storage resized away and refilled with other numbers (an owner may
    put back anything): what an op computed from the old ones stays as it
    was; what reads w after the refill, its saved tensor too, reads the new.
    `keep`: a list the program keeps the readers in (nothing evictable)."""
    a = x @ w
    h = a.sin()  # saves a
    if keep is None:
        del a
    else:
        keep += [a, h]
    _free_and_refill(w, refill)
    return ((h @ w.t()).sigmoid() * h).sum()


def _refill_run(rows, session=None, keep=None):
    """_refilled_otherwise_loss with x of `rows` rows and w of 64 KiB: (loss,
    w's gradient, w after the step, the session's stats or None; with
    "left_allocated": its bytes once the step's tensors are dropped)."""
    torch.manual_seed(0)
    x = torch.randn(rows, 128)
    w = torch.randn(128, 128, requires_grad=True)
    refill = w.detach() * 2
    if session is None:
        loss = _refilled_otherwise_loss(w, x, refill, keep)
        loss.backward()
        return loss.detach(), w.grad, w.detach(), None
    with session() as s:
        loss = _refilled_otherwise_loss(w, x, refill, keep)
        loss.backward()
    stats = s.stats()
    out = loss.detach().clone(), w.grad.clone(), w.detach().clone()
    del loss  # the gradient's recipe reads a (pinned) or w's copy: they go with it
    if keep:
        del keep[:]
    w.grad = None
    stats["left_allocated"] = s.stats()["allocated_bytes"]
    return (*out, stats)


@pytest.mark.parametrize("rows, copies", [(256, 1), (64, 0)])
def test_what_reads_a_resized_storage_recomputes_from_a_copy_of_what_it_read(rows, copies):
    # Where w (64 KiB) is smaller than its reader a (x @ w: 128 KiB at 256
    # rows), a copy of w is kept for a's recipe: a stays evictable (chaos
    # evicts it) and comes back from the numbers it was computed from, not
    # the refill, while mm's backward reads the refilled w as plain eager
    # does. Where a is smaller (32 KiB at 64 rows), a is pinned instead.
    plain = _refill_run(rows)
    got = _refill_run(rows, lambda: dtralloc.dtr(device="cpu", chaos=True, check_invariants=True))
    assert all(torch.equal(p, g) for p, g in zip(plain[:3], got[:3]))
    stats = got[3]
    assert stats["resize_copies"] == copies
    assert stats["left_allocated"] == 0


def _resized_under_pressure_loss(w, x, refill):
    """As _refilled_otherwise_loss, with the small pool's first three 2 MiB
    segments full at the resize: x @ w and its sine (1 MiB each at 2048
    rows), then four 1 MiB tensors, all held by the program; the four go
    after the refill, and what follows needs little memory."""
    a = x @ w
    h = a.sin()
    filler = [torch.ones(1 << 18) for _ in range(4)]
    _free_and_refill(w, refill)
    del a, filler
    return h.sum() * w.sum()


@pytest.mark.parametrize("budget_mib, copies", [(8, 1), (6, 0)])
def test_a_copy_for_a_resized_storage_is_made_only_where_the_budget_has_room(budget_mib, copies):
    # Under 6 MiB nothing can be evicted to make room for w's copy (64 KiB:
    # a fourth segment), and x @ w is pinned instead; under 8 MiB the copy is made.
    torch.manual_seed(0)
    x = torch.randn(2048, 128)
    w = torch.randn(128, 128, requires_grad=True)
    refill = w.detach() * 2
    start = w.detach().clone()
    results = []
    for session in (contextlib.nullcontext,
                    lambda: dtralloc.dtr(device="cpu", budget=budget_mib << 20, check_invariants=True)):
        with torch.no_grad():
            w.copy_(start)
        with session() as s:
            loss = _resized_under_pressure_loss(w, x, refill)
            loss.backward()
        results.append((loss.detach(), w.grad))
        w.grad = None
    assert all(torch.equal(p, g) for p, g in zip(*results))
    assert s.stats()["resize_copies"] == copies


def test_a_storage_the_session_made_leaves_the_mirror_when_resized_outside_the_dispatcher():
    # FSDP frees storages it made inside the session (resize_(0)): the CPU
    # mirror must let their blocks go (on CUDA the pool really frees them and
    # may hand the block to another value: the engine must not keep it)
    with dtralloc.dtr(device="cpu", check_invariants=True) as s:
        t = torch.ones(1 << 18)  # 1 MiB, made in the session
        y = t * 2
        before = s.stats()["allocated_bytes"]
        t.untyped_storage().resize_(0)
        freed = before - s.stats()["allocated_bytes"]
        t.untyped_storage().resize_(1 << 20)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t):
            t.fill_(1.0)
        z = (t + y).sum()
    assert freed == 1 << 20
    assert z.item() == 3 * (1 << 18)


def _train(model, batch, steps, session=None, device="cpu"):
    """`steps` AdamW steps on batches of shape `batch`, each rank its own,
    forward and backward inside a fresh `session()` when given: (losses,
    evictions)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1 + dist.get_rank())
    losses, evictions = [], 0
    for _ in range(steps):
        x = torch.randn(*batch, device=device)
        if session is None:
            loss = model(x).square().mean()
            loss.backward()
        else:
            with session() as s:
                loss = model(x).square().mean()
                loss.backward()
            evictions += s.stats()["evictions"]
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, evictions


def _fsdp_steps(reshard_after_forward, session=None, steps=2, device="cpu"):
    """`steps` AdamW steps of an FSDP2 model (four blocks with dropout, each
    its own FSDP unit): (losses + full parameters, evictions). Also the CUDA
    scenario's (tests/_dtr_gpu_worker.py distributed)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1)) for _ in range(4)],
                          nn.Linear(32, 4)).to(device)
    for block in model[:4]:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    losses, evictions = _train(model, (8, 32), steps, session, device)
    return losses + [p.full_tensor() for p in model.parameters()], evictions


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_fsdp2_training_steps_under_chaos_match_plain(world, reshard_after_forward):
    plain, _ = _fsdp_steps(reshard_after_forward)
    got, evictions = _fsdp_steps(reshard_after_forward,
                                 lambda: dtralloc.dtr(device="cpu", chaos=True, check_invariants=True))
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert evictions > 0


def _fsdp_bench():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_fsdp_budget

    return bench_fsdp_budget


def _fsdp_at_fraction(mode, family, fraction):
    """bench_fsdp_budget's `family` in `mode`: two plain steps, one step in a
    session without a budget, two at `fraction` of that step's peak, one
    intra-op thread (as the bench: at two, MKL's sgemm gave other bits now
    and then: docs/live.md, Known limits, not with MKL_CBWR set). Returns
    (whether the budgeted steps match plain bit for bit, the unbounded
    step's stats, the budgeted steps' stats)."""
    bench = _fsdp_bench()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, _, _ = bench.train(mode, 2, family=family)
        _, _, unbounded = bench.train(mode, 1, lambda: dtralloc.dtr(device="cpu"), family)
        budget = int(fraction * unbounded[0]["peak_bytes"])
        got, _, stats = bench.train(mode, 2, lambda: dtralloc.dtr(device="cpu", budget=budget), family)
    finally:
        torch.set_num_threads(threads)
    return all(torch.equal(a, b) for a, b in zip(plain, got)), unbounded[0], stats


@pytest.mark.parametrize("mode", ["FSDP2, reshard after forward", "FSDP2, no reshard after forward"])
def test_fsdp2_trains_under_a_budget_below_its_peak_and_matches_plain(world, mode):
    # bench/bench_fsdp_budget.py's model (six FSDP2 units, 512 wide, batch
    # 256) at 0.78 of its session's peak. Each reshard frees parameters (an
    # overwrite of values nothing can recompute): only what reads them is
    # pinned, so the rest of each block's activations and gradients stays
    # evictable. With everything computed from them pinned (the engine at
    # 92e9119) this ran out of memory in both modes.
    exact, _, stats = _fsdp_at_fraction(mode, "mlp", 0.78)
    assert exact and sum(s["evictions"] for s in stats) > 0


def test_fsdp2_reshards_recompute_nothing_where_what_is_kept_leaves_room(world):
    # bench_fsdp_budget.py's transformer blocks (four FSDP2 units, no
    # reshard after forward) at 0.9 of the session's peak: a budget the same
    # run meets without evicting anything. Each post-backward reshard frees a
    # weight whose dead input gradient is read by the gradients of the block
    # below; with little of the budget unevictable they are pinned and the
    # dead one goes (RematEngine::prepare_write). Bringing it back wherever
    # half the budget was allocated (the rule of d77f04c) recomputed
    # dozens of values a step here and evicted as many to make room.
    exact, _, stats = _fsdp_at_fraction("FSDP2, no reshard after forward", "gpt", 0.9)
    assert exact and [(s["evictions"], s["remats"]) for s in stats] == [(0, 0), (0, 0)]


def test_fsdp2_resharding_after_forward_trains_under_half_its_peak_with_copies_of_the_weights(world):
    # bench_fsdp_budget.py's residual conv blocks (four FSDP2 units, reshard
    # after forward) at 0.45 of the session's peak. Each reshard frees a
    # block's weights, read by its conv outputs, which outweigh them: a copy
    # of each weight serves the outputs' recipes, and they stay evictable
    # (Note [copy before a resize]). With the outputs pinned instead (the
    # engine before this test) the smallest budget that fit was 0.73 of the
    # peak (bench/results/fsdp_budget-2026-11-29b-cpu.md).
    exact, unbounded, stats = _fsdp_at_fraction("FSDP2, reshard after forward", "conv", 0.45)
    assert exact
    assert unbounded["resize_copies"] == 0  # nothing is evicted without a budget: no copy pays
    assert all(s["resize_copies"] > 0 and s["evictions"] > 0 for s in stats)


@pytest.mark.parametrize("bucket_view", [False, True], ids=["grads", "grads-as-bucket-views"])
def test_ddp_training_steps_under_chaos_match_plain(world, bucket_view):
    def steps(session=None):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4)),
            gradient_as_bucket_view=bucket_view)
        losses, evictions = _train(model, (16, 32), 3, session)
        return losses + [p.detach().clone() for p in model.parameters()], evictions

    before = _collectives()
    plain, _ = steps()
    launched_plain = _collectives() - before
    before = _collectives()
    got, evictions = steps(lambda: dtralloc.dtr(device="cpu", chaos=True, check_invariants=True))
    assert _collectives() - before == launched_plain
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert evictions > 0


_TWO_RANKS = r'''
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
import test_dtr_distributed as t, dtralloc
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
plain, _ = t._fsdp_steps(True)
got, evictions = t._fsdp_steps(True, lambda: dtralloc.dtr(device="cpu", chaos=True))
same = all(torch.equal(a, b) for a, b in zip(plain, got))
dist.destroy_process_group()
print("RESULT", rank, same, evictions, float(got[0]), flush=True)
'''


def test_fsdp2_on_two_ranks_under_chaos_matches_plain_and_does_not_hang(tmp_path):
    import subprocess

    store = tmp_path / "store"
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    here = os.path.dirname(os.path.abspath(__file__))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(store), here], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    results = [line.split() for out in outs for line in out.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2, "\n".join(outs)
    for _, rank, same, evictions, loss in results:
        assert same == "True", f"rank {rank} differs from plain:\n" + "\n".join(outs)
        assert int(evictions) > 0
    assert results[0][4] != results[1][4]  # the ranks drew different batches: a real two-rank run
