// Tests the cuda backend (backend_cuda.cpp) against the fake CUDA runtime.
//
//   test_cuda_backend /path/to/libdtralloc_fakecudart.so [/path/to/libcudart.so.N]
//
// The fake is selected through DTRALLOC_CUDART and steered through its
// fakecuda_* controls. Runtime discovery happens once per process, so the
// discovery scenarios (bad override, library without the API, retry after a
// failure, a runtime already loaded) each run in a forked child before this
// process loads anything. The optional second argument is a real CUDA runtime;
// with it, a child checks that a runtime already in the process is found
// (step (b) of the search) and that a machine without a GPU reports 0 devices.
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "allocator.h"
#include "backend.h"
#include "check.h"
#include "config.h"
#include "cudart_api.h"
#include "op_timer.h"

namespace {

using namespace dtralloc;
using namespace dtralloc::cudart;

constexpr std::size_t kMiB = std::size_t(1) << 20;

// The fake's controls, found in the copy of the library the backend loaded.
struct FakeControls {
  void (*set_device_count)(int);
  void (*set_capacity)(std::size_t);
  void (*fail_next_mallocs)(int);
  long (*call_count)(const char*);
  void (*reset)();
  void (*complete_events)();
  int (*live_allocations)();
  int (*live_events)();
  std::size_t (*used_bytes)(int);
  int (*set_stream_capture)(void* stream, int status);
  int (*set_stream_device)(void* stream, int device);
  void (*set_clock_ns)(long long ns);
  // The driver API's query (cuda.h), which the fake exports too.
  int (*primary_ctx_get_state)(int device, unsigned int* flags, int* active);

  bool has_context(int device) const {
    unsigned int flags = 0;
    int active = -1;
    CHECK_EQ(primary_ctx_get_state(device, &flags, &active), 0);
    return active == 1;
  }
};

template <typename Fn>
void resolve(void* library, const char* symbol, Fn*& slot) {
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    std::fprintf(stderr, "fake runtime lacks %s\n", symbol);
    std::exit(1);
  }
  slot = reinterpret_cast<Fn*>(address);
}

FakeControls load_controls(const std::string& fake_path) {
  void* library = dlopen(fake_path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  CHECK(library != nullptr);  // the backend must have loaded this very file
  FakeControls fake{};
  resolve(library, "fakecuda_set_device_count", fake.set_device_count);
  resolve(library, "fakecuda_set_capacity", fake.set_capacity);
  resolve(library, "fakecuda_fail_next_mallocs", fake.fail_next_mallocs);
  resolve(library, "fakecuda_call_count", fake.call_count);
  resolve(library, "fakecuda_reset", fake.reset);
  resolve(library, "fakecuda_complete_events", fake.complete_events);
  resolve(library, "fakecuda_live_allocations", fake.live_allocations);
  resolve(library, "fakecuda_live_events", fake.live_events);
  resolve(library, "fakecuda_used_bytes", fake.used_bytes);
  resolve(library, "fakecuda_set_stream_capture", fake.set_stream_capture);
  resolve(library, "fakecuda_set_stream_device", fake.set_stream_device);
  resolve(library, "fakecuda_set_clock_ns", fake.set_clock_ns);
  resolve(library, "cuDevicePrimaryCtxGetState", fake.primary_ctx_get_state);
  return fake;
}

// Runs fn (returning an exit code) in a forked child; true when it exits 0.
bool passes_in_child(const std::function<int()>& fn) {
  std::fflush(nullptr);
  pid_t pid = fork();
  if (pid == 0) {
    int code = fn();
    std::fflush(nullptr);
    _exit(code);
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return false;
  return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

std::string canonical(const std::string& path) {
  char resolved[PATH_MAX];
  return realpath(path.c_str(), resolved) ? resolved : path;
}

// ---- Discovery, each case in its own process ------------------------------

int child_bogus_override() {
  const char* bogus = "/nonexistent/dtralloc/libcudart-bogus.so";
  setenv("DTRALLOC_CUDART", bogus, 1);
  CHECK(cuda_device_count() == 0);  // never throws
  CHECK(cuda_runtime_path().empty());
  std::string message = thrown_message<std::runtime_error>([] { make_cuda_backend(0); });
  CHECK_CONTAINS(message, "DTRALLOC_CUDART");
  CHECK_CONTAINS(message, bogus);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([] { cuda_runtime(); }), "DTRALLOC_CUDART");
  return 0;
}

// A loadable library without the runtime API (libc) names the missing symbol.
int child_not_a_runtime() {
  Dl_info info{};
  CHECK(dladdr(reinterpret_cast<void*>(&getpid), &info) != 0);
  setenv("DTRALLOC_CUDART", info.dli_fname, 1);
  std::string message = thrown_message<std::runtime_error>([] { make_cuda_backend(0); });
  CHECK_CONTAINS(message, "cudaMalloc");
  CHECK_CONTAINS(message, "DTRALLOC_CUDART");
  CHECK(cuda_runtime_path().empty());
  return 0;
}

// A failed search is not remembered: fixing the cause makes the next call work.
int child_retry_after_failure(const std::string& fake_path) {
  setenv("DTRALLOC_CUDART", "/nonexistent/libcudart.so", 1);
  CHECK(!thrown_message<std::runtime_error>([] { cuda_runtime(); }).empty());
  setenv("DTRALLOC_CUDART", fake_path.c_str(), 1);
  CHECK(make_cuda_backend(0) != nullptr);
  CHECK(cuda_runtime_path() == fake_path);
  return 0;
}

// Without the override, whatever the machine has: no crash, no throw.
int child_default_search() {
  unsetenv("DTRALLOC_CUDART");
  int count = cuda_device_count();
  CHECK(count >= 0);
  std::printf("  default search: runtime %s, %d device(s)\n",
              cuda_runtime_path().empty() ? "(none)"
                                          : cuda_runtime_path().c_str(),
              count);
  return 0;
}

// Step (b): a runtime that torch/cupy already loaded is the one used, even
// when the loader's search path would not find it.
int child_already_loaded(const std::string& real_path) {
  unsetenv("DTRALLOC_CUDART");
  void* preloaded = dlopen(real_path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  CHECK(preloaded != nullptr);
  CHECK(cuda_device_count() >= 0);
  CHECK(cuda_runtime_path() == real_path);  // the loaded copy, by its name
  CHECK(cuda_runtime_version() >= 12000);
  std::printf("  already loaded: %s, version %d, %d device(s)\n",
              cuda_runtime_path().c_str(), cuda_runtime_version(),
              cuda_device_count());
  return 0;
}

// ---- The backend on the fake runtime ---------------------------------------

void test_basics() {
  auto backend = make_cuda_backend(0);
  CHECK(std::string(backend->name()) == "cuda");
  CHECK(!backend->host_accessible());
  CHECK(backend->total_bytes() == 1024 * kMiB);
  CHECK(backend->free_bytes() == 1024 * kMiB);
}

void test_allocate_release(const FakeControls& fake) {
  fake.reset();
  auto backend = make_cuda_backend(0);
  void* ptr = backend->allocate(kMiB, 0);
  CHECK(ptr != nullptr);
  CHECK(reinterpret_cast<std::uintptr_t>(ptr) % 512 == 0);
  std::memset(ptr, 0xAB, kMiB);  // the fake's device memory is host memory
  CHECK(static_cast<unsigned char*>(ptr)[kMiB - 1] == 0xAB);
  CHECK(fake.used_bytes(0) == kMiB);
  CHECK(fake.live_allocations() == 1);
  CHECK(backend->free_bytes() == 1023 * kMiB);
  backend->release(ptr, kMiB, 0);
  CHECK(fake.used_bytes(0) == 0);
  CHECK(fake.live_allocations() == 0);
}

void test_capacity_exhaustion(const FakeControls& fake) {
  fake.reset();
  fake.set_capacity(4 * kMiB);
  const CudaRuntimeApi& api = cuda_runtime();
  auto backend = make_cuda_backend(0);
  CHECK(backend->total_bytes() == 4 * kMiB);
  void* big = backend->allocate(3 * kMiB, 0);
  CHECK(big != nullptr);
  CHECK(backend->free_bytes() == kMiB);
  CHECK(backend->allocate(2 * kMiB, 0) == nullptr);  // out of memory: no throw
  CHECK(api.GetLastError() == cudaSuccess);       // and no error left behind
  void* small = backend->allocate(kMiB, 0);
  CHECK(small != nullptr);
  CHECK(backend->free_bytes() == 0);
  backend->release(big, 3 * kMiB, 0);
  backend->release(small, kMiB, 0);
  CHECK(fake.used_bytes(0) == 0);
}

void test_injected_failures(const FakeControls& fake) {
  fake.reset();
  const CudaRuntimeApi& api = cuda_runtime();
  auto backend = make_cuda_backend(0);
  fake.fail_next_mallocs(2);
  CHECK(backend->allocate(4096, 0) == nullptr);
  CHECK(backend->allocate(4096, 0) == nullptr);
  CHECK(api.GetLastError() == cudaSuccess);
  void* ptr = backend->allocate(4096, 0);
  CHECK(ptr != nullptr);
  CHECK(fake.call_count("cudaMalloc") == 3);
  backend->release(ptr, 4096, 0);
}

void test_events(const FakeControls& fake) {
  fake.reset();
  const CudaRuntimeApi& api = cuda_runtime();
  auto backend = make_cuda_backend(0);
  EventHandle event = backend->create_event();
  CHECK(event != nullptr);
  CHECK(backend->event_completed(event));  // never recorded
  const Stream stream = 7;
  backend->record_event(event, stream);
  CHECK(!backend->event_completed(event));
  CHECK(api.GetLastError() == cudaSuccess);  // "not ready" was cleared
  backend->synchronize_event(event);
  CHECK(backend->event_completed(event));

  backend->record_event(event, stream);
  CHECK(api.StreamSynchronize(reinterpret_cast<cudaStream_t>(8)) == cudaSuccess);
  CHECK(!backend->event_completed(event));  // another stream
  CHECK(api.StreamSynchronize(reinterpret_cast<cudaStream_t>(7)) == cudaSuccess);
  CHECK(backend->event_completed(event));

  backend->record_event(event, stream);
  backend->synchronize_device();
  CHECK(backend->event_completed(event));
  backend->record_event(event, 0);
  fake.complete_events();
  CHECK(backend->event_completed(event));
  backend->record_event(event, stream);
  fake.reset();
  CHECK(backend->event_completed(event));

  CHECK(fake.live_events() == 1);
  backend->destroy_event(event);
  CHECK(fake.live_events() == 0);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { backend->event_completed(event); }),
                 "cudaErrorInvalidResourceHandle");
  CHECK(api.GetLastError() == cudaSuccess);
}

// Timing events: elapsed time once both completed, "not ready" (negative)
// before; an event made for record_stream (no timing) is refused, as
// cudaEventElapsedTime documents.
void test_timing_events(const FakeControls& fake) {
  fake.reset();
  auto backend = make_cuda_backend(0);
  EventHandle a = backend->create_timing_event();
  EventHandle b = backend->create_timing_event();
  CHECK(a != nullptr && b != nullptr);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { backend->elapsed_ms(a, b); }),
                 "cudaErrorInvalidResourceHandle");  // never recorded
  fake.set_clock_ns(1000000);
  backend->record_event(a, 7);
  fake.set_clock_ns(6000000);
  backend->record_event(b, 7);
  CHECK(backend->elapsed_ms(a, b) < 0);
  CHECK(cuda_runtime().GetLastError() == cudaSuccess);  // "not ready" is an answer
  fake.complete_events();
  CHECK_EQ(backend->elapsed_ms(a, b), 5.0);
  EventHandle untimed = backend->create_event();
  backend->record_event(untimed, 7);
  fake.complete_events();
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { backend->elapsed_ms(a, untimed); }),
                 "cudaErrorInvalidResourceHandle");
  for (EventHandle e : {a, b, untimed}) backend->destroy_event(e);
  CHECK(fake.live_events() == 0);
  fake.reset();
}

// OpTimer: an op's cost is the GPU time from the previous mark on its stream
// to its own, handed over once both marks completed, in order; intervals
// another op, a recompute or a second stream shares measure nothing; the
// events are reused, bounded, and all destroyed with the timer.
void test_op_timer(const FakeControls& fake) {
  // cudaEventElapsedTime answers in float milliseconds.
  auto near_ns = [](double ns, double expected) { return std::abs(ns - expected) < 1.0; };
  fake.reset();
  auto backend = make_cuda_backend(0);
  std::vector<std::pair<int, double>> got;
  auto at = [&](long long us) { fake.set_clock_ns(us * 1000); };
  auto collect = [&](OpTimer& t) { return t.collect([&](int op, double ns) { got.emplace_back(op, ns); }); };
  {
    OpTimer timer(*backend);
    CHECK(timer.active());
    at(0), timer.mark(0, 7, true);      // op 0: no previous mark, nothing to measure
    at(10), timer.mark(1, 7, true);     // op 1: 10 us
    at(30), timer.mark(-1, 7, true);    // no engine op (a scalar read)
    at(35), timer.mark(2, 7, true);     // op 2: its interval measures 5 us
    at(50), timer.mark(3, 7, false);    // op 3: a recompute ran before it
    at(60), timer.mark(4, 9, true);     // op 4: on another stream than the last mark
    at(64), timer.mark(5, 9, true);     // op 5: 4 us
    CHECK(collect(timer) == 0);         // nothing has completed
    CHECK(timer.pending() == 6);
    fake.complete_events();
    CHECK(collect(timer) == 3);
    CHECK(got.size() == 3);
    CHECK(got[0].first == 1 && got[1].first == 2 && got[2].first == 5);
    CHECK(near_ns(got[0].second, 10000));
    CHECK(near_ns(got[1].second, 5000));
    CHECK(near_ns(got[2].second, 4000));
    CHECK(timer.pending() == 0);
    // Completed events are recorded again: no new ones per op.
    const long created = fake.call_count("cudaEventCreateWithFlags");
    for (int op = 6; op < 12; ++op) {
      at(100 + op), timer.mark(op, 9, true);
      fake.complete_events();
      collect(timer);
    }
    CHECK(fake.call_count("cudaEventCreateWithFlags") <= created + 1);
    CHECK(got.size() == 3 + 6);
    CHECK(near_ns(got.back().second, 1000));
    // A GPU far behind: the oldest marks are dropped, never waited for.
    for (std::size_t op = 0; op < OpTimer::kMaxMarks + 10; ++op) timer.mark(static_cast<int>(op), 9, true);
    CHECK(timer.pending() == OpTimer::kMaxMarks - 1);
    CHECK(fake.live_events() <= static_cast<int>(OpTimer::kMaxMarks) + 2);
  }
  CHECK(fake.live_events() == 0);
  {
    // While a stream captures a CUDA graph no event is touched (a query would
    // invalidate the capture), and the interval after it measures nothing.
    OpTimer timer(*backend);
    got.clear();
    at(0); CHECK(timer.mark(0, 7, true));
    void* const captured = reinterpret_cast<void*>(7);
    CHECK(fake.set_stream_capture(captured, cudaStreamCaptureStatusActive) == 0);
    const long records = fake.call_count("cudaEventRecord");
    at(5); CHECK(!timer.mark(1, 7, true));
    CHECK(fake.call_count("cudaEventRecord") == records);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    CHECK(cuda_runtime().StreamIsCapturing(reinterpret_cast<cudaStream_t>(captured), &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusActive);  // not invalidated
    CHECK(fake.set_stream_capture(captured, cudaStreamCaptureStatusNone) == 0);
    at(9); CHECK(timer.mark(2, 7, true));
    at(12); CHECK(timer.mark(3, 7, true));
    fake.complete_events();
    CHECK(timer.collect([&](int op, double ns) { got.emplace_back(op, ns); }) == 1);
    CHECK(got.size() == 1 && got[0].first == 3 && near_ns(got[0].second, 3000));
  }
  CHECK(fake.live_events() == 0);
  fake.set_clock_ns(-1);
  // A host backend has no timing events: the caller's clock stands.
  auto host = make_host_backend(std::size_t{1} << 30);
  OpTimer none(*host);
  CHECK(!none.active());
  none.mark(0, 0, true);
  CHECK(none.collect([](int, double) { CHECK(false); }) == 0);
  fake.reset();
}

// Every call lands on the backend's device and the caller's device survives.
void test_device_guard(const FakeControls& fake) {
  fake.reset();
  fake.set_device_count(2);
  const CudaRuntimeApi& api = cuda_runtime();
  CHECK(cuda_device_count() == 2);
  auto on0 = make_cuda_backend(0);
  auto on1 = make_cuda_backend(1);
  CHECK(api.SetDevice(0) == cudaSuccess);  // the caller works on device 0
  long sets = fake.call_count("cudaSetDevice");
  void* ptr = on1->allocate(8192, 0);
  CHECK(fake.used_bytes(1) == 8192);
  CHECK(fake.used_bytes(0) == 0);
  CHECK(fake.call_count("cudaSetDevice") == sets + 2);  // switch and restore
  int current = -1;
  CHECK(api.GetDevice(&current) == cudaSuccess && current == 0);

  EventHandle event = on1->create_event();
  on1->record_event(event, 0);  // device 1's default stream needs device 1
  on0->synchronize_device();
  CHECK(!on1->event_completed(event));
  on1->synchronize_device();
  CHECK(on1->event_completed(event));
  on1->destroy_event(event);

  CHECK(api.SetDevice(1) == cudaSuccess);
  void* on_device0 = on0->allocate(4096, 0);
  CHECK(fake.used_bytes(0) == 4096);
  CHECK(api.GetDevice(&current) == cudaSuccess && current == 1);
  CHECK(api.SetDevice(0) == cudaSuccess);
  on0->release(on_device0, 4096, 0);
  on1->release(ptr, 8192, 0);
  CHECK(fake.used_bytes(0) == 0 && fake.used_bytes(1) == 0);
}

// A thread that never chose a device (torchrun's helper threads, a thread
// that frees a tensor of device 1) must not come out of dtralloc with a new
// context on device 0: on a GPU that is hundreds of MiB on GPU 0 per rank. The
// guard switches to the backend's device and restores the previous one only
// where that device already had a context (torch's c10::cuda::MaybeSetDevice).
void test_device_guard_makes_no_stray_context(const FakeControls& fake) {
  fake.reset();
  fake.set_device_count(2);
  CHECK(!fake.has_context(0) && !fake.has_context(1));
  std::thread fresh([&] {
    auto on1 = make_cuda_backend(1);
    void* ptr = on1->allocate(4096, 0);
    EventHandle event = on1->create_event();
    on1->record_event(event, 0);
    on1->synchronize_event(event);
    on1->destroy_event(event);
    on1->synchronize_device();
    CHECK(on1->total_bytes() == 1024 * kMiB);
    on1->release(ptr, 4096, 0);
  });
  fresh.join();
  CHECK(fake.has_context(1));
  CHECK(!fake.has_context(0));  // no stray context on device 0
  // Where device 0 has a context, the caller's device is restored as before.
  const CudaRuntimeApi& api = cuda_runtime();
  std::thread chose0([&] {
    CHECK(api.SetDevice(0) == cudaSuccess);
    auto on1 = make_cuda_backend(1);
    void* ptr = on1->allocate(4096, 0);
    on1->release(ptr, 4096, 0);
    int current = -1;
    CHECK(api.GetDevice(&current) == cudaSuccess && current == 0);
  });
  chose0.join();
  fake.reset();
}

// record_stream with a stream of another device (torch allows
// tensor.record_stream(s) for any stream): an event of the block's device
// cannot be recorded there ("event and stream must be on the same device",
// cudaEventRecord), so the free waits for that stream instead. Waiting for
// the block's own device would let the block go while the other device's
// stream may still use it.
void test_record_stream_on_another_devices_stream(const FakeControls& fake) {
  fake.reset();
  fake.set_device_count(2);
  const CudaRuntimeApi& api = cuda_runtime();
  const Stream ours = 0x6000, theirs = 0x7000;
  CHECK(fake.set_stream_device(reinterpret_cast<void*>(ours), 0) == 0);
  CHECK(fake.set_stream_device(reinterpret_cast<void*>(theirs), 1) == 0);
  {
    Allocator a(make_cuda_backend(0), parse_config(""));
    void* p = a.malloc(4096, 0);
    a.record_stream(p, ours);  // this device's stream: an event, the free is pending
    a.free(p);
    CHECK(fake.live_events() == 1);
    fake.complete_events();
    void* q = a.malloc(4096, 0);
    CHECK(q == p);
    a.record_stream(q, theirs);
    const long stream_syncs = fake.call_count("cudaStreamSynchronize");
    const long device_syncs = fake.call_count("cudaDeviceSynchronize");
    a.free(q);
    CHECK(fake.call_count("cudaStreamSynchronize") == stream_syncs + 1);
    CHECK(fake.call_count("cudaDeviceSynchronize") == device_syncs);
    CHECK(fake.live_events() == 0);  // the refused one was destroyed
    CHECK(api.GetLastError() == cudaSuccess);  // and left no error behind
    a.check_invariants();
    void* r = a.malloc(4096, 0);  // free at once: the same block comes back
    CHECK(r == p);
    a.free(r);
  }
  fake.reset();
}

// CUDA graph capture: dtralloc keeps no private pool per graph, so it refuses
// a capture, and must do so before it makes a call the capture forbids
// (cudaMalloc, cudaEventQuery, ...), which would invalidate the user's
// capture and surface as an obscure CUDA error instead.
void test_capture_is_refused_before_any_illegal_call(const FakeControls& fake) {
  fake.reset();
  const CudaRuntimeApi& api = cuda_runtime();
  Allocator a(make_cuda_backend(0), parse_config(""));
  const Stream side = 0x5000, other = 0x6000;
  void* warm = a.malloc(kMiB, side);  // a cached small segment on `side`
  a.free(warm);
  void* pending = a.malloc(512, side);
  a.record_stream(pending, other);
  a.free(pending);  // an event on `other` now holds it

  CHECK_EQ(fake.set_stream_capture(reinterpret_cast<void*>(side), cudaStreamCaptureStatusActive), 0);
  auto status_of = [&](Stream s) {
    cudaStreamCaptureStatus status = -1;
    CHECK_EQ(api.StreamIsCapturing(reinterpret_cast<cudaStream_t>(s), &status), cudaSuccess);
    return status;
  };
  const long mallocs = fake.call_count("cudaMalloc");
  const long queries = fake.call_count("cudaEventQuery");
  // A cache hit needs no CUDA call; the pending event is not polled.
  void* hit = a.malloc(kMiB, side);
  CHECK(hit != nullptr);
  CHECK_EQ(fake.call_count("cudaMalloc"), mallocs);
  CHECK_EQ(fake.call_count("cudaEventQuery"), queries);
  // A miss would need cudaMalloc: refused, naming the cause and the way out.
  std::string message = thrown_message<std::runtime_error>([&] { a.malloc(4 * kMiB, side); });
  CHECK_CONTAINS(message, "CUDA graph");
  CHECK_CONTAINS(message, "capturing");
  CHECK_CONTAINS(message, "dtralloc.install()");
  CHECK_EQ(fake.call_count("cudaMalloc"), mallocs);
  CHECK_EQ(fake.call_count("cudaEventQuery"), queries);
  CHECK_EQ(status_of(side), cudaStreamCaptureStatusActive);  // the capture survives
  CHECK(api.GetLastError() == cudaSuccess);
  // The legacy default stream of a device with a capture under way is refused
  // too (the runtime answers cudaErrorStreamCaptureImplicit for it).
  CHECK_CONTAINS(thrown_message<std::runtime_error>([&] { a.malloc(4 * kMiB, 0); }), "CUDA graph");
  CHECK(api.GetLastError() == cudaSuccess);
  CHECK_EQ(fake.call_count("cudaMalloc"), mallocs);
  a.free(hit);
  a.check_invariants();

  // Once the capture ends, everything works again.
  CHECK_EQ(fake.set_stream_capture(reinterpret_cast<void*>(side), cudaStreamCaptureStatusNone), 0);
  void* big = a.malloc(4 * kMiB, side);
  fake.complete_events();
  void* again = a.malloc(512, side);
  CHECK(again == pending);  // the event was polled and the block came back
  a.free(big);
  a.free(again);
  a.empty_cache();
  a.check_invariants();
  CHECK_EQ(fake.live_allocations(), 0);
  CHECK_EQ(fake.live_events(), 0);
}

void test_bad_devices(const FakeControls& fake) {
  fake.reset();
  CHECK_CONTAINS(thrown_message<std::runtime_error>([] { make_cuda_backend(1); }),
                 "CUDA device 1 does not exist");
  CHECK_CONTAINS(thrown_message<std::runtime_error>([] { make_cuda_backend(-1); }),
                 "CUDA device -1 does not exist");
  fake.set_device_count(0);
  CHECK(cuda_device_count() == 0);
  CHECK_CONTAINS(thrown_message<std::runtime_error>([] { make_cuda_backend(0); }),
                 "cudaErrorNoDevice");
  CHECK(cuda_runtime().GetLastError() == cudaSuccess);
  fake.reset();
}

void test_runtime_errors_throw(const FakeControls& fake) {
  fake.reset();
  auto backend = make_cuda_backend(0);
  int not_device_memory = 0;
  std::string message =
      thrown_message<std::runtime_error>([&] { backend->release(&not_device_memory, 4, 0); });
  CHECK_CONTAINS(message, "cudaFree");
  CHECK_CONTAINS(message, "cudaErrorInvalidValue");
  CHECK(cuda_runtime().GetLastError() == cudaSuccess);
}

void test_call_counters(const FakeControls& fake) {
  fake.reset();
  auto backend = make_cuda_backend(0);
  fake.reset();
  void* ptr = backend->allocate(4096, 0);
  backend->release(ptr, 4096, 0);
  backend->total_bytes();
  CHECK(fake.call_count("cudaMalloc") == 1);
  CHECK(fake.call_count("cudaFree") == 1);
  CHECK(fake.call_count("cudaMemGetInfo") == 1);
  CHECK(fake.call_count("cudaGetDevice") == 3);  // one per guarded call
  CHECK(fake.call_count("cudaSetDevice") == 0);  // device 0 was current
  CHECK(fake.call_count("cudaGetLastError") == 0);
  EventHandle event = backend->create_event();
  backend->event_completed(event);
  backend->destroy_event(event);
  CHECK(fake.call_count("cudaEventCreateWithFlags") == 1);
  CHECK(fake.call_count("cudaEventQuery") == 1);
  CHECK(fake.call_count("cudaEventDestroy") == 1);
  CHECK(fake.call_count("cudaGetDevice") == 4);  // query/destroy skip the guard
  CHECK(fake.call_count("cudaNoSuchFunction") == -1);
  CHECK(fake.call_count(nullptr) == -1);
}

void test_reset_keeps_allocations(const FakeControls& fake) {
  fake.reset();
  auto backend = make_cuda_backend(0);
  void* ptr = backend->allocate(kMiB, 0);
  fake.set_capacity(16 * kMiB);
  fake.reset();
  CHECK(fake.live_allocations() == 1);
  CHECK(fake.used_bytes(0) == kMiB);
  CHECK(backend->total_bytes() == 1024 * kMiB);
  backend->release(ptr, kMiB, 0);
  CHECK(fake.live_allocations() == 0);
}

// The fake and the backend under several threads, each with its own backend
// (a Backend is not thread-safe by contract; the runtime is).
void test_threads(const FakeControls& fake) {
  fake.reset();
  fake.set_device_count(2);
  std::vector<std::thread> threads;
  std::vector<int> failures(8, 0);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &failures] {
      auto backend = make_cuda_backend(t % 2);
      for (int i = 0; i < 300; ++i) {
        std::size_t bytes = 512 * static_cast<std::size_t>(i % 7 + 1);
        void* ptr = backend->allocate(bytes, 0);
        if (ptr == nullptr) ++failures[t];
        EventHandle event = backend->create_event();
        backend->record_event(event, 0);
        backend->synchronize_event(event);
        backend->destroy_event(event);
        backend->release(ptr, bytes, 0);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int count : failures) CHECK(count == 0);
  CHECK(fake.live_allocations() == 0);
  CHECK(fake.live_events() == 0);
  CHECK(fake.used_bytes(0) == 0 && fake.used_bytes(1) == 0);
  CHECK(fake.call_count("cudaMalloc") == 8 * 300);
  fake.reset();
}

// Async segments (async_segments:on) from threads on two devices, each with
// a backend (so a pool) and a stream of its own: every allocation after a
// thread's first reuses what its last free gave the pool on that stream,
// nothing waits for the device, and when the backends go, so do their pools.
void test_async_segments_threads(const FakeControls& fake) {
  fake.reset();
  fake.set_device_count(2);
  const Config config = parse_config("async_segments:on");
  std::vector<std::thread> threads;
  std::vector<int> failures(8, 0);
  std::vector<std::unique_ptr<Backend>> backends;
  for (int t = 0; t < 8; ++t) backends.push_back(make_cuda_backend_for(config, t % 2));
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t, &failures, &backends] {
      Backend& backend = *backends[t];
      const Stream stream = 0x1000 + 0x100 * static_cast<Stream>(t);
      for (int i = 0; i < 300; ++i) {
        const std::size_t bytes = 4096 * static_cast<std::size_t>(7 - i % 7);  // shrinking: each fits the last
        void* ptr = backend.allocate(bytes, stream);
        if (ptr == nullptr) {
          ++failures[t];
          continue;
        }
        std::memset(ptr, t, bytes);
        backend.release(ptr, bytes, stream);
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int count : failures) CHECK(count == 0);
  CHECK(fake.call_count("cudaMallocFromPoolAsync") == 8 * 300);
  CHECK(fake.call_count("cudaFreeAsync") == 8 * 300);
  CHECK(fake.call_count("cudaMalloc") == 0 && fake.call_count("cudaFree") == 0);
  CHECK(fake.call_count("cudaDeviceSynchronize") == 0 && fake.call_count("cudaStreamSynchronize") == 0);
  // Each pool holds its largest block (28 KiB), reused all along.
  for (auto& backend : backends) {
    Backend::DevicePoolBytes bytes;
    CHECK(backend->device_pool_bytes(bytes));
    CHECK(bytes.reserved == 7 * 4096 && bytes.peak == 7 * 4096);
  }
  // A trim synchronizes its device, which gives back what every pool there holds.
  for (auto& backend : backends) {
    backend->trim();
    Backend::DevicePoolBytes bytes;
    CHECK(backend->device_pool_bytes(bytes) && bytes.reserved == 0 && bytes.peak == 7 * 4096);
  }
  CHECK(fake.used_bytes(0) == 0 && fake.used_bytes(1) == 0);
  backends.clear();
  CHECK(fake.call_count("cudaMemPoolDestroy") == 8);
  CHECK(fake.live_allocations() == 0);
  // A backend without async segments reports no driver pool.
  Backend::DevicePoolBytes none;
  CHECK(!make_cuda_backend(0)->device_pool_bytes(none));
  fake.reset();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s /path/to/libdtralloc_fakecudart.so "
                 "[/path/to/real/libcudart.so]\n",
                 argv[0]);
    return 2;
  }
  const std::string fake_path = canonical(argv[1]);

  CHECK(passes_in_child(child_bogus_override));
  CHECK(passes_in_child(child_not_a_runtime));
  CHECK(passes_in_child([&] { return child_retry_after_failure(fake_path); }));
  CHECK(passes_in_child(child_default_search));
  if (argc >= 3) {
    const std::string real_path = argv[2];
    CHECK(passes_in_child([&] { return child_already_loaded(real_path); }));
  }

  setenv("DTRALLOC_CUDART", fake_path.c_str(), 1);
  CHECK(cuda_runtime_path().empty());  // nothing loaded before first use
  CHECK(cuda_device_count() == 1);
  CHECK(cuda_runtime_path() == fake_path);
  CHECK(cuda_runtime_version() == 13000);
  const FakeControls fake = load_controls(fake_path);

  test_basics();
  test_allocate_release(fake);
  test_capacity_exhaustion(fake);
  test_injected_failures(fake);
  test_events(fake);
  test_timing_events(fake);
  test_op_timer(fake);
  test_device_guard(fake);
  test_device_guard_makes_no_stray_context(fake);
  test_capture_is_refused_before_any_illegal_call(fake);
  test_record_stream_on_another_devices_stream(fake);
  test_bad_devices(fake);
  test_runtime_errors_throw(fake);
  test_call_counters(fake);
  test_reset_keeps_allocations(fake);
  test_threads(fake);
  test_async_segments_threads(fake);

  return check_summary("test_cuda_backend");
}
