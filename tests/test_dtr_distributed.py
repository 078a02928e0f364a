"""Live DTR with torch.distributed on CPU (gloo): collectives.

A collective must never be rerun by a recompute (on one rank alone it would
hang the others or pair with another collective). The tests run a one-rank
gloo group in this process (real c10d ops, DDP's real reducer).
"""
from __future__ import annotations

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


@pytest.mark.parametrize("how", ["functional", "c10d"])
def test_a_value_written_in_place_by_a_collective_is_pinned_never_recomputed(world, how):
    torch.manual_seed(0)
    w = torch.randn(64, requires_grad=True)
    before = _collectives()
    _in_place_collective_loss(how, world, w).backward()
    launched_plain, plain = _collectives() - before, w.grad
    w.grad = None
    before = _collectives()
    with dtralloc.dtr(device="cpu", chaos=True, check_invariants=True) as s:
        _in_place_collective_loss(how, world, w).backward()
    assert _collectives() - before == launched_plain == 1
    assert torch.equal(w.grad, plain)
    assert s.stats()["evictions"] > 0 and s.stats()["remats"] > 0  # what does not read the collective still is


def test_ddp_training_steps_under_chaos_match_plain(world):
    def steps(session=None):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        out, evictions = [], 0
        for _ in range(3):
            x = torch.randn(16, 32)
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
            out.append(loss.detach())
        return out + [p.detach().clone() for p in model.parameters()], evictions

    before = _collectives()
    plain, _ = steps()
    launched_plain = _collectives() - before
    before = _collectives()
    got, evictions = steps(lambda: dtralloc.dtr(device="cpu", chaos=True, check_invariants=True))
    assert _collectives() - before == launched_plain
    assert all(torch.equal(a, b) for a, b in zip(plain, got))
    assert evictions > 0
