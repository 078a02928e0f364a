"""Segments a CUDA pool makes and releases per training step under a budget,
counted as calls into the CUDA runtime and driver (no GPU: the fake runtime
counts them, allocator/fake_cudart).

A recorded step's allocations and frees (a bundled trace) run through
``Pool("cuda")`` for several steps, as a training loop repeats them: what the
step kept (gradients) is freed at the start of the next one
(``zero_grad(set_to_none=True)``), parameters and optimizer state stay. The
budget M is the peak reserved bytes of the same steps on torch's policy with
no budget. Per configuration, the calls of the last step (the steady state):
each cudaFree and each VMM release waits for the device, and a VMM segment
costs a cuMemCreate and a cuMemMap per 2 MiB page to make and a cuMemUnmap per
page to release, which is what made VMM segments 5-20x slower a sample on an
H100 (bench/results/gpu_session-2026-11-27-h100.md). Under the dtralloc
policy on cudaMalloc'd segments, split_oversize (on by default there) cuts an
oversize request from a cached oversize segment instead of giving that
segment back and making one of its own; `split_oversize:off` shows the pool
without it. `arena:on` reserves what the budget leaves in one segment at the
first miss (Note [arena], docs/allocator.md): no segment is made or given back
after it, Llama's 500 MiB logits included.

    python bench/segment_churn.py [--traces resnet50 gpt2 ...] [--steps 4] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

CALLS = ("cudaMalloc", "cudaFree", "cuMemCreate", "cuMemMap", "cuMemUnmap", "cudaDeviceSynchronize")
CONFIGS = ("", "policy:dtralloc", "policy:dtralloc,split_oversize:off", "policy:dtralloc,unmap_pages:on",
           "policy:dtralloc,arena:on")
DEFAULT_TRACES = ("resnet50", "gpt2", "bert", "unet", "mlp")


def _worker(trace_name: str, conf: str, steps: int) -> str:
    """Runs in a process of its own (the runtime is loaded once per process):
    the budget, then one line per step, tab-separated: the calls, then the page cuts."""
    from dtralloc.testing import FakeCudaRuntime, fake_cudart_path

    os.environ["DTRALLOC_CUDART"] = fake_cudart_path()
    import dtralloc
    import dtralloc.traces as bundled

    fake = FakeCudaRuntime()
    fake.set_capacity(1 << 40)  # memfd pages: only what is written takes memory
    trace = bundled.load_bundled(trace_name)

    def run(pool, n):
        live, kept, out = {}, [], []
        for sid, s in enumerate(trace.storages):
            if s.initial:
                live[sid] = pool.malloc(max(1, s.nbytes))
        for sid in trace.frees_before:
            pool.free(live.pop(sid))
        for _ in range(n):
            before = {c: fake.calls(c) for c in CALLS}
            releases = pool.stats()["num_page_releases"]
            for sid in kept:
                pool.free(live.pop(sid))
            for op in trace.ops:
                for sid in op.created:
                    live[sid] = pool.malloc(max(1, trace.storages[sid].nbytes))
                for sid in op.frees:
                    if sid in live and not trace.storages[sid].initial:
                        pool.free(live.pop(sid))
            kept = [sid for sid in live if not trace.storages[sid].initial]
            calls = [fake.calls(c) - before[c] for c in CALLS]
            out.append(calls + [pool.stats()["num_page_releases"] - releases])
        return out

    plain = dtralloc.Pool("cuda", conf="")
    run(plain, steps)
    budget = plain.stats()["reserved_bytes.all.peak"]
    del plain
    pool = dtralloc.Pool("cuda", conf=",".join(filter(None, (conf, f"budget:{budget}B"))))
    rows = run(pool, steps)
    return "\n".join([str(budget)] + ["\t".join(map(str, r)) for r in rows])


def measure(trace_name: str, conf: str, steps: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", trace_name, conf, str(steps)],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    lines = proc.stdout.strip().splitlines()
    return {"budget": int(lines[0]), "last": list(map(int, lines[-1].split("\t")))}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", nargs="+", default=list(DEFAULT_TRACES), help="bundled traces")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the last one is reported)")
    parser.add_argument("--out", help="also write the report (markdown) here")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(_worker(args.worker[0], args.worker[1], int(args.worker[2])))
        return 0
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step fills an empty pool)")
    command = "python bench/segment_churn.py --traces " + " ".join(args.traces) + f" --steps {args.steps}"
    out = [f"# Segments made and released per step under a budget (fake CUDA runtime)\n",
           f"date: {time.strftime('%Y-%m-%d')}  ",
           f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, CPython {platform.python_version()}  ",
           f"command: `{command}`\n",
           "Budget M: peak reserved of the same steps on torch's policy, no budget. Calls in the last of "
           f"{args.steps} steps (the steady state); `page cuts`: unmap_pages releases of part of a "
           "segment. The fake runtime counts cudaDeviceSynchronize where dtralloc calls it (before a VMM "
           "release); on a GPU each cudaFree waits for the device too.\n",
           "| trace | M | install | " + " | ".join(CALLS) + " | page cuts |",
           "|---|---|---|" + "---|" * (len(CALLS) + 1)]
    for name in args.traces:
        for conf in CONFIGS:
            print(f"[segment_churn] {name} {conf or '(torch policy)'}", file=sys.stderr, flush=True)
            r = measure(name, conf, args.steps)
            label = f"`{conf}`" if conf else "torch's policy"
            if "error" in r:
                out.append(f"| {name} | | {label} | failed: {r['error'][:200]} |")
                continue
            out.append(f"| {name} | {r['budget'] / (1 << 30):.2f} GiB | {label} | " +
                       " | ".join(map(str, r["last"])) + " |")
    report = "\n".join(out) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
