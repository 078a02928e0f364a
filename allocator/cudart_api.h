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
//   * cudaEventRecord, cudaStreamSynchronize, cudaStreamWaitEvent,
//     cudaStreamIsCapturing, cudaMallocFromPoolAsync and cudaFreeAsync
//     become macros (the _ptsz variants) when
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

// The stream-ordered allocator's memory pools (cudaMemPoolCreate,
// cudaMallocFromPoolAsync, cudaFreeAsync; async_segments, backend_cuda.cpp).
// Values as in driver_types.h (CUDA 12 and 13 agree).
struct OpaqueMemPool;
typedef OpaqueMemPool* cudaMemPool_t;
// enum cudaDeviceAttr: cudaDevAttrMemoryPoolsSupported
constexpr int cudaDevAttrMemoryPoolsSupported = 115;
// enum cudaMemPoolAttr (each value a cuuint64_t, unsigned long long)
constexpr int cudaMemPoolAttrReleaseThreshold = 0x4;
constexpr int cudaMemPoolAttrReservedMemCurrent = 0x5;
constexpr int cudaMemPoolAttrReservedMemHigh = 0x6;
// enum cudaMemAllocationType, cudaMemAllocationHandleType, cudaMemLocationType
constexpr int cudaMemAllocationTypePinned = 0x1;
constexpr int cudaMemHandleTypeNone = 0x0;
constexpr int cudaMemLocationTypeDevice = 1;

struct cudaMemLocation {
  int type;  // cudaMemLocationType
  int id;
};

// CUDA 13's layout. CUDA 12.0 had 64 reserved bytes after
// win32SecurityAttributes, which later versions turned into maxSize, usage
// and 54 reserved: the same 88 bytes, and zero means the same in each.
struct cudaMemPoolProps {
  int allocType;    // cudaMemAllocationType
  int handleTypes;  // cudaMemAllocationHandleType
  cudaMemLocation location;
  void* win32SecurityAttributes;
  std::size_t maxSize;  // 0: the system's default
  unsigned short usage;
  unsigned char reserved[54];
};
static_assert(sizeof(cudaMemPoolProps) == 88, "cudaMemPoolProps layout differs from driver_types.h");

}  // namespace cudart

// The slice of the driver API (cuda.h) that dtralloc's VMM segments call:
// CUDA's virtual memory management, which maps physical pages into a
// reserved address range one by one, so that a page can be given back while
// the rest of the range stays mapped (unmap_pages, backend_cuda.cpp). Types
// and values as in cuda.h (CUDA 12 and 13 agree); CUresult is an int.
namespace cudrv {

typedef int CUresult;
enum : CUresult {
  CUDA_SUCCESS = 0,
  CUDA_ERROR_INVALID_VALUE = 1,
  CUDA_ERROR_OUT_OF_MEMORY = 2,
  CUDA_ERROR_NOT_INITIALIZED = 3,
  CUDA_ERROR_INVALID_DEVICE = 101,
  CUDA_ERROR_INVALID_CONTEXT = 201,
  CUDA_ERROR_NOT_SUPPORTED = 801,
};

typedef unsigned long long CUdeviceptr;                   // CUdeviceptr_v2
typedef unsigned long long CUmemGenericAllocationHandle;  // _v1
typedef int CUdevice;
struct CUctx_st;
typedef CUctx_st* CUcontext;

// CUdevice_attribute
constexpr int CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102;
// CUmemAllocationType, CUmemAllocationHandleType, CUmemLocationType,
// CUmemAccess_flags, CUmemAllocationGranularity_flags (enums, int-sized)
constexpr int CU_MEM_ALLOCATION_TYPE_PINNED = 0x1;
constexpr int CU_MEM_HANDLE_TYPE_NONE = 0x0;
constexpr int CU_MEM_LOCATION_TYPE_DEVICE = 0x1;
constexpr int CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3;
constexpr int CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0x0;

struct CUmemLocation {  // CUmemLocation_v1
  int type;             // CUmemLocationType
  int id;
};

struct CUmemAllocationProp {  // CUmemAllocationProp_v1
  int type;                   // CUmemAllocationType
  int requestedHandleTypes;   // CUmemAllocationHandleType
  CUmemLocation location;
  void* win32HandleMetaData;
  struct {
    unsigned char compressionType;
    unsigned char gpuDirectRDMACapable;
    unsigned short usage;
    unsigned char reserved[4];
  } allocFlags;
};

struct CUmemAccessDesc {  // CUmemAccessDesc_v1
  CUmemLocation location;
  int flags;  // CUmemAccess_flags
};

static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout differs from cuda.h");
static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout differs from cuda.h");

}  // namespace cudrv

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
  // Milliseconds between two completed events made without
  // cudaEventDisableTiming (the live session's op costs on a GPU, OpTimer).
  Err (*EventElapsedTime)(float* ms, Event start, Event end);
  Err (*GetLastError)();
  const char* (*GetErrorString)(Err error);
  Err (*RuntimeGetVersion)(int* runtime_version);

  // The stream-ordered allocator (CUDA 11.2 and later), optional: all of
  // them or none (PoolApi::complete()); async_segments needs them.
  struct PoolApi {
    using Pool = cudart::cudaMemPool_t;
    Err (*DeviceGetAttribute)(int* value, int attribute, int device);
    Err (*MemPoolCreate)(Pool* pool, const cudart::cudaMemPoolProps* props);
    Err (*MemPoolDestroy)(Pool pool);
    Err (*MemPoolGetAttribute)(Pool pool, int attribute, void* value);
    Err (*MemPoolSetAttribute)(Pool pool, int attribute, void* value);
    Err (*MemPoolTrimTo)(Pool pool, std::size_t min_bytes_to_keep);
    Err (*MallocFromPoolAsync)(void** ptr, std::size_t size, Pool pool, Stream stream);
    Err (*FreeAsync)(void* dev_ptr, Stream stream);

    bool complete() const {
      return DeviceGetAttribute && MemPoolCreate && MemPoolDestroy && MemPoolGetAttribute && MemPoolSetAttribute &&
             MemPoolTrimTo && MallocFromPoolAsync && FreeAsync;
    }
  } pools{};

  // From the driver API (cuda.h), optional: CUresult
  // cuDevicePrimaryCtxGetState(CUdevice dev, unsigned int* flags, int* active).
  // CUdevice is the device ordinal and CUresult an int (0 = CUDA_SUCCESS).
  // Found in the runtime library if it has it (the fake does), else in
  // libcuda.so.1; nullptr when neither does.
  int (*DevicePrimaryCtxGetState)(int device, unsigned int* flags, int* active);

  // Driver API, optional, for VMM segments (backend_cuda.cpp): found where
  // DevicePrimaryCtxGetState is. All of them or none: VmmApi::complete().
  struct VmmApi {
    using R = cudrv::CUresult;
    R (*DeviceGet)(cudrv::CUdevice* device, int ordinal);
    R (*DeviceGetAttribute)(int* value, int attribute, cudrv::CUdevice device);
    R (*CtxGetCurrent)(cudrv::CUcontext* context);
    R (*MemGetAllocationGranularity)(std::size_t* granularity, const cudrv::CUmemAllocationProp* prop,
                                     int option);
    R (*MemAddressReserve)(cudrv::CUdeviceptr* ptr, std::size_t size, std::size_t alignment,
                           cudrv::CUdeviceptr addr, unsigned long long flags);
    R (*MemAddressFree)(cudrv::CUdeviceptr ptr, std::size_t size);
    R (*MemCreate)(cudrv::CUmemGenericAllocationHandle* handle, std::size_t size,
                   const cudrv::CUmemAllocationProp* prop, unsigned long long flags);
    R (*MemRelease)(cudrv::CUmemGenericAllocationHandle handle);
    R (*MemMap)(cudrv::CUdeviceptr ptr, std::size_t size, std::size_t offset,
                cudrv::CUmemGenericAllocationHandle handle, unsigned long long flags);
    R (*MemUnmap)(cudrv::CUdeviceptr ptr, std::size_t size);
    R (*MemSetAccess)(cudrv::CUdeviceptr ptr, std::size_t size, const cudrv::CUmemAccessDesc* desc,
                      std::size_t count);
    R (*GetErrorString)(R error, const char** text);

    bool complete() const {
      return DeviceGet && DeviceGetAttribute && CtxGetCurrent && MemGetAllocationGranularity &&
             MemAddressReserve && MemAddressFree && MemCreate && MemRelease && MemMap && MemUnmap &&
             MemSetAccess && GetErrorString;
    }
  } vmm{};
};

// Loads the CUDA runtime on first use and returns its function table. Throws
// std::runtime_error naming the cause and the fix when none can be loaded. A
// failed load is not remembered: a later call (say, after `import torch`
// brought a runtime into the process) searches again.
const CudaRuntimeApi& cuda_runtime();

// The loaded runtime's version, e.g. 12040 for 12.4. Loads like cuda_runtime().
int cuda_runtime_version();

}  // namespace dtralloc
