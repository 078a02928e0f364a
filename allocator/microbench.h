// Hot-path microbenchmark loops, run in C++ so that Python call overhead
// does not swamp the tens of nanoseconds being measured (bench/ drives them).
#pragma once

#include <cstddef>
#include <vector>

#include "allocator.h"

namespace dtralloc {

// Median over `repeats` of nanoseconds per malloc+free pair, each thread
// cycling through `sizes` (cache hits after a warm-up pass). With several
// threads, each uses its own stream when `stream_per_thread`.
double bench_pool_pairs(Allocator& pool, const std::vector<std::size_t>& sizes,
                        std::size_t pairs_per_thread, int threads, int repeats,
                        bool stream_per_thread);
// The same loop over the C library's malloc/free, as a reference point.
double bench_libc_pairs(const std::vector<std::size_t>& sizes, std::size_t pairs_per_thread,
                        int threads, int repeats);

}  // namespace dtralloc
