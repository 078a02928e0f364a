// HistoryModel: an allocator's event history turned into what a dashboard
// draws. Input: the events as columns (dtralloc's own history, or a torch
// snapshot's device_traces converted to the same columns) and the state
// before the first event. Output:
//   * block lifetimes: each allocation with the events that allocated it,
//     asked to free it and completed the free (-1 = before the history,
//     n = still alive after it), its address, block size and requested size;
//   * segment lifetimes, the same way;
//   * per event, the largest free block after it (the one figure that needs
//     the address order; totals follow from the lifetimes by prefix sums).
//
// The free space is modelled as gaps between occupied blocks inside segments
// (allocated and pending blocks occupy; gaps never merge across a segment
// boundary), exactly as BlockPool keeps its free blocks. Histories that do
// not add up (a free of an unknown block, an allocation outside every known
// segment, a segment released with blocks still in it: what a ring that
// wrapped, or a hand-edited snapshot, can hold) are counted in `anomalies`
// and modelled as well as they allow, never thrown.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtralloc {

// Action codes: 0-5 are TraceAction (allocator.h) with the same values;
// the rest occur only in torch snapshots.
enum class HistoryAction : std::uint8_t {
  kAlloc = 0,
  kFreeRequested = 1,
  kFreeCompleted = 2,
  kSegmentAlloc = 3,
  kSegmentFree = 4,
  kOom = 5,
  kSegmentMap = 6,    // torch expandable segments: a range mapped (modelled as a segment)
  kSegmentUnmap = 7,  // ... and unmapped
  kFree = 8,          // torch before 2.1: one event for both halves of a free
  kSnapshot = 9,      // torch: a marker where a snapshot was taken
  kOther = 10,        // an action this model does not know (counted, ignored)
};
constexpr int kNumHistoryActions = 11;
const char* history_action_name(int code);

struct HistoryInput {
  std::size_t n = 0;
  const std::uint8_t* action = nullptr;
  const std::uint64_t* addr = nullptr;
  const std::int64_t* size = nullptr;        // requested bytes (alloc/free), segment bytes
  const std::int64_t* block_size = nullptr;  // alloc: the block as placed; 0 = unknown
  const std::uint64_t* stream = nullptr;
  // State before event 0.
  std::vector<std::uint64_t> initial_segment_addr;
  std::vector<std::int64_t> initial_segment_size;
  std::vector<std::uint64_t> initial_segment_stream;
  std::vector<std::uint64_t> initial_block_addr;
  std::vector<std::int64_t> initial_block_size;       // as placed
  std::vector<std::int64_t> initial_block_requested;
  std::vector<std::uint8_t> initial_block_pending;    // freed, waiting on an event
  // Block size when an alloc's block_size is 0: torch rounds to 512 bytes.
  std::int64_t round_bytes = 512;
  bool per_event_totals = false;  // also fill allocated/pending/reserved per event
};

struct HistoryModel {
  // Block lifetimes, ordered by start (initial blocks first, start = -1).
  std::vector<std::int64_t> block_start, block_free_requested, block_free_completed;
  std::vector<std::uint64_t> block_addr, block_stream;
  std::vector<std::int64_t> block_size, block_requested;
  // Segment lifetimes, ordered by start.
  std::vector<std::int64_t> segment_start, segment_end;
  std::vector<std::uint64_t> segment_addr, segment_stream;
  std::vector<std::int64_t> segment_size;
  // Per event, after it.
  std::vector<std::int64_t> largest_free;
  std::vector<std::int64_t> allocated, pending, reserved;  // per_event_totals only
  // Over the whole history (the state before event 0 included).
  std::int64_t peak_allocated = 0, peak_reserved = 0;
  // Before event 0.
  std::int64_t initial_largest_free = 0;
  std::int64_t anomalies = 0;
};

HistoryModel build_history_model(const HistoryInput& in);

}  // namespace dtralloc
