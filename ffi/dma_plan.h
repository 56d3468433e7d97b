// The copy engines' plan of a batch (copy_units.cuh): the contiguous and strided copies that
// move its bytes, from indices read on the host. Host code, CUDA-free, shared by the CUDA
// module's copy engines (copy_engines.cu), the CPU module's layered copy, which runs it with
// memcpy (block_copy_cpu.cc), and the host emulation (tests/native/copy_units_emulation.cc).
#pragma once

#include <cstddef>
#include <cstdint>
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

}  // namespace kvxfer
