"""The command line of the scenario workers (tests/_abi_worker.py,
tests/_vmm_worker.py): ``python WORKER.py SCENARIO`` runs the worker's
``scenario_<SCENARIO>`` function, which raises on failure, and prints
``PASS <SCENARIO>`` when it returns."""
from __future__ import annotations

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
