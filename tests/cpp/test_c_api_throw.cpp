// The two entry points that throw into torch: dtralloc_malloc_or_throw, the
// allocation function install() hands torch (torch turns a C++ exception into
// a Python RuntimeError) where dtralloc_malloc returns NULL, and
// dtralloc_begin_allocate_to_pool, which refuses CUDA graph capture. Python
// cannot test these through ctypes (a C++ exception there aborts, and the
// capture hook takes a std::function by value).
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>

#include "check.h"
#include "include/dtralloc.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s /path/to/libdtralloc_fakecudart.so\n", argv[0]);
    return 2;
  }
  setenv("DTRALLOC_CUDART", argv[1], 1);
  setenv("DTRALLOC_CONF", "budget:64M", 1);
  const ssize_t MiB = 1 << 20;

  void* p = dtralloc_malloc_or_throw(10 * MiB, 0, nullptr);
  CHECK(p != nullptr);
  CHECK(dtralloc_malloc_or_throw(0, 0, nullptr) == nullptr);

  std::string message = check::thrown_message<std::runtime_error>(
      [&] { dtralloc_malloc_or_throw(100 * MiB, 0, nullptr); });
  // torch turns this into RuntimeError(what()): the words accelerate's and
  // Lightning's batch-size finders match on must be in it.
  CHECK_CONTAINS(message, "CUDA out of memory.");
  CHECK_CONTAINS(message, "Budget 64 MiB");
  CHECK_CONTAINS(std::string(dtralloc_last_error()), "CUDA out of memory.");

  // torch passes the size as size_t: 2^63 and more is a request that cannot
  // be served (an OOM), not a negative size to ignore.
  const std::size_t huge = std::size_t{1} << 63;
  for (std::size_t size : {huge, huge + 4096, ~std::size_t{0}}) {
    CHECK_CONTAINS(check::thrown_message<std::runtime_error>(
                       [&] { dtralloc_malloc_or_throw(size, 0, nullptr); }),
                   "CUDA out of memory.");
    CHECK(dtralloc_malloc(size, 0, nullptr) == nullptr);
    CHECK_CONTAINS(std::string(dtralloc_last_error()), "CUDA out of memory.");
  }

  // The C-safe twin reports the same failure as NULL.
  CHECK(dtralloc_malloc(100 * MiB, 0, nullptr) == nullptr);
  dtralloc_free(p, 10 * MiB, 0, nullptr);
  CHECK(dtralloc_invalid_free_count() == 0);
  void* q = dtralloc_malloc_or_throw(50 * MiB, 0, nullptr);
  CHECK(q != nullptr);
  dtralloc_free(q, 50 * MiB, 0, nullptr);
  dtralloc_empty_cache();

  // The type torch casts the hook's address to (torch/csrc/cuda/Module.cpp,
  // set_begin_allocate_to_pool: void(int, MempoolId_t,
  // std::function<bool(cudaStream_t)>), MempoolId_t a pair of unsigned long
  // long): this line does not compile unless the prototypes agree.
  using BeginAllocateToPool = void(int, std::pair<unsigned long long, unsigned long long>,
                                   std::function<bool(CUstream_st*)>);
  BeginAllocateToPool* begin = &dtralloc_begin_allocate_to_pool;
  bool filter_called = false;
  const std::string refusal = check::thrown_message<std::runtime_error>([&] {
    begin(0, {3, 0}, [&](CUstream_st*) { return filter_called = true; });
  });
  CHECK_CONTAINS(refusal, "CUDA graph");
  CHECK_CONTAINS(refusal, "private pool (3, 0)");
  CHECK_CONTAINS(refusal, "dtralloc.install()");
  CHECK_CONTAINS(refusal, "reduce-overhead");
  CHECK(!filter_called);
  CHECK_CONTAINS(std::string(dtralloc_last_error()), "CUDA graph");
  return check::check_summary("test_c_api_throw");
}
