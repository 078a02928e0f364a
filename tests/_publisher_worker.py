"""A process that publishes allocator counters for tests/test_top.py and
tests/test_publisher.py.

    python _publisher_worker.py pool [SEED]     a dtralloc.Pool (virtual), published
    python _publisher_worker.py global          the process-wide allocator of device 0
                                                (run with DTRALLOC_CUDART=<fake runtime>)
    python _publisher_worker.py fork            publishes, forks; the child exits; prints
                                                whether the file outlived the child
    python _publisher_worker.py dtr             a CPU dtr() session under a budget that
                                                evicts, waiting inside its block (prints
                                                {"stats": session.stats()})

It allocates a fixed mix, prints one JSON line {"path", "stats"}, then waits
for a line on stdin ("exit" ends it; "spike" allocates and frees 1 GiB and
answers "done") so the parent reads a state it knows.
"""
from __future__ import annotations

import json
import random
import sys
import time

import dtralloc
from dtralloc import _core

MiB = 1 << 20


def main() -> int:
    kind = sys.argv[1]
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
    if kind == "fork":
        import os

        pool = dtralloc.Pool("virtual", capacity="80G")
        path = pool.publish(5.0, "pool virtual")
        child = os.fork()
        if child == 0:
            return 0  # a normal exit: atexit handlers run
        os.waitpid(child, 0)
        survived = os.path.exists(path)
        pool.publish(0, "")
        print(json.dumps({"after_child_exit": survived, "after_parent_stops": os.path.exists(path)}))
        return 0
    if kind == "dtr":
        return dtr_session()
    if kind == "pool":
        pool = dtralloc.Pool("virtual", capacity="80G", conf="budget:20G")
        path = pool.publish(5.0, "pool virtual")
    else:
        pool = _core.global_pool(0)
        path = pool.published_path
    live = []
    for _ in range(400):
        if live and rng.random() < 0.4:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.malloc(rng.choice([1000, 4096, 3 * MiB, 12 * MiB, 40 * MiB])))
    pool.add_published_counts(12, 5)
    time.sleep(0.05)  # ten periods: the published frame holds the state above
    print(json.dumps({"path": path, "stats": pool.stats()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "spike":
            big = pool.malloc(1 << 30)
            time.sleep(0.05)
            pool.free(big)
            time.sleep(0.05)
            print("done", flush=True)
        else:
            break
    return 0


def dtr_session() -> int:
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(8)])
    x = torch.randn(4096, 128)
    for _ in range(2):  # kernels allocate more on their first call
        model.zero_grad(set_to_none=True)
        with dtralloc.dtr(device="cpu") as s:
            model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    with dtralloc.dtr(budget=s.stats()["peak_bytes"] * 3 // 4, device="cpu") as s:
        for _ in range(8):  # a session publishes from its 256th recorded op on (allocator/bindings/live_session.cpp)
            model.zero_grad(set_to_none=True)
            model(x).sum().backward()
        time.sleep(0.05)  # ten periods: the published frame holds the state above
        print(json.dumps({"stats": s.stats()}), flush=True)
        sys.stdin.readline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
