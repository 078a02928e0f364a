"""What dtralloc.dashboard returns, and the defaults it replays with."""
from __future__ import annotations

import html as _html
import os
from typing import Union

# Budgets every policy is replayed at for the overhead-vs-budget curves (on
# top of the runs' own): a 0.1 grid is what the policy tables in bench/ use,
# and replays of the bundled traces take milliseconds each.
SWEEP_FRACTIONS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
DEFAULT_POLICIES = ("dtralloc",)
DEFAULT_BUDGETS = (0.5,)


class Dashboard:
    """A built page. ``save(path)`` writes it; in Jupyter it displays inline."""

    def __init__(self, html: str, runs: list, facts: dict):
        self.html = html
        self.runs = runs        # the runs' figures, as the page's data-run elements hold them
        self.facts = facts      # sizes: raw column bytes, blobs

    def save(self, path: Union[str, os.PathLike]) -> str:
        path = os.fspath(path)
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)
        return path

    def _repr_html_(self) -> str:
        # An iframe keeps the page's script and styles apart from the notebook's.
        return (f'<iframe srcdoc="{_html.escape(self.html, quote=True)}" sandbox="allow-scripts" '
                'style="width:100%;height:1100px;border:1px solid #ddd"></iframe>')

    def __repr__(self) -> str:
        return f"<dtralloc.Dashboard: {len(self.runs)} runs, {len(self.html) / 2**20:.2f} MiB>"
