// Bindings of the dashboard room: the history as numpy columns (read straight
// out of the ring: no Python object per event), the history model
// (history_model.h), op stamps, and the publisher `dtralloc top` reads
// (publisher.h).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <string>
#include <vector>

#include "allocator.h"
#include "bindings.h"
#include "history_model.h"
#include "publisher.h"

namespace dtralloc::bindings {
namespace {

// A vector's buffer handed to numpy without a copy.
template <typename T>
py::array_t<T> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  py::capsule owner(heap, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(static_cast<py::ssize_t>(heap->size()), heap->data(), owner);
}

template <typename T>
using Column = py::array_t<T, py::array::c_style | py::array::forcecast>;

template <typename T>
std::vector<T> to_vector(const Column<T>& a) {
  return std::vector<T>(a.data(), a.data() + a.size());
}

py::tuple action_names() {
  py::tuple names(kNumHistoryActions);
  for (int i = 0; i < kNumHistoryActions; ++i) names[i] = history_action_name(i);
  return names;
}

py::dict history_model(const Column<std::uint8_t>& action, const Column<std::uint64_t>& addr,
                       const Column<std::int64_t>& size, const Column<std::int64_t>& block_size,
                       const Column<std::uint64_t>& stream, const Column<std::uint64_t>& seg_addr,
                       const Column<std::int64_t>& seg_size, const Column<std::uint64_t>& seg_stream,
                       const Column<std::uint64_t>& blk_addr, const Column<std::int64_t>& blk_size,
                       const Column<std::int64_t>& blk_requested, const Column<std::uint8_t>& blk_pending,
                       std::int64_t round_bytes, bool per_event_totals) {
  const auto n = static_cast<std::size_t>(action.size());
  if (addr.size() != action.size() || size.size() != action.size() || block_size.size() != action.size() ||
      stream.size() != action.size())
    throw std::invalid_argument("history_model: the event columns differ in length");
  if (seg_size.size() != seg_addr.size() || seg_stream.size() != seg_addr.size() ||
      blk_size.size() != blk_addr.size() || blk_requested.size() != blk_addr.size() ||
      blk_pending.size() != blk_addr.size())
    throw std::invalid_argument("history_model: the initial-state columns differ in length");
  HistoryInput in;
  in.n = n;
  in.action = action.data();
  in.addr = addr.data();
  in.size = size.data();
  in.block_size = block_size.data();
  in.stream = stream.data();
  in.initial_segment_addr = to_vector(seg_addr);
  in.initial_segment_size = to_vector(seg_size);
  in.initial_segment_stream = to_vector(seg_stream);
  in.initial_block_addr = to_vector(blk_addr);
  in.initial_block_size = to_vector(blk_size);
  in.initial_block_requested = to_vector(blk_requested);
  in.initial_block_pending = to_vector(blk_pending);
  in.round_bytes = round_bytes;
  in.per_event_totals = per_event_totals;
  HistoryModel m;
  {
    py::gil_scoped_release release;
    m = build_history_model(in);
  }
  py::dict d;
  d["block_start"] = to_numpy(std::move(m.block_start));
  d["block_free_requested"] = to_numpy(std::move(m.block_free_requested));
  d["block_free_completed"] = to_numpy(std::move(m.block_free_completed));
  d["block_addr"] = to_numpy(std::move(m.block_addr));
  d["block_stream"] = to_numpy(std::move(m.block_stream));
  d["block_size"] = to_numpy(std::move(m.block_size));
  d["block_requested"] = to_numpy(std::move(m.block_requested));
  d["segment_start"] = to_numpy(std::move(m.segment_start));
  d["segment_end"] = to_numpy(std::move(m.segment_end));
  d["segment_addr"] = to_numpy(std::move(m.segment_addr));
  d["segment_stream"] = to_numpy(std::move(m.segment_stream));
  d["segment_size"] = to_numpy(std::move(m.segment_size));
  d["largest_free"] = to_numpy(std::move(m.largest_free));
  if (per_event_totals) {
    d["allocated"] = to_numpy(std::move(m.allocated));
    d["pending"] = to_numpy(std::move(m.pending));
    d["reserved"] = to_numpy(std::move(m.reserved));
  }
  d["initial_largest_free"] = m.initial_largest_free;
  d["peak_allocated"] = m.peak_allocated;
  d["peak_reserved"] = m.peak_reserved;
  d["anomalies"] = m.anomalies;
  return d;
}

py::dict layout_dict() {
  const PublishedLayout l = published_layout();
  py::dict d;
  d["version"] = kPublishedVersion;
  d["label_offset"] = l.header_fields_offset - kPublishedLabelBytes;
  d["label_bytes"] = kPublishedLabelBytes;
  d["header_fields_offset"] = l.header_fields_offset;
  d["samples_offset"] = l.samples_offset;
  d["segments_offset"] = l.segments_offset;
  d["file_bytes"] = l.file_bytes;
  d["samples"] = kPublishedSamples;
  d["segments"] = kPublishedSegments;
  d["header_fields"] = l.header_fields;
  d["sample_fields"] = l.sample_fields;
  d["segment_fields"] = l.segment_fields;
  d["default_period_us"] = kDefaultPublishPeriodUs;
  return d;
}

}  // namespace

py::dict history_columns(const TraceEntry* older, std::size_t older_count, const TraceEntry* newer,
                         std::size_t newer_count) {
  const auto n = static_cast<py::ssize_t>(older_count + newer_count);
  py::array_t<std::uint8_t> action(n);
  py::array_t<std::uint64_t> addr(n), stream(n);
  py::array_t<std::int64_t> size(n), time_us(n), device_free(n), block_size(n);
  py::array_t<std::int32_t> op(n);
  auto* p_action = action.mutable_data();
  auto* p_addr = addr.mutable_data();
  auto* p_stream = stream.mutable_data();
  auto* p_size = size.mutable_data();
  auto* p_time = time_us.mutable_data();
  auto* p_free = device_free.mutable_data();
  auto* p_block = block_size.mutable_data();
  auto* p_op = op.mutable_data();
  std::size_t i = 0;
  for (const auto& [run, count] : {std::pair{older, older_count}, std::pair{newer, newer_count}})
    for (std::size_t k = 0; k < count; ++k, ++i) {
      const TraceEntry& e = run[k];
      p_action[i] = static_cast<std::uint8_t>(e.action);
      p_addr[i] = e.addr;
      p_stream[i] = e.stream;
      p_size[i] = static_cast<std::int64_t>(e.size);
      p_time[i] = e.time_us;
      p_op[i] = e.op;
      p_free[i] = e.action == TraceAction::kOom ? static_cast<std::int64_t>(e.detail) : 0;
      p_block[i] = e.action == TraceAction::kAlloc ? static_cast<std::int64_t>(e.detail) : 0;
    }
  py::dict d;
  d["action"] = action;
  d["addr"] = addr;
  d["size"] = size;
  d["stream"] = stream;
  d["time_us"] = time_us;
  d["op"] = op;
  d["device_free"] = device_free;
  d["block_size"] = block_size;
  d["action_names"] = action_names();
  return d;
}

py::dict history_columns(Allocator& a, Snapshot* segments) {
  py::dict d;
  // Under the allocator's lock, with the GIL held: numpy's buffers come from
  // the C heap, never from this allocator.
  Snapshot snap = a.snapshot([&](const TraceEntry* older, std::size_t older_count, const TraceEntry* newer,
                                 std::size_t newer_count) {
    d = history_columns(older, older_count, newer, newer_count);
  });
  if (segments) *segments = std::move(snap);
  return d;
}

void bind_dashboard(py::module_& m) {
  auto pool = py::reinterpret_borrow<py::class_<Allocator>>(m.attr("Pool"));
  pool.def("history", [](Allocator& a) { return history_columns(a, nullptr); },
           "The event history as numpy columns, oldest first: action (codes into "
           "action_names), addr, size, stream, time_us, op (the op stamp; -1 none), "
           "device_free (oom rows), block_size (alloc rows: the block as placed).")
      .def_property_readonly("history_size", &Allocator::history_size,
                             "Events in the history now (at most history_entries).")
      .def("set_op_stamp", &Allocator::set_op_stamp, py::arg("op"),
           "Stamp every history entry from now on with `op` (-1 = none).")
      .def_property_readonly("op_stamp", &Allocator::op_stamp)
      .def("publish",
           [](Allocator& a, double period_ms, std::string label) {
             if (label.empty()) label = std::string("pool ") + a.backend().name();
             py::gil_scoped_release release;  // stopping joins a thread that takes the pool lock
             return a.publish(static_cast<std::int64_t>(period_ms * 1000.0), label);
           },
           py::arg("period_ms") = kDefaultPublishPeriodUs / 1000.0, py::arg("label") = "",
           "Publish this pool's counters for `dtralloc top` every period_ms (0 stops); returns "
           "the file's path. The label defaults to 'pool <backend>'.")
      .def_property_readonly("published_path", &Allocator::published_path)
      .def("add_published_counts", &Allocator::add_published_counts, py::arg("evictions"),
           py::arg("remats"));
  m.def("history_action_names", &action_names);
  m.def("history_model", &history_model, py::arg("action"), py::arg("addr"), py::arg("size"),
        py::arg("block_size"), py::arg("stream"), py::arg("initial_segment_addr"),
        py::arg("initial_segment_size"), py::arg("initial_segment_stream"),
        py::arg("initial_block_addr"), py::arg("initial_block_size"),
        py::arg("initial_block_requested"), py::arg("initial_block_pending"),
        py::arg("round_bytes") = 512, py::arg("per_event_totals") = false,
        "Block and segment lifetimes and the largest free block after every event "
        "(history_model.h).");
  m.def("publisher_layout", &layout_dict, "The layout of the files dtralloc top reads (publisher.h).");
}

}  // namespace dtralloc::bindings
