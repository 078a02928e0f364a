"""dtralloc.install() and dtralloc.install_cupy(), without a GPU.

The CPU build of torch installed here has no CUDA allocator, so the paths a GPU
user meets are reached by monkeypatching the few torch attributes install()
looks at. The configuration that install() would put in force process-wide is
recorded instead of applied, so these tests leave the pytest process exactly
as they found it; tests/_abi_worker.py's install_wiring scenario runs the real
thing in a fresh process and then calls every function install() handed over.
"""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import types

import pytest

import dtralloc
from dtralloc import torch_hooks
from dtralloc.testing import fake_cudart_path

torch = pytest.importorskip("torch")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_abi_worker.py")

HOOK_SYMBOLS = {
    "_set_init_fn": "dtralloc_init",
    "_set_reset_fn": "dtralloc_empty_cache",
    "_set_memory_fraction_fn": "dtralloc_set_memory_fraction",
    "_set_base_alloc_fn": "dtralloc_base_alloc",
    "_set_record_stream_fn": "dtralloc_record_stream",
}


def run_worker(scenario: str, conf: str | None = None) -> subprocess.CompletedProcess:
    """One scenario of tests/_abi_worker.py in a fresh process on the fake runtime."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DTRALLOC_")}
    env["DTRALLOC_CUDART"] = fake_cudart_path()
    if conf is not None:
        env["DTRALLOC_CONF"] = conf
    proc = subprocess.run(
        [sys.executable, WORKER, scenario], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and f"PASS {scenario}" in proc.stdout, proc.stdout + proc.stderr
    return proc


def c_symbol(name: str) -> int:
    return ctypes.cast(getattr(ctypes.CDLL(dtralloc.library_path()), name), ctypes.c_void_p).value


@pytest.fixture
def events(monkeypatch):
    """A fresh, uninstalled torch_hooks whose process-wide configure() is recorded.

    monkeypatch restores _installed_conf and _core.configure after the test.
    """
    log: list[tuple] = []
    monkeypatch.setattr(torch_hooks, "_installed_conf", None)
    monkeypatch.setattr(torch_hooks._core, "configure", lambda text: log.append(("configure", text)))
    return log


class _Hooks:
    """Stands in for torch._C._CUDAPluggableAllocator: records the _set_*_fn calls."""

    def __init__(self, log, missing=()):
        self._log = log
        self._missing = set(missing)

    def __getattr__(self, name):
        if not name.startswith("_set_") or name in self._missing:
            raise AttributeError(name)
        return lambda address: self._log.append((name, address))


@pytest.fixture
def cuda_torch(monkeypatch, events):
    """torch as install() sees it on a fresh GPU process; returns a settings namespace."""
    settings = types.SimpleNamespace(initialized=False, refuse=None, missing_hooks=())
    monkeypatch.setattr(torch._C, "_cuda_customAllocator", lambda alloc, free: object(), raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: settings.initialized)

    class FakePluggableAllocator:
        def __init__(self, path, alloc_fn_name, free_fn_name):
            events.append(("CUDAPluggableAllocator", path, alloc_fn_name, free_fn_name))
            self._allocator = _Hooks(events, settings.missing_hooks)

    def change_current_allocator(allocator):
        events.append(("change_current_allocator", allocator))
        if settings.refuse:
            raise RuntimeError(settings.refuse)

    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggableAllocator)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator", change_current_allocator)
    return settings


def test_not_installed_by_default(events):
    assert not dtralloc.installed()


@pytest.mark.skipif(hasattr(torch._C, "_cuda_customAllocator"), reason="needs a CPU-only torch")
def test_cpu_torch_has_no_cuda_allocator_to_replace(events):
    with pytest.raises(torch_hooks.InstallError, match="built without CUDA") as info:
        dtralloc.install()
    assert torch.__version__ in str(info.value)
    assert "dtralloc.Pool works without one" in str(info.value)
    assert events == []  # nothing was configured
    assert not dtralloc.installed()


@pytest.mark.parametrize(
    "conf, key",
    [("budget:lots", "budget"), ("bogus_key:1", "bogus_key"), ({"max_split_size_mb": "x"}, "max_split_size_mb")],
)
def test_bad_conf_raises_before_touching_torch(monkeypatch, events, conf, key):
    class Untouchable(types.ModuleType):
        def __getattr__(self, name):
            raise AssertionError(f"install() touched torch.{name} before validating the conf")

    monkeypatch.setitem(sys.modules, "torch", Untouchable("torch"))
    with pytest.raises(dtralloc.ConfigError, match=f"'{key}'"):
        dtralloc.install(conf)
    assert events == []
    assert not dtralloc.installed()


def test_bad_conf_from_the_environment_is_a_config_error(monkeypatch, events):
    monkeypatch.setenv("DTRALLOC_CONF", "roundup_power2_divisions:3")
    with pytest.raises(dtralloc.ConfigError, match="roundup_power2_divisions"):
        dtralloc.install()


def test_install_wires_torch_to_the_c_abi(cuda_torch, events):
    dtralloc.install("budget:6G,max_split_size_mb:200")
    assert dtralloc.installed()
    # Configured first, then the allocator built from our library, hooks set, swapped in.
    assert events[0] == ("configure", "budget:6G,max_split_size_mb:200")
    assert events[1] == ("CUDAPluggableAllocator", dtralloc.library_path(), "dtralloc_malloc_or_throw", "dtralloc_free")
    hooks = dict(e for e in events[2:-1])
    assert hooks == {setter: c_symbol(symbol) for setter, symbol in HOOK_SYMBOLS.items()}
    assert events[-1][0] == "change_current_allocator"
    assert all(address for address in hooks.values())


def test_install_takes_a_dict_and_is_idempotent(cuda_torch, events):
    dtralloc.install({"budget": "6G", "garbage_collection_threshold": 0.8})
    assert events[0] == ("configure", "budget:6G,garbage_collection_threshold:0.8")
    n = len(events)
    dtralloc.install("budget:6G,garbage_collection_threshold:0.8")  # same conf: nothing happens
    assert len(events) == n
    with pytest.raises(torch_hooks.InstallError, match="already installed") as info:
        dtralloc.install("budget:1G")
    assert "budget:6G" in str(info.value) and "budget:1G" in str(info.value)
    assert len(events) == n


def test_install_uses_dtralloc_conf_by_default(monkeypatch, cuda_torch, events):
    monkeypatch.setenv("DTRALLOC_CONF", "budget:0.5")
    dtralloc.install()
    assert events[0] == ("configure", "budget:0.5")


def test_install_works_with_a_torch_that_lacks_some_hooks(cuda_torch, events):
    cuda_torch.missing_hooks = ("_set_record_stream_fn", "_set_base_alloc_fn")
    dtralloc.install("")
    hooks = dict(e for e in events[2:-1])
    assert set(hooks) == {"_set_init_fn", "_set_reset_fn", "_set_memory_fraction_fn"}
    assert dtralloc.installed()


def test_install_after_cuda_init_says_to_install_first(cuda_torch, events):
    cuda_torch.initialized = True
    with pytest.raises(torch_hooks.InstallError) as info:
        dtralloc.install()
    message = str(info.value)
    assert "after CUDA was initialized" in message
    assert "Call dtralloc.install() at the top of your program" in message
    assert "before any tensor is created on or moved to the GPU" in message
    assert events == []  # neither configured nor touched torch's allocator
    assert not dtralloc.installed()


def test_torch_refusing_the_swap_becomes_an_install_error(cuda_torch, events):
    cuda_torch.refuse = "Can't swap an already initialized allocator"
    with pytest.raises(torch_hooks.InstallError) as info:
        dtralloc.install("budget:6G")
    message = str(info.value)
    assert "Call dtralloc.install() before the first CUDA allocation" in message
    assert "Can't swap an already initialized allocator" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not dtralloc.installed()
    # A later install (say, in a fresh program state) is not blocked by the failure.
    cuda_torch.refuse = None
    dtralloc.install("budget:6G")
    assert dtralloc.installed()


def test_install_error_is_a_runtime_error():
    assert issubclass(torch_hooks.InstallError, RuntimeError)


def test_install_then_call_what_torch_was_given():
    """Real configure() in a fresh process; then calls install()'s function pointers."""
    proc = run_worker("install_wiring")
    assert "Budget 64 MiB" in proc.stderr  # the conf passed to install() is in force


def test_install_after_dtralloc_already_allocated_is_an_install_error():
    run_worker("install_after_dtralloc_use")


# ---- CuPy --------------------------------------------------------------------


def test_install_cupy_without_cupy_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    with pytest.raises(RuntimeError, match="needs CuPy"):
        dtralloc.install_cupy()


def test_install_cupy_sets_dtralloc_cupy_allocator(monkeypatch):
    chosen = []
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(set_allocator=chosen.append)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    dtralloc.install_cupy()
    assert chosen == [dtralloc.cupy_allocator]


def test_cupy_allocations_come_from_the_torch_pool():
    """A stand-in cupy module (CuPy's own signatures) in a process on the fake runtime."""
    run_worker("cupy", conf="budget:64M")
