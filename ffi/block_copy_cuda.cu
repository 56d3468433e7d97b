// The block copy and the layered copy on XLA's stream: a whole batch of (partial) blocks per
// call, between pools in device or pinned host memory (a `pinned_host` operand is its host
// pointer; the kernel reaches both through unified addressing), with the copy kernel or, where
// the call asks for them (dma=true), the copy engines.
#include "block_copy_cuda.h"
#include "layer_copy.h"

namespace kvxfer {

ffi::Error CopyOnStream(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                        ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                        ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer out,
                        ffi::Buffer<ffi::S32> superseded, ffi::Buffer<ffi::U8> staging,
                        const CopyOptions& options) {
  Batch b;
  KVXFER_RETURN_IF_ERROR(
      PoolBatch(dst, src, out, src_idx, dst_idx, num_tokens, options.whole_blocks, &b));
  KVXFER_RETURN_IF_ERROR(CudaStatus(
      CopyUnaliased(stream, b.dst.data, dst.untyped_data(), b.dst_blocks * b.g.block_bytes),
      "cudaMemcpyAsync"));
  if (NothingToCopy(b)) return ffi::Error::Success();
  const bool stage = b.src.data == b.dst.data && !options.hazard_free;
  KVXFER_RETURN_IF_ERROR(CheckWorkspaces(b.num_pairs, b.g, stage, superseded.element_count(),
                                         staging.element_count()));
  if (options.dma) {
    KVXFER_RETURN_IF_ERROR(RefuseCopyEngines(b, "block copy", true));
    return CudaStatus(EnqueueDmaCopies(stream, {b}, false), "block copy on the copy engines");
  }
  // Every pair reads the source as it was before the call. When the source is the pool being
  // written and a block may be both read and written, gather the sources out first.
  if (stage) {
    Batch gather = b;
    gather.dst = {reinterpret_cast<char*>(staging.typed_data()), b.g.block_bytes, true};
    // one slot per pair: no duplicates
    KVXFER_RETURN_IF_ERROR(CopyBatch(stream, gather, nullptr, true, options.max_ctas));
    b.src = {reinterpret_cast<char*>(staging.typed_data()), b.g.block_bytes, true};
  }
  return CopyBatch(stream, b, superseded.typed_data(), options.unique_dst, options.max_ctas);
}

namespace {

// kInGraph: the handler of a command-buffer compatible target, which XLA may record into a
// CUDA graph and replay without running this code, so it must not take the copy engines' path;
// the Python side sends dma=true to the "nograph" targets only.
template <bool kInGraph>
ffi::Error BlockCopy(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                     ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                     ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                     ffi::Result<ffi::Buffer<ffi::U8>> staging, CopyOptions options) {
  if (kInGraph && options.dma) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer block copy: dma=true goes through the target jax_kvxfer_block_copy_nograph");
  }
  return CopyOnStream(stream, dst, src, src_idx, dst_idx, num_tokens, *out, *superseded,
                      *staging, options);
}

// The layered copy (layer_copy.h): the copy kernel over every layer and slab in one launch, or
// with dma=true the copy engines, one list of copies over every layer and slab.
ffi::Error LayerCopy(cudaStream_t stream, ffi::Buffer<ffi::S32> src_idx,
                     ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                     ffi::RemainingArgs arrays, ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                     ffi::RemainingRets outs, Layered<CopyOptions> options) {
  LayerCopyPlan plan;
  KVXFER_RETURN_IF_ERROR(PlanLayerCopy(src_idx, dst_idx, num_tokens, arrays, outs, options, &plan));
  if (superseded->element_count() < src_idx.element_count()) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer layer copy: the int32 workspace needs an entry per pair");
  }
  for (auto& [out, in, bytes] : plan.destinations) {
    KVXFER_RETURN_IF_ERROR(CudaStatus(CopyUnaliased(stream, out, in, bytes), "cudaMemcpyAsync"));
  }
  if (NothingToCopy(plan.parts[0])) return ffi::Error::Success();
  const CopyOptions& o = options.o;
  if (!o.dma) {
    return CopyParts(stream, plan.parts, superseded->typed_data(), o.unique_dst, o.max_ctas);
  }
  KVXFER_RETURN_IF_ERROR(RefuseCopyEngines(plan.parts[0], "layer copy", false));
  return CudaStatus(EnqueueDmaCopies(stream, plan.parts, false), "layer copy on the copy engines");
}

}  // namespace

// The kernel-only targets may be recorded into a CUDA graph (XLA's command buffers, which then
// replay chained copies without running the handler): they read nothing on the host, and XLA
// records them again whenever one of their buffers moves. The "nograph" targets run the same
// handlers without the trait, for what a graph must not hold: dma=true copies and copies on a
// stream of their own (a graph on the compute stream would serialize them).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyCuda, BlockCopy<true>, BindCopy(KVXFER_POOLS_2),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyWithinCuda, Within<BlockCopy<true>>{},
                              BindCopy(KVXFER_POOLS_1), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyNoGraphCuda, BlockCopy<false>, BindCopy(KVXFER_POOLS_2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyWithinNoGraphCuda, Within<BlockCopy<false>>{},
                              BindCopy(KVXFER_POOLS_1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerCopyCuda, LayerCopy, BindLayerCopy(KVXFER_STREAM));

}  // namespace kvxfer
