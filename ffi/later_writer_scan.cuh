// The duplicate scan of the copy kernels that find their pairs' later writers themselves (the
// fused kernels, CopyLeanKernel<true, *>) and of SupersededTokensKernel: CUDA device code, so not in
// copy_units.cuh, which the host emulation compiles (it takes the scan's answers from an
// in-order reference instead). Shared by block_copy_cuda.cu and benchmarks/floor_probe.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "copy_units.cuh"

namespace kvxfer {

// The most tokens that a pair after `i` with the same destination writes (0: none): pair i then
// copies only the tokens above that, so the last pair wins without two CTAs writing the same
// bytes. Every thread of a kThreads-thread CTA calls it, and every one gets the answer.
// In the fused kernels this scan stands before the copy's first load (or its first store), so
// it is written for latency: the pair's own indices and the later pairs' destinations are loaded
// with no branch between them (one memory latency, not two), and one barrier that also answers
// whether any of them matches (__syncthreads_or) ends the scan of a block no later pair writes,
// the usual case. Only then are the matches' sources and token counts read, and their maximum
// taken within warps by shuffles, with one more barrier.
__device__ __forceinline__ int32_t LaterWriterTokens(const Batch& b, int64_t i) {
  __shared__ int32_t warp_best[kThreads / 32];
  int32_t s = -1, d = -1;
  if (i < b.num_pairs) {
    s = b.src_idx[i];
    d = b.dst_idx[i];
  }
  bool written_again = false;
  for (int64_t j = i + 1 + threadIdx.x; j < b.num_pairs; j += kThreads) {
    written_again |= b.dst_idx[j] == d;
  }
  if (!__syncthreads_or(IndicesInRange(b, s, d) && written_again)) return 0;
  int32_t m = 0;
  for (int64_t j = i + 1 + threadIdx.x; j < b.num_pairs; j += kThreads) {
    if (b.dst_idx[j] != d) continue;
    const int32_t sj = b.src_idx[j];
    const int32_t nj = b.whole_blocks ? 0 : b.num_tokens[j];  // 0: whole (see PairTokens)
    if (sj >= 0 && sj < b.src_blocks) {  // dj == d is in range (checked above)
      m = max(m, static_cast<int32_t>(TokensToCopy(nj, b.g)));
    }
  }
  for (int lanes = 16; lanes > 0; lanes /= 2) m = max(m, __shfl_xor_sync(0xffffffffu, m, lanes));
  if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = m;
  __syncthreads();
  for (int w = 0; w < kThreads / 32; ++w) m = max(m, warp_best[w]);
  return m;
}

// The vote of LaterWriterTokensInCopy's answer over a kThreads-thread CTA copying pair `i` (s, d:
// its indices), each thread holding the destination of one later pair (`later`, -1 for none):
// 0 where no later pair writes the block, -1 where one does or more later pairs exist than the
// CTA has threads. (benchmarks/floor_probe.cu times it with `later` loaded otherwise.)
__device__ __forceinline__ int32_t LaterWriterVote(const Batch& b, uint32_t i, int64_t s,
                                                   int64_t d, int32_t later) {
  const bool valid = IndicesInRange(b, s, d);
  const bool beyond = i + 1 + kThreads < b.num_pairs;  // the same for the CTA
  return __syncthreads_or((valid && later == d) || beyond) ? int32_t{-1} : int32_t{0};
}

// The scan in the steps of CopyLeanThread's `begin` (a kThreads-thread CTA, all of whose
// threads copy pair `i`): begin loads the one later destination that this thread checks, beside
// the pair's own indices; answer(), asked after the copy's first loads are issued, is the CTA's
// vote (LaterWriterVote): -1 sends the pair to LaterWriterTokens.
struct LaterWriterTokensInCopy {
  const Batch& b;
  // s, d: pair i's own indices as the copy loaded them (-1 past the batch's end).
  __device__ __forceinline__ auto operator()(uint32_t i, int64_t s, int64_t d) const {
    // 32-bit: the lean copy takes at most kLeanResidentCtas pairs.
    const uint32_t j = i + 1 + threadIdx.x;
    const int32_t later = j < b.num_pairs ? b.dst_idx[j] : -1;
    const Batch& batch = b;
    return [&batch, i, s, d, later]() { return LaterWriterVote(batch, i, s, d, later); };
  }
};

// CopyLeanKernel's body (block_copy_cuda.cu; the floor probe's lean rows run it too): thread
// blockIdx.x * kThreads + threadIdx.x of the lean copy (CopyLeanThread). kScanInCopy: every CTA
// lies within one pair and scans for its later writers itself: with kEarlyLoads, by a vote after
// its first two loads (v33), falling back to the whole scan where that cannot tell (rare; every
// thread of the CTA together); without, by the whole scan before its first loads (v27).
template <bool kScanInCopy, bool kEarlyLoads>
__device__ __forceinline__ void CopyLeanKernelBody(const Batch& b, int pair_threads_log2,
                                                   int lanes_log2) {
  const uint32_t t = blockIdx.x * kThreads + threadIdx.x;
  const auto whole_scan = [&](uint32_t pair, int64_t, int64_t) {
    const int32_t start = LaterWriterTokens(b, pair);  // >= 0: never sends the pair back
    return [start]() { return start; };
  };
  if constexpr (kScanInCopy && kEarlyLoads) {
    if (!CopyLeanThread<uint4, 2>(b, t, pair_threads_log2, lanes_log2,
                                  LaterWriterTokensInCopy{b})) {
      CopyLeanThread<uint4>(b, t, pair_threads_log2, lanes_log2, whole_scan);
    }
  } else if constexpr (kScanInCopy) {
    CopyLeanThread<uint4>(b, t, pair_threads_log2, lanes_log2, whole_scan);
  } else {
    CopyLeanThread<uint4>(b, t, pair_threads_log2, lanes_log2,
                          [](uint32_t, int64_t, int64_t) { return []() { return 0; }; });
  }
}

}  // namespace kvxfer
