// OpSeries: the pool sampled once per op, as columns. The replay driver and
// the live session (dtralloc.dtr) fill the same columns with the same
// meanings, so reports and the dashboard read both one way.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator.h"

namespace dtralloc {

struct OpSeries {
  std::vector<std::int32_t> op;            // the engine's op index
  std::vector<std::int64_t> reserved;      // bytes in segments
  std::vector<std::int64_t> allocated;     // bytes in allocated blocks
  std::vector<std::int64_t> evictable;     // resident bytes the evictor could take now
  std::vector<std::int64_t> largest_free;  // largest cached free block
  std::vector<std::int64_t> free;          // all cached free blocks
  // With a history: how many history events precede the sample (the
  // history's first event is 0); the dashboard's address views start there.
  std::vector<std::int64_t> event;

  void add(std::int32_t op_index, const Allocator::Sample& s, std::size_t evictable_bytes) {
    op.push_back(op_index);
    reserved.push_back(s.reserved);
    allocated.push_back(s.allocated);
    evictable.push_back(static_cast<std::int64_t>(evictable_bytes));
    largest_free.push_back(s.largest_free);
    free.push_back(s.free);
    if (s.history) event.push_back(static_cast<std::int64_t>(s.history_recorded));
  }
  std::size_t size() const { return op.size(); }
};

}  // namespace dtralloc
