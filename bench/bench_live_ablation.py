"""Where a live dtr() training step's time goes: one model's step, side by side
in one process, under plain eager and under each layer a dtr() session adds.

A session costs per ATen op on the host (a dispatch mode, saved-tensor hooks,
the record call into C++, on CUDA a timing event per op) and per step in the
pool (segments made and given back at the budget: on a GPU each cudaFree
waits for the device). On a GPU the host runs ahead of the kernels, so the
per-op cost shows only once the host becomes the slower of the two: this
bench reports, per configuration, the host's time for the step (until the
step's Python returns) next to the step's wall time (after a synchronize),
and the cudaMalloc/cudaFree calls of the pool in the step, with the host time inside them.

Configurations (one process; on CUDA every one on the pool that
dtralloc.install("policy:dtralloc") made, so the pool is the same for all):

* plain                  the step as it is
* noop mode              under a TorchDispatchMode that only calls the op
* noop mode + hooks      the same with saved-tensor hooks that return what they get
* dtr                    dtralloc.dtr() without a budget
* dtr, no series         dtr(series=0): no per-op sample (the dashboard's series)
* dtr, no GPU op timing  CUDA: dtr() without the per-op CUDA timing event (op_timer.h);
                         op costs stay the host clock's (diagnostic only: the
                         session is made with no stream to mark)
* dtr, budget M          dtr(budget=M), M = plain's peak reserved bytes (on CPU:
                         the session mirror's peak without a budget)
* dtr, budget M, no series  the same with series=0: under a budget each op's
                         sample walks every resident value for the evictable
                         bytes (3 µs an op on ResNet-50's graph on CPU)
* dtr[, budget M], forward in the block  the session around the forward and
                         the loss only; backward and the optimizer's step run
                         after the block (the session alive, its budget in
                         force on CUDA), so their ops pass no dispatch mode.
                         On CPU the mirror counts what the block runs only.

Rounds alternate the configurations; per configuration the fastest round
counts (the least disturbed). Overheads are ratios to plain in the same run.
The configurations without a budget are timed first, those with budget M
after them, each group after a warm-up step of its own: on CUDA all share one
pool, which a budget shrinks (cached segments given back, each cudaFree
waiting for the device) and a step without one grows again (cudaMalloc), so
alternating the two groups would time those transitions in both instead of a
training loop's steady state. The report is rewritten after each batch, so a
run cut short keeps what it measured.

Each model runs at its base batch B and at multiples of it (--multiples;
ResNet-50 1 and 3, GPT-2 1 and 2.5 by default): at B the host is the slower
side on a GPU, at 3 B the kernels should be, and a session whose host costs
hide behind them shows wall close to plain's plus its recomputes. Where wall
comes close to host plus plain's wall instead, something makes the host wait
for the device each step. --profile says what: one step of plain, dtr and
dtr at budget M at the largest batch under torch.profiler (CUDA activity
only, so ATen ops are not instrumented), reporting the GPU's busy time (the
union of its kernels, copies and sets) against the step's span, and the CUDA
runtime and driver calls the host made, by name, with the ones that wait for
the device marked.

    python bench/bench_live_ablation.py [--models resnet50,gpt2] [--multiples 1,3] [--rounds 5] [--profile] [--out FILE.md]
    python bench/bench_live_ablation.py --smoke --device cpu     # tiny models, seconds
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _report import header, write  # noqa: E402
from bench_gpu_budget import BASE_BATCH, GPT2_LOSS_CHUNKS, SMOKE_BATCH, Model  # noqa: E402
from bench_live_overhead import CountMode, NoopMode, NoopModeAndHooks  # noqa: E402

FORWARD = ", forward in the block"
CONFIGS = ("plain", "noop mode", "noop mode + hooks", "dtr", "dtr, no series", "dtr, no GPU op timing",
           "dtr" + FORWARD, "dtr, budget M", "dtr, budget M, no series", "dtr, budget M" + FORWARD)
# Batches, as multiples of the model's base batch B: B, and one where the
# kernels should outlast the host, which M holds (on the first H100 run,
# 2026-11-27, dtr at budget M trained GPT-2 at 2.75-2.88 B with the logits
# whole, ResNet-50 at 5.75 B).
MULTIPLES = {"resnet50": (1.0, 3.0), "gpt2": (1.0, 2.5)}
PROFILED = ("plain", "dtr", "dtr, budget M")
# CUDA runtime and driver calls that wait for the device (or for a stream or
# an event): the ones that keep the host from running ahead of the kernels.
WAITS = ("Synchronize", "cudaFree", "cuMemFree", "cudaMemcpy", "cuMemcpyDtoH", "cuMemUnmap", "cudaHostAlloc")


def waits(name: str) -> bool:
    """Whether the CUDA call `name` makes the host wait for the device.
    cudaMemcpyAsync does not (unless to pageable host memory); cudaMemcpy does."""
    return any(w in name for w in WAITS) and "Async" not in name


@contextlib.contextmanager
def _without_gpu_timing():
    """dtr() sessions made inside get no stream to mark: the session then
    never creates its OpTimer (live_session.cpp), and op costs stay the
    clock's. For this ablation only."""
    from dtralloc.dtr import session as session_module

    original = session_module.helpers

    def helpers(device):
        h = original(device)
        h["current_stream"] = None
        return h

    session_module.helpers = helpers
    try:
        yield
    finally:
        session_module.helpers = original


@contextlib.contextmanager
def _untimed_session(device: str):
    """A dtr() session made without a stream to mark (_without_gpu_timing);
    yields the session, as `with dtr() as s` does."""
    from dtralloc.dtr import dtr

    with _without_gpu_timing():
        session = dtr(device=device)
    with session as s:
        yield s


class Bench:
    def __init__(self, name: str, batch: int, smoke: bool, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda
        self.device = "cuda" if cuda else "cpu"
        # GPT-2's loss in as many pieces as the budget bench's: the same model as the one whose figures it explains.
        self.m = Model(name, smoke, torch.device(self.device), GPT2_LOSS_CHUNKS if name == "gpt2" else 1)
        self.batch = self.m.batch(batch)
        self.budget = None

    def set_batch(self, size: int):
        self.batch = None  # the old one goes first
        self.batch = self.m.batch(size)

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def context(self, config: str):
        from dtralloc.dtr import dtr

        config = config.removesuffix(FORWARD)
        if config == "plain":
            return contextlib.nullcontext()
        if config == "noop mode":
            return NoopMode()
        if config == "noop mode + hooks":
            return NoopModeAndHooks()
        if config == "dtr":
            return dtr(device=self.device)
        if config == "dtr, no series":
            return dtr(device=self.device, series=0)
        if config == "dtr, no GPU op timing":
            return _untimed_session(self.device)
        if config == "dtr, budget M":
            return dtr(device=self.device, budget=self.budget)
        if config == "dtr, budget M, no series":
            return dtr(device=self.device, budget=self.budget, series=0)
        raise ValueError(config)

    def device_calls(self) -> tuple:
        """The pool's cudaMalloc and cudaFree calls so far, and the host
        nanoseconds inside them (cudaFree's wait for the device included)."""
        if not self.cuda:
            return (0, 0, 0)
        import dtralloc

        s = dtralloc.memory_stats()
        return (s.get("num_device_alloc", 0), s.get("num_device_free", 0),
                s.get("device_alloc_ns", 0) + s.get("device_free_ns", 0))

    def step(self, config: str) -> dict:
        """One step under `config`: its times and counts, or {"oom": message}
        where it did not fit (the model and optimizer stay usable: the
        gradients are dropped and the next step starts clean)."""
        import gc

        from bench_gpu_budget import _is_oom

        calls = self.device_calls()
        self.sync()
        start = time.perf_counter()
        message = None
        try:
            if config.endswith(FORWARD):
                s = self.context(config)
                self.m.step(self.batch, forward_in=s)
            else:
                with self.context(config) as s:
                    self.m.step(self.batch)
        except (RuntimeError, MemoryError) as e:
            if not _is_oom(e):
                raise
            message = (str(e).splitlines() or [type(e).__name__])[0]
            if message.endswith(":"):  # the first line introduces a list: its last sentence goes with it
                message = message[:message.rfind(". ") + 1] or message
        if message is not None:  # outside the handler: the traceback's frames (and tensors) are gone
            self.m.optimizer.zero_grad(set_to_none=True)
            gc.collect()
            self.sync()
            return {"oom": message}
        host = time.perf_counter() - start
        self.sync()
        wall = time.perf_counter() - start
        after = self.device_calls()
        stats = s.stats() if hasattr(s, "stats") else {}
        return {"host": host, "wall": wall, "mallocs": after[0] - calls[0], "frees": after[1] - calls[1],
                "device_ms": (after[2] - calls[2]) / 1e6,
                "evictions": stats.get("evictions", 0), "remats": stats.get("remats", 0),
                "gpu_timed_ops": stats.get("gpu_timed_ops", 0), "carried": stats.get("carried_costs", 0)}

    def profile(self, config: str) -> dict:
        """One step of `config` (after a warm one) under torch.profiler: the
        step's host and wall time there, the GPU's busy time (the union of
        its kernels', copies' and sets' intervals) and span, and the CUDA
        runtime and driver calls by name: {name: [calls, total µs]}. On CPU
        (the plumbing check) the CPU activity stands in, and the calls
        stay empty."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        if "oom" in self.step(config):
            return {"oom": True}
        activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        # acc_events: nothing to accumulate in a profiler used once, but torch
        # 2.11 warns without it.
        with profile(activities=[activity], acc_events=True) as prof:
            r = self.step(config)
        if "oom" in r:
            return {"oom": True}
        gpu, calls = [], {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                gpu.append((e.time_range.start, e.time_range.end))
            elif e.name.startswith("cu"):
                entry = calls.setdefault(e.name, [0, 0.0])
                entry[0] += 1
                entry[1] += e.time_range.elapsed_us()
        gpu.sort()
        busy, reach = 0.0, None
        for lo, hi in gpu:  # the union of the intervals
            if reach is None or lo > reach:
                busy += hi - lo
                reach = hi
            elif hi > reach:
                busy += hi - reach
                reach = hi
        span = reach - gpu[0][0] if gpu else 0.0  # the latest end less the earliest start
        return {"host": r["host"], "wall": r["wall"], "gpu_busy_us": busy, "gpu_span_us": span,
                "gpu_events": len(gpu), "calls": calls}

    def measure_budget(self) -> int:
        """M: plain's peak reserved bytes (CUDA), or a budget-free session's
        mirror peak (CPU)."""
        from dtralloc.dtr import dtr

        if self.cuda:
            import gc

            import dtralloc

            # What the pool caches from an earlier model's steps would count
            # in this one's peak reserved bytes.
            gc.collect()
            dtralloc.empty_cache()
            self.step("plain")
            dtralloc.reset_peak_memory_stats()
            self.step("plain")
            return int(dtralloc.memory_stats()["reserved_bytes.all.peak"])
        with dtr(device="cpu") as s:
            self.m.step(self.batch)
        return int(s.stats()["peak_bytes"])

    def ops_per_step(self) -> int:
        with CountMode() as counter:
            self.m.step(self.batch)
        return counter.ops


def groups(configs) -> list:
    """The configurations without a budget, then those with one (timed
    apart: see the module's docstring)."""
    return [[c for c in configs if "budget" not in c], [c for c in configs if "budget" in c]]


def run(name: str, batch: int, multiples, rounds: int, smoke: bool, cuda: bool, profile: bool,
        progress=lambda result: None) -> dict:
    """One model at each multiple of `batch`; `progress(result so far)` after
    each batch and after the profile."""
    b = Bench(name, batch, smoke, cuda)
    configs = [c for c in CONFIGS if cuda or c != "dtr, no GPU op timing"]
    b.budget = b.measure_budget()  # at B
    ops = b.ops_per_step()
    result = {"model": name, "description": b.m.description, "batch": batch, "ops": ops, "budget": b.budget,
              "runs": [], "profiled": {}, "profiled_batch": None}
    for m in multiples:
        size = max(1, round(m * batch))
        b.set_batch(size)
        best: dict = {}
        for group in groups(configs):
            for c in group:  # warm-up: kernels, optimizer state, the sessions' first step, the pool's size
                b.step(c)
            for _ in range(rounds):
                for c in group:
                    r = b.step(c)
                    if c not in best or ("oom" in best[c] and "oom" not in r) or (
                            "oom" not in r and r["wall"] < best[c]["wall"]):
                        best[c] = r
        result["runs"].append({"batch": size, "multiple": m, "rows": {c: best[c] for c in configs}})
        progress(result)
    if profile:  # at the largest batch, which the loop above left set
        result["profiled_batch"] = result["runs"][-1]["batch"]
        for c in PROFILED:
            result["profiled"][c] = b.profile(c)
        progress(result)
    return result


def _profile_section(res: dict, cuda: bool) -> list:
    lines = [f"### Under torch.profiler, batch {res['profiled_batch']}", "",
             "One step each (after a warm one), CUDA activity only. GPU busy: the union of its kernels', copies' and "
             "sets' times; span: first start to last end. The profiler adds its own cost to every CUDA call; three "
             "cudaDeviceSynchronize are not the step's: the bench's before the step and after it, and the "
             "profiler's own as it stops.", "",
             "| config | host ms | wall ms | GPU busy ms | GPU span ms | GPU idle in span | CUDA calls | of them waiting |",
             "|---|---|---|---|---|---|---|---|"]
    for c, p in res["profiled"].items():
        if p.get("oom"):
            lines.append(f"| {c} | OOM | | | | | | |")
            continue
        n = sum(k for k, _ in p["calls"].values())
        waiting = sum(k for name, (k, _) in p["calls"].items() if waits(name))
        idle = 1 - p["gpu_busy_us"] / p["gpu_span_us"] if p["gpu_span_us"] else 0.0
        lines.append(f"| {c} | {p['host'] * 1e3:.2f} | {p['wall'] * 1e3:.2f} | {p['gpu_busy_us'] / 1e3:.2f} | "
                     f"{p['gpu_span_us'] / 1e3:.2f} | {idle:.1%} | {n} | {waiting} |")
    lines.append("")
    for c, p in res["profiled"].items():
        if p.get("oom") or not p["calls"]:
            continue
        top = sorted(p["calls"].items(), key=lambda kv: -kv[1][1])[:14]
        lines += [f"CUDA calls under {c}, by total time (* waits for the device):", "",
                  "| call | calls | total ms | mean µs |", "|---|---|---|---|"]
        for name, (k, us) in top:
            lines.append(f"| {name}{' *' if waits(name) else ''} | {k} | {us / 1e3:.2f} | {us / k:.1f} |")
        lines.append("")
    if not cuda:
        lines += ["(CPU: no GPU events and no CUDA calls; this checks the plumbing only.)", ""]
    return lines


def report(results: list, rounds: int, command: str, device_line: str, cuda: bool = True) -> str:
    lines = [header("Where a live dtr() step's time goes", command), device_line, "",
             f"Fastest of {rounds} alternating rounds per configuration; host: the step's Python returned; "
             "wall: after a synchronize; per-op figures over plain divide by the step's ATen ops (counted at B). "
             "host + plain wall: what the step would take were the host and the device never to overlap.", ""]
    for res in results:
        lines += [f"## {res['model']}", "", f"{res['description']}: {res['ops']} ATen ops a step at batch "
                  f"{res['batch']} (B); M = {res['budget'] / (1 << 30):.3f} GiB (at B)", ""]
        for run_ in res["runs"]:
            rows = run_["rows"]
            plain = rows["plain"]
            lines += [f"### batch {run_['batch']} ({run_['multiple']:g} B)", "",
                      "| config | host ms | wall ms | wall / plain | host over plain, µs/op | host + plain wall, ms | "
                      "cudaMalloc | cudaFree | in them, ms | evictions | remats | GPU-timed / carried ops |",
                      "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for c, r in rows.items():
                calls = f"{r.get('mallocs', '')} | {r.get('frees', '')} | " + (
                    f"{r['device_ms']:.2f}" if "device_ms" in r else "")
                if "oom" in r or "oom" in plain:
                    lines.append(f"| {c} | OOM | | | | | | | | | | |" if "oom" in r else
                                 f"| {c} | {r['host'] * 1e3:.2f} | {r['wall'] * 1e3:.2f} | | | | {calls} | "
                                 f"{r['evictions']} | {r['remats']} | {r['gpu_timed_ops']} / {r['carried']} |")
                    continue
                lines.append(f"| {c} | {r['host'] * 1e3:.2f} | {r['wall'] * 1e3:.2f} | {r['wall'] / plain['wall']:.3f} | "
                             f"{(r['host'] - plain['host']) / res['ops'] * 1e6:.1f} | "
                             f"{(r['host'] + plain['wall']) * 1e3:.2f} | {calls} | "
                             f"{r['evictions']} | {r['remats']} | {r['gpu_timed_ops']} / {r['carried']} |")
            ooms = [(c, r["oom"]) for c, r in rows.items() if "oom" in r]
            if ooms:
                lines += [""] + [f"- {c}: {message}" for c, message in ooms]
            lines.append("")
        if res["profiled"]:
            lines += _profile_section(res, cuda)
    lines.append("Where host ms is close to wall ms the step is bound by the host (the per-op costs show in "
                  "full); where it is well below, the GPU is the slower and host costs hide behind it. "
                  "cudaMalloc/cudaFree: the pool's calls in the step; in them: the host time inside those "
                  "calls (memory_stats' device_alloc_ns + device_free_ns), each cudaFree's wait for the "
                  "device included. GPU-timed / carried ops: the session's ops the GPU priced by the step's "
                  "end, and those priced at the step before's GPU time until then (docs/live.md, \"On a GPU\").")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,gpt2", help="comma-separated: resnet50, gpt2")
    parser.add_argument("--batch", type=int, help="batch size B (default: bench_gpu_budget's B per model)")
    parser.add_argument("--multiples", help="comma-separated multiples of B to run at (default per model: "
                        + "; ".join(f"{m} {','.join(f'{x:g}' for x in v)}" for m, v in MULTIPLES.items()) + ")")
    parser.add_argument("--profile", action="store_true",
                        help="also one step each of plain, dtr and dtr at budget M at the largest batch under "
                             "torch.profiler: GPU busy time and the CUDA calls by name")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="the zoo's small models (for --device cpu)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.batch is not None and args.batch < 1:
        parser.error("--batch must be at least 1")
    multiples = None
    if args.multiples:
        try:
            multiples = tuple(float(x) for x in args.multiples.split(",") if x.strip())
        except ValueError:
            parser.error(f"--multiples takes numbers separated by commas (1,3), not {args.multiples!r}")
        if not multiples or any(x <= 0 for x in multiples):
            parser.error(f"--multiples must be positive numbers (1,3), not {args.multiples!r}")
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in BASE_BATCH]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; available: {', '.join(BASE_BATCH)}")
    cuda = args.device == "cuda"
    import torch

    if cuda and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --device cpu (with --smoke for seconds)")
    if cuda:
        import dtralloc

        dtralloc.install("policy:dtralloc")  # before any CUDA tensor
    device_line = (f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}" if cuda
                   else f"device: CPU, torch {torch.__version__}, {torch.get_num_threads()} threads")
    results = []
    command = "python bench/bench_live_ablation.py " + " ".join(argv if argv is not None else sys.argv[1:])
    for name in models:
        batch = args.batch or (SMOKE_BATCH if args.smoke else BASE_BATCH)[name]

        def progress(result):  # the file after each batch: a run cut short keeps what it measured
            if args.out:
                write(report(results + [result], args.rounds, command, device_line, cuda), args.out)

        results.append(run(name, batch, multiples or MULTIPLES[name], args.rounds, args.smoke, cuda, args.profile,
                           progress))
        print(report(results, args.rounds, command, device_line, cuda))  # the file: progress() wrote it
    return 0


if __name__ == "__main__":
    sys.exit(main())
