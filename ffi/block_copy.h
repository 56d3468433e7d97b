// Geometry and argument checks shared by the CPU and CUDA block-copy handlers.
//
// A pool is [num_blocks, num_layers, kv_factor, num_kv_heads, tokens_per_block, size_per_head].
// Both handlers see it as [num_blocks, outer, tokens, row] where outer = layers * kv * heads and a
// row is one token of one head (size_per_head elements). "The first n tokens of a block" are then
// `outer` runs of n rows each, `tokens` rows apart.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

#if defined(__CUDACC__)
#define KVXFER_HOST_DEVICE __host__ __device__
#else
#define KVXFER_HOST_DEVICE
#endif

// In a function returning ffi::Error: evaluates the expression (an ffi::Error) and returns it
// where it is a failure.
#define KVXFER_RETURN_IF_ERROR(...)                                     \
  do {                                                                  \
    if (auto kvxfer_error = (__VA_ARGS__); kvxfer_error.failure()) {    \
      return kvxfer_error;                                              \
    }                                                                   \
  } while (false)

namespace kvxfer {

namespace ffi = xla::ffi;

struct PoolGeometry {
  int64_t outer = 0;        // layers * kv_factor * heads: the runs per block
  int64_t tokens = 0;       // tokens per block
  int64_t row_bytes = 0;    // bytes of one token row; 0 when a row is not a whole number of bytes
  int64_t block_bytes = 0;  // bytes of one block
};

// Bits one element occupies in memory: XLA hands custom calls 4-bit operands packed two per
// byte (layout E(4)), on the GPU and on the CPU alike.
inline int64_t StoredBits(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::S4:
    case ffi::DataType::U4:
    case ffi::DataType::F4E2M1FN:
      return 4;
    default:
      return 8 * static_cast<int64_t>(ffi::ByteWidth(type));
  }
}

inline std::string DimsToString(ffi::AnyBuffer::Dimensions dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks that dst, src and out are pools of one block shape and dtype and that the three index
// arrays have one length; fills the geometry. Never dereferences a data pointer.
inline ffi::Error CheckPools(ffi::AnyBuffer dst, ffi::AnyBuffer src, ffi::AnyBuffer out,
                             ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                             ffi::Buffer<ffi::S32> num_tokens,
                             PoolGeometry* geometry, int64_t* num_pairs) {
  auto dd = dst.dimensions(), sd = src.dimensions(), od = out.dimensions();
  if (dd.size() != 6 || sd.size() != 6 || od.size() != 6) {
    return ffi::Error::InvalidArgument("jax_kvxfer block copy: pools must be 6-D, got dst " +
                                       DimsToString(dd) + " and src " + DimsToString(sd));
  }
  for (int i = 0; i < 6; ++i) {
    if (od[i] != dd[i] || (i > 0 && sd[i] != dd[i])) {
      return ffi::Error::InvalidArgument("jax_kvxfer block copy: block shapes differ: dst " +
                                         DimsToString(dd) + ", src " + DimsToString(sd));
    }
  }
  if (src.element_type() != dst.element_type() || out.element_type() != dst.element_type()) {
    return ffi::Error::InvalidArgument("jax_kvxfer block copy: dst and src dtypes differ");
  }
  int64_t n = src_idx.element_count();
  if (dst_idx.element_count() != static_cast<size_t>(n) ||
      num_tokens.element_count() != static_cast<size_t>(n)) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer block copy: src_indices, dst_indices and num_tokens differ in length");
  }
  int64_t outer = dd[1] * dd[2] * dd[3];
  int64_t row_bits = dd[5] * StoredBits(dst.element_type());
  int64_t block_bits = outer * dd[4] * row_bits;
  if (block_bits % 8 != 0) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer block copy: a block of this sub-byte dtype is not a whole number of bytes");
  }
  geometry->outer = outer;
  geometry->tokens = dd[4];
  geometry->row_bytes = row_bits % 8 == 0 ? row_bits / 8 : 0;
  geometry->block_bytes = block_bits / 8;
  *num_pairs = n;
  return ffi::Error::Success();
}

// The workspaces XLA allocates as extra results (sized by the Python side, copy_results): an
// int32 per pair for the GPU's duplicate scan (its answer), and room for every pair's source
// block when a copy within one pool must be staged.
inline ffi::Error CheckWorkspaces(int64_t num_pairs, const PoolGeometry& g, bool stage,
                                  size_t superseded_count, size_t staging_bytes) {
  if (superseded_count < static_cast<size_t>(num_pairs)) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer block copy: the int32 workspace needs an entry per pair");
  }
  if (stage && staging_bytes < static_cast<size_t>(num_pairs * g.block_bytes)) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer block copy: source and destination are one buffer but no staging space was "
        "given; copy within one pool through copy_blocks(pool, pool, ...)");
  }
  return ffi::Error::Success();
}

// The attributes of the calls, by name as the Python side passes them, decoded once into a
// struct: a block copy's, a lane copy's, and either with the layer views (layer_copy.h).
struct CopyOptions {
  bool unique_dst;    // no block is written twice: the GPU skips its duplicate scan
  int64_t max_ctas;   // GPU grid cap in CTAs of 1024 threads, <= 0: none
  bool dma;           // GPU: the copy engines; refused where they cannot run, never downgraded
  bool whole_blocks;  // known on the host: every pair copies a whole block
  bool hazard_free = true;  // no block is both read and written (a layered copy: always)
};

constexpr int64_t kOnboardLane = 1;  // the lane of onboards (host -> device)

// A lane copy (the manager's copies beside compute; lanes_cuda.cu).
struct LaneOptions {
  int64_t lane;              // 0: offloads, 1: onboards
  int64_t wait_lane;         // the lane waits for this one first, or -1
  int64_t stream_wait_lane;  // XLA's stream waits for it first, or -1
  bool whole_blocks;
  // An onboard: its copies in this many groups of layers, each group's done before the next
  // starts (a step's layer waits for its group alone: WaitLayers); 1: not split.
  int64_t layer_groups;
};

// A layered copy's (layer_copy.h): the layers' views, then a copy's or a lane copy's options.
template <typename Options>
struct Layered {
  bool offload;  // layers -> host rows; else host rows -> layers
  ffi::Span<const int64_t> views;  // per layer: copies, num_blocks, outer, tokens, row_bytes
  Options o;
};

// The FFI bindings after the pool operand(s), shared by the handlers: `binding` already holds
// the platform context (if any) and the pool(s). (Bindings cannot be copied or moved: each
// helper takes one by reference and returns the extended binding as a new value.)
template <typename Binding>
auto BindIndices(Binding&& binding) {
  return std::move(binding).template Arg<ffi::Buffer<ffi::S32>>()  // src_indices [B]
      .template Arg<ffi::Buffer<ffi::S32>>()            // dst_indices [B]
      .template Arg<ffi::Buffer<ffi::S32>>();           // num_tokens [B]
}

template <typename Binding>
auto BindResults(Binding&& binding) {
  return std::move(binding).template Ret<ffi::AnyBuffer>()  // new dst pool, aliased to operand 0
      .template Ret<ffi::Buffer<ffi::S32>>()            // [B]: the GPU's duplicate scan
      .template Ret<ffi::Buffer<ffi::U8>>();            // staging [B * block bytes] or [0]
}

// One copy: the pool(s), the indices, the results, the options.
template <typename Binding>
auto BindCopy(Binding&& binding) {
  return BindResults(BindIndices(std::forward<Binding>(binding))).template Attrs<CopyOptions>();
}

template <typename Binding>
auto BindLaneCopy(Binding&& binding) {
  return BindIndices(std::forward<Binding>(binding))
      .template Ret<ffi::AnyBuffer>()  // new dst pool
      .template Attrs<LaneOptions>();
}

// The lanes' join: after the binding's one array (any: a pool), the same, aliased, and the
// lanes to wait for.
template <typename Binding>
auto BindJoinLanes(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("lanes");  // bit i: wait for lane i
}

// The wait for onboarded layers: after the binding's one array, the same, aliased, and how many
// of the first layers to wait for.
template <typename Binding>
auto BindWaitLayers(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Ret<ffi::AnyBuffer>()
      .template Attr<int64_t>("layers");
}

// TensorRT-LLM's rule: n <= 0 or n >= tokens copies the whole block. Rows that are not whole
// bytes (odd size_per_head of a 4-bit type) only ever copy whole blocks.
KVXFER_HOST_DEVICE inline int64_t TokensToCopy(int32_t n, const PoolGeometry& g) {
  return (n <= 0 || n >= g.tokens || g.row_bytes == 0) ? g.tokens : n;
}

}  // namespace kvxfer

// The decodings (each struct's members in order; a layered copy passes no hazard_free).
#define KVXFER_ATTR(type, name) xla::ffi::StructMember<type>(name)
#define KVXFER_COPY_ATTRS                                                              \
  KVXFER_ATTR(bool, "unique_dst"), KVXFER_ATTR(int64_t, "max_ctas"), KVXFER_ATTR(bool, "dma"), \
      KVXFER_ATTR(bool, "whole_blocks")
#define KVXFER_LANE_ATTRS                                                                \
  KVXFER_ATTR(int64_t, "lane"), KVXFER_ATTR(int64_t, "wait_lane"),                       \
      KVXFER_ATTR(int64_t, "stream_wait_lane"), KVXFER_ATTR(bool, "whole_blocks"),    \
      KVXFER_ATTR(int64_t, "layer_groups")
#define KVXFER_LAYER_ATTRS \
  KVXFER_ATTR(bool, "offload"), KVXFER_ATTR(xla::ffi::Span<const int64_t>, "views")
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(kvxfer::CopyOptions, KVXFER_COPY_ATTRS,
                                      KVXFER_ATTR(bool, "hazard_free"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(kvxfer::LaneOptions, KVXFER_LANE_ATTRS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(kvxfer::Layered<kvxfer::CopyOptions>, KVXFER_LAYER_ATTRS,
                                      KVXFER_COPY_ATTRS);
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(kvxfer::Layered<kvxfer::LaneOptions>, KVXFER_LAYER_ATTRS,
                                      KVXFER_LANE_ATTRS);
