"""Smaller faults of the GPU path, each with the behaviour a user would see.

* an eviction hook that returns something other than True/False;
* which CUDA runtime dtralloc loads when torch (built against CUDA 12 or 13)
  is in the process but no runtime is loaded yet;
* a process forked from one whose dtralloc allocators hold CUDA memory.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import dtralloc
from dtralloc.testing import fake_cudart_path

MiB = 1 << 20
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_abi_worker.py")


@pytest.mark.parametrize("answer", [None, 1, "yes", 0.0])
def test_eviction_hook_returning_the_wrong_type_says_what_it_must_return(make_pool, answer):
    pool = make_pool("virtual", "1G", "budget:64M")

    def make_room(nbytes, stream):
        return answer

    pool.set_eviction_hook(make_room)
    with pytest.raises(TypeError) as info:
        pool.malloc(100 * MiB)
    message = str(info.value)
    assert "eviction hook" in message and "make_room" in message
    assert repr(answer) in message and type(answer).__name__ in message
    assert "True" in message and "False" in message
    pool.check_invariants()


def _runtime_chosen(tmp_path, torch_cuda: str | None) -> str:
    """The CUDA runtime dtralloc loads in a fresh process where the loader
    finds both libcudart.so.13 and libcudart.so.12 (copies of the fake) and
    torch, built against `torch_cuda`, is imported but loaded none."""
    for soname in ("libcudart.so.12", "libcudart.so.13"):
        shutil.copy(fake_cudart_path(), tmp_path / soname)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["LD_LIBRARY_PATH"] = f"{tmp_path}:{env.get('LD_LIBRARY_PATH', '')}"
    code = (
        "import torch, dtralloc\n"
        # torch/version.py of a CUDA build: cuda = '12.8' (None in the CPU build here)
        f"torch.version.cuda = {torch_cuda!r}\n"
        "dtralloc.memory_stats(0)\n"
        "print(dtralloc._core.cuda_runtime_path())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return os.path.basename(proc.stdout.strip().splitlines()[-1])


def _cudart_loaded_by_torch() -> str | None:
    """The CUDA runtime `import torch` loaded into this process (a CUDA build
    of torch links one: torch 2.11+cu130 loads nvidia/cu13/lib/libcudart.so.13
    from its wheel, GPU or not), else None (the CPU build here)."""
    import torch  # noqa: F401  (imported for what it loads)

    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libcudart.so"):
                return path
    return None


_TORCH_CUDART = _cudart_loaded_by_torch()

# The two tests below need a torch that leaves the runtime unloaded at import:
# the CPU build. A CUDA build has loaded its own already, and search step (b)
# takes it whatever the version preference says (the next test checks that).
_CUDA_TORCH = pytest.mark.skipif(_TORCH_CUDART is not None, reason="this torch loads its CUDA runtime at import")


@_CUDA_TORCH
@pytest.mark.parametrize("torch_cuda, soname", [("12.8", "libcudart.so.12"), ("13.0", "libcudart.so.13")])
def test_the_runtime_of_the_torch_in_the_process_is_preferred(tmp_path, torch_cuda, soname):
    assert _runtime_chosen(tmp_path, torch_cuda) == soname


@_CUDA_TORCH
def test_without_a_cuda_torch_the_newest_runtime_is_tried_first(tmp_path):
    assert _runtime_chosen(tmp_path, None) == "libcudart.so.13"


@pytest.mark.skipif(_TORCH_CUDART is None, reason="this torch loads no CUDA runtime (CPU build)")
def test_the_runtime_a_cuda_torch_loaded_is_the_one_dtralloc_uses():
    """One runtime in the process: dtralloc takes the libcudart that a CUDA
    build of torch loaded at import (from its wheel's nvidia/ folder, which is
    on no search path), with or without a GPU."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    code = (
        "import json, torch, dtralloc\n"
        "from dtralloc import _core\n"
        "_core.cuda_device_count()\n"  # loads the runtime (0 devices without a driver)
        "loaded = sorted({l.split()[-1] for l in open('/proc/self/maps') if '/libcudart.so' in l})\n"
        "print(json.dumps(loaded))\n"
        "print(_core.cuda_runtime_path())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *_, loaded, used = proc.stdout.strip().splitlines()
    loaded = json.loads(loaded)
    assert len(loaded) == 1, f"more than one CUDA runtime in the process: {loaded}"
    assert os.path.samefile(used, loaded[0]), (used, loaded)


def test_a_forked_child_does_not_use_the_parents_pool():
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["DTRALLOC_CUDART"] = fake_cudart_path()
    proc = subprocess.run([sys.executable, WORKER, "fork"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "PASS fork" in proc.stdout, proc.stdout + proc.stderr


def _real_cudart() -> str | None:
    """A real CUDA runtime on this machine (a toolkit's), else None."""
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        for soname in ("libcudart.so.13", "libcudart.so.12"):
            path = os.path.join(root or "", "lib64", soname)
            if root and os.path.exists(path):
                return path
    return None


@pytest.mark.skipif(_real_cudart() is None, reason="no CUDA toolkit's libcudart on this machine")
def test_a_real_cuda_runtime_resolves_every_function_dtralloc_calls():
    """The fake runtime mirrors the functions dtralloc declares; this loads the
    real one (CUDA 12/13's libcudart, where a toolkit is installed) so that a
    function missing or renamed in it fails here, not first on a GPU machine.
    Without a GPU the pool's creation then names the runtime and the cause."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["DTRALLOC_CUDART"] = _real_cudart()
    code = (
        "import dtralloc\n"
        "from dtralloc import _core\n"
        "n = _core.cuda_device_count()\n"  # loads the runtime and resolves every symbol, or raises
        "print('runtime', _core.cuda_runtime_path())\n"
        "if n == 0:\n"
        "    try:\n"
        "        dtralloc.memory_stats(0)\n"
        "    except RuntimeError as e:\n"
        "        print('error', e)\n"
        "else:\n"
        "    print('devices', n)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert lines["runtime"] == env["DTRALLOC_CUDART"], proc.stdout
    if "error" in lines:
        assert "sees no usable GPU" in lines["error"] and env["DTRALLOC_CUDART"] in lines["error"], lines
        assert "has no symbol" not in lines["error"]
    else:
        assert int(lines["devices"]) > 0
