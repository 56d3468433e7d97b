// What the CUDA handlers share: the copy kernel (copy_kernel.cu), the copy engines
// (copy_engines.cu) and the block copy on a given stream (block_copy_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <vector>

#include "block_copy.h"
#include "copy_units.cuh"
#include "dma_plan.h"

namespace kvxfer {

// A CUDA call's result as an ffi::Error: success, or an internal error naming `what`.
inline ffi::Error CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_kvxfer block copy: ") + what + ": " +
                              cudaGetErrorString(err));
}

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

// "XLA did not alias": a result in another buffer than its operand starts as a copy of it.
inline cudaError_t CopyUnaliased(cudaStream_t stream, void* out, const void* in, size_t bytes) {
  if (out == in || bytes == 0) return cudaSuccess;
  return cudaMemcpyAsync(out, in, bytes, cudaMemcpyDefault, stream);
}

// Whether a batch copies nothing (no pairs, or an empty pool or block).
inline bool NothingToCopy(const Batch& b) {
  return b.num_pairs == 0 || b.src_blocks == 0 || b.dst_blocks == 0 || b.g.block_bytes == 0;
}

// SMs per device, read when the module loads: handlers run inside CUDA graph capture, where
// device queries are not allowed.
void ReadSmCounts();

// The kernel copy of batch `b` (no staging): where destinations may repeat, the duplicate scan
// first, in the copy itself or (`superseded`: an int32 per pair) in a kernel before it.
ffi::Error CopyBatch(cudaStream_t stream, Batch b, int32_t* superseded, bool unique_dst,
                     int64_t max_ctas);

// The copy kernel over `parts`, batches that share their pairs and token counts (a layered copy's
// layers and slabs, copy_units.cuh's PartsLaunch): one launch per kMaxParts parts of one vector
// width. No duplicate scan: set each part's `superseded` where destinations may repeat.
ffi::Error LaunchPartsKernel(cudaStream_t stream, const std::vector<Batch>& parts,
                             int64_t max_ctas);

// CopyBatch over such parts: where destinations may repeat, one duplicate scan for all of them.
ffi::Error CopyParts(cudaStream_t stream, std::vector<Batch> parts, int32_t* superseded,
                     bool unique_dst, int64_t max_ctas);

extern std::atomic<int64_t> dma_batches;  // batches copied by the copy engines (for tests)

// Whether `p` is (pinned) host memory. JAX offers no other host memory on GPUs.
bool IsHostMemory(const void* p);

// The first of src_indices, dst_indices and num_tokens (unless the batch copies whole blocks)
// not in pinned host memory, where the copy engines' handlers read them, or null.
const char* IndicesOffHost(const Batch& b);
// Where a `call` ("block copy") asks for the copy engines and they cannot run (indices off the
// host, or with `across`, not one pool in device and one in pinned host memory): the error, naming
// what was expected. Never a silent fall back to the kernel.
ffi::Error RefuseCopyEngines(const Batch& b, const char* call, bool across);

// Batches on the copy engines, indices read on the host: one batch, or a layered copy's parts
// (which write bytes of their own). In any order where a batch's destinations are distinct, else
// (or with `in_order`) one copy after another in pair order. Counts one batch in dma_batches.
cudaError_t EnqueueDmaCopies(cudaStream_t stream, const std::vector<Batch>& parts, bool in_order);
// Planned copies (dma_plan.h) on the copy engines, in any order unless `in_order`; counts one
// batch in dma_batches.
cudaError_t EnqueuePlannedCopies(cudaStream_t stream, const std::vector<DmaCopy>& copies,
                                 bool in_order);

// The whole block copy on `stream`, as the block-copy targets run it (block_copy_cuda.cu).
ffi::Error CopyOnStream(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                        ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                        ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer out,
                        ffi::Buffer<ffi::S32> superseded, ffi::Buffer<ffi::U8> staging,
                        const CopyOptions& options);

// The start of a CUDA handler's binding: XLA's stream, then two pools (destination, source) or
// one (a copy within it). A macro, since a binding can be neither copied nor moved.
#define KVXFER_STREAM ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
#define KVXFER_POOLS_1 KVXFER_STREAM.Arg<ffi::AnyBuffer>()
#define KVXFER_POOLS_2 KVXFER_POOLS_1.Arg<ffi::AnyBuffer>()

// A handler over one pool that is both destination and source (a copy within it): one operand
// rather than the same array passed twice, since XLA would copy a donated operand that another
// operand of the same call also reads.
template <auto kHandler>
struct Within {
  template <typename... Rest>
  ffi::Error operator()(cudaStream_t stream, ffi::AnyBuffer pool, Rest... rest) const {
    return kHandler(stream, pool, pool, rest...);
  }
};

}  // namespace kvxfer
