// The copy engines' plan of a batch (copy_units.cuh): the contiguous and strided copies that
// move its bytes, from indices read on the host. Host code, CUDA-free, shared by the CUDA
// module's copy engines (copy_engines.cu), the CPU module's layered copy, which runs it with
// memcpy (block_copy_cpu.cc), and the host emulation (tests/native/copy_units_emulation.cc).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "copy_units.cuh"

namespace kvxfer {

// One copy of the copy engines' plan: `height` rows of `width` bytes, `pitch` bytes apart
// (height 1: a contiguous range, possibly several adjacent blocks).
struct DmaCopy {
  char* dst;
  const char* src;
  size_t width;
  size_t pitch;
  size_t height;
};

// The copy engines' plan for a batch whose indices the handler reads on the host: out-of-range
// pairs skipped as by the kernel, whole blocks adjacent in both contiguous pools merged into one
// copy, a partial block one strided copy, in pair order. Returns whether two valid pairs write
// one block: the copies must then run in this order, so that the later pair wins. Host code.
inline bool PlanDmaCopies(const Batch& b, std::vector<DmaCopy>* out) {
  const PoolGeometry& g = b.g;
  std::vector<DmaCopy>& copies = *out;
  std::vector<bool> written(static_cast<size_t>(b.dst_blocks), false);
  bool duplicates = false, last_whole = false;
  const bool contiguous = b.dst.stride == g.block_bytes && b.src.stride == g.block_bytes;
  int64_t last_s = -2, last_d = -2;
  for (int64_t i = 0; i < b.num_pairs; ++i) {
    const int64_t s = b.src_idx[i], d = b.dst_idx[i];
    if (!IndicesInRange(b, s, d)) continue;
    duplicates = duplicates || written[d];
    written[d] = true;
    const int64_t n = PairTokens(b, i);
    const bool whole = n == g.tokens;
    const int64_t from = b.src.by_pair ? i : s;  // a staged source holds pair i's block at i
    if (whole && last_whole && from == last_s + 1 && d == last_d + 1 && contiguous) {
      copies.back().width += static_cast<size_t>(g.block_bytes);
    } else {
      copies.push_back({b.dst.data + d * b.dst.stride, b.src.data + from * b.src.stride,
                        static_cast<size_t>(whole ? g.block_bytes : n * g.row_bytes),
                        static_cast<size_t>(g.tokens * g.row_bytes),
                        static_cast<size_t>(whole ? 1 : g.outer)});
    }
    last_s = from;
    last_d = d;
    last_whole = whole;
  }
  return duplicates;
}

// A run of a staged onboard's first half: `bytes` from `src` into the staging slots from `pair`'s.
struct StagedRun {
  int64_t pair;
  const char* src;
  size_t bytes;
};

// A staged onboard's first half (lanes_cuda.cu): whole blocks of `b` from its source pool into a
// staging buffer of one `b.g.block_bytes` slot per pair (pair order), one copy per run of pairs
// whose source slots follow each other (the block manager hands host rows out in runs), out-of-
// range pairs skipped; the copy kernel then moves each staged block to its destination. Returns
// false, planning nothing, where two valid pairs write one block (the kernel's launch over parts
// does no duplicate scan) or where there would be more than `max_copies_per_pair` copies per
// valid pair (scattered rows: one copy each straight to its slot is as good). Host code.
inline bool PlanStagedSources(const Batch& b, double max_copies_per_pair,
                              std::vector<StagedRun>* out) {
  const PoolGeometry& g = b.g;
  std::vector<bool> written(static_cast<size_t>(b.dst_blocks), false);
  std::vector<StagedRun> runs;
  const bool contiguous = b.src.stride == g.block_bytes;
  int64_t valid = 0, last_s = -2, last_pair = -2;
  for (int64_t i = 0; i < b.num_pairs; ++i) {
    const int64_t s = b.src_idx[i], d = b.dst_idx[i];
    if (!IndicesInRange(b, s, d)) continue;
    if (written[d]) return false;
    written[d] = true;
    ++valid;
    if (contiguous && s == last_s + 1 && i == last_pair + 1) {
      runs.back().bytes += static_cast<size_t>(g.block_bytes);
    } else {
      runs.push_back({i, b.src.data + s * b.src.stride, static_cast<size_t>(g.block_bytes)});
    }
    last_s = s;
    last_pair = i;
  }
  if (valid == 0 || static_cast<double>(runs.size()) > max_copies_per_pair * valid) return false;
  *out = std::move(runs);
  return true;
}

// The layers of group g of `groups` over `num_layers` layers: [g * L / G, (g + 1) * L / G), as
// near equal as whole layers allow. jax_kvxfer/transfer/_lanes.py spells the same rule.
inline std::pair<int64_t, int64_t> LayerGroupBounds(int64_t g, int64_t groups, int64_t num_layers) {
  return {g * num_layers / groups, (g + 1) * num_layers / groups};
}

// A part of a copy and the layers it holds: `first_layer` and `num_layers` (a pool's batch: all
// of them, its `outer` runs layer by layer; a layered copy's part: one layer's slab).
struct LayeredPart {
  Batch batch;
  int64_t first_layer;
  int64_t num_layers;
};

// An onboard split by layers (lanes_cuda.cu: the model's layer l waits only for its group's
// copies): per group of `groups`, the parts' bytes of that group's layers, and `ends[g]`, the
// layer that group g ends before. A part over several layers is cut into its layers' runs (each
// layer's runs are contiguous in a block, so a group's runs are one range per block, at the
// part's block strides). Returns false, splitting nothing, where a part's runs are not whole
// bytes or not whole layers (a 4-bit pool with odd rows), or `groups` is not in [2, layers].
// Host code.
inline bool SplitLayerGroups(const std::vector<LayeredPart>& parts, int64_t groups,
                             std::vector<std::vector<Batch>>* out, std::vector<int64_t>* ends) {
  int64_t num_layers = 0;
  for (const LayeredPart& p : parts) {
    const PoolGeometry& g = p.batch.g;
    if (p.num_layers < 1 || g.outer % p.num_layers != 0 || (p.num_layers > 1 && g.row_bytes == 0)) {
      return false;
    }
    num_layers = std::max(num_layers, p.first_layer + p.num_layers);
  }
  if (groups < 2 || groups > num_layers) return false;
  out->assign(static_cast<size_t>(groups), {});
  ends->clear();
  for (int64_t k = 0; k < groups; ++k) {
    const auto [lo, hi] = LayerGroupBounds(k, groups, num_layers);
    ends->push_back(hi);
    for (const LayeredPart& p : parts) {
      const int64_t from = std::max(lo, p.first_layer);
      const int64_t to = std::min(hi, p.first_layer + p.num_layers);
      if (from >= to) continue;
      if (to - from == p.num_layers) {
        (*out)[k].push_back(p.batch);
        continue;
      }
      Batch b = p.batch;
      const int64_t runs = b.g.outer / p.num_layers;  // per layer
      const int64_t offset = (from - p.first_layer) * runs * b.g.tokens * b.g.row_bytes;
      b.dst.data += offset;
      b.src.data += offset;
      b.g.outer = (to - from) * runs;
      b.g.block_bytes = b.g.outer * b.g.tokens * b.g.row_bytes;
      (*out)[k].push_back(b);
    }
  }
  return true;
}

}  // namespace kvxfer
