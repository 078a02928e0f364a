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
