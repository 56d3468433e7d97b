// The copy engines' plan of a batch (copy_units.cuh): the contiguous and strided copies that
// move its bytes, from indices read on the host. Host code, CUDA-free, shared by the CUDA
// module's copy engines (copy_engines.cu), the CPU module's layered copy, which runs it with
// memcpy (block_copy_cpu.cc), and the host emulation (tests/native/copy_units_emulation.cc).
#pragma once

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

}  // namespace kvxfer
