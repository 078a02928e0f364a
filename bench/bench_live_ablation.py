"""Where a live dtr() training step's time goes: one model's step, side by side
in one process, under plain eager and under each layer a dtr() session adds.

A session costs per ATen op on the host (a dispatch mode, saved-tensor hooks,
the record call into C++, on CUDA a timing event per op) and per step in the
pool (segments made and given back at the budget: on a GPU each cudaFree
waits for the device). On a GPU the host runs ahead of the kernels, so the
per-op cost shows only once the host becomes the slower of the two: this
bench reports, per configuration, the host's time for the step (until the
step's Python returns) next to the step's wall time (after a synchronize),
and the cudaMalloc/cudaFree calls of the pool in the step.

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

Rounds alternate the configurations; per configuration the fastest round
counts (the least disturbed). Overheads are ratios to plain in the same run.

    python bench/bench_live_ablation.py [--models resnet50,gpt2] [--rounds 5] [--out FILE.md]
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
from _report import emit, header  # noqa: E402
from bench_gpu_budget import BASE_BATCH, SMOKE_BATCH, Model  # noqa: E402
from bench_live_overhead import CountMode, NoopMode, NoopModeAndHooks  # noqa: E402

CONFIGS = ("plain", "noop mode", "noop mode + hooks", "dtr", "dtr, no series", "dtr, no GPU op timing",
           "dtr, budget M")


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


class Bench:
    def __init__(self, name: str, batch: int, smoke: bool, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda
        self.device = "cuda" if cuda else "cpu"
        self.m = Model(name, smoke, torch.device(self.device))
        self.batch = self.m.batch(batch)
        self.budget = None

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def context(self, config: str):
        from dtralloc.dtr import dtr

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
            stack = contextlib.ExitStack()
            stack.enter_context(_without_gpu_timing())
            stack.enter_context(dtr(device=self.device))
            return stack
        if config == "dtr, budget M":
            return dtr(device=self.device, budget=self.budget)
        raise ValueError(config)

    def device_calls(self) -> tuple:
        if not self.cuda:
            return (0, 0)
        import dtralloc

        s = dtralloc.memory_stats()
        return (s.get("num_device_alloc", 0), s.get("num_device_free", 0))

    def step(self, config: str) -> dict:
        calls = self.device_calls()
        self.sync()
        start = time.perf_counter()
        ctx = self.context(config)
        with ctx as s:
            self.m.step(self.batch)
        host = time.perf_counter() - start
        self.sync()
        wall = time.perf_counter() - start
        after = self.device_calls()
        stats = s.stats() if hasattr(s, "stats") else {}
        return {"host": host, "wall": wall, "mallocs": after[0] - calls[0], "frees": after[1] - calls[1],
                "evictions": stats.get("evictions", 0), "gpu_timed_ops": stats.get("gpu_timed_ops", 0)}

    def measure_budget(self) -> int:
        """M: plain's peak reserved bytes (CUDA), or a budget-free session's
        mirror peak (CPU)."""
        from dtralloc.dtr import dtr

        if self.cuda:
            import dtralloc

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


def run(name: str, batch: int, rounds: int, smoke: bool, cuda: bool) -> dict:
    b = Bench(name, batch, smoke, cuda)
    configs = [c for c in CONFIGS if cuda or c != "dtr, no GPU op timing"]
    b.budget = b.measure_budget()
    for c in configs:  # warm-up: kernels, optimizer state, the sessions' first step
        b.step(c)
    ops = b.ops_per_step()
    best: dict = {}
    for _ in range(rounds):
        for c in configs:
            r = b.step(c)
            if c not in best or r["wall"] < best[c]["wall"]:
                best[c] = r
    return {"model": name, "description": b.m.description, "batch": batch, "ops": ops, "budget": b.budget,
            "rows": best}


def report(results: list, rounds: int, command: str, device_line: str) -> str:
    lines = [header("Where a live dtr() step's time goes", command), device_line, "",
             f"Fastest of {rounds} alternating rounds per configuration; host: the step's Python returned; "
             "wall: after a synchronize; per-op figures over plain divide by the step's ATen ops.", ""]
    for res in results:
        rows = res["rows"]
        plain = rows["plain"]
        lines += [f"## {res['model']}", "", f"{res['description']}, batch {res['batch']}: {res['ops']} ATen ops a step; "
                  f"M = {res['budget'] / (1 << 30):.3f} GiB", "",
                  "| config | host ms | wall ms | wall / plain | host over plain, µs/op | cudaMalloc | cudaFree | "
                  "evictions | GPU-timed ops |", "|---|---|---|---|---|---|---|---|---|"]
        for c, r in rows.items():
            lines.append(f"| {c} | {r['host'] * 1e3:.2f} | {r['wall'] * 1e3:.2f} | {r['wall'] / plain['wall']:.3f} | "
                         f"{(r['host'] - plain['host']) / res['ops'] * 1e6:.1f} | {r['mallocs']} | {r['frees']} | "
                         f"{r['evictions']} | {r['gpu_timed_ops']} |")
        lines.append("")
    lines.append("Where host ms is close to wall ms the step is bound by the host (the per-op costs show in "
                  "full); where it is well below, the GPU is the slower and host costs hide behind it. "
                  "cudaMalloc/cudaFree: the pool's calls in the step (each cudaFree waits for the device).")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,gpt2", help="comma-separated: resnet50, gpt2")
    parser.add_argument("--batch", type=int, help="batch size (default: bench_gpu_budget's B per model)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--smoke", action="store_true", help="the zoo's small models (for --device cpu)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
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
        results.append(run(name, batch, args.rounds, args.smoke, cuda))
        emit(report(results, args.rounds, command, device_line), args.out)  # after each model: a kill keeps it
    return 0


if __name__ == "__main__":
    sys.exit(main())
