// What the CUDA handlers share: the block copy on a given stream (block_copy_cuda.cu), used by
// the both-ways fork/join (both_ways_cuda.cu) and the transfer lanes (lanes_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <vector>

#include "block_copy.h"
#include "copy_units.cuh"
#include "nanobind/nanobind.h"

namespace kvxfer {

inline ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("jax_kvxfer block copy: ") + what + ": " +
                              cudaGetErrorString(err));
}

// Whether `p` is (pinned) host memory. JAX offers no other host memory on GPUs.
bool IsHostMemory(const void* p);

// Sets the current device for the scope (events and streams belong to one device).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    (void)cudaGetDevice(&previous_);
    if (previous_ != device) (void)cudaSetDevice(device);
  }
  ~ScopedDevice() { (void)cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// Batches copied by the copy engines so far (read by tests).
extern std::atomic<int64_t> dma_batches;

// The copy kernel over `parts`, batches that share their pairs and token counts (a layered copy's
// layers and slabs, copy_units.cuh's PartsLaunch): one launch per kMaxParts parts of one vector
// width. No duplicate scan: set each part's `superseded` where destinations may repeat.
ffi::Error LaunchPartsKernel(cudaStream_t stream, const std::vector<Batch>& parts,
                             int64_t max_ctas);

// CopyBatch over such parts: where destinations may repeat, one duplicate scan for all of them.
ffi::Error CopyParts(cudaStream_t stream, std::vector<Batch> parts, int32_t* superseded,
                     bool unique_dst, int64_t max_ctas);

// The kernel copy of batch `b` (no staging): where destinations may repeat, the duplicate scan
// first, in the copy itself or (`superseded`: an int32 per pair) in a kernel before it.
ffi::Error CopyBatch(cudaStream_t stream, Batch b, int32_t* superseded, bool unique_dst,
                     int64_t max_ctas);

// Batches on the copy engines, indices read on the host: one batch, or a layered copy's parts
// (which write bytes of their own). In any order where a batch's destinations are distinct, else
// (or with `in_order`) one copy after another in pair order.
cudaError_t EnqueueDmaCopies(cudaStream_t stream, const std::vector<Batch>& parts, bool in_order);

// The whole block copy on `stream`, as the block-copy targets run it.
ffi::Error CopyOnStream(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                        ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                        ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer out,
                        ffi::Buffer<ffi::S32> superseded, ffi::Buffer<ffi::U8> staging,
                        const CopyOptions& options);

// The start of a CUDA handler's binding: XLA's stream, then two pools (destination, source) or
// one (a copy within it). A macro, since a binding can be neither copied nor moved.
#define KVXFER_POOLS_1 ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>()
#define KVXFER_POOLS_2 KVXFER_POOLS_1.Arg<ffi::AnyBuffer>()

XLA_FFI_DECLARE_HANDLER_SYMBOL(kBlockCopyForkCuda);  // both_ways_cuda.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(kBlockCopyJoinCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kLayerCopyCuda);  // layer_copy_cuda.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(kLaneCopyCuda);  // lanes_cuda.cu
XLA_FFI_DECLARE_HANDLER_SYMBOL(kLaneCopyWithinCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kLayerLaneCopyCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kJoinLanesCuda);
void DefineLaneFunctions(nanobind::module_& m);  // lanes_cuda.cu

}  // namespace kvxfer
