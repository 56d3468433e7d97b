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
  PoolGeometry g;
  int64_t num_pairs = 0;
  if (auto err = CheckPools(dst, src, out, src_idx, dst_idx, num_tokens, &g, &num_pairs);
      err.failure()) {
    return err;
  }
  const int64_t dst_blocks = dst.dimensions()[0], src_blocks = src.dimensions()[0];
  char* out_data = static_cast<char*>(out.untyped_data());
  if (cudaError_t err = CopyUnaliased(stream, out_data, dst.untyped_data(),
                                      dst_blocks * g.block_bytes);
      err != cudaSuccess) {
    return CudaError(err, "cudaMemcpyAsync");
  }
  Batch b = PoolBatch(out_data, static_cast<char*>(src.untyped_data()), src_idx.typed_data(),
                      dst_idx.typed_data(), num_tokens.typed_data(), num_pairs, src_blocks,
                      dst_blocks, g, options.whole_blocks);
  if (NothingToCopy(b)) return ffi::Error::Success();
  const bool stage = src.untyped_data() == out_data && !options.hazard_free;
  if (auto err = CheckWorkspaces(num_pairs, g, stage, superseded.element_count(),
                                 staging.element_count());
      err.failure()) {
    return err;
  }
  if (options.dma) {
    if (auto err = RefuseCopyEngines(b, "block copy", true); err.failure()) return err;
    cudaError_t err = EnqueueDmaCopies(stream, {b}, false);
    return err == cudaSuccess ? ffi::Error::Success()
                              : CudaError(err, "block copy on the copy engines");
  }
  // Every pair reads the source as it was before the call. When the source is the pool being
  // written and a block may be both read and written, gather the sources out first.
  if (stage) {
    Batch gather = b;
    gather.dst = {reinterpret_cast<char*>(staging.typed_data()), g.block_bytes, true};
    // one slot per pair: no duplicates
    if (auto err = CopyBatch(stream, gather, nullptr, true, options.max_ctas); err.failure()) {
      return err;
    }
    b.src = {reinterpret_cast<char*>(staging.typed_data()), g.block_bytes, true};
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
  if (auto err = PlanLayerCopy(src_idx, dst_idx, num_tokens, arrays, outs, options, &plan);
      err.failure()) {
    return err;
  }
  if (superseded->element_count() < src_idx.element_count()) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer layer copy: the int32 workspace needs an entry per pair");
  }
  for (auto& [in, out] : plan.destinations) {
    if (cudaError_t err = CopyUnaliased(stream, out.untyped_data(), in.untyped_data(),
                                        in.size_bytes());
        err != cudaSuccess) {
      return CudaError(err, "cudaMemcpyAsync");
    }
  }
  if (NothingToCopy(plan.parts[0])) return ffi::Error::Success();
  const CopyOptions& o = options.o;
  if (!o.dma) {
    return CopyParts(stream, plan.parts, superseded->typed_data(), o.unique_dst, o.max_ctas);
  }
  if (auto err = RefuseCopyEngines(plan.parts[0], "layer copy", false); err.failure()) {
    return err;
  }
  if (cudaError_t err = EnqueueDmaCopies(stream, plan.parts, false); err != cudaSuccess) {
    return CudaError(err, "layer copy on the copy engines");
  }
  return ffi::Error::Success();
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
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerCopyCuda, LayerCopy,
                              BindLayerOperands(KVXFER_STREAM)
                                  .Ret<ffi::Buffer<ffi::S32>>()  // [B]: the duplicate scan
                                  .RemainingRets()  // the host array or the layers, aliased
                                  .Attrs<Layered<CopyOptions>>());

}  // namespace kvxfer
