// The layered copy of a pool over an engine's own per-layer arrays (KVCacheBlockPool.from_layers):
// blocks move between L layer arrays on the GPU and one host array with a contiguous row per
// block that holds every layer's part of it, in one custom call. Shared by the CPU and CUDA
// handlers, which run the parts this plans: one batch (copy_units.cuh) per layer and K/V slab.
//
// Layer l is seen as `copies` slabs (K/V first: [2, num_blocks, ...]; otherwise 1) of
// [num_blocks, outer, tokens, row]; a slab's block is S = outer * tokens * row_bytes bytes, and
// block b of slab c lies at (c * num_blocks + b) * S. A host row is every layer's blocks in
// order, slab by slab: layer l's slab c at offset(l) + c * S_l, rows R = sum of copies * S bytes
// apart. A partial copy of n tokens is then, per layer and slab, the first n rows of each of
// its `outer` runs, on both sides.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "block_copy.h"
#include "copy_units.cuh"

namespace kvxfer {

struct LayerCopyPlan {
  std::vector<Batch> parts;  // one per layer and slab, each writing bytes of its own
  std::vector<int64_t> row_offsets;  // where each part lies in a host row
  std::vector<int64_t> part_layers;  // each part's layer
  int64_t row_bytes = 0;             // of a host row
  // (result, operand, bytes) of each destination array: where XLA did not alias them, the
  // result starts as a copy of the operand
  std::vector<std::tuple<void*, const void*, size_t>> destinations;
};

// The layered calls' bindings after the platform context (if any): the indices, then the host
// array and the layers; a layered copy's workspace for the GPU's duplicate scan; the host array
// (offload) or the layers (onboard), aliased; the options.
template <typename Binding>
auto BindLayerCopy(Binding&& binding) {
  return BindIndices(std::forward<Binding>(binding))
      .RemainingArgs()                        // the host array, then the layers
      .template Ret<ffi::Buffer<ffi::S32>>()  // [B]: the GPU's duplicate scan
      .RemainingRets()                        // the host array or the layers, aliased
      .template Attrs<Layered<CopyOptions>>();
}

template <typename Binding>
auto BindLayerLaneCopy(Binding&& binding) {
  return BindIndices(std::forward<Binding>(binding))
      .RemainingArgs()  // the host array, then the layers
      .RemainingRets()  // the host array or the layers, aliased
      .template Attrs<Layered<LaneOptions>>();
}

// Checks the operands against the views and plans the parts; never dereferences a data
// pointer. `arrays`: the host array, then the layers; `outs`: the host result (offload) or the
// layers' results (onboard). `o`: a layered copy's options or a lane copy's.
template <typename Options>
ffi::Error PlanLayerCopy(ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                         ffi::Buffer<ffi::S32> num_tokens, ffi::RemainingArgs arrays,
                         ffi::RemainingRets outs, const Layered<Options>& o, LayerCopyPlan* plan) {
  const auto bad = [](const std::string& what) {
    return ffi::Error::InvalidArgument("jax_kvxfer layer copy: " + what);
  };
  constexpr size_t kFields = 5;
  const size_t num_layers = o.views.size() / kFields;
  if (o.views.size() % kFields != 0 || num_layers == 0 || arrays.size() != num_layers + 1 ||
      outs.size() != (o.offload ? 1 : num_layers)) {
    return bad("the operands, results and layer views disagree in number");
  }
  const int64_t n = src_idx.element_count();
  if (dst_idx.element_count() != static_cast<size_t>(n) ||
      num_tokens.element_count() != static_cast<size_t>(n)) {
    return bad("src_indices, dst_indices and num_tokens differ in length");
  }
  auto host = arrays.get<ffi::AnyBuffer>(0);
  if (!host.has_value()) return bad("the host array is not a buffer");
  const auto host_dims = host->dimensions();
  if (host_dims.size() == 0) return bad("the host array has no block axis");
  const int64_t host_blocks = host_dims[0];
  int64_t row_bytes = 0;  // of a host row: every layer's block
  std::vector<ffi::AnyBuffer> layers;
  for (size_t l = 0; l < num_layers; ++l) {
    auto layer = arrays.get<ffi::AnyBuffer>(l + 1);
    if (!layer.has_value()) return bad("a layer is not a buffer");
    const int64_t* v = o.views.begin() + kFields * l;
    const int64_t copies = v[0], blocks = v[1], outer = v[2], tokens = v[3], row = v[4];
    if (copies < 1 || blocks < 0 || outer < 1 || tokens < 1 || row < 1 ||
        blocks != o.views[1] || tokens != o.views[3]) {
      return bad("layer " + std::to_string(l) + " has a view that does not fit the others");
    }
    if (layer->element_type() != host->element_type() ||
        layer->size_bytes() != static_cast<size_t>(copies * blocks * outer * tokens * row)) {
      return bad("layer " + std::to_string(l) + " does not match its view or the host's dtype");
    }
    row_bytes += copies * outer * tokens * row;
    layers.push_back(*layer);
  }
  if (host->size_bytes() != static_cast<size_t>(host_blocks * row_bytes)) {
    return bad("the host array is not one row per block of every layer's block bytes");
  }
  // The destinations' results, which must match their operands.
  for (size_t k = 0; k < outs.size(); ++k) {
    auto out = outs.get<ffi::AnyBuffer>(k);
    const ffi::AnyBuffer in = o.offload ? *host : layers[k];
    if (!out.has_value() || (*out)->size_bytes() != in.size_bytes()) {
      return bad("a result does not match its operand");
    }
    plan->destinations.emplace_back((*out)->untyped_data(), in.untyped_data(), in.size_bytes());
  }
  plan->row_bytes = row_bytes;
  const int64_t device_blocks = o.views[1];
  char* host_data = static_cast<char*>(o.offload ? std::get<0>(plan->destinations[0])
                                                 : host->untyped_data());
  int64_t offset = 0;  // of layer l's part in a host row
  for (size_t l = 0; l < num_layers; ++l) {
    const int64_t* v = o.views.begin() + kFields * l;
    const PoolGeometry g{v[2], v[3], v[4], v[2] * v[3] * v[4]};
    char* layer_data = static_cast<char*>(o.offload ? layers[l].untyped_data()
                                                    : std::get<0>(plan->destinations[l]));
    for (int64_t c = 0; c < v[0]; ++c) {
      const Side device{layer_data + c * device_blocks * g.block_bytes, g.block_bytes, false};
      const Side row{host_data + offset + c * g.block_bytes, row_bytes, false};
      Batch b{o.offload ? row : device, o.offload ? device : row, src_idx.typed_data(),
              dst_idx.typed_data(), num_tokens.typed_data(), nullptr, n,
              o.offload ? device_blocks : host_blocks, o.offload ? host_blocks : device_blocks,
              g, o.o.whole_blocks};
      plan->parts.push_back(b);
      plan->row_offsets.push_back(offset + c * g.block_bytes);
      plan->part_layers.push_back(static_cast<int64_t>(l));
    }
    offset += v[0] * g.block_bytes;
  }
  return ffi::Error::Success();
}

}  // namespace kvxfer
