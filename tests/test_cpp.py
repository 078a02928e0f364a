"""Builds and runs the C++ tests (tests/cpp/test_*.cpp) under AddressSanitizer,
UndefinedBehaviorSanitizer and LeakSanitizer.

The build lives in a temporary directory, separate from the Python package's
build: the allocator is compiled with -fsanitize=address,undefined at -O1 (fast
enough to build and run on 2 cores in a couple of minutes, optimized enough for
the stress test to reach real interleavings). CMakeLists.txt gives each test
its ASAN_OPTIONS (detect_leaks=1) and a timeout, so running ctest by hand in a
build tree behaves the same as this test.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPP_TESTS = sorted(p.stem for p in (ROOT / "tests" / "cpp").glob("test_*.cpp"))
JOBS = "2"
SANITIZE = "address,undefined"


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


def _sanitizers_link(compiler: str, work: Path) -> bool:
    """True when the compiler can build and run a program with the sanitizers."""
    src = work / "probe.cpp"
    exe = work / "probe"
    src.write_text("int main() { return 0; }\n")
    try:
        build = subprocess.run(
            [compiler, f"-fsanitize={SANITIZE}", str(src), "-o", str(exe)],
            capture_output=True, timeout=60, check=False,
        )
        return build.returncode == 0 and subprocess.run([str(exe)], timeout=60, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the C++ tests and the fake CUDA runtime are Linux-only")
def test_cpp_under_sanitizers(tmp_path: Path) -> None:
    cmake = _tool("cmake")
    if cmake is None:
        pytest.skip("cmake not found (neither on PATH nor the `cmake` pip package)")
    compiler = _compiler()
    if compiler is None:
        pytest.skip("no C++ compiler found (CXX, c++, g++ or clang++)")
    if not _sanitizers_link(compiler, tmp_path):
        pytest.skip(f"{compiler} cannot build and run -fsanitize={SANITIZE} programs")
    assert CPP_TESTS, "no tests/cpp/test_*.cpp found"

    build = tmp_path / "build"
    configure = [
        cmake, "-S", str(ROOT), "-B", str(build),
        f"-DCMAKE_CXX_COMPILER={compiler}",
        "-DCMAKE_BUILD_TYPE=Debug",  # keeps assert() on
        "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -g",
        "-DDTRALLOC_BUILD_TESTS=ON",
        "-DDTRALLOC_BUILD_PYTHON=OFF",
        f"-DDTRALLOC_SANITIZE={SANITIZE}",
    ]
    ninja = _tool("ninja")
    if ninja is not None:
        configure += ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"]
    elif shutil.which("make") is None:
        pytest.skip("neither ninja nor make found to drive the build")
    _run(configure, ROOT, 180, "cmake configure")

    # Only the tests and the fake runtime they are given, two jobs.
    targets = [*CPP_TESTS, "dtralloc_fakecudart"]
    _run([cmake, "--build", str(build), "--parallel", JOBS, "--target", *targets], ROOT, 900, "C++ build")

    ctest = Path(cmake).with_name("ctest")
    ctest_cmd = [str(ctest) if ctest.exists() else "ctest", "--output-on-failure", "-j", JOBS, "--timeout", "300"]
    output = _run(ctest_cmd, build, 900, "ctest")
    assert "100% tests passed" in output, output[-20000:]
    for name in CPP_TESTS:  # every test ran and reported its checks
        assert name in output, output[-20000:]
