"""Builds and runs the C++ tests (tests/cpp/test_*.cpp) under the sanitizers.

Two builds, each in a temporary directory apart from the Python package's:

* AddressSanitizer + UndefinedBehaviorSanitizer (LeakSanitizer at exit):
  every C++ test, among them the million-operation model test
  (test_pool_model, a fresh seed each run, printed first).
* ThreadSanitizer: the tests that run threads or the CUDA backend
  (test_stress_threads, test_allocator, test_cuda_backend).

The allocator is compiled at -O1 (fast enough to build and run on 2 cores in
a few minutes, optimized enough for the stress tests to reach real
interleavings). CMakeLists.txt gives each test its sanitizer options and a
timeout, so running ctest by hand in a build tree behaves the same as here.

These tests never skip: without cmake, a C++ compiler or a working
sanitizer runtime they fail, naming what is missing (.ci/run installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPP_TESTS = sorted(p.stem for p in (ROOT / "tests" / "cpp").glob("test_*.cpp"))
JOBS = "2"
# (sanitizers, the tests built and run under them)
BUILDS = {
    "address,undefined": CPP_TESTS,
    "thread": ["test_stress_threads", "test_allocator", "test_cuda_backend"],
}


def _tool(name: str) -> str | None:
    """`name` on PATH, else the binary of its pip package (cmake, ninja)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        module = __import__(name)
    except ImportError:
        return None
    bin_dir = getattr(module, "CMAKE_BIN_DIR" if name == "cmake" else "BIN_DIR", None)
    if bin_dir:
        candidate = Path(bin_dir) / name
        if candidate.exists():
            return str(candidate)
    return None


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _run(cmd: list[str], cwd: Path, timeout: int, what: str) -> str:
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, timeout=timeout, check=False,
        )
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        pytest.fail(f"{what} took more than {timeout} s:\n{' '.join(cmd)}\n{out[-20000:]}")
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n{' '.join(cmd)}\n{proc.stdout[-20000:]}")
    return proc.stdout


def _sanitizers_link(compiler: str, sanitize: str, work: Path) -> bool:
    """True when the compiler can build and run a program with the sanitizers."""
    src = work / "probe.cpp"
    exe = work / "probe"
    src.write_text("int main() { return 0; }\n")
    try:
        build = subprocess.run(
            [compiler, f"-fsanitize={sanitize}", str(src), "-o", str(exe)],
            capture_output=True, timeout=60, check=False,
        )
        return build.returncode == 0 and subprocess.run([str(exe)], timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _toolchain(sanitize: str, work: Path) -> tuple[str, str, list[str]]:
    """cmake, the compiler and the generator arguments; fails naming what is
    missing. An empty `sanitize` asks for no sanitizer runtime."""
    cmake = _tool("cmake")
    if cmake is None:
        pytest.fail("cmake not found (neither on PATH nor the `cmake` pip package): pip install cmake ninja")
    compiler = _compiler()
    if compiler is None:
        pytest.fail("no C++ compiler found (CXX, c++, g++ or clang++): install g++ (apt-get install g++)")
    if sanitize and not _sanitizers_link(compiler, sanitize, work):
        pytest.fail(f"{compiler} cannot build and run -fsanitize={sanitize} programs (install its sanitizer runtime)")
    ninja = _tool("ninja")
    if ninja is not None:
        return cmake, compiler, ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    if shutil.which("make") is None:
        pytest.fail("neither ninja nor make found to drive the build: pip install ninja")
    return cmake, compiler, []


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the C++ tests and the fake CUDA runtime are Linux-only")
@pytest.mark.parametrize("sanitize", list(BUILDS))
def test_cpp_under_sanitizers(tmp_path: Path, sanitize: str) -> None:
    tests = BUILDS[sanitize]
    assert tests and set(tests) <= set(CPP_TESTS), tests
    cmake, compiler, generator = _toolchain(sanitize, tmp_path)
    build = tmp_path / "build"
    configure = [
        cmake, "-S", str(ROOT), "-B", str(build), *generator,
        f"-DCMAKE_CXX_COMPILER={compiler}",
        "-DCMAKE_BUILD_TYPE=Debug",  # keeps assert() on
        "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g",
        "-DDTRALLOC_BUILD_TESTS=ON",
        "-DDTRALLOC_BUILD_PYTHON=OFF",
        f"-DDTRALLOC_SANITIZE={sanitize}",
    ]
    _run(configure, ROOT, 180, "cmake configure")

    # Only these tests and the fake runtime they are given, two jobs.
    _run([cmake, "--build", str(build), "--parallel", JOBS, "--target", *tests, "dtralloc_fakecudart"],
         ROOT, 900, "C++ build")

    ctest = Path(cmake).with_name("ctest")
    ctest_cmd = [str(ctest) if ctest.exists() else "ctest", "--output-on-failure", "-j", JOBS,
                 "--timeout", "300", "-R", "^(" + "|".join(tests) + ")$"]
    output = _run(ctest_cmd, build, 900, "ctest")
    assert "100% tests passed" in output, output[-20000:]
    for name in tests:  # every test ran and reported its checks
        assert name in output, output[-20000:]


def _dynamic_symbols(library: Path) -> list[tuple[str, str]]:
    """(nm type letter, mangled name) of every symbol `library` defines for the
    dynamic linker; 'u' is a GNU-unique symbol, bound process-wide."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.fail("nm not found (binutils, which g++ depends on): apt-get install binutils")
    out = _run([nm, "-D", "--defined-only", str(library)], library.parent, 60, "nm")
    return [(f[1], f[2]) for f in (line.split() for line in out.splitlines()) if len(f) == 3]


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="ELF symbol visibility")
def test_a_statically_linked_cxx_runtime_stays_private(tmp_path: Path) -> None:
    """A toolchain that links libstdc++ statically (-static-libstdc++ in LDFLAGS,
    as a GPU machine's image did) must not make libdtralloc.so export the
    runtime: its locale ids are GNU-unique symbols, which the dynamic linker
    binds process-wide even under RTLD_LOCAL, so a libstdc++.so loaded later
    (torch's) would use our copy's, and `import dtralloc; import torch`
    crashed inside torch's import (pytorch/pytorch#109923). CMakeLists.txt
    links with --exclude-libs,ALL; this builds the library that way and reads
    what it exports."""
    cmake, compiler, generator = _toolchain("", tmp_path)
    build = tmp_path / "build"
    _run([cmake, "-S", str(ROOT), "-B", str(build), *generator,
          f"-DCMAKE_CXX_COMPILER={compiler}", "-DDTRALLOC_BUILD_PYTHON=OFF",
          "-DCMAKE_SHARED_LINKER_FLAGS=-static-libstdc++"], ROOT, 180, "cmake configure")
    _run([cmake, "--build", str(build), "--parallel", JOBS, "--target", "dtralloc"], ROOT, 900, "build")
    symbols = _dynamic_symbols(build / "libdtralloc.so")
    assert any(name == "dtralloc_malloc" for _, name in symbols), "the C ABI is no longer exported"
    unique = [name for kind, name in symbols if kind == "u"]
    assert not unique, f"{len(unique)} GNU-unique symbols exported, e.g. {unique[:5]}"
    # The runtime's own classes (std::locale, std::ios_base, the exception
    # machinery) belong to libstdc++; templates our code instantiates may show.
    runtime = [name for _, name in symbols
               if name.startswith(("_ZNSt6locale", "_ZNSt8ios_base", "__cxa_", "_ZSt4cout"))]
    assert not runtime, f"libstdc++ exported from libdtralloc.so: {runtime[:5]}"


@pytest.mark.parametrize(
    "missing, message",
    [("cmake", "cmake not found"), ("compiler", "no C++ compiler"), ("sanitizer", "cannot build and run")],
)
def test_a_missing_tool_fails_instead_of_skipping(monkeypatch, tmp_path, missing, message):
    """CI must not go green with the C++ tests quietly skipped."""
    if missing == "cmake":
        monkeypatch.setattr(sys.modules[__name__], "_tool", lambda name: None)
    elif missing == "compiler":
        monkeypatch.setattr(sys.modules[__name__], "_compiler", lambda: None)
    else:
        monkeypatch.setattr(sys.modules[__name__], "_compiler", lambda: "/bin/false")
    with pytest.raises(pytest.fail.Exception, match=re.escape(message)):
        _toolchain("address,undefined", tmp_path)
