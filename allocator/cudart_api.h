// The slice of the CUDA runtime API that dtralloc calls, declared by hand.
//
// dtralloc builds without a CUDA toolkit: the runtime is found with dlopen at
// run time (backend_cuda.cpp) and called through the table of function
// pointers below. The same declarations type the fake runtime that tests load
// instead (fake_cudart/fake_cudart.cpp), so both sides agree on the ABI.
//
// Everything lives in namespace dtralloc so that a translation unit may also
// include the real cuda_runtime.h without a clash. Two names need care there:
//   * cudaEventDisableTiming is a macro in the real headers; we only declare
//     our constant when that macro is absent (same value, use it unqualified).
//   * cudaEventRecord, cudaStreamSynchronize, cudaStreamWaitEvent and
//     cudaStreamIsCapturing become macros (the _ptsz variants) when
//     CUDA_API_PER_THREAD_DEFAULT_STREAM is defined, which is why the table's
//     fields drop the "cuda" prefix.
#pragma once

#include <cstddef>

namespace dtralloc {
namespace cudart {

// The real cudaError_t is an enum of int size; an int keeps every code the
// runtime may return representable, not only the ones named here.
typedef int cudaError_t;
enum : cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorNoDevice = 100,
  cudaErrorInvalidDevice = 101,
  cudaErrorInvalidResourceHandle = 400,
  cudaErrorNotReady = 600,
  // Stream capture (CUDA graphs): an operation not permitted while a stream
  // captures, a capture invalidated by one, and a query of the legacy default
  // stream while a blocking stream of its device captures.
  cudaErrorStreamCaptureUnsupported = 900,
  cudaErrorStreamCaptureInvalidated = 901,
  cudaErrorStreamCaptureImplicit = 906,
};

// enum cudaStreamCaptureStatus, as an int like cudaError_t.
typedef int cudaStreamCaptureStatus;
enum : cudaStreamCaptureStatus {
  cudaStreamCaptureStatusNone = 0,
  cudaStreamCaptureStatusActive = 1,
  cudaStreamCaptureStatusInvalidated = 2,
};

struct OpaqueStream;
struct OpaqueEvent;
typedef OpaqueStream* cudaStream_t;
typedef OpaqueEvent* cudaEvent_t;

#ifndef cudaEventDisableTiming
constexpr unsigned int cudaEventDisableTiming = 0x02;
#endif

}  // namespace cudart

// One pointer per runtime function, with the real C signatures. The fields are
// named after the CUDA functions without their "cuda" prefix (see above).
struct CudaRuntimeApi {
  using Err = cudart::cudaError_t;
  using Stream = cudart::cudaStream_t;
  using Event = cudart::cudaEvent_t;

  Err (*Malloc)(void** dev_ptr, std::size_t size);
  Err (*Free)(void* dev_ptr);
  Err (*MemGetInfo)(std::size_t* free, std::size_t* total);
  Err (*GetDevice)(int* device);
  Err (*SetDevice)(int device);
  Err (*GetDeviceCount)(int* count);
  Err (*DeviceSynchronize)();
  Err (*StreamSynchronize)(Stream stream);
  Err (*StreamWaitEvent)(Stream stream, Event event, unsigned int flags);
  Err (*StreamIsCapturing)(Stream stream, cudart::cudaStreamCaptureStatus* status);
  Err (*EventCreateWithFlags)(Event* event, unsigned int flags);
  Err (*EventRecord)(Event event, Stream stream);
  Err (*EventQuery)(Event event);
  Err (*EventSynchronize)(Event event);
  Err (*EventDestroy)(Event event);
  Err (*GetLastError)();
  const char* (*GetErrorString)(Err error);
  Err (*RuntimeGetVersion)(int* runtime_version);

  // From the driver API (cuda.h), optional: CUresult
  // cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active).
  // CUdevice is the device ordinal and CUresult an int (0 = CUDA_SUCCESS).
  // Found in the runtime library if it has it (the fake does), else in
  // libcuda.so.1; nullptr when neither does.
  int (*DevicePrimaryCtxGetState)(int device, unsigned int* flags, int* active);
};

// Loads the CUDA runtime on first use and returns its function table. Throws
// std::runtime_error naming the cause and the fix when none can be loaded. A
// failed load is not remembered: a later call (say, after `import torch`
// brought a runtime into the process) searches again.
const CudaRuntimeApi& cuda_runtime();

// The loaded runtime's version, e.g. 12040 for 12.4. Loads like cuda_runtime().
int cuda_runtime_version();

}  // namespace dtralloc
