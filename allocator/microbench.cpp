// Hot-path microbenchmark loops (microbench.h).
#include "microbench.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <stdexcept>
#include <thread>

namespace dtralloc {
namespace {

template <typename Loop>
double median_ns_per_pair(std::size_t pairs_per_thread, int threads, int repeats, Loop loop) {
  if (threads < 1 || repeats < 1 || pairs_per_thread == 0)
    throw std::invalid_argument("bench: threads, repeats and pairs must be positive");
  std::vector<double> samples;
  for (int r = 0; r < repeats; ++r) {
    auto start = std::chrono::steady_clock::now();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t) workers.emplace_back(loop, t);
    for (auto& w : workers) w.join();
    double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    // Per pair as seen by one thread: wall time over the pairs each ran.
    samples.push_back(ns / static_cast<double>(pairs_per_thread));
  }
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace

double bench_pool_pairs(Allocator& pool, const std::vector<std::size_t>& sizes,
                        std::size_t pairs_per_thread, int threads, int repeats,
                        bool stream_per_thread) {
  if (sizes.empty()) throw std::invalid_argument("bench: no sizes");
  auto loop = [&](int t) {
    Stream stream = stream_per_thread ? static_cast<Stream>(t + 1) : 0;
    // Warm-up: one pass so every size is a cache hit afterwards.
    for (std::size_t s : sizes) pool.free(pool.malloc(s, stream));
    const std::size_t n = sizes.size();
    for (std::size_t i = 0; i < pairs_per_thread; ++i) pool.free(pool.malloc(sizes[i % n], stream));
  };
  return median_ns_per_pair(pairs_per_thread, threads, repeats, loop);
}

double bench_pool_churn(Allocator& pool, const std::vector<std::size_t>& sizes,
                        std::size_t live_copies, std::size_t pairs_per_thread, int threads,
                        int repeats, bool stream_per_thread) {
  if (sizes.empty() || live_copies == 0) throw std::invalid_argument("bench: no sizes or copies");
  auto loop = [&](int t) {
    Stream stream = stream_per_thread ? static_cast<Stream>(t + 1) : 0;
    std::vector<std::size_t> slot_size;
    std::vector<void*> slot;
    for (std::size_t c = 0; c < live_copies; ++c)
      for (std::size_t s : sizes) {
        slot_size.push_back(s);
        slot.push_back(pool.malloc(s, stream));
      }
    const std::size_t n = slot.size();
    // A fixed stride coprime to n visits the slots in a scrambled order.
    const std::size_t stride = n > 7 && n % 7 ? 7 : 1;
    std::size_t i = 0;
    for (std::size_t k = 0; k < pairs_per_thread; ++k) {
      i = (i + stride) % n;
      pool.free(slot[i]);
      slot[i] = pool.malloc(slot_size[i], stream);
    }
    for (void* p : slot) pool.free(p);
  };
  return median_ns_per_pair(pairs_per_thread, threads, repeats, loop);
}

double bench_libc_pairs(const std::vector<std::size_t>& sizes, std::size_t pairs_per_thread,
                        int threads, int repeats) {
  if (sizes.empty()) throw std::invalid_argument("bench: no sizes");
  auto loop = [&](int) {
    const std::size_t n = sizes.size();
    for (std::size_t i = 0; i < pairs_per_thread; ++i) {
      void* p = std::malloc(sizes[i % n]);
      // Keep the compiler from pairing malloc/free away.
      asm volatile("" : : "r"(p) : "memory");
      std::free(p);
    }
  };
  return median_ns_per_pair(pairs_per_thread, threads, repeats, loop);
}

}  // namespace dtralloc
