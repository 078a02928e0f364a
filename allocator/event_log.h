// EventLog: what the evictor and the engine did, as columns (one entry per
// event), for reports and dashboards. The replay driver owns one; the engine
// logs evictions and recomputes into it, the evictor each call for room.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace dtralloc {

enum class EventKind : std::uint8_t {
  kRoomAsked = 0,   // the pool asked the evictor for room (bytes: the request)
  kEvicted = 1,     // a value lost its memory to make room
  kRecomputed = 2,  // a value was brought back by rerunning its producer
};

// What an eviction call chose (kRoomAsked only).
enum class PlanKind : std::uint8_t {
  kNoPlan = 0,      // no eviction can serve the request now: OOM follows
  kWindow = 1,      // a run of adjacent blocks the request fits once evicted
  kRelease = 2,     // whole segments released so the budget has room
  kSingle = 3,      // one tensor (the single-tensor policies)
};

class EventLog {
 public:
  std::vector<std::int32_t> op;            // the op in flight
  std::vector<std::uint8_t> kind;          // EventKind
  std::vector<std::int32_t> value;         // -1 for kRoomAsked
  std::vector<std::int64_t> bytes;         // the request (kRoomAsked) or the value's bytes
  std::vector<std::uint64_t> addr;         // the value's block (0 for kRoomAsked)
  std::vector<std::uint8_t> plan;          // PlanKind (kRoomAsked), else 0
  std::vector<double> score;               // the chosen plan's cost per byte (kRoomAsked)
  std::vector<std::uint64_t> window_addr;  // the chosen address range (kRoomAsked; 0: none)
  std::vector<std::int64_t> window_bytes;

  void add(int op_index, EventKind k, int value_id, std::size_t nbytes, std::uintptr_t address,
           PlanKind p = PlanKind::kNoPlan, double plan_score = 0, std::uintptr_t range_addr = 0,
           std::size_t range_bytes = 0) {
    op.push_back(op_index);
    kind.push_back(static_cast<std::uint8_t>(k));
    value.push_back(value_id);
    bytes.push_back(static_cast<std::int64_t>(nbytes));
    addr.push_back(address);
    plan.push_back(static_cast<std::uint8_t>(p));
    score.push_back(plan_score);
    window_addr.push_back(range_addr);
    window_bytes.push_back(static_cast<std::int64_t>(range_bytes));
  }
  std::size_t size() const { return op.size(); }
};

}  // namespace dtralloc
