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
// Steady state of a training step: each thread first allocates `live_copies`
// blocks of every size (the working set: tensors alive around the one being
// replaced), then repeatedly frees one block and allocates one of the same
// size in its place. Freed blocks mostly have allocated neighbours, so the
// pair is an exact-size cache hit without split or merge, as in the steady
// state of training. Median ns per free+malloc pair.
double bench_pool_churn(Allocator& pool, const std::vector<std::size_t>& sizes,
                        std::size_t live_copies, std::size_t pairs_per_thread, int threads,
                        int repeats, bool stream_per_thread);
// The same loop over the C library's malloc/free, as a reference point.
double bench_libc_pairs(const std::vector<std::size_t>& sizes, std::size_t pairs_per_thread,
                        int threads, int repeats);

}  // namespace dtralloc
