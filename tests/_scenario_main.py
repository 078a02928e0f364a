"""The command line of the scenario workers (tests/_abi_worker.py,
tests/_vmm_worker.py, tests/_async_worker.py): ``python WORKER.py SCENARIO``
runs the worker's ``scenario_<SCENARIO>`` function, which raises on failure,
and prints ``PASS <SCENARIO>`` when it returns. run_in_fresh_process() is the
test's side: one scenario over the fake CUDA runtime, in an interpreter of
its own (the runtime is loaded once per process)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys


def run(namespace: dict, argv: list[str]) -> int:
    """Runs the scenario argv[1] names among the ``scenario_*`` functions of
    `namespace` (a worker's globals()); 2 with a usage line for anything else."""
    scenarios = {name[len("scenario_"):]: fn for name, fn in namespace.items() if name.startswith("scenario_")}
    if len(argv) != 2 or argv[1] not in scenarios:
        print(f"usage: {argv[0]} {{{','.join(sorted(scenarios))}}}", file=sys.stderr)
        return 2
    scenarios[argv[1]]()
    print(f"PASS {argv[1]}", flush=True)
    return 0


def run_in_fresh_process(worker: str, scenario: str, conf: str | None = None) -> None:
    """Runs `scenario` of `worker` with DTRALLOC_CUDART at the fake runtime
    (and DTRALLOC_CONF=`conf` when given, nothing else of the caller's
    DTRALLOC_*); fails the test with the worker's output unless it passed."""
    from dtralloc.testing import fake_cudart_path

    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["DTRALLOC_CUDART"] = fake_cudart_path()
    if conf is not None:
        env["DTRALLOC_CONF"] = conf
    proc = subprocess.run([sys.executable, worker, scenario], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"PASS {scenario}" in proc.stdout, (
        f"scenario {scenario!r} failed (exit {proc.returncode})\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    )


def global_malloc_free():
    """dtralloc_malloc and dtralloc_free, the C entry points of libdtralloc.so
    that install() hands torch, as callables (size, device, stream) and
    (ptr, size, device, stream)."""
    from dtralloc._native import library_path

    lib = ctypes.CDLL(library_path())
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ctypes.cast(lib.dtralloc_malloc, ctypes.c_void_p).value)
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(
        ctypes.cast(lib.dtralloc_free, ctypes.c_void_p).value)
    return malloc, free
