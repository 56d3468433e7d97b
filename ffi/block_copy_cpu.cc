// CPU handler of the jax_kvxfer block copy: the reference implementation of the op's semantics.
#include <cstring>
#include <type_traits>
#include <vector>

#include "block_copy.h"
#include "dma_plan.h"
#include "layer_copy.h"
#include "nanobind/nanobind.h"
#include "targets.h"

namespace nb = nanobind;
namespace kvxfer {
namespace {

// Copies the first n token rows of every run of one block (or the whole block).
void CopyBlockPrefix(char* dst, const char* src, int64_t n, const PoolGeometry& g) {
  if (n == g.tokens) {
    std::memcpy(dst, src, g.block_bytes);
    return;
  }
  const int64_t pitch = g.tokens * g.row_bytes;
  for (int64_t r = 0; r < g.outer; ++r) std::memcpy(dst + r * pitch, src + r * pitch, n * g.row_bytes);
}

// The copy on buffers as XLA hands them over. `staging` (bytes, or null): room for every pair's
// source block, needed where source and result are one buffer and a block may be both read
// and written (`hazard_free` false); the pairs apply in order, so the last pair writing a
// token wins.
ffi::Error CopyPairs(ffi::AnyBuffer dst, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> src_idx,
                     ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                     ffi::AnyBuffer out, bool hazard_free, size_t superseded_count,
                     char* staging, size_t staging_bytes) {
  PoolGeometry g;
  int64_t num_pairs = 0;
  KVXFER_RETURN_IF_ERROR(CheckPools(dst, src, out, src_idx, dst_idx, num_tokens, &g, &num_pairs));
  const int64_t dst_blocks = dst.dimensions()[0], src_blocks = src.dimensions()[0];
  char* out_data = static_cast<char*>(out.untyped_data());
  if (out_data != dst.untyped_data()) {  // XLA did not alias: start from dst's contents
    std::memcpy(out_data, dst.untyped_data(), dst_blocks * g.block_bytes);
  }
  const char* src_data = static_cast<const char*>(src.untyped_data());
  const bool stage = src_data == out_data && !hazard_free;
  KVXFER_RETURN_IF_ERROR(CheckWorkspaces(num_pairs, g, stage, superseded_count, staging_bytes));
  const int32_t* si = src_idx.typed_data();
  const int32_t* di = dst_idx.typed_data();
  const int32_t* nt = num_tokens.typed_data();
  auto valid = [&](int64_t i) {  // out-of-range pairs are skipped, never touched
    return si[i] >= 0 && si[i] < src_blocks && di[i] >= 0 && di[i] < dst_blocks;
  };

  // Every pair reads the source as it was before the call. When the source is the pool being
  // written and a block may be both read and written, read the sources out first.
  if (stage) {
    for (int64_t i = 0; i < num_pairs; ++i) {
      if (valid(i)) std::memcpy(staging + i * g.block_bytes, src_data + si[i] * g.block_bytes, g.block_bytes);
    }
  }
  for (int64_t i = 0; i < num_pairs; ++i) {
    if (!valid(i)) continue;
    const char* from = stage ? staging + i * g.block_bytes : src_data + si[i] * g.block_bytes;
    CopyBlockPrefix(out_data + di[i] * g.block_bytes, from, TokensToCopy(nt[i], g), g);
  }
  return ffi::Error::Success();
}

// `unique_dst` (which lets the GPU skip its duplicate scan), the GPU's grid cap and its choice
// of copy engines change nothing here; `whole_blocks` only promises what num_tokens says.
ffi::Error BlockCopyCpu(ffi::AnyBuffer dst, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> src_idx,
                        ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                        ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                        ffi::Result<ffi::Buffer<ffi::U8>> staging, CopyOptions options) {
  return CopyPairs(dst, src, src_idx, dst_idx, num_tokens, *out, options.hazard_free,
                   superseded->element_count(), reinterpret_cast<char*>(staging->typed_data()),
                   staging->element_count());
}

// Copies within one pool. One operand rather than the same array passed twice: XLA would copy
// a donated operand that another operand of the same call also reads.
ffi::Error BlockCopyWithinCpu(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src_idx,
                              ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                              ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                              ffi::Result<ffi::Buffer<ffi::U8>> staging, CopyOptions options) {
  return BlockCopyCpu(pool, pool, src_idx, dst_idx, num_tokens, out, superseded, staging,
                      options);
}

// Runs the copy engines' plan of `parts` (dma_plan.h) with memcpy: each part's pairs in order.
void CopyPlanned(const std::vector<Batch>& parts) {
  for (const Batch& part : parts) {
    if (part.src_blocks == 0 || part.dst_blocks == 0) continue;
    std::vector<DmaCopy> copies;
    PlanDmaCopies(part, &copies);
    for (const DmaCopy& c : copies) {
      for (size_t row = 0; row < c.height; ++row) {
        std::memcpy(c.dst + row * c.pitch, c.src + row * c.pitch, c.width);
      }
    }
  }
}

// An onboard split by layers as the GPU's lane splits it (SplitLayerGroups), group after group;
// false where it does not split (the caller copies it whole).
bool CopyLayerGroups(const std::vector<LayeredPart>& parts, int64_t groups) {
  std::vector<std::vector<Batch>> split;
  std::vector<int64_t> ends;
  if (!SplitLayerGroups(parts, groups, &split, &ends)) return false;
  for (const std::vector<Batch>& group : split) CopyPlanned(group);
  return true;
}

// The manager's lane copies (lanes_cuda.cu) and their join. The CPU has no lanes: a lane copy
// is done when its call is, in pair order, which is what the manager's runs need (no pair reads
// a slot that an earlier pair of the run writes), and the join only hands the array on. An
// onboard with layer groups runs the GPU's split, so that tests check it here too.
ffi::Error LaneCopyCpu(ffi::AnyBuffer dst, ffi::AnyBuffer src, ffi::Buffer<ffi::S32> src_idx,
                       ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                       ffi::Result<ffi::AnyBuffer> out, LaneOptions options) {
  const bool onboard = options.lane == kOnboardLane && src.untyped_data() != dst.untyped_data();
  if (options.layer_groups > 1 && onboard) {
    Batch b;
    KVXFER_RETURN_IF_ERROR(
        PoolBatch(dst, src, *out, src_idx, dst_idx, num_tokens, options.whole_blocks, &b));
    if (b.dst.data != dst.untyped_data()) {  // XLA did not alias: start from dst's contents
      std::memcpy(b.dst.data, dst.untyped_data(), b.dst_blocks * b.g.block_bytes);
    }
    if (CopyLayerGroups({{b, 0, dst.dimensions()[1]}}, options.layer_groups)) {
      return ffi::Error::Success();
    }
  }
  return CopyPairs(dst, src, src_idx, dst_idx, num_tokens, *out, true,
                   src_idx.element_count(), nullptr, 0);
}

ffi::Error LaneCopyWithinCpu(ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src_idx,
                             ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                             ffi::Result<ffi::AnyBuffer> out, LaneOptions options) {
  return LaneCopyCpu(pool, pool, src_idx, dst_idx, num_tokens, out, options);
}

// The layered copy (layer_copy.h): each part's pairs in order, the copy engines' plan run with
// memcpy (which the emulation checks against the reference, as the GPU's copy kernel).
template <typename Options>
ffi::Error CopyLayers(ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                      ffi::Buffer<ffi::S32> num_tokens, ffi::RemainingArgs arrays,
                      ffi::RemainingRets outs, const Layered<Options>& options) {
  LayerCopyPlan plan;
  KVXFER_RETURN_IF_ERROR(PlanLayerCopy(src_idx, dst_idx, num_tokens, arrays, outs, options, &plan));
  for (auto& [out, in, bytes] : plan.destinations) {
    if (out != in) {  // XLA did not alias: start from in's contents
      std::memcpy(out, in, bytes);
    }
  }
  if constexpr (std::is_same_v<Options, LaneOptions>) {
    if (options.o.layer_groups > 1 && !options.offload) {
      std::vector<LayeredPart> parts;
      for (size_t k = 0; k < plan.parts.size(); ++k) {
        parts.push_back({plan.parts[k], plan.part_layers[k], 1});
      }
      if (CopyLayerGroups(parts, options.o.layer_groups)) return ffi::Error::Success();
    }
  }
  CopyPlanned(plan.parts);
  return ffi::Error::Success();
}

ffi::Error LayerCopyCpu(ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                        ffi::Buffer<ffi::S32> num_tokens, ffi::RemainingArgs arrays,
                        ffi::Result<ffi::Buffer<ffi::S32>> /*superseded*/, ffi::RemainingRets outs,
                        Layered<CopyOptions> options) {
  return CopyLayers(src_idx, dst_idx, num_tokens, arrays, outs, options);
}

// The layered copy on a lane: on the CPU, done when its call is.
ffi::Error LayerLaneCopyCpu(ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                            ffi::Buffer<ffi::S32> num_tokens, ffi::RemainingArgs arrays,
                            ffi::RemainingRets outs, Layered<LaneOptions> options) {
  return CopyLayers(src_idx, dst_idx, num_tokens, arrays, outs, options);
}

ffi::Error JoinLanesCpu(ffi::AnyBuffer array, ffi::Result<ffi::AnyBuffer> out,
                        int64_t /*lanes*/) {
  if (out->untyped_data() != array.untyped_data()) {
    std::memcpy(out->untyped_data(), array.untyped_data(), array.size_bytes());
  }
  return ffi::Error::Success();
}

// The CPU's lanes are done when their calls are: nothing to wait for.
ffi::Error WaitLayersCpu(ffi::AnyBuffer array, ffi::Result<ffi::AnyBuffer> out,
                         int64_t /*layers*/) {
  return JoinLanesCpu(array, out, 0);
}

}  // namespace

// The start of a binding: two pools (destination, source) or one (a copy within it).
#define KVXFER_POOLS_1 ffi::Ffi::Bind().Arg<ffi::AnyBuffer>()
#define KVXFER_POOLS_2 KVXFER_POOLS_1.Arg<ffi::AnyBuffer>()
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyCpu, BlockCopyCpu, BindCopy(KVXFER_POOLS_2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyWithinCpu, BlockCopyWithinCpu, BindCopy(KVXFER_POOLS_1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyCpu, LaneCopyCpu, BindLaneCopy(KVXFER_POOLS_2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyWithinCpu, LaneCopyWithinCpu, BindLaneCopy(KVXFER_POOLS_1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerCopyCpu, LayerCopyCpu, BindLayerCopy(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerLaneCopyCpu, LayerLaneCopyCpu,
                              BindLayerLaneCopy(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kJoinLanesCpu, JoinLanesCpu, BindJoinLanes(KVXFER_POOLS_1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kWaitLayersCpu, WaitLayersCpu, BindWaitLayers(KVXFER_POOLS_1));

void DefineSlotColumns(nb::module_& m);  // slot_columns.cc
void DefineStoreIo(nb::module_& m);  // store_io.cc

}  // namespace kvxfer

NB_MODULE(_kvxfer_cpu, m) {
  m.doc() = "CPU XLA FFI handlers of jax_kvxfer, the manager's batch reader, the stores' loops";
  kvxfer::DefineSlotColumns(m);
  kvxfer::DefineStoreIo(m);
  m.def("registrations", []() {
    nb::dict d;
#define KVXFER_REGISTER(name, cuda, cpu) \
  d[name] = nb::capsule(reinterpret_cast<void*>(kvxfer::k##cpu##Cpu));
    KVXFER_TARGETS(KVXFER_REGISTER)
#undef KVXFER_REGISTER
    return d;
  });
}
