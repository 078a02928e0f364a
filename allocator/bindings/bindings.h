// dtralloc._core: the pybind11 face of the allocator, one file per room of
// the Python package. Private; the public API is python/dtralloc/__init__.py.
// module.cpp defines the module and calls each bind_* below once.
#pragma once

#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>

#include "allocator.h"
#include "config.h"

namespace dtralloc::bindings {

namespace py = pybind11;

// Pool, the process-wide allocators, stats and snapshots (pool.cpp).
void bind_pool(py::module_& m);
// Trace replay through pool + engine + evictor (replay.cpp).
void bind_replay(py::module_& m);
// Live DTR on eager PyTorch: the session and saved handles (live.cpp).
void bind_live(py::module_& m);
// What dashboards and `dtralloc top` read: history columns, the history
// model, the publisher (dashboard.cpp). Adds methods to Pool: after bind_pool.
void bind_dashboard(py::module_& m);

// One allocator's history as numpy columns (dashboard.cpp): action, addr,
// size, stream, time_us, op, device_free, block_size, and action_names.
// Reads the ring under the allocator's lock, with the segments of the same
// moment going to `segments` (may be null).
py::dict history_columns(Allocator& a, Snapshot* segments);
// The same columns from entries already copied out (a replay keeps its
// pool's history after the pool is gone): the ring's two runs, oldest first.
py::dict history_columns(const TraceEntry* older, std::size_t older_count, const TraceEntry* newer,
                         std::size_t newer_count);

// A split limit as torch reports it: bytes, or -1 for none.
inline std::int64_t split_size_for_python(std::size_t limit) {
  return limit == kNoLimit ? -1 : static_cast<std::int64_t>(limit);
}

}  // namespace dtralloc::bindings
