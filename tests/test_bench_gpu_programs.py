"""The programs the benches run in fresh processes on a GPU are strings no
CPU run executes: they must at least compile. bench_hot_path's GPU loop
did not until 2026-11-30 (`del torch.empty(...)`), and its GPU part failed
on its first GPU run."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))


@pytest.mark.parametrize("module, name", [("bench_hot_path", "GPU_LOOP"), ("replay_fragmentation", "GPU_RUN")])
def test_the_gpu_programs_compile(module, name):
    program = getattr(__import__(module), name)
    compile(program, f"{module}.{name}", "exec")


def test_hot_path_gpu_part_alone_reports_without_a_gpu(tmp_path):
    """`--gpu` runs the GPU part alone (gpu_session.sh's hot_path step, which
    the CPU parts' minutes kept from running): without a GPU it says so."""
    import subprocess

    out = tmp_path / "hot_path.md"
    bench = Path(__file__).resolve().parent.parent / "bench" / "bench_hot_path.py"
    r = subprocess.run([sys.executable, str(bench), "--quick", "--gpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = out.read_text()
    assert "--gpu" in report and "GPU" in report and "publisher" not in report, report
