// The per-thread work of the batched copy kernel: which bytes each thread of each work unit
// copies. Shared by the CUDA handler (block_copy_cuda.cu), where the
// device functions run on the GPU, and by a host emulation (tests/native/copy_units_emulation.cc)
// that runs every unit and thread of a launch one after another and checks the bytes against
// a reference, so the index arithmetic is tested on machines without a GPU. Nothing here may
// use CUDA beyond the qualifiers below and the vector types uint2 / uint4.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "block_copy.h"

#if defined(__CUDACC__)
#define KVXFER_DEVICE __device__
#define KVXFER_DEVICE_INLINE __device__ __forceinline__
#else
#define KVXFER_DEVICE
#define KVXFER_DEVICE_INLINE inline
#endif

namespace kvxfer {

constexpr int kThreads = 256;  // threads of one work unit; a CTA holds one or four units
constexpr int kUnroll = 4;     // vector loads in flight per thread
constexpr int64_t kMaxUnitsPerPair = 4096;

// One side of a batch: a pool addressed by the pair's block index, or a staging buffer laid out
// one block per pair (by_pair); slots `stride` bytes apart (the block's bytes, or more where a
// block is one layer's part of a host row holding every layer's).
struct Side {
  char* data;
  int64_t stride;
  bool by_pair;
};

struct Batch {
  Side dst, src;
  const int32_t* src_idx;     // [num_pairs]
  const int32_t* dst_idx;     // [num_pairs]
  const int32_t* num_tokens;  // [num_pairs]; never read when whole_blocks
  // [num_pairs] the tokens of each pair that a later pair writes anyway (LaterWriterTokens),
  // or null where no two pairs write one block
  const int32_t* superseded;
  int64_t num_pairs, src_blocks, dst_blocks;
  PoolGeometry g;
  bool whole_blocks;  // known on the host: every pair copies a whole block
};

// Checks a block copy's pools and indices (CheckPools) and fills `b` with the batch from src's
// blocks to out's (dst's result), each pool's blocks one after another. Host code.
inline ffi::Error PoolBatch(ffi::AnyBuffer dst, ffi::AnyBuffer src, ffi::AnyBuffer out,
                            ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                            ffi::Buffer<ffi::S32> num_tokens, bool whole_blocks, Batch* b) {
  PoolGeometry g;
  int64_t num_pairs = 0;
  KVXFER_RETURN_IF_ERROR(CheckPools(dst, src, out, src_idx, dst_idx, num_tokens, &g, &num_pairs));
  *b = {{static_cast<char*>(out.untyped_data()), g.block_bytes, false},
        {static_cast<char*>(src.untyped_data()), g.block_bytes, false}, src_idx.typed_data(),
        dst_idx.typed_data(), num_tokens.typed_data(), nullptr, num_pairs, src.dimensions()[0],
        dst.dimensions()[0], g, whole_blocks};
  return ffi::Error::Success();
}

// Out-of-range pairs (negative padding or a bad traced index) are skipped, never touched.
KVXFER_HOST_DEVICE inline bool IndicesInRange(const Batch& b, int64_t s, int64_t d) {
  return s >= 0 && s < b.src_blocks && d >= 0 && d < b.dst_blocks;
}

// The tokens pair `pair` copies. A batch known on the host to copy whole blocks never reads
// num_tokens: inside jit it is then a constant that XLA may leave in memory compute-sanitizer's
// initcheck does not see written.
KVXFER_HOST_DEVICE inline int64_t PairTokens(const Batch& b, int64_t pair) {
  return b.whole_blocks ? b.g.tokens : TokensToCopy(b.num_tokens[pair], b.g);
}

// Copies the kUnroll vectors kStep apart from `base` that lie below `end`: all loaded, then
// all stored, so that the loads are in flight together.
template <typename V, int kStep>
KVXFER_DEVICE_INLINE void CopyVectors(V* __restrict__ d, const V* __restrict__ s, int64_t base,
                                      int64_t end) {
  V v[kUnroll];
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (base + k * kStep < end) v[k] = s[base + k * kStep];
  }
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (base + k * kStep < end) d[base + k * kStep] = v[k];
  }
}

// Copies `runs` runs of `per_run` vectors, `pitch` bytes apart: each group of kGroup lanes of a
// warp takes whole runs and its lanes stride along one, so no thread divides to find its run
// and a short run does not leave most of the warp idle. The `stride` threads of this pair take
// the work from `first` (the thread's rank among them).
template <typename V, int kGroup>
KVXFER_DEVICE void CopyShortRuns(char* dst, const char* src, int64_t runs, int64_t per_run,
                                 int64_t pitch, int64_t first, int64_t stride) {
  constexpr int64_t kGroupsPerWarp = 32 / kGroup;
  const int lane = static_cast<int>(first % 32);
  const int64_t run_stride = stride / 32 * kGroupsPerWarp;
  for (int64_t r = first / 32 * kGroupsPerWarp + lane / kGroup; r < runs; r += run_stride) {
    const V* s = reinterpret_cast<const V*>(src + r * pitch);
    V* d = reinterpret_cast<V*>(dst + r * pitch);
    for (int64_t base = lane % kGroup; base < per_run; base += kGroup * kUnroll) {
      CopyVectors<V, kGroup>(d, s, base, per_run);
    }
  }
}

// Copies `runs` runs of `run_bytes` each, `pitch` bytes apart, with vectors of type V, by the
// `stride` threads of this pair from `first` (unit * kThreads + thread).
template <typename V>
KVXFER_DEVICE void CopyRuns(char* dst, const char* src, int64_t runs, int64_t run_bytes,
                            int64_t pitch, int64_t first, int64_t stride) {
  const int64_t per_run = run_bytes / static_cast<int64_t>(sizeof(V));
  if (runs == 1) {
    // A whole block: one contiguous run in chunks of kThreads * kUnroll vectors, each copied by
    // one unit, so that a unit's loads in flight are neighbours (DRAM pages), not `stride`
    // vectors apart.
    constexpr int64_t kChunk = int64_t{kThreads} * kUnroll;
    const int64_t thread = first % kThreads, unit = first / kThreads, units = stride / kThreads;
    for (int64_t base = unit * kChunk + thread; base < per_run; base += units * kChunk) {
      CopyVectors<V, kThreads>(reinterpret_cast<V*>(dst), reinterpret_cast<const V*>(src), base,
                               per_run);
    }
    return;
  }
  // A partial block: one short run per layer, K/V and head, copied by groups of the fewest
  // lanes (a power of two) that cover a run with kUnroll vectors each, but never less than a
  // 128-byte line per group and instruction: over PCIe part of a line costs about as much as
  // the line.
  constexpr int64_t kMinLanes = 128 / sizeof(V) < 32 ? 128 / sizeof(V) : 32;
  if (per_run > 16 * kUnroll || kMinLanes > 16) {
    CopyShortRuns<V, 32>(dst, src, runs, per_run, pitch, first, stride);
  } else if (per_run > 8 * kUnroll || kMinLanes > 8) {
    CopyShortRuns<V, 16>(dst, src, runs, per_run, pitch, first, stride);
  } else {
    CopyShortRuns<V, 8>(dst, src, runs, per_run, pitch, first, stride);
  }
}

// Work unit u in [0, num_pairs * units_per_pair) copies a share of pair u / units_per_pair:
// tokens [start, n) of every run of the block (start: the tokens a later pair writes anyway),
// or the whole block as one run, with vectors of type V (every address and length of the batch
// is aligned to V). `thread` in [0, kThreads). `found_start` >= 0: the start as the unit found it
// itself (the copy kernel that scans), else b.superseded's.
template <typename V>
KVXFER_DEVICE void CopyUnit(const Batch& b, int64_t unit, int64_t units_per_pair, int thread,
                            int64_t found_start = -1) {
  // 32-bit division where both fit (always, in practice): a 64-bit one is a long subroutine
  // on the GPU, standing before the unit's first load.
  const int64_t pair =
      (static_cast<uint64_t>(unit) | static_cast<uint64_t>(units_per_pair)) <= UINT32_MAX
          ? static_cast<uint32_t>(unit) / static_cast<uint32_t>(units_per_pair)
          : unit / units_per_pair;
  if (pair >= b.num_pairs) return;
  // The pair's indices and token counts are loaded together, before any is checked.
  const int64_t s = b.src_idx[pair], d = b.dst_idx[pair];
  const int32_t tokens = b.whole_blocks ? 0 : b.num_tokens[pair];
  const int64_t start = found_start >= 0 ? found_start
                        : b.superseded == nullptr ? 0 : b.superseded[pair];
  if (!IndicesInRange(b, s, d)) return;
  const PoolGeometry& g = b.g;
  const int64_t n = b.whole_blocks ? g.tokens : TokensToCopy(tokens, g);
  if (start >= n) return;

  int64_t runs = 1, run_bytes = g.block_bytes, pitch = 0, offset = 0;
  if (start > 0 || n < g.tokens) {
    runs = g.outer;
    run_bytes = (n - start) * g.row_bytes;
    pitch = g.tokens * g.row_bytes;
    offset = start * g.row_bytes;
  }
  char* dst = b.dst.data + (b.dst.by_pair ? pair : d) * b.dst.stride + offset;
  const char* src = b.src.data + (b.src.by_pair ? pair : s) * b.src.stride + offset;
  const int64_t rank = (unit - pair * units_per_pair) * kThreads + thread;
  CopyRuns<V>(dst, src, runs, run_bytes, pitch, rank, units_per_pair * kThreads);
}

// Work units per pair (any count copies the same bytes). Whole blocks: about 16 KiB each. A
// batch that may copy partial blocks hands each warp whole runs, so it gets fewer: never more
// than the runs fill (further warps would idle), and about one per 64 KiB of block unless that
// leaves the GPU less than `wave_ctas` units in all (a wave: 8 per SM). Host code.
inline int64_t UnitsPerPair(const PoolGeometry& g, int64_t num_pairs, bool whole_blocks,
                            int64_t wave_ctas) {
  const int64_t by_bytes = (g.block_bytes + kThreads * 16 * kUnroll - 1) / (kThreads * 16 * kUnroll);
  if (whole_blocks) return std::clamp<int64_t>(by_bytes, 1, kMaxUnitsPerPair);
  constexpr int64_t kPartialUnitBytes = int64_t{64} << 10;
  const int64_t by_runs = (g.outer + kThreads / 32 - 1) / (kThreads / 32);
  const int64_t by_partial_bytes = (g.block_bytes + kPartialUnitBytes - 1) / kPartialUnitBytes;
  const int64_t one_wave = (wave_ctas + num_pairs - 1) / std::max<int64_t>(num_pairs, 1);
  const int64_t units = std::min({by_bytes, by_runs, std::max(by_partial_bytes, one_wave)});
  return std::clamp<int64_t>(units, 1, kMaxUnitsPerPair);
}

// One launch of the copy kernel over several batches that share their pairs and token counts
// (a layered copy's parts: a layer or K/V slab each, with geometries and buffers of their own):
// part k's work units are [first_unit[k], first_unit[k + 1]) of the launch. One launch instead
// of one per part saves the host a launch per layer and the GPU a ramp per kernel. Passed to the
// kernel by value (about 10 KiB of parameters: Volta and later take 32 KiB).
constexpr int kMaxParts = 64;

struct PartsLaunch {
  Batch part[kMaxParts];
  int64_t units_per_pair[kMaxParts];
  int64_t first_unit[kMaxParts + 1];
  int count;
};
static_assert(sizeof(PartsLaunch) <= 32764, "a kernel's parameters hold at most 32,764 bytes");

// The launch over parts[0, count), 1 <= count <= kMaxParts, on a GPU whose wave holds
// `wave_ctas` CTAs. Host code.
inline PartsLaunch PlanParts(const Batch* parts, int count, int64_t wave_ctas) {
  PartsLaunch p;
  p.count = count;
  p.first_unit[0] = 0;
  for (int k = 0; k < count; ++k) {
    p.part[k] = parts[k];
    p.units_per_pair[k] = UnitsPerPair(parts[k].g, parts[k].num_pairs, parts[k].whole_blocks,
                                       wave_ctas);
    p.first_unit[k + 1] = p.first_unit[k] + parts[k].num_pairs * p.units_per_pair[k];
  }
  return p;
}

// The part that unit u of the launch belongs to (u < first_unit[count]). A linear walk: the
// table is short, and every thread of a CTA reads the same entries.
KVXFER_HOST_DEVICE inline int PartOf(const PartsLaunch& p, int64_t u) {
  int k = 0;
  while (k + 1 < p.count && u >= p.first_unit[k + 1]) ++k;
  return k;
}

// The widest vector (16, 8, 4 or 1 bytes) every address the kernel forms is aligned to: each is
// a pool base plus multiples of the strides and of the block and row sizes. Host code.
inline int VectorBytes(const Batch& b) {
  const uint64_t align = reinterpret_cast<uint64_t>(b.dst.data) |
                         reinterpret_cast<uint64_t>(b.src.data) |
                         static_cast<uint64_t>(b.dst.stride) |
                         static_cast<uint64_t>(b.src.stride) |
                         static_cast<uint64_t>(b.g.block_bytes) |
                         static_cast<uint64_t>(b.g.row_bytes);
  for (int bytes : {16, 8, 4}) {
    if (align % bytes == 0) return bytes;
  }
  return 1;
}

// Where the launch of the copy kernel that starts at parts[begin] ends: up to kMaxParts
// neighbouring parts of one vector width. Host code.
inline size_t LaunchEnd(const std::vector<Batch>& parts, size_t begin) {
  const int bytes = VectorBytes(parts[begin]);
  size_t end = begin + 1;
  while (end < parts.size() && end - begin < kMaxParts && VectorBytes(parts[end]) == bytes) ++end;
  return end;
}

}  // namespace kvxfer
