"""What a dtr() session records for dashboards, and how much by default
(no torch: the dashboard reads these without importing it)."""
from __future__ import annotations

# The per-op series' phase codes (Session.series()["phase"]).
PHASES = ("forward", "backward", "optimizer")
# Ops whose per-op series and event log a session keeps by default: 2^20 ops
# is some hundreds of training steps of a mid-sized model, at most ~60 MiB
# (about 57 bytes per op); past it the recording stops and costs nothing.
SERIES_OPS = 1 << 20
# Events of the CPU mirror's history ring with history=True (48 bytes each:
# 48 MiB): tens of thousands of ops, each allocating and freeing a few times.
HISTORY_EVENTS = 1 << 20
