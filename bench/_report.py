"""The header every committed benchmark report starts with: date, machine, command."""
from __future__ import annotations

import datetime
import os
import platform


def header(title: str, command: str) -> str:
    return (
        f"# {title}\n\n"
        f"date: {datetime.date.today().isoformat()}  \n"
        f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
        f"{platform.python_implementation()} {platform.python_version()}  \n"
        f"command: `{command}`\n"
    )


def write(report: str, out_path: str) -> None:
    """Write the report to `out_path` (its folder made where missing)."""
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        f.write(report)


def emit(report: str, out_path: str | None) -> None:
    """Print the report, and write it to `out_path` when given."""
    print(report)
    if out_path:
        write(report, out_path)
