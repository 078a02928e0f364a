"""How far live DTR should take the budget bench's models, predicted by replay.

bench_gpu_budget.py measures on a GPU the largest batch that trains in M,
plain torch's peak reserved bytes at batch B, and the step time there. GPUs
are lent rarely and for minutes; this bench predicts the same from training
steps recorded anywhere (on CPU by default) and replayed through the pool:

1. The model at its full size (GPT-2 small at seq 1024, ResNet-50 at 224x224,
   as bench_gpu_budget.Model builds them) trains one step at the base batch,
   so the optimizer's state exists as it does in a training loop.
2. One step is recorded (dtralloc.trace.record) at each batch: the base batch
   B and its multiples (--multiples). Each op's cost is its time where it
   ran: the wall clock on CPU, CUDA events on a GPU.
3. M is the replay's peak reserved bytes of the step at B with no eviction
   (policy none), on the pool settings a CUDA device gets under a budget
   (split_oversize on, unmap_pages off: `dtralloc config`).
4. Each batch's step is replayed twice in one pool with the budget M (the
   second step places by what the first kept, as in a training loop), per
   policy (--policies) and pool settings (--confs, each added to those).
   Reported: whether both steps fit, the last step's evictions, the segments
   it made and gave back (cudaMalloc / cudaFree on a GPU, each cudaFree
   waiting for the device), and its recompute overhead: the recorded cost of
   what it recomputed over the step's own (compute_overhead; on CPU, CPU op
   costs); where a batch does not fit, the evictions until it ran out. The
   largest batch that fits is the predicted reach.

`--traces DIR` replays steps saved before (`--save-traces`, or the
`predict_reach` step of bench/gpu_session.sh on a GPU) instead of recording:
what a GPU recorded, replayed on any machine with the GPU's op costs.

Scaling: activations grow with the batch while the parameters, gradients and
optimizer state do not, and they cancel out of the question (both sides of
"does k B fit in M(B)" hold them), so a small B predicts a large one's reach
up to the segments' rounding. Two things do not scale: the memory that is not
the step's (a GPU's cuBLAS workspace, the CUDA context) and op costs, which on
CPU are not a GPU's (convolutions weigh more there against normalization and
activations). Near the edge a small B flatters: with its logits whole GPT-2
fits 3x B at B 2 by a hair, where an H100 fitted 2.75x at B 8 and not 2.875x
(bench/results/predict_reach-2026-11-30-cpu.md). The overheads here are the
recompute's share of the step's compute, not step time: a live session adds
its host cost on top (bench_live_ablation.py).

On CPU, GPT-2's attention dropout is switched off while recording: torch's
CPU attention with dropout takes the math path, which keeps each layer's
seq x seq attention matrices (12 heads x 1024 x 1024 floats a sample and
layer), while the GPU's flash attention with dropout keeps only its output
and log-sum-exp, as the CPU's flash kernel does without dropout. The memory
is then the GPU's; the dropout masks of the residual branches stay.

    python bench/predict_reach.py [--models gpt2 resnet50] [--base gpt2=2 resnet50=8]
        [--multiples 1 2 2.5 3 4] [--gpt2-loss-chunks 8 1] [--policies dtralloc msps dtr]
        [--confs "" arena:on] [--recordings N] [--device cpu|cuda] [--save-traces DIR]
        [--note TEXT] [--out FILE.md]
    python bench/predict_reach.py --traces DIR [--models ...] [--base ...] [--policies ...] [--confs ...]
    python bench/predict_reach.py --smoke     # the zoo's small models, seconds
"""
from __future__ import annotations

import argparse
import gc
import os
import re
import shlex
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _report import emit, header, write  # noqa: E402
from bench_gpu_budget import BASE_BATCH, GPT2_LOSS_CHUNKS, SMOKE_BATCH, Model  # noqa: E402
from replay_device_calls import async_waits, frees_without_eviction  # noqa: E402

MODELS = ("gpt2", "resnet50")
# Base batches on CPU: large enough that the step's activations, not the
# optimizer's step, make the peak; small enough that 4x B records in the
# memory of a 24 GiB machine (GPT-2 small at batch 8: 12 GiB).
CPU_BASE = {"gpt2": 2, "resnet50": 8}
MULTIPLES = (1, 2, 2.5, 3, 4)
SMOKE_MULTIPLES = (1, 2, 3)
POLICIES = ("dtralloc", "msps", "dtr")
# What a CUDA device's pool resolves under the dtralloc policy and a budget
# (config.cpp: split_oversize and unmap_pages, auto).
GPU_CONF = "split_oversize:on,unmap_pages:off"
GiB = 1 << 30


def batches_for(base: int, multiples) -> list[int]:
    """The batches to record: base x each multiple, rounded, without repeats."""
    return sorted({max(1, round(base * m)) for m in multiples} | {base})


def attention_dropout_off(model) -> int:
    """Sets the attention's dropout probability to 0 in every GPT-2 block
    (transformers' GPT2Attention.attn_dropout, or the plain-torch layout's
    float); returns how many it changed."""
    import torch

    n = 0
    for module in model.modules():
        d = getattr(module, "attn_dropout", None)
        if isinstance(d, torch.nn.Dropout):
            d.p = 0.0
            n += 1
        elif isinstance(d, float):
            module.attn_dropout = 0.0
            n += 1
    return n


def record_steps(name: str, smoke: bool, device: str, loss_chunks: int, batches, recordings: int = 1,
                 save_dir=None) -> tuple[dict, str, dict]:
    """{batch: [trace per recording]} of one training step each, after one
    warm-up step at the smallest batch (the recordings in rounds: every batch
    once, then again); the model's description; and {batch: why} for the
    batches not recorded (from the first that ran out of device memory on)."""
    import torch

    from dtralloc.trace import record

    m = Model(name, smoke, torch.device(device), loss_chunks)
    description = m.description
    if name == "gpt2" and device == "cpu":
        changed = attention_dropout_off(m.model)
        description += f"; attention dropout off while recording on CPU ({changed} layers: flash attention's memory)"
    m.step(m.batch(batches[0]))  # the optimizer's state, made before any recorded step
    traces, skipped = {}, {}
    for round_ in range(recordings):
        for b in batches:
            if b in skipped:
                continue
            if any(x < b for x in skipped):  # larger than a batch that did not fit
                skipped[b] = "not tried: a smaller batch ran out of memory"
                traces.pop(b, None)  # recorded in an earlier round, perhaps: every round or none
                continue
            label = (f"{name}" + (f"-c{loss_chunks}" if name == "gpt2" else "") + f"-b{b}"
                     + (f"-r{round_ + 1}" if recordings > 1 else ""))
            start = time.perf_counter()
            try:
                batch = m.batch(b)
                trace = record(lambda: m.step(batch), name=label)
            except torch.OutOfMemoryError as e:  # the device's memory, not M: the step is too large here
                skipped[b] = "out of memory while recording: " + str(e).splitlines()[0][:200]
                traces.pop(b, None)  # a batch is recorded every round or not at all
                batch = None
                m.optimizer.zero_grad(set_to_none=True)
                gc.collect()
                if device == "cuda":
                    torch.cuda.empty_cache()
                print(f"  {label}: {skipped[b]}", file=sys.stderr)
                continue
            traces.setdefault(b, []).append(trace)
            print(f"  recorded {label}: {len(trace.ops)} ops in {time.perf_counter() - start:.1f} s",
                  file=sys.stderr)
            if save_dir:
                os.makedirs(save_dir, exist_ok=True)
                trace.save(os.path.join(save_dir, label + ".dtrace"))
            batch = trace = None
            gc.collect()
    del m
    gc.collect()
    return traces, description, skipped


# A saved step's file name: MODEL[-cCHUNKS]-bBATCH[-rRECORDING].dtrace (record_steps).
TRACE_NAME = re.compile(r"^(gpt2|resnet50)(?:-c(\d+))?-b(\d+)(?:-r(\d+))?\.dtrace$")


def load_steps(directory: str) -> dict:
    """Saved steps by (model, loss chunks): {batch: [trace per recording]}."""
    from dtralloc.trace.model import load

    if not os.path.isdir(directory):
        raise SystemExit(f"predict_reach: --traces {directory!r} is not a directory")
    found = {}
    for name in sorted(os.listdir(directory)):
        m = TRACE_NAME.match(name)
        if not m:
            continue
        model, chunks, batch, rec = m.group(1), int(m.group(2) or 1), int(m.group(3)), int(m.group(4) or 1)
        found.setdefault((model, chunks), {}).setdefault(batch, []).append((rec, load(os.path.join(directory, name))))
    if not found:
        raise SystemExit(f"predict_reach: no saved steps in {directory!r} (files named MODEL[-cN]-bN[-rN].dtrace, "
                         f"as --save-traces writes them)")
    return {key: {b: [t for _, t in sorted(ts, key=lambda x: x[0])] for b, ts in by_batch.items()}
            for key, by_batch in found.items()}


def predict(traces: dict, base: int, policies, confs=("",), steps: int = 2) -> dict:
    """Per recording: M from its step at `base`, and per batch, pool
    settings and policy the replay under M. Returns {"m_bytes": [per
    recording], "rows": [per batch, settings, policy and recording]}."""
    from dtralloc.replay import replay

    rounds = min(len(ts) for ts in traces.values())
    # Each step's peak without eviction; M is the base step's.
    plain_peak = {(b, k): replay(trace, policy="none", conf=GPU_CONF).peak_reserved_bytes
                  for b, recorded in traces.items() for k, trace in enumerate(recorded[:rounds])}
    m_bytes = [plain_peak[base, k] for k in range(rounds)]
    rows = []
    for b, recorded in sorted(traces.items()):
        for k, trace in enumerate(recorded[:rounds]):
            for conf in confs:
                for policy in policies:
                    r = replay(trace, budget=m_bytes[k], policy=policy, conf=",".join(filter(None, (GPU_CONF, conf))),
                               steps=steps, history=True)
                    rows.append({"batch": b, "multiple": b / base, "recording": k,
                                 "plain_peak": plain_peak[b, k], "conf": conf, "policy": policy,
                                 "fits": bool(r.feasible),
                                 "evictions": r.last_step_evictions if r.feasible else r.evictions,
                                 "calls": (r.last_step_device_alloc_calls, r.last_step_device_free_calls,
                                           frees_without_eviction(r, len(trace.ops), steps),
                                           async_waits(r, steps))
                                 if r.feasible else None,
                                 "overhead": r.last_step_compute_overhead if r.feasible else None,
                                 "oom": "" if r.feasible else _first_sentences(r.oom_message or "")})
    return {"m_bytes": m_bytes, "rows": rows, "recordings": rounds}


def _first_sentences(message: str) -> str:
    """An OOM message's first line up to what it says about the device and
    what to try (the same for every row here)."""
    line = (message.splitlines() or [""])[0]
    return line.split(", device capacity")[0].split(" The budget caps")[0]


def reach(result: dict, policy: str, recording: int = 0, conf: str = ""):
    """The largest batch of one recording that fits under `policy` (on the
    settings `conf`) with every smaller recorded batch fitting too, as a
    multiple of the base (None: not even B)."""
    best = None
    mine = (r for r in result["rows"]
            if r["policy"] == policy and r["recording"] == recording and r.get("conf", "") == conf)
    for r in sorted(mine, key=lambda r: r["batch"]):
        if not r["fits"]:
            break
        best = r["multiple"]
    return best


def _spread(values, fmt: str) -> str:
    """The median of `values`, with their range where they differ."""
    if not values:
        return "-"
    values = sorted(values)
    mid = statistics.median(values)
    if values[0] == values[-1]:
        return fmt.format(mid)
    return f"{fmt.format(mid)} ({fmt.format(values[0])}-{fmt.format(values[-1])})"


def _settings(conf: str) -> str:
    return conf or "defaults"


def report(models: list[dict], args, command: str, device_line: str) -> str:
    lines = [header("Largest batch in a fixed memory, predicted by replay", command)]
    lines.append(device_line)
    lines.append("")
    if args.note:
        lines += [args.note, ""]
    lines.append(f"M = the replay's peak reserved bytes of the step at the base batch B, no eviction, on the pool "
                 f"settings of a CUDA device under a budget (`{GPU_CONF}`). Each batch's step replayed twice in "
                 f"one pool with budget M; the last step's evictions, segments made / given back (cudaMalloc / "
                 f"cudaFree on a GPU; in brackets, of the cudaFree, those at ops where nothing was evicted: "
                 f"whole free segments given back to make one of another size, bench/replay_device_calls.py; "
                 f"after it, how many of the step's segments would make the pool wait for the device on "
                 f"`async_segments:on`, for a model of the driver's pool that reuses a freed segment only whole "
                 f"and holds the rest until a synchronize: replay_device_calls.async_waits; each cudaMalloc and "
                 f"cudaFree waits otherwise) "
                 f"and recompute overhead (recorded cost of what it recomputed / the step's own: compute, not "
                 f"step time; where a batch does not fit, the evictions until it ran out). "
                 f"Reach: the largest recorded batch that fits, every smaller one "
                 f"fitting too. With several recordings (each op's cost is its recorded time, which varies from "
                 f"one recording to the next): in how many each batch fits, and the median (range) of what "
                 f"fitted.")
    confs = list(args.confs)
    several = len(confs) > 1
    for mdl in models:
        res = mdl["result"]
        n = res["recordings"]
        lines += ["", f"## {mdl['label']}", "", mdl["description"], "",
                  f"B = {mdl['base']}; M = {_spread([x / GiB for x in res['m_bytes']], '{:.3f}')} GiB; "
                  f"recorded on {mdl['device']} ({mdl['durations']}), {n} recording{'s' if n > 1 else ''}", ""]
        parts = []
        for conf in confs:
            for p in mdl["policies"]:
                each = [reach(res, p, k, conf) for k in range(n)]
                shown = ", ".join("not even B" if x is None else f"{x:.2f}x B" for x in each)
                parts.append(f"{p}{f' [{_settings(conf)}]' if several else ''} {shown}")
        lines.append("Reach: " + "; ".join(parts) + (" (one per recording)" if n > 1 else ""))
        lines += ["", "| batch | x B | plain peak, GiB |" + (" settings |" if several else "")
                  + " policy | fits in M | evictions | segments made / given back | recompute overhead |",
                  "|---|---|---|" + ("---|" if several else "") + "---|---|---|---|---|"]
        cells = {}
        for r in res["rows"]:
            cells.setdefault((r["batch"], r.get("conf", ""), r["policy"]), []).append(r)
        for (b, conf, policy), rs in cells.items():
            fitted = [r for r in rs if r["fits"]]
            fits = ("yes" if len(fitted) == n else "no" if not fitted else f"{len(fitted)} of {n}") if n > 1 \
                else ("yes" if fitted else "no")
            evictions = _spread([r["evictions"] for r in fitted] or [r["evictions"] for r in rs], "{:.0f}")
            calls = (f"{_spread([r['calls'][0] for r in fitted], '{:.0f}')} / "
                     f"{_spread([r['calls'][1] for r in fitted], '{:.0f}')}") if fitted else "-"
            quiet = [r["calls"][2] for r in fitted if r["calls"][1] and r["calls"][2] is not None]
            if quiet:
                calls += f" ({_spread(quiet, '{:.0f}')} where nothing was evicted)"
            waits = [r["calls"][3] for r in fitted if r["calls"][0] and r["calls"][3] is not None]
            if waits:
                calls += f"; async segments: {_spread(waits, '{:.0f}')} waits"
            overhead = _spread([r["overhead"] for r in fitted], "{:.3f}")
            peak = _spread([r["plain_peak"] / GiB for r in rs], "{:.3f}")
            lines.append(f"| {b} | {rs[0]['multiple']:.2f} | {peak} |" + (f" {_settings(conf)} |" if several else "")
                         + f" {policy} | {fits} | {evictions} | {calls} | {overhead} |")
        if res.get("skipped"):
            lines += ["", "Not recorded:", ""]
            lines += [f"- batch {b}: {why}" for b, why in sorted(res["skipped"].items())]
        failed = [r for r in res["rows"] if not r["fits"]]
        if failed:
            lines += ["", "Where a batch did not fit (the replay's error):", ""]
            lines += [f"- batch {r['batch']}, {r['policy']}" + (f" [{_settings(r['conf'])}]" if several else "")
                      + (f", recording {r['recording'] + 1}" if n > 1 else "") + f": {r['oom']}" for r in failed]
    return "\n".join(lines) + "\n"


def _pairs(values, what: str) -> dict:
    out = {}
    for v in values:
        name, sep, n = v.partition("=")
        if not sep or name not in MODELS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"predict_reach: --{what} takes MODEL=N with MODEL one of {', '.join(MODELS)} "
                             f"and N a positive integer, not {v!r}")
        out[name] = int(n)
    return out


def _label(name: str, chunks: int) -> str:
    return name if name != "gpt2" else f"gpt2, loss {'whole' if chunks == 1 else f'in {chunks} pieces'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--base", nargs="+", default=[], metavar="MODEL=N",
                        help="the base batch B per model (default on CPU: gpt2=2 resnet50=8; on CUDA the budget "
                             "bench's: gpt2=8 resnet50=64; --smoke: its smoke batches; --traces: the smallest "
                             "saved batch)")
    parser.add_argument("--multiples", nargs="+", type=float, default=None,
                        help=f"multiples of B to record (default {' '.join(map(str, MULTIPLES))}; "
                             f"--smoke {' '.join(map(str, SMOKE_MULTIPLES))})")
    parser.add_argument("--gpt2-loss-chunks", nargs="+", type=int, default=[GPT2_LOSS_CHUNKS],
                        help=f"GPT-2's loss in this many pieces, one prediction each (default {GPT2_LOSS_CHUNKS}, "
                             "the budget bench's; 1: the logits whole)")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--confs", nargs="+", default=[""], metavar="CONF",
                        help="pool settings added to a CUDA device's for the budgeted replays, one column each "
                             "(default: none added; \"\" is that, e.g. --confs \"\" arena:on)")
    parser.add_argument("--recordings", type=int, default=1,
                        help="record each batch this many times (op costs vary from one recording to the next)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--smoke", action="store_true", help="the zoo's small models")
    parser.add_argument("--save-traces", metavar="DIR", help="also save every recorded step here")
    parser.add_argument("--traces", metavar="DIR",
                        help="replay the steps saved here (--save-traces) instead of recording; the recording "
                             "options (--multiples, --gpt2-loss-chunks, --recordings, --device, --smoke) do not apply")
    parser.add_argument("--note", default="", help="a paragraph for the report, after the device line")
    parser.add_argument("--out", help="also write the report here")
    args = parser.parse_args(argv)
    if any(m <= 0 for m in args.multiples or ()):
        raise SystemExit("predict_reach: --multiples must be positive")
    if args.recordings < 1:
        raise SystemExit("predict_reach: --recordings must be at least 1")
    if any(c < 1 for c in args.gpt2_loss_chunks):
        raise SystemExit("predict_reach: --gpt2-loss-chunks must be at least 1")
    import dtralloc
    from dtralloc import _core

    bad = [p for p in args.policies if p == "none" or p not in dtralloc.POLICIES]
    if bad:
        raise SystemExit(f"predict_reach: --policies: {bad[0]!r} is not an evicting policy; "
                         f"one of {', '.join(p for p in dtralloc.POLICIES if p != 'none')}")
    for conf in args.confs:
        try:
            _core.describe_config(",".join(filter(None, (GPU_CONF, conf))))
        except _core.ConfigError as e:
            raise SystemExit(f"predict_reach: --confs {conf!r}: {e}") from None
        if "budget" in conf or "policy" in conf:
            raise SystemExit(f"predict_reach: --confs {conf!r}: the budget is M and the policy --policies'")
    given_bases = _pairs(args.base, "base")
    command = shlex.join(["python", "bench/predict_reach.py", *(sys.argv[1:] if argv is None else argv)])
    models = []

    def add(name, chunks, description, device, base, traces, skipped):
        durations = traces[base][0].meta.get("durations", "?")
        result = predict(traces, base, args.policies, args.confs)
        result["skipped"] = skipped
        models.append({"label": _label(name, chunks), "description": description, "base": base, "device": device,
                       "durations": durations, "policies": args.policies, "result": result})
        # Rewritten after each model: a run cut short keeps what it measured.
        if args.out:
            write(report(models, args, command, device_line), args.out)

    if args.traces:
        saved = load_steps(args.traces)
        device_line = f"steps saved in {args.traces}, replayed here (dtralloc {dtralloc.__version__})"
        for (name, chunks), traces in sorted(saved.items()):
            if name not in args.models:
                continue
            base = given_bases.get(name, min(traces))
            if base not in traces:
                raise SystemExit(f"predict_reach: --base {name}={base}: no saved step at that batch in {args.traces} "
                                 f"(saved: {', '.join(map(str, sorted(traces)))})")
            meta = traces[base][0].meta
            description = (f"{meta.get('name', name)} and its other batches, recorded {meta.get('recorded_at', '?')} "
                           f"on {', '.join(meta.get('devices', [])) or '?'} under torch {meta.get('torch', '?')}")
            add(name, chunks, description, ", ".join(meta.get("devices", [])) or "?",
                base, {b: ts for b, ts in traces.items() if b >= base}, {})
        if not models:
            raise SystemExit(f"predict_reach: no saved steps of {', '.join(args.models)} in {args.traces}")
        emit(report(models, args, command, device_line), args.out)
        return 0

    bases = {**(SMOKE_BATCH if args.smoke else CPU_BASE if args.device == "cpu" else BASE_BATCH), **given_bases}
    multiples = args.multiples or (SMOKE_MULTIPLES if args.smoke else MULTIPLES)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("predict_reach: --device cuda, but torch sees no CUDA device")
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        device_line = f"device: CPU, torch {torch.__version__}, {torch.get_num_threads()} threads"
    else:
        device_line = f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}"
    for name in args.models:
        for chunks in (args.gpt2_loss_chunks if name == "gpt2" else [1]):
            base = bases[name]
            batches = batches_for(base, multiples)
            print(f"{_label(name, chunks)}: recording batches {batches}", file=sys.stderr)
            traces, description, skipped = record_steps(name, args.smoke, args.device, chunks, batches,
                                                        args.recordings, args.save_traces)
            if base not in traces:
                raise SystemExit(f"predict_reach: {name}'s step at the base batch {base} could not be recorded "
                                 f"({skipped[base]}); pass a smaller --base {name}=N")
            add(name, chunks, description, args.device, base, traces, skipped)
            del traces
            gc.collect()
    emit(report(models, args, command, device_line), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
