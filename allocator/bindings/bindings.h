// dtralloc._core: the pybind11 face of the allocator, one file per room of
// the Python package. Private; the public API is python/dtralloc/__init__.py.
// module.cpp defines the module and calls each bind_* below once.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator.h"
#include "config.h"
#include "event_log.h"
#include "op_series.h"

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

// A column as a numpy array. With an `owner` (a Python object that keeps
// `v` alive and never changes it, such as a ReplayResult) the array views
// `v` without a copy; with a null owner it is a copy (`v` may grow later).
template <typename T>
py::array_t<T> column(const std::vector<T>& v, py::handle owner) {
  if (!owner) return py::array_t<T>(static_cast<py::ssize_t>(v.size()), v.data());
  return py::array_t<T>({static_cast<py::ssize_t>(v.size())}, {static_cast<py::ssize_t>(sizeof(T))}, v.data(),
                        owner);
}
// A per-op series (op_series.h) and an event log (event_log.h) as dicts of
// columns, named as the C++ fields (replay.cpp): ReplayResult.series /
// .events and the live session's series() / events() read the same.
py::dict series_columns(const OpSeries& s, py::handle owner);
py::dict event_columns(const EventLog& e, py::handle owner);
// One allocator's snapshot in torch's layout, this device's history as
// columns when `columns` (pool.cpp).
py::dict snapshot_dict(Allocator& a, bool columns);

// A split limit as torch reports it: bytes, or -1 for none.
inline std::int64_t split_size_for_python(std::size_t limit) {
  return limit == kNoLimit ? -1 : static_cast<std::int64_t>(limit);
}

}  // namespace dtralloc::bindings
