// Device workspaces of TVM-compiled CUDA kernels from torch's CUDA caching allocator.
//
// A kernel library exported by TVM allocates the scratch buffers of its kernels (the sampling
// geometry between the CUDA kernels of one call) through the function pointers
// `__TVMBackendAllocWorkspace` and `__TVMBackendFreeWorkspace`, which TVM's loader points at
// TVM's per-thread workspace pool. That pool is not ordered on any stream, frees and
// re-allocates (synchronising the device) when a larger call comes, and cannot be used while a
// CUDA graph is captured. tvm_deform points those variables at the two functions below: CUDA
// workspaces come from torch's caching allocator on the current stream of their device
// (stream-ordered; inside a graph capture, from the capture's private pool), and every other
// device's go to TVM's own functions, given at attach time.

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

extern "C" {

typedef void* (*FAllocWorkspace)(int device_type, int device_id, uint64_t nbytes,
                                 int dtype_code_hint, int dtype_bits_hint);
typedef int (*FFreeWorkspace)(int device_type, int device_id, void* ptr);

static FAllocWorkspace tvm_alloc = nullptr;
static FFreeWorkspace tvm_free = nullptr;

// DLPack's device type of CUDA memory.
static const int kDLCUDA = 2;

// TVM's own functions, for the other devices' workspaces (the host's).
void tvm_deform_workspace_fallback(FAllocWorkspace alloc, FFreeWorkspace free) {
  tvm_alloc = alloc;
  tvm_free = free;
}

void* tvm_deform_alloc_workspace(int device_type, int device_id, uint64_t nbytes,
                                 int dtype_code_hint, int dtype_bits_hint) {
  if (device_type == kDLCUDA) {
    try {
      auto stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_id));
      return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(nbytes, stream.stream());
    } catch (...) {
      return nullptr;  // TVM's generated code reports a null workspace as an error
    }
  }
  return tvm_alloc(device_type, device_id, nbytes, dtype_code_hint, dtype_bits_hint);
}

int tvm_deform_free_workspace(int device_type, int device_id, void* ptr) {
  if (device_type == kDLCUDA) {
    try {
      c10::cuda::CUDACachingAllocator::raw_delete(ptr);
    } catch (...) {
      return -1;
    }
    return 0;
  }
  return tvm_free(device_type, device_id, ptr);
}

}  // extern "C"
