// CUDA handler of the layered copy (layer_copy.h), on XLA's stream: the copy kernel over every
// layer and slab in one launch, or with dma=true and indices in pinned host memory the copy
// engines, one list of copies over every layer and slab.
#include "block_copy_cuda.h"
#include "layer_copy.h"

namespace kvxfer {
namespace {

ffi::Error LayerCopy(cudaStream_t stream, ffi::Buffer<ffi::S32> src_idx,
                     ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                     ffi::RemainingArgs arrays, ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                     ffi::RemainingRets outs, LayerCopyOptions options) {
  LayerCopyPlan plan;
  if (auto err = PlanLayerCopy(src_idx, dst_idx, num_tokens, arrays, outs, options, &plan);
      err.failure()) {
    return err;
  }
  if (superseded->element_count() < src_idx.element_count()) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer layer copy: the int32 workspace needs an entry per pair");
  }
  for (auto& [in, out] : plan.destinations) {
    if (out.untyped_data() != in.untyped_data() && in.size_bytes() > 0) {  // XLA did not alias
      cudaError_t err = cudaMemcpyAsync(out.untyped_data(), in.untyped_data(), in.size_bytes(),
                                        cudaMemcpyDefault, stream);
      if (err != cudaSuccess) return CudaError(err, "cudaMemcpyAsync");
    }
  }
  if (src_idx.element_count() == 0 || plan.parts[0].src_blocks == 0 ||
      plan.parts[0].dst_blocks == 0) {
    return ffi::Error::Success();
  }
  const bool dma = options.dma && IsHostMemory(src_idx.typed_data()) &&
                   IsHostMemory(dst_idx.typed_data()) &&
                   (options.whole_blocks || IsHostMemory(num_tokens.typed_data()));
  if (!dma) {
    return CopyParts(stream, plan.parts, superseded->typed_data(), options.unique_dst,
                     options.max_ctas);
  }
  if (cudaError_t err = EnqueueDmaCopies(stream, plan.parts, false); err != cudaSuccess) {
    return CudaError(err, "layer copy on the copy engines");
  }
  dma_batches.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerCopyCuda, LayerCopy,
                              BindLayerOperands(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .Ret<ffi::Buffer<ffi::S32>>()  // [B]: the duplicate scan
                                  .RemainingRets()  // the host array or the layers, aliased
                                  .Attrs<LayerCopyOptions>());

}  // namespace kvxfer
