"""Per-op bookkeeping of live DTR counted in instructions, not seconds.

bench_live_overhead.py times the same workloads, but on a shared machine of
two cores its cells swing by 20-30% from one run to the next (its committed
results say so), so a change of one microsecond an op cannot be told from
noise. This bench runs each workload under valgrind's callgrind, which
counts the instructions the process executes: the same build and workload
give the same count to within 0.2% from one run to the next, whatever else
the machine runs.

Per workload (bench_live_overhead.workloads(): the add loop, the chain, the
two MLPs, the SGD step, ResNet-50's graph, the RNNs) and configuration
(plain, noop mode, noop mode + hooks, dtr, dtr with an unreached budget, dtr
with the forward alone in the block, as there), one process: the workload runs twice in its context as a warm-up
(first calls, imports, and the lifetimes a budgeted session learns from the
step before), then `--steps` times, each in a context of its own as a
training loop would, and only those steps are counted
(callgrind's --toggle-collect on operator.call, which wraps them and
nothing else; the import and the warm-up run uninstrumented until the
process says it is warm and callgrind_control turns instrumentation on).
Reported: instructions per ATen op (the ops a dispatch mode sees in one
step), and the differences that matter: dtr over plain, and
dtr over noop mode + hooks (what the session itself adds to the floor of
any runtime built on a dispatch mode and saved-tensor hooks).

`--package NAME=DIR` also measures the dtr configurations with dtralloc
imported from DIR (a built package: the dtralloc folder with its compiled
libraries), so that a change and the build before it are compared in one
run. Instructions are not time: a Python-API call's instructions cost more
than an engine loop's (cache misses, branches), so a time target is still
judged by bench_live_overhead.py; what this bench tells reliably is which
change removes work, and how much.

    python bench/bench_live_instructions.py [--workloads chain,mlp,dropout] [--configs plain,hooks,dtr]
        [--steps 5] [--package before=/path/to/pkg] [--jobs 2] [--out FILE.md]

Needs valgrind (`apt-get install valgrind`, with its callgrind_control); a
counted step takes about 50 times its plain time under it, and each process
spends about half a minute importing torch uninstrumented.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))

# Short names for bench_live_overhead's workloads and configurations (its names).
WORKLOADS = {
    "adds": "add loop (2000 x torch.add, 8 floats)",
    "chain": "add chain (x = x + b, 2000 times, 8 floats)",
    "mlp": "MLP 32 x Linear(16)+Tanh, fwd+bwd",
    "dropout": "MLP 32 x Linear(16)+ReLU+Dropout, fwd+bwd",
    "sgd": "SGD step (foreach, momentum, weight decay), 160 x 64 floats",
    "resnet": "ResNet-50 graph at width 8, 32x32, batch 2: training step",
    "rnn": "LSTM + GRU (16 wide) over a packed batch of 4 x 12 steps, fwd+bwd",
}
CONFIGS = {
    "plain": "plain",
    "noop": "noop mode",
    "hooks": "noop mode + hooks",
    "dtr": "dtr",
    "budget": "dtr, budget",
    "forward": "dtr, forward in the block",
}
DTR_CONFIGS = ("dtr", "budget", "forward")
DEFAULT_WORKLOADS = "chain,mlp,dropout"
DEFAULT_CONFIGS = "plain,hooks,dtr"


def _use_package(directory: str) -> None:
    """Import dtralloc from `directory` (main checked it holds one) instead
    of the installed one (an editable install's finder would take precedence
    over sys.path)."""
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()
                        and "editable" not in type(f).__module__.lower()]
    sys.path.insert(0, directory)


def child(workload: str, config: str, steps: int, package: str | None, go: str | None = None) -> int:
    """One measured process (run under callgrind by the parent): prints the
    ATen ops of one step and where dtralloc came from, as JSON. With `go`
    (a file's path), it says READY and its pid once warm, and waits for
    that file: the parent turns callgrind's instrumentation on meanwhile
    (import and warm-up run uninstrumented, several times faster)."""
    import operator
    import time

    if package:
        _use_package(package)
    sys.path.insert(0, HERE)
    import torch

    import dtralloc
    import bench_live_overhead as overhead

    torch.set_num_threads(1)  # one thread: no worker threads' spinning counted
    fn = overhead.workloads()[WORKLOADS[workload]]
    ctx = overhead.contexts()[CONFIGS[config]]

    def measured(k):
        for _ in range(k):
            overhead.timed(fn, ctx)  # (its two clock reads are a few hundred instructions a step)

    measured(2)  # warm-up
    ops = overhead.ops_of(fn)
    if go:
        print(f"READY {os.getpid()}", flush=True)
        while not os.path.exists(go):
            time.sleep(0.01)
    operator.call(measured, steps)  # counted: callgrind --toggle-collect=_operator_call
    print(json.dumps({"ops": ops, "dtralloc": os.path.dirname(dtralloc.__file__)}))
    return 0


_TOTALS = re.compile(r"^(?:summary|totals):\s*(\d+)", re.M)


def instructions_of(callgrind_out: str) -> int:
    """The Ir total of a callgrind output file."""
    with open(callgrind_out) as f:
        text = f.read()
    found = _TOTALS.findall(text)
    if not found:
        raise RuntimeError(f"{callgrind_out}: no totals line (callgrind stopped early?)")
    return int(found[-1])


def run_one(workload, config, steps, package_name, package_dir, workdir):
    name = f"{workload}-{config}-{package_name or 'this'}"
    out = os.path.join(workdir, name + ".callgrind")
    go = os.path.join(workdir, name + ".go")
    # Instrumentation off until the child is warm (callgrind_control turns
    # it on); counting only inside operator.call, which wraps the steps.
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
           "--toggle-collect=_operator_call", f"--callgrind-out-file={out}", sys.executable,
           os.path.abspath(__file__), "--child", workload, config, str(steps), "--child-go", go]
    if package_dir:
        cmd += ["--child-package", package_dir]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    label = f"{workload}/{config} ({package_name or 'this build'})"
    with open(os.path.join(workdir, name + ".err"), "w+") as err:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("READY "):
                on = subprocess.run(["callgrind_control", "-i", "on", line.split()[1]], capture_output=True, text=True)
                if on.returncode != 0:
                    p.kill()
                    raise RuntimeError(f"{label}: callgrind_control -i on failed:\n{on.stdout}{on.stderr}")
                open(go, "w").close()
        p.wait()
        if p.returncode != 0 or not any(line.startswith("READY ") for line in lines):
            err.seek(0)
            raise RuntimeError(f"{label} failed (exit {p.returncode}):\n{err.read()[-3000:]}")
    info = json.loads(lines[-1])
    total = instructions_of(out)
    return {"workload": workload, "config": config, "package": package_name, "ops": info["ops"],
            "dtralloc": info["dtralloc"], "instructions": total, "per_op": total / steps / info["ops"]}


def measure(workloads, configs, steps, packages, jobs, echo=print):
    tasks = []
    for w in workloads:
        for c in configs:
            tasks.append((w, c, None, None))
            if c in DTR_CONFIGS:
                tasks += [(w, c, name, d) for name, d in packages]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtralloc-instructions-") as workdir:
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            futures = [pool.submit(run_one, w, c, steps, name, d, workdir) for w, c, name, d in tasks]
            for f in concurrent.futures.as_completed(futures):
                r = f.result()
                echo(f"  {r['workload']:8s} {r['config']:7s} {r['package'] or 'this build':12s} "
                     f"{r['per_op']:10.0f} instructions/op", file=sys.stderr)
                rows.append(r)
    return rows


def report(rows, workloads, configs, steps, packages, command, header_fn) -> str:
    by = {(r["workload"], r["config"], r["package"]): r for r in rows}
    builds = [None] + [name for name, _ in packages]

    def label(config, build):
        return CONFIGS[config] + (f" [{build}]" if build else "")

    columns = [(c, None) for c in configs] + [(c, b) for c in configs if c in DTR_CONFIGS for b in builds[1:]]
    lines = [header_fn("Live DTR per-op bookkeeping in instructions (callgrind, CPU)", command)]
    import torch

    lines += [f"torch {torch.__version__}, one thread; {steps} steps counted per cell, each in its own "
              "context, after two warm-up steps; instructions per ATen op of a step.", ""]
    if packages:
        lines += ["Builds: this build = the installed dtralloc; " +
                  "; ".join(f"[{name}] = {d}" for name, d in packages), ""]
    head = ["workload", "ATen ops"] + [label(c, b) for c, b in columns]
    diffs = []  # (config, base, build)
    for b in builds:
        if "dtr" in configs and "plain" in configs:
            diffs.append(("dtr", "plain", b))
        if "dtr" in configs and "hooks" in configs:
            diffs.append(("dtr", "hooks", b))
    if "forward" in configs and "plain" in configs:
        diffs += [("forward", "plain", b) for b in builds]
    head += [f"{label(c, b)} over {CONFIGS[base]}" for c, base, b in diffs]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for w in workloads:
        ops = next(r["ops"] for r in rows if r["workload"] == w)
        cells = [WORKLOADS[w], str(ops)]
        cells += [f"{by[(w, c, b)]['per_op']:,.0f}" for c, b in columns]
        cells += [f"{by[(w, c, b)]['per_op'] - by[(w, base, None)]['per_op']:,.0f}" for c, base, b in diffs]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Configurations as in bench_live_overhead.py: noop mode, a TorchDispatchMode that only calls "
              "the op (a Python __torch_dispatch__); noop mode + hooks, the same with saved-tensor hooks that "
              "return what they get; dtr, dtralloc.dtr(device='cpu') without a budget; dtr, budget: with a "
              "budget of 1 TiB, never reached; dtr, forward in the block: the session around the forward and the "
              "loss only, backward after the block (per op of the whole step; a workload without a backward runs "
              "whole inside, as under dtr). The dtr session's __torch_dispatch__ is C, so part of what it "
              "adds over noop mode + hooks replaces that mode's Python frame."]
    return "\n".join(lines) + "\n"


def _parse_list(text, known, what):
    items = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in items if s not in known]
    if unknown or not items:
        raise SystemExit(f"--{what}: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(known)}")
    return items


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        def option(flag):
            return argv[argv.index(flag) + 1] if flag in argv else None
        return child(argv[1], argv[2], int(argv[3]), option("--child-package"), option("--child-go"))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="workloads: " + ", ".join(f"{k} ({v})" for k, v in WORKLOADS.items()))
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS, help=f"comma-separated (default {DEFAULT_WORKLOADS})")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated from {', '.join(CONFIGS)} (default {DEFAULT_CONFIGS})")
    parser.add_argument("--steps", type=int, default=5, help="steps counted per cell (default 5)")
    parser.add_argument("--package", action="append", default=[], metavar="NAME=DIR",
                        help="also measure the dtr configurations with dtralloc from DIR (repeatable)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes at once (default: cores)")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if not hasattr(__import__("operator"), "call"):
        raise SystemExit("bench_live_instructions: needs Python 3.11 or newer (operator.call, inside which "
                         f"callgrind counts), not {sys.version.split()[0]}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("bench_live_instructions: valgrind (with callgrind_control) is not on PATH "
                         "(apt-get install valgrind)")
    if args.steps < 1:
        raise SystemExit("--steps: at least 1")
    workloads = _parse_list(args.workloads, WORKLOADS, "workloads")
    configs = _parse_list(args.configs, CONFIGS, "configs")
    packages = []
    for spec in args.package:
        name, sep, directory = spec.partition("=")
        if not sep or not name or not directory:
            raise SystemExit(f"--package {spec!r}: give NAME=DIR")
        if not os.path.isfile(os.path.join(directory, "dtralloc", "__init__.py")):
            raise SystemExit(f"--package {spec!r}: {directory} holds no dtralloc/__init__.py")
        packages.append((name, os.path.abspath(directory)))
    sys.path.insert(0, HERE)
    from _report import emit, header

    rows = measure(workloads, configs, args.steps, packages, max(1, args.jobs))
    command = "python bench/bench_live_instructions.py " + " ".join(argv)
    emit(report(rows, workloads, configs, args.steps, packages, command.strip(), header), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
