"""Property-based stress of dtralloc.Pool (hypothesis, stateful).

Random malloc / free / record_stream / complete_events / empty_cache / bad-free
sequences over streams 0..3, sizes log-uniform from 1 B to 64 MiB plus the
policy's boundary sizes, under a budget small enough that OOMs happen, with
random confs (max_split_size_mb, max_non_split_rounding_mb,
roundup_power2_divisions, garbage_collection_threshold) and a random eviction
hook. Under a tight budget a large-pool request may get a segment of its own
(2 MiB-rounded) size instead of a 20 MiB one; the model allows exactly that.
After every step:

* pool.check_invariants() (DESIGN.md invariants 1-5 by a full walk);
* a model of what the test holds: each block is where the snapshot says, on
  its stream, 512-aligned, not overlapping another live block, of the size the
  documented rounding rule gives; pending (record_stream) blocks stay pending
  until an event completes them; stats equal the model's sums;
* fragmentation keys equal what the snapshot shows.

A malloc that succeeds from the cache must return the best fit the model
predicts; one that fails must have had no way to succeed (no eligible cached
block on its stream, no room for a new segment under the budget, nothing left
to release). On the host backend every block carries a pattern unique to it
over its whole requested range, written at malloc and verified at free, so a
block handed out twice or a segment released under a live block shows up.

Budget: 100 examples x up to 50 steps per machine, about 20 s in all on two
cores. HYPOTHESIS_PROFILE=thorough runs many more.
"""
from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
from conftest import (
    MiB,
    stats_delta,
    torch_pool_kind,
    torch_round_size,
    torch_segment_size,
)
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import dtralloc

STREAMS = st.integers(0, 3)

BOUNDARY_SIZES = [1, 511, 512, 513, MiB - 1, MiB, MiB + 1, 10 * MiB - 512, 10 * MiB,
                  10 * MiB + 1, 20 * MiB, 21 * MiB, 64 * MiB]
# Log-uniform 1 B .. 64 MiB (2**26); shrinks towards 1 B.
SIZES = st.one_of(
    st.integers(0, 26 * 64).map(lambda k: max(1, int(2 ** (k / 64)))),
    st.sampled_from(BOUNDARY_SIZES),
)

# Log-uniform 1 MiB .. 64 MiB.
BIG_SIZES = st.integers(20 * 64, 26 * 64).map(lambda k: int(2 ** (k / 64)))


@st.composite
def confs(draw):
    conf = {}
    if draw(st.booleans()):
        conf["max_split_size_mb"] = draw(st.sampled_from([21, 24, 32, 40, 64]))
        if draw(st.booleans()):
            conf["max_non_split_rounding_mb"] = draw(st.sampled_from([0, 2, 8, 40, "none"]))
    if draw(st.booleans()):
        conf["roundup_power2_divisions"] = draw(st.sampled_from([0, 1, 2, 4, 8, 16]))
    if draw(st.booleans()):
        conf["garbage_collection_threshold"] = draw(st.sampled_from([0.3, 0.5, 0.8, 0.95]))
    return conf


def _own_segment_size(rounded):
    """A segment of the request's own size, rounded to 2 MiB."""
    return -(-rounded // (2 * MiB)) * (2 * MiB)


class HookError(RuntimeError):
    pass


_GOLDEN = 0x9E3779B97F4A7C15  # odd: serial * _GOLDEN mod 2**64 is unique per serial


@dataclass
class Held:
    size: int           # requested
    rounded: int        # by the documented rule
    block_size: int     # what the pool gave (>= rounded)
    stream: int
    tag: int            # the pattern written into the block
    evictable: bool
    recorded: set = field(default_factory=set)  # other streams (record_stream)


class PoolMachine(RuleBasedStateMachine):
    backend = "host"

    def __init__(self):
        super().__init__()
        self.pool = None

    # ------------------------------------------------------------------ setup

    @initialize(conf=confs(), budget_mb=st.integers(40, 160),
                hook_mode=st.sampled_from([None, None, "evict", "refuse", "raise"]))
    def setup(self, conf, budget_mb, hook_mode):
        self.conf = conf
        self.budget = budget_mb * MiB
        self.divisions = conf.get("roundup_power2_divisions", 0)
        self.max_split = conf.get("max_split_size_mb", 0) * MiB or None
        non_split_mb = conf.get("max_non_split_rounding_mb", 20)
        self.max_non_split = 1 << 62 if non_split_mb == "none" else non_split_mb * MiB
        conf_text = ",".join(f"{k}:{v}" for k, v in {**conf, "budget": f"{budget_mb}M"}.items())
        # Capacity above the budget: the budget is the limit that binds.
        self.pool = dtralloc.Pool(self.backend, capacity=2 * self.budget, conf=conf_text)
        self.data = self.pool.host_accessible
        self.held: dict[int, Held] = {}
        self.pending: dict[int, Held] = {}
        self.freed_addrs: dict[int, None] = {}  # in the order of their first free
        self.serial = 0
        self.ooms = self.hook_calls = self.invalid_frees = 0
        self.hook_mode = hook_mode
        if hook_mode is not None:
            self.pool.set_eviction_hook(self._hook)

    def teardown(self):
        if self.pool is None:
            return
        # When a step already failed, report that failure, not a follow-up.
        failing = sys.exc_info()[0] is not None
        try:
            self._return_everything_and_check()
        except Exception:
            if not failing:
                raise
        finally:
            self._release_best_effort()

    def _return_everything_and_check(self):
        pool = self.pool
        pool.set_eviction_hook(None)
        for addr in list(self.held):
            self._free_model(addr)
        for addr, h in self.pending.items():
            self._verify(addr, h)
        pool.complete_events()
        self.pending.clear()
        pool.empty_cache()
        pool.check_invariants()
        s = pool.stats()
        assert s["reserved_bytes.all.current"] == 0
        assert s["active.all.current"] == 0

    def _release_best_effort(self):
        pool, self.pool = self.pool, None
        pool.set_eviction_hook(None)
        for addr in self.held:
            try:
                pool.free(addr)
            except Exception:
                pass
        self.held.clear()
        pool.complete_events()
        pool.empty_cache()

    # ------------------------------------------------------------ data pattern

    def _fill(self, addr, h):
        if not self.data:
            return
        words = h.size // 8
        if words:
            np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(addr))[:] = h.tag
        if h.size % 8:
            ctypes.memset(addr + 8 * words, h.tag & 0xFF, h.size % 8)

    def _verify(self, addr, h):
        if not self.data:
            return
        words = h.size // 8
        if words:
            view = np.ctypeslib.as_array((ctypes.c_uint64 * words).from_address(addr))
            bad = np.flatnonzero(view != np.uint64(h.tag))
            assert bad.size == 0, f"block {addr:#x} overwritten at offset {8 * int(bad[0])}"
        tail = h.size % 8
        if tail:
            assert ctypes.string_at(addr + 8 * words, tail) == bytes([h.tag & 0xFF]) * tail

    # ------------------------------------------------------------ the model

    def _kind(self, rounded):
        return torch_pool_kind(rounded)

    def _eligible(self, block_size, rounded):
        if block_size < rounded:
            return False
        if self.max_split is not None:
            if rounded < self.max_split <= block_size:
                return False  # small requests never take oversize blocks
            if rounded >= self.max_split and block_size >= rounded + self.max_non_split:
                return False  # too much waste for an unsplittable block
        return True

    def _best_fit(self, rounded, stream, snap):
        """(size, address) of the cached block the pool must use, or None:
        the smallest free block of the stream's pool that fits, lowest
        address first, unless the oversize rules forbid it."""
        kind = self._kind(rounded)
        candidates = [(b["size"], b["address"])
                      for seg in snap["segments"]
                      if seg["stream"] == stream and seg["segment_type"] == kind
                      for b in seg["blocks"]
                      if b["state"] == "inactive" and b["size"] >= rounded]
        if not candidates:
            return None
        best = min(candidates)
        return best if self._eligible(best[0], rounded) else None

    def _splits(self, free_size, rounded):
        """torch's rule: is the rest of a free block split off?"""
        rest = free_size - rounded
        if self._kind(rounded) == "small":
            return rest >= 512
        oversize = self.max_split is not None and rounded >= self.max_split
        return not oversize and rest > MiB

    def _allocated_size(self, free_size, rounded):
        """Size of the block carved for `rounded` out of a free block."""
        return rounded if self._splits(free_size, rounded) else free_size

    def _free_model(self, addr):
        """The test frees a block it holds (a rule or the eviction hook)."""
        h = self.held.pop(addr)
        self._verify(addr, h)
        self.pool.free(addr)
        self.freed_addrs.setdefault(addr)
        if h.recorded:
            self.pending[addr] = h

    def _hook(self, nbytes, stream):
        self.hook_calls += 1
        assert nbytes > 0 and 0 <= stream <= 3
        victims = [a for a, h in self.held.items() if h.evictable]
        if self.hook_mode == "refuse":
            return False
        if victims:
            self._free_model(victims[0])
        if self.hook_mode == "raise":
            raise HookError("the evictor failed")
        return bool(victims)

    def _reconcile_pending(self, synced_before):
        """Pending blocks the pool completed during a malloc: only a sync of
        all streams (the OOM ladder) may complete them."""
        if not self.pending:
            return
        snap_blocks = {b["address"]: b for seg in self.pool.snapshot()["segments"] for b in seg["blocks"]}
        done = [a for a in self.pending
                if snap_blocks.get(a, {}).get("state") != "active_pending_free"]
        if done:
            assert self.pool.stats()["num_sync_all_streams"] > synced_before, (
                "a block waiting on a record_stream event was completed without a sync")
        for a in done:
            # (Verified before the malloc: its memory may be released by now.)
            event("pending block completed by the OOM ladder")
            del self.pending[a]

    # ------------------------------------------------------------ rules

    @rule(size=SIZES, stream=STREAMS, evictable=st.booleans())
    def malloc(self, size, stream, evictable):
        pool = self.pool
        rounded = torch_round_size(size, self.divisions)
        snap = pool.snapshot()
        expected = self._best_fit(rounded, stream, snap)
        segments_before = {seg["address"] for seg in snap["segments"]}
        synced_before = pool.stats()["num_sync_all_streams"]
        calls_before = self.hook_calls
        for a, h in self.pending.items():
            self._verify(a, h)  # untouched while another stream may use it
        try:
            addr = pool.malloc(size, stream)
        except dtralloc.OutOfMemoryError as e:
            self.ooms += 1
            event("malloc: out of memory")
            assert expected is None, f"OOM although a cached block fits: {e}"
            self._reconcile_pending(synced_before)
            self._check_oom_was_unavoidable(rounded, stream, str(e))
            return
        except HookError:
            event("malloc: eviction hook raised")
            assert self.hook_mode == "raise" and self.hook_calls == calls_before + 1
            self._reconcile_pending(synced_before)
            return
        self._reconcile_pending(synced_before)
        assert addr % 512 == 0
        assert addr not in self.held
        event("malloc: cache hit" if expected is not None else "malloc: new segment or after fallbacks")
        if self.hook_calls > calls_before:
            event("malloc: served after eviction")
        seg, block = self._find(addr)
        assert block["state"] == "active_allocated" and block["requested_size"] == size
        assert seg["stream"] == stream, "a block crossed streams"
        assert seg["segment_type"] == self._kind(rounded)
        bs = block["size"]
        if expected is not None:
            assert addr == expected[1], "not the best fit from the cache"
            assert bs == self._allocated_size(expected[0], rounded), "split rule"
            assert self.hook_calls == calls_before
        elif seg["address"] not in segments_before:  # a fresh segment
            total = seg["total_size"]
            assert addr == seg["address"]
            if total != torch_segment_size(rounded):
                # Under a tight budget a large-pool request may get a segment
                # of its own 2 MiB-rounded size instead of a 20 MiB one, but
                # only when the 20 MiB one would not have fit.
                assert total == _own_segment_size(rounded) and self._kind(rounded) == "large"
                reserved_before = pool.stats()["reserved_bytes.all.current"] - total
                assert reserved_before + torch_segment_size(rounded) > self.budget
                event("malloc: own-size segment under a tight budget")
            assert bs == self._allocated_size(total, rounded), "split rule"
        else:  # carved from a block that a fallback step freed up
            assert bs == rounded or (bs > rounded and not self._splits(bs, rounded)), "split rule"
        self.serial += 1
        h = Held(size, rounded, bs, stream, (self.serial * _GOLDEN) & (2**64 - 1), evictable)
        self.held[addr] = h
        self._fill(addr, h)

    # Choices are drawn as indices into lists in allocation order, never as
    # addresses: host addresses differ from run to run, and hypothesis needs
    # the same draws to replay (and shrink) a failure.
    @rule(size=BIG_SIZES, stream=STREAMS, evictable=st.booleans())
    def malloc_big(self, size, stream, evictable):
        """Large-pool and oversize requests, where splitting rules differ."""
        self.malloc(size, stream, evictable)

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data(), shrink_by=st.sampled_from([0, 1, 512, MiB, 3 * MiB, 15 * MiB]))
    def free_and_ask_again(self, data, shrink_by):
        """Free a block and ask at once, on its stream, for about its size:
        the paths that reuse cached blocks (best fit, split of the merged
        block, oversize rounding)."""
        addr = self._pick(data, list(self.held)[-4:], "free_and_ask_again")
        if addr is not None:
            h = self.held[addr]
            self._free_model(addr)
            self.malloc(max(1, h.size - shrink_by), h.stream, evictable=False)

    @staticmethod
    def _pick(data, items, label):
        i = data.draw(st.integers(0, 1 << 16), label=label)
        return items[i % len(items)] if items else None

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data())
    def free(self, data):
        addr = self._pick(data, list(self.held), "free")
        if addr is not None:
            self._free_model(addr)

    @precondition(lambda self: self.pool is not None)
    @rule(data=st.data(), stream=STREAMS)
    def record_stream(self, data, stream):
        addr = self._pick(data, list(self.held), "record_stream")
        if addr is None:
            return
        self.pool.record_stream(addr, stream)
        h = self.held[addr]
        if stream != h.stream:
            h.recorded.add(stream)

    @precondition(lambda self: self.pool is not None)
    @rule()
    def complete_events(self):
        for addr, h in self.pending.items():
            self._verify(addr, h)  # untouched while another stream used it
        self.pool.complete_events()
        self.pending.clear()

    @precondition(lambda self: self.pool is not None)
    @rule()
    def empty_cache(self):
        for addr, h in self.pending.items():
            self._verify(addr, h)
        self.pool.empty_cache()
        self.pending.clear()
        for seg in self.pool.snapshot()["segments"]:
            assert any(b["state"] == "active_allocated" for b in seg["blocks"]), (
                "empty_cache kept a segment nobody uses")

    @precondition(lambda self: self.pool is not None)
    @rule(kind=st.sampled_from(["freed", "interior", "odd", "record_stream"]), data=st.data())
    def bad_free(self, kind, data):
        stale = self._pick(data, [a for a in self.freed_addrs if a not in self.held], "stale")
        base = self._pick(data, list(self.held), "base")
        if kind in ("freed", "record_stream") and stale is not None:
            addr = stale
        elif kind == "interior" and base is not None:
            addr = base + 256  # inside the block, never a block start (512-aligned)
        else:
            addr = 0x7  # never a block address
        before = self.pool.stats()
        segments_before = self.pool.snapshot()["segments"]
        with pytest.raises(dtralloc.InvalidPointerError):
            if kind == "record_stream":
                self.pool.record_stream(addr, 1)
            else:
                self.pool.free(addr)
        self.invalid_frees += 1
        after = self.pool.stats()
        delta = stats_delta(before, after)
        assert delta == {"num_invalid_frees": (self.invalid_frees - 1, self.invalid_frees)}
        assert self.pool.snapshot()["segments"] == segments_before

    # ------------------------------------------------------------ checks

    def _find(self, addr):
        for seg in self.pool.snapshot()["segments"]:
            for b in seg["blocks"]:
                if b["address"] == addr:
                    return seg, b
        raise AssertionError(f"{addr:#x} is in no segment of the snapshot")

    def _check_oom_was_unavoidable(self, rounded, stream, message):
        snap, s = self.pool.snapshot(), self.pool.stats()
        assert self._best_fit(rounded, stream, snap) is None, message
        reserved = s["reserved_bytes.all.current"]
        smallest = min(torch_segment_size(rounded), _own_segment_size(rounded))
        assert reserved + smallest > self.budget, (
            f"OOM with room for a new segment under the budget: {message}")
        for seg in snap["segments"]:
            states = {b["state"] for b in seg["blocks"]}
            assert states != {"inactive"}, "an entirely free segment survived the retry ladder"
            assert "active_pending_free" not in states, "the retry ladder did not wait for events"
        assert "budget" in message.lower() and "fragmentation" in message.lower()

    @invariant()
    def consistent(self):
        if self.pool is None:
            return
        pool = self.pool
        pool.check_invariants()
        s, snap = pool.stats(), pool.snapshot()
        blocks = {b["address"]: (seg, b) for seg in snap["segments"] for b in seg["blocks"]}
        for addr, h in self.held.items():
            seg, b = blocks[addr]
            assert (b["state"], b["size"], b["requested_size"]) == ("active_allocated", h.block_size, h.size)
            assert seg["stream"] == h.stream
        for addr, h in self.pending.items():
            seg, b = blocks[addr]
            assert (b["state"], b["size"]) == ("active_pending_free", h.block_size)
        states = [b["state"] for _, b in blocks.values()]
        assert states.count("active_allocated") == len(self.held)
        assert states.count("active_pending_free") == len(self.pending)

        # Live blocks: 512-aligned and disjoint.
        live = sorted((a, h.block_size) for a, h in {**self.held, **self.pending}.items())
        assert all(a % 512 == 0 for a, _ in live)
        for (a, n), (b, _) in zip(live, live[1:]):
            assert a + n <= b, f"blocks {a:#x}+{n} and {b:#x} overlap"

        # Stats equal the model.
        held = self.held.values()
        assert s["allocation.all.current"] == len(self.held)
        assert s["requested_bytes.all.current"] == sum(h.size for h in held)
        assert s["allocated_bytes.all.current"] == sum(h.block_size for h in held)
        assert s["allocated_bytes.all.current"] >= sum(h.rounded for h in held)
        assert s["allocated_bytes.small_pool.current"] == sum(
            h.block_size for h in held if self._kind(h.rounded) == "small")
        assert s["active.all.current"] == len(self.held) + len(self.pending)
        assert s["active_bytes.all.current"] == (
            sum(h.block_size for h in held) + sum(h.block_size for h in self.pending.values()))
        assert s["reserved_bytes.all.current"] == sum(seg["total_size"] for seg in snap["segments"])
        assert s["reserved_bytes.all.current"] <= self.budget
        assert s["reserved_bytes.all.peak"] <= self.budget
        assert s["num_ooms"] == self.ooms
        assert s["num_eviction_calls"] == self.hook_calls
        assert s["num_invalid_frees"] == self.invalid_frees

        # Fragmentation keys equal what the snapshot shows.
        free = [b["size"] for _, b in blocks.values() if b["state"] == "inactive"]
        assert s["fragmentation.free_bytes"] == sum(free)
        assert s["fragmentation.largest_free_bytes"] == max(free, default=0)
        expected_external = 1 - max(free) / sum(free) if free else 0.0
        assert s["fragmentation.external"] == pytest.approx(expected_external)
        assert s["fragmentation.reserved_unallocated_bytes"] == (
            s["reserved_bytes.all.current"] - s["allocated_bytes.all.current"])


class VirtualPoolMachine(PoolMachine):
    """Same rules on the virtual backend (no bytes, first-fit address reuse)."""

    backend = "virtual"


# A CI-sized budget unless the profile asks for more (HYPOTHESIS_PROFILE=thorough).
_STRESS = settings(
    settings.default,
    max_examples=max(100, settings.default.max_examples if settings.default.max_examples > 100 else 0),
    stateful_step_count=50,
    deadline=None,
)

TestHostPoolStress = pytest.mark.slow(PoolMachine.TestCase)
TestHostPoolStress.settings = _STRESS
TestVirtualPoolStress = pytest.mark.slow(VirtualPoolMachine.TestCase)
TestVirtualPoolStress.settings = _STRESS
