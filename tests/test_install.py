"""dtralloc.install() and dtralloc.install_cupy(), without a GPU.

The CPU build of torch installed here has no CUDA allocator. tests/_torch_standin.py
stands in for the C bindings a CUDA build has (exactly their names, with the
behaviour of torch's C++ under a pluggable allocator); torch's own Python code
(torch.cuda.memory.CUDAPluggableAllocator, change_current_allocator) runs as
is on top. The configuration that install() would put in force process-wide is
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
from _torch_standin import SETTERS, StandIn

import dtralloc
from dtralloc import torch_hooks
from dtralloc.testing import fake_cudart_path

torch = pytest.importorskip("torch")

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_abi_worker.py")

# What install() hands each of torch's setters.
HOOK_SYMBOLS = {
    "set_init_fn": "dtralloc_init",
    "set_reset_fn": "dtralloc_empty_cache",
    "set_memory_fraction_fn": "dtralloc_set_memory_fraction",
    "set_base_alloc_fn": "dtralloc_base_alloc",
    "set_record_stream_fn": "dtralloc_record_stream",
    "set_begin_allocate_to_pool": "dtralloc_begin_allocate_to_pool",
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


def _set_attr(monkeypatch):
    return lambda obj, name, value: monkeypatch.setattr(obj, name, value, raising=False)


@pytest.fixture
def cuda_torch(monkeypatch, events):
    """torch as install() sees it in a fresh GPU process (CUDA not initialized)."""
    graphs = torch.cuda.graphs
    for owner, name in ((graphs.graph, "__enter__"), (graphs.CUDAGraph, "capture_begin")):
        monkeypatch.setattr(owner, name, owner.__dict__[name])  # install() replaces them: put back after
    return StandIn(torch).apply(_set_attr(monkeypatch))


def test_the_standin_binding_has_exactly_torchs_setters(cuda_torch):
    binding = torch._C._cuda_customAllocator(1, 2)
    assert {n for n in dir(binding) if not n.startswith("__")} == set(SETTERS)
    with pytest.raises(TypeError):
        binding.set_record_stream_fn(None)  # pybind11's uint64_t argument


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
    assert events == [("configure", "budget:6G,max_split_size_mb:200")]
    binding = torch._C._cuda_getAllocator()  # swapped in by torch's change_current_allocator
    assert binding is not None
    allocator = cuda_torch.allocator_of(binding)
    # Built by torch's own CUDAPluggableAllocator from our library's symbols.
    assert allocator.alloc_fn == c_symbol("dtralloc_malloc_or_throw")
    assert allocator.free_fn == c_symbol("dtralloc_free")
    # Every hook under torch's name; end_allocate_to_pool and release_pool are
    # never reached, because the begin hook refuses the capture.
    assert allocator.hooks == {setter: c_symbol(symbol) for setter, symbol in HOOK_SYMBOLS.items()}


def test_install_takes_a_dict_and_is_idempotent(cuda_torch, events):
    dtralloc.install({"budget": "6G", "garbage_collection_threshold": 0.8})
    assert events[0] == ("configure", "budget:6G,garbage_collection_threshold:0.8")
    binding = torch._C._cuda_getAllocator()
    n = len(events)
    dtralloc.install("budget:6G,garbage_collection_threshold:0.8")  # same conf: nothing happens
    assert len(events) == n and torch._C._cuda_getAllocator() is binding
    with pytest.raises(torch_hooks.InstallError, match="already installed") as info:
        dtralloc.install("budget:1G")
    assert "budget:6G" in str(info.value) and "budget:1G" in str(info.value)
    assert len(events) == n


def test_install_uses_dtralloc_conf_by_default(monkeypatch, cuda_torch, events):
    monkeypatch.setenv("DTRALLOC_CONF", "budget:0.5")
    dtralloc.install()
    assert events[0] == ("configure", "budget:0.5")


@pytest.mark.parametrize(
    "missing", ["set_record_stream_fn", "set_reset_fn", "set_memory_fraction_fn", "set_init_fn", "set_base_alloc_fn"]
)
def test_install_fails_loudly_when_torch_lacks_a_hook(monkeypatch, events, missing):
    """Without set_record_stream_fn, tensor.record_stream() would do nothing and
    a block still used on a side stream would be handed out again: silent
    corruption. Without the others, empty_cache(), set_per_process_memory_fraction()
    ... would silently do nothing. install() refuses, before swapping anything."""
    standin = StandIn(torch, setters=[s for s in SETTERS if s != missing]).apply(_set_attr(monkeypatch))
    with pytest.raises(torch_hooks.InstallError) as info:
        dtralloc.install("")
    assert missing in str(info.value)
    assert torch.__version__ in str(info.value)
    assert standin.state.current is None  # torch's allocator was not swapped
    assert not dtralloc.installed()


def test_install_warns_when_torch_cannot_refuse_a_capture_at_its_start(monkeypatch, events):
    """A torch without set_begin_allocate_to_pool (before 2.2): dtralloc still
    refuses a capture at its first cache miss, but one that only hits the cache
    shares blocks silently; say so."""
    standin = StandIn(torch, setters=[s for s in SETTERS if "pool" not in s]).apply(_set_attr(monkeypatch))
    with pytest.warns(RuntimeWarning, match="set_begin_allocate_to_pool"):
        dtralloc.install("")
    assert dtralloc.installed() and standin.state.current is not None


class _CaptureParts:
    """What a torch.cuda.graph holds and calls on __enter__ (torch/cuda/graphs.py,
    graph.__init__ and __enter__): the capture stream's context and the
    CUDAGraph. Records which of them torch reached."""

    def __init__(self):
        self.calls: list[str] = []

    def __enter__(self):
        self.calls.append("capture stream made current")

    def __exit__(self, *exc):
        self.calls.append("capture stream left")

    def capture_begin(self, *args, **kwargs):
        self.calls.append("capture_begin")

    def capture_end(self):
        self.calls.append("capture_end")


def _graph_context(parts: _CaptureParts):
    # graph.__init__ makes a CUDA stream, which the CPU build cannot: set the
    # attributes it sets, with the stand-in parts.
    ctx = object.__new__(torch.cuda.graph)
    ctx.stream_ctx = ctx.cuda_graph = parts
    ctx.pool, ctx.capture_error_mode = (), "global"
    ctx._enable_annotations = ctx.check_input_liveness = False
    return ctx


def test_install_refuses_a_graph_capture_before_torch_changes_anything(cuda_torch, events):
    """torch's C++ capture_begin puts the CUDA generators into capture mode
    before it calls the allocator's hook, and graph.__enter__ has made the
    capture stream current by then: the refusal comes first, in Python."""
    dtralloc.install("")
    parts = _CaptureParts()
    with pytest.raises(RuntimeError) as info:
        with _graph_context(parts):
            pass
    message = str(info.value)
    assert "torch.cuda.graph was about to begin a CUDA graph capture" in message
    assert "does not support CUDA graph capture" in message and "dtralloc.install()" in message
    assert "the current stream and the CUDA random generators are as they were" in message
    assert parts.calls == []
    with pytest.raises(RuntimeError, match="CUDAGraph.capture_begin was about to begin"):
        torch.cuda.CUDAGraph.capture_begin(parts)
    assert parts.calls == []


def test_captures_run_as_torch_wrote_them_once_dtralloc_is_not_torchs_allocator(monkeypatch, cuda_torch, events):
    dtralloc.install("")
    cuda_torch.state.current = None  # another allocator is torch's now
    # What graph.__enter__ calls besides the capture's parts (no CUDA here):
    # synchronize and empty_cache first; torch 2.14 also asks for the current
    # stream after capture_begin (maybe_stamp_capture_root, which uses it only
    # with annotations on).
    for name in ("synchronize", "empty_cache", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, lambda: None)
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    parts = _CaptureParts()
    with _graph_context(parts):
        pass
    assert parts.calls == ["capture stream made current", "capture_begin", "capture_end", "capture stream left"]


def test_install_after_cuda_init_says_to_install_first(cuda_torch, events):
    cuda_torch.state.cuda_initialized = True
    torch.cuda._initialized = True  # torch.cuda.is_initialized(); undone by the fixture
    with pytest.raises(torch_hooks.InstallError) as info:
        dtralloc.install()
    message = str(info.value)
    assert "after CUDA was initialized" in message
    assert "Call dtralloc.install() at the top of your program" in message
    assert "before any tensor is created on or moved to the GPU" in message
    assert events == []  # neither configured nor touched torch's allocator
    assert cuda_torch.state.current is None
    assert not dtralloc.installed()


def test_torch_refusing_the_swap_becomes_an_install_error(cuda_torch, events):
    # torch's own allocator already served memory without torch.cuda's Python
    # lazy init (a C++ extension did): changeCurrentAllocator refuses.
    cuda_torch.state.cuda_initialized = True
    with pytest.raises(torch_hooks.InstallError) as info:
        dtralloc.install("budget:6G")
    message = str(info.value)
    assert "Call dtralloc.install() before the first CUDA allocation" in message
    assert "Can't swap an already initialized allocator" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not dtralloc.installed()
    # A later install (say, in a fresh program state) is not blocked by the failure.
    cuda_torch.state.cuda_initialized = False
    dtralloc.install("budget:6G")
    assert dtralloc.installed()


def test_install_error_is_a_runtime_error():
    assert issubclass(torch_hooks.InstallError, RuntimeError)


def test_install_then_call_what_torch_was_given():
    """Real configure() in a fresh process; then calls install()'s function pointers."""
    proc = run_worker("install_wiring")
    assert "Budget 64 MiB" in proc.stderr  # the conf passed to install() is in force


def test_torch_memory_functions_answer_with_dtrallocs_figures():
    run_worker("torch_memory_functions")


def test_install_replaces_exactly_the_memory_bindings(cuda_torch, events):
    before = dict(vars(torch._C))
    dtralloc.install("")
    changed = {name for name, value in vars(torch._C).items() if before.get(name) is not value}
    assert changed == {
        "_cuda_memoryStats",
        "_cuda_resetPeakMemoryStats",
        "_cuda_resetAccumulatedMemoryStats",
        "_cuda_memorySnapshot",
        "_accelerator_getDeviceStats",
        "_accelerator_resetPeakStats",
        "_accelerator_resetAccumulatedStats",
    }


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
