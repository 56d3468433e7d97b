// The per-thread work of the batched copy kernel: which bytes each thread of each work unit
// copies. Shared by the CUDA handler (block_copy_cuda.cu), where every function runs on the GPU,
// and by a host emulation (tests/native/copy_units_emulation.cc), which runs every unit and
// thread of a launch one after another and checks the bytes against a reference, so the index
// arithmetic is tested on machines without a GPU. Nothing here may use CUDA beyond the
// qualifiers below and the vector types uint2 / uint4.
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

constexpr int kThreads = 256;                // threads of one work unit ("virtual CTA")
constexpr int kSmallUnitThreads = 128;       // ... of a large partial batch's units (SmallUnits)
constexpr int kUnroll = 4;                   // vector loads in flight per thread
constexpr int64_t kMaxCtasPerPair = 4096;

// One side of a batch: a pool addressed by the pair's block index, or a staging buffer laid out
// one block per pair (by_pair).
struct Side {
  char* data;
  bool by_pair;
};

struct Batch {
  Side dst, src;
  const int32_t* src_idx;     // [num_pairs]
  const int32_t* dst_idx;     // [num_pairs]
  const int32_t* num_tokens;  // [num_pairs]
  // [num_pairs] tokens a later pair overwrites anyway; with `claims`, [dst_blocks] each block's
  // last writer (ClaimLastWriter) instead; or null
  const int32_t* first;
  int64_t num_pairs, src_blocks, dst_blocks;
  PoolGeometry g;
  bool scan_in_copy = false;  // each CTA finds its pair's `first` itself (FusedScanFits)
  bool whole_blocks = false;  // known on the host: every pair copies a whole block
  bool claims = false;        // `first` holds the claims, each unit finds its start from them
};

// Out-of-range pairs (negative padding or a bad traced index) are skipped, never touched.
KVXFER_HOST_DEVICE inline bool IndicesInRange(const Batch& b, int64_t s, int64_t d) {
  return s >= 0 && s < b.src_blocks && d >= 0 && d < b.dst_blocks;
}
KVXFER_DEVICE_INLINE bool PairValid(const Batch& b, int64_t pair) {
  return IndicesInRange(b, b.src_idx[pair], b.dst_idx[pair]);
}

// The tokens pair `pair` copies. A batch known on the host to copy whole blocks never reads
// num_tokens: it is then a constant of zeros, which inside jit XLA may leave in memory that
// compute-sanitizer's initcheck does not see written (it flagged the scan's reads of it).
KVXFER_HOST_DEVICE inline int64_t PairTokens(const Batch& b, int64_t pair) {
  return b.whole_blocks ? b.g.tokens : TokensToCopy(b.num_tokens[pair], b.g);
}

// The slot of `side`'s pool that pair `pair` reads or writes: its block `index` (idx[pair]), or
// its own slot where the side is a staging buffer laid out by pair.
KVXFER_DEVICE_INLINE int64_t SlotAt(const Side& side, int64_t pair, int64_t index) {
  return side.by_pair ? pair : index;
}
KVXFER_DEVICE_INLINE int64_t SlotOf(const Side& side, const int32_t* idx, int64_t pair) {
  return side.by_pair ? pair : idx[pair];
}

// The last writer of each destination block, for a batch too large for every pair to scan the
// later ones (num_pairs^2 index reads): with last[] first set to -1, each valid pair j raises
// last[dst_idx[j]] to j (`raise_to(address, j)`: atomicMax on the GPU), so that afterwards
// last[d] is the greatest valid pair writing d, and pair i has a later writer exactly when
// last[dst_idx[i]] != i.
template <typename RaiseTo>
KVXFER_DEVICE_INLINE void ClaimLastWriter(const Batch& b, int64_t j, int32_t* last,
                                          RaiseTo raise_to) {
  if (j < b.num_pairs && PairValid(b, j)) raise_to(&last[b.dst_idx[j]], static_cast<int32_t>(j));
}

// What the duplicate scan gives pair i, from the claims (ClaimLastWriter): the most tokens that
// a later valid pair writing the same block copies. Those pairs lie between i and the block's
// last writer, so a pair whose block is not written again reads two entries, and a batch of
// distinct destinations costs num_pairs reads rather than num_pairs^2 / 2.
KVXFER_DEVICE_INLINE int32_t LaterWriterTokensFromClaims(const Batch& b, int64_t i,
                                                         const int32_t* last) {
  if (!PairValid(b, i)) return 0;
  const int32_t d = b.dst_idx[i];
  const int64_t greatest = last[d];
  int64_t most = 0;
  for (int64_t j = i + 1; j <= greatest; ++j) {
    if (b.dst_idx[j] != d || !PairValid(b, j)) continue;
    const int64_t n = PairTokens(b, j);
    most = n > most ? n : most;
  }
  return static_cast<int32_t>(most);
}

// The tokens of pair `pair` that a later pair writes anyway, where its copy starts: the scan's
// answer (`first`), or found from the claims (by every thread of the pair's units: one entry
// read unless the block is written again), or 0 when the batch needs no scan. (The claims share
// `first` rather than a field of their own: a larger Batch changed the fused-scan kernels'
// machine code, and 256 x 64 KiB whole copies lost 6 % of their GPU time with it.)
KVXFER_DEVICE_INLINE int64_t SupersededTokens(const Batch& b, int64_t pair) {
  if (b.first == nullptr) return 0;
  return b.claims ? LaterWriterTokensFromClaims(b, pair, b.first) : b.first[pair];
}

// unit / units_per_pair: the pair a work unit copies. In 32 bits where both fit (always, in
// practice: a grid has at most 2^30 CTAs), since a 64-bit division is a long subroutine on the
// GPU and stands before a unit's first load (benchmarks/floor_probe.cu: 0.1 us of a 2 us copy).
KVXFER_DEVICE_INLINE int64_t PairOfUnit(int64_t unit, int64_t units_per_pair) {
  if ((static_cast<uint64_t>(unit) | static_cast<uint64_t>(units_per_pair)) <= UINT32_MAX) {
    return static_cast<uint32_t>(unit) / static_cast<uint32_t>(units_per_pair);
  }
  return unit / units_per_pair;
}

// Loads / stores the kUnroll vectors kStep apart from `base` that lie below `end`.
template <typename V, int kStep>
KVXFER_DEVICE_INLINE void LoadVectors(V (&v)[kUnroll], const V* s, int64_t base, int64_t end) {
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (base + k * kStep < end) v[k] = s[base + k * kStep];
  }
}
template <typename V, int kStep>
KVXFER_DEVICE_INLINE void StoreVectors(V* d, const V (&v)[kUnroll], int64_t base, int64_t end) {
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (base + k * kStep < end) d[base + k * kStep] = v[k];
  }
}

// Copies those vectors: all loaded, then all stored, so that the loads are in flight together.
template <typename V, int kStep>
KVXFER_DEVICE_INLINE void CopyVectors(V* d, const V* s, int64_t base, int64_t end) {
  V v[kUnroll];
  LoadVectors<V, kStep>(v, s, base, end);
  StoreVectors<V, kStep>(d, v, base, end);
}

// Copies `runs` runs of `per_run` vectors, `pitch` bytes apart: each group of kGroup lanes of a
// warp takes whole runs and its lanes stride along one, so no thread divides to find its run
// and a run of a few vectors (n = 1) does not leave most of the warp idle. The `stride`
// threads of this pair take the work from `first`.
template <typename V, int kGroup>
KVXFER_DEVICE void CopyShortRuns(char* __restrict__ dst, const char* __restrict__ src, int64_t runs,
                              int64_t per_run, int64_t pitch, int64_t first, int64_t stride) {
  constexpr int64_t kGroupsPerWarp = 32 / kGroup;
  const int lane = static_cast<int>(first % 32);
  const int64_t run_stride = stride / 32 * kGroupsPerWarp;
  for (int64_t r = first / 32 * kGroupsPerWarp + lane / kGroup; r < runs; r += run_stride) {
    const V* __restrict__ s = reinterpret_cast<const V*>(src + r * pitch);
    V* __restrict__ d = reinterpret_cast<V*>(dst + r * pitch);
    for (int64_t base = lane % kGroup; base < per_run; base += kGroup * kUnroll) {
      CopyVectors<V, kGroup>(d, s, base, per_run);
    }
  }
}

// Copies `runs` runs of `run_bytes` each, `pitch` bytes apart, using vectors of type V. The
// `stride` threads of this pair take the work from `first` (the thread's rank among them).
template <typename V, int kUnitThreads>
KVXFER_DEVICE void CopyRuns(char* __restrict__ dst, const char* __restrict__ src, int64_t runs,
                         int64_t run_bytes, int64_t pitch, int64_t first, int64_t stride) {
  const int64_t per_run = run_bytes / sizeof(V);
  if (runs == 1) {
    // A whole block: one contiguous run, in chunks of kUnitThreads * kUnroll vectors, each read
    // and written by one work unit, so that a unit's loads in flight are neighbours (DRAM pages)
    // rather than `stride` vectors apart. `first` is unit * kUnitThreads + thread and `stride`
    // units * kUnitThreads (CopyUnit).
    constexpr int64_t kChunk = int64_t{kUnitThreads} * kUnroll;
    const int64_t thread = first % kUnitThreads, unit = first / kUnitThreads;
    const int64_t units = stride / kUnitThreads;
    const V* __restrict__ s = reinterpret_cast<const V*>(src);
    V* __restrict__ d = reinterpret_cast<V*>(dst);
    for (int64_t base = unit * kChunk + thread; base < per_run; base += units * kChunk) {
      CopyVectors<V, kUnitThreads>(d, s, base, per_run);
    }
    return;
  }
  // A partial block: `runs` short runs (one per layer, K/V and head), copied by lane groups of a
  // power of two lanes: a constant per loop, so the index arithmetic of these device-speed loops
  // stays shifts and masks. The fewest lanes that cover a run with kUnroll vectors each (more
  // bytes in flight per thread: 256 x 256 KiB T/2 +4-7 points), but never less than a 128-byte
  // line per group and instruction (over PCIe a part of a line costs about as much as the line:
  // in groups of 2 lanes, 4,096 x 64 KiB n = 1 lost 10-16 points device to host).
  // (16-byte vectors: 8 lanes at least; narrower vectors need more lanes for a line.)
  constexpr int64_t kMinLanes = 128 / sizeof(V) < 32 ? 128 / sizeof(V) : 32;
  static_assert(kMinLanes >= 8);
  if (per_run > 16 * kUnroll || kMinLanes > 16) {
    CopyShortRuns<V, 32>(dst, src, runs, per_run, pitch, first, stride);
  } else if (per_run > 8 * kUnroll || kMinLanes > 8) {
    CopyShortRuns<V, 16>(dst, src, runs, per_run, pitch, first, stride);
  } else {
    CopyShortRuns<V, 8>(dst, src, runs, per_run, pitch, first, stride);
  }
}

// Work unit u in [0, num_pairs * units_per_pair) copies a strided share of pair
// u / units_per_pair: tokens [start, n) of every run of the block (start: the tokens a later
// pair writes anyway), or the whole block as one run, with vectors of type V (every address and
// length of the batch is aligned to V). kUnitThreads threads per unit.
template <typename V, int kUnitThreads = kThreads>
KVXFER_DEVICE void CopyUnit(const Batch& b, int64_t unit, int64_t units_per_pair, int thread,
                         int64_t start) {
  const int64_t pair = PairOfUnit(unit, units_per_pair);
  const int64_t cta = unit - pair * units_per_pair;
  if (pair >= b.num_pairs) return;
  // The pair's indices and its token count are loaded together, before the indices are checked
  // (PairValid, then PairTokens, would wait for one memory latency, then for another).
  const int64_t s = b.src_idx[pair], d = b.dst_idx[pair];
  const int32_t tokens = b.whole_blocks ? 0 : b.num_tokens[pair];
  if (!IndicesInRange(b, s, d)) return;
  const PoolGeometry& g = b.g;
  const int64_t n = b.whole_blocks ? g.tokens : TokensToCopy(tokens, g);  // PairTokens
  if (start >= n) return;

  int64_t runs = 1, run_bytes = g.block_bytes, pitch = 0, offset = 0;
  if (start > 0 || n < g.tokens) {
    runs = g.outer;
    run_bytes = (n - start) * g.row_bytes;
    pitch = g.tokens * g.row_bytes;
    offset = start * g.row_bytes;
  }
  char* dst = b.dst.data + SlotAt(b.dst, pair, d) * g.block_bytes + offset;
  const char* src = b.src.data + SlotAt(b.src, pair, s) * g.block_bytes + offset;
  CopyRuns<V, kUnitThreads>(dst, src, runs, run_bytes, pitch, cta * kUnitThreads + thread,
                            units_per_pair * kUnitThreads);
}

// A work unit of a batch known to copy whole blocks, in the kernel that scans for later
// writers itself: the unit's first chunk is loaded before `superseded()` answers (the scan:
// whether a later pair writes the same block; every thread of the unit calls it, together), so
// the scan's latency hides behind the loads, and the chunk is stored unless the block is
// superseded. The same bytes as CopyUnit with start 0 or T; at 16-64 KiB a unit's whole share
// is that one chunk. kThreads threads per unit.
template <typename V, typename Superseded>
KVXFER_DEVICE void CopyWholeUnit(const Batch& b, int64_t unit, int64_t units_per_pair, int thread,
                              Superseded superseded) {
  constexpr int64_t kChunk = int64_t{kThreads} * kUnroll;
  const int64_t pair = PairOfUnit(unit, units_per_pair);
  const bool valid = pair < b.num_pairs && PairValid(b, pair);
  const int64_t per_block = b.g.block_bytes / static_cast<int64_t>(sizeof(V));
  const int64_t step = units_per_pair * kChunk;
  int64_t base = (unit - pair * units_per_pair) * kChunk + thread;
  const V* __restrict__ s = nullptr;
  V* __restrict__ d = nullptr;
  V v[kUnroll];
  if (valid) {
    s = reinterpret_cast<const V*>(b.src.data +
                                   SlotOf(b.src, b.src_idx, pair) * b.g.block_bytes);
    d = reinterpret_cast<V*>(b.dst.data + SlotOf(b.dst, b.dst_idx, pair) * b.g.block_bytes);
    LoadVectors<V, kThreads>(v, s, base, per_block);
  }
  if (superseded() || !valid) return;
  while (true) {
    StoreVectors<V, kThreads>(d, v, base, per_block);
    base += step;
    if (base >= per_block) return;
    LoadVectors<V, kThreads>(v, s, base, per_block);
  }
}

// The widest vector (16, 8, 4 or 1 bytes) every address the kernel forms is aligned to: each is
// a pool base plus multiples of the block and row sizes. Host code.
inline int VectorBytes(const Batch& b) {
  const uint64_t align = reinterpret_cast<uint64_t>(b.dst.data) |
                         reinterpret_cast<uint64_t>(b.src.data) |
                         static_cast<uint64_t>(b.g.block_bytes) |
                         static_cast<uint64_t>(b.g.row_bytes);
  for (int bytes : {16, 8, 4}) {
    if (align % bytes == 0) return bytes;
  }
  return 1;
}

// Work units of `unit_threads` threads (kThreads, or kSmallUnitThreads: SmallUnits) per pair. A
// batch known to copy whole blocks: about 16 KiB of the block each (at kThreads). A partial
// copy hands each warp whole runs, so a batch that may copy partial blocks gets fewer (any count
// copies the same bytes):
//  - never more than the block's runs fill, one warp each: further warps would idle (v11, and
//    v13b: 64 KiB T-1 74 -> 86 % of the memcpy in GPU time);
//  - about one per 64 KiB of block (a warp copies ~4 KiB at n = T/2), unless the batch would
//    then fill less than one wave of CTAs: every CTA also scans the batch for later writers
//    (v13: at 256 KiB T/2, 5 units per pair instead of 16 took 69 -> 88 %).
// Whole blocks keep more units: 16 instead of 64 per 1 MiB block cost 4 points in v11.
constexpr int64_t kOneWaveCtas = 1056;  // H200: 132 SMs x 8 CTAs of kThreads threads
inline int64_t UnitsPerPair(const PoolGeometry& g, int64_t num_pairs, bool whole_blocks,
                            int64_t unit_threads = kThreads) {
  const int64_t warps = unit_threads / 32;
  constexpr int64_t kPartialUnitBytes = int64_t{64} << 10;
  const int64_t per_unit = unit_threads * 16 * kUnroll;
  const int64_t by_bytes = (g.block_bytes + per_unit - 1) / per_unit;
  if (whole_blocks) return std::clamp<int64_t>(by_bytes, 1, kMaxCtasPerPair);
  const int64_t by_runs = (g.outer + warps - 1) / warps;
  const int64_t by_partial_bytes = (g.block_bytes + kPartialUnitBytes - 1) / kPartialUnitBytes;
  const int64_t one_wave = (kOneWaveCtas + num_pairs - 1) / std::max<int64_t>(num_pairs, 1);
  const int64_t units = std::min({by_bytes, by_runs, std::max(by_partial_bytes, one_wave)});
  return std::clamp<int64_t>(units, 1, kMaxCtasPerPair);
}

// Whether a batch's units are kSmallUnitThreads threads: a partial batch copied with one CTA per
// unit and without the fused scan, too large for its kThreads-thread units to be resident at
// once. A 16 KiB block at n = T/2 (8 KiB) fills only 128 threads at kUnroll vectors each
// (CopyRuns' lane rule), so a 256-thread unit idles half its threads and an SM holds 4 such
// units (56 registers); a small unit holds the same 8 KiB with all its threads, and an SM holds
// 9 of them (v21: 4,096 x 16 KiB T/2 62 -> 80 % of the memcpy). A batch whose kThreads-thread
// units all fit at once keeps them: it is bound by one unit's latency, and more, smaller CTAs
// only add launch work (v24, replayed from a graph: 256 x 16 KiB T/2 2.39 -> 2.29 us a copy,
// where the second small unit of each pair found no run to copy; 64 KiB T/2 within 0.06 us).
// The fused kernels keep kThreads too. Host code.
// H200: 132 SMs x 4 CTAs of kThreads threads, as the copy kernels' 56-58 registers per thread
// allow (kOneWaveCtas counts the 8 that the thread limit would; UnitsPerPair was tuned with it).
constexpr int64_t kResidentCtas = 528;
inline bool SmallUnits(const Batch& b, int64_t max_ctas) {
  return !b.whole_blocks && !b.scan_in_copy && max_ctas <= 0 &&
         b.num_pairs > kResidentCtas / UnitsPerPair(b.g, b.num_pairs, false);
}

// -- Lean partial copies (v25, v26) ---------------------------------------------------------
// A partial batch with nothing to scan (distinct destinations promised, one pair, or the staging
// gather) or whose copy scans for later writers itself with at least kThreads threads per pair
// (v26), 16-byte vectors, and few enough threads that the GPU holds them all at once: each pair
// gets P threads (a power of two, a quarter of the block's vectors: two vectors a thread at
// n = T/2), each run of the block G = P / runs lanes (a power of two, at least 8: a 128-byte
// line per group and instruction), and a lane copies the run's vectors lane, lane + G, ...,
// kUnroll of them per pass. A thread finds its pair, run and lane by shifts and masks and
// addresses a block in 32 bits, so the kernel stays within 32 registers (8 CTAs of kThreads per
// SM). The general units are sized for whole runs, since the host does not know n, and a
// 256 x 64 KiB batch at T/2 then gives each thread four vectors; a copy of the same runs with
// two vectors a thread took 3.6-3.8 us against their 4.1 (benchmarks/floor_probe.cu). v25,
// device to device with distinct destinations: 256 x 16 KiB T/2 61 -> 66-72 % of the memcpy in
// GPU time, 64 KiB T/2 79 -> 82 %; the host directions unchanged. v26, the default copy (the
// scan fused in) device to device: 256 x 64 KiB T/2 67-70 -> 69-73 %, T-1 88-92 -> 95-100 %;
// n = 1 (not a target) 7 -> 5.5 %. v27, the scan's loads issued in the same memory latency as
// the pair's own (before the branch on its indices, where v26 had them after): 64 KiB T/2
// 72 -> 73-78 %, 16 KiB T/2 56-57 -> 59-64 %. v33, the first two loads issued before the scan's
// vote, with no spill on the hot path (later_writer_scan.cuh's CopyLeanKernelBody): graph
// replay, T/2, 64 KiB 4.46 us a copy and 16 KiB 2.42, against 4.68 and 2.66 with the whole scan
// before the loads.
struct LeanShape {
  int pair_threads_log2 = 0;  // P = 2^pair_threads_log2 threads per pair
  int lanes_log2 = 0;         // G = 2^lanes_log2 lanes per run
  int64_t ctas = 0;           // the grid: num_pairs * P threads in CTAs of kThreads
};
// H200: 132 SMs x 8 CTAs of kThreads threads at <= 32 registers a thread.
constexpr int64_t kLeanResidentCtas = 1056;

// Whether the batch takes the lean copy, and its shape. Host code.
inline bool LeanShapeFor(const Batch& b, int vector_bytes, int64_t max_ctas, LeanShape* shape) {
  const PoolGeometry& g = b.g;
  if (b.whole_blocks || max_ctas > 0 || vector_bytes != 16 || g.row_bytes <= 0 ||
      g.outer <= 0 || b.num_pairs <= 0) {
    return false;
  }
  // A batch whose copy scans for later writers itself (the handler leaves `first` null then;
  // the host emulation passes the scan's answers in it) needs every CTA within one pair (P >=
  // kThreads), for the scan's barrier; any other batch must need no scan.
  if (!b.scan_in_copy && b.first != nullptr) return false;
  const int64_t vectors = g.block_bytes / 16;
  int p = 0;
  while ((int64_t{1} << p) * kUnroll < vectors) ++p;
  int lanes = 0;
  while ((int64_t{2} << lanes) * g.outer <= (int64_t{1} << p)) ++lanes;
  constexpr int kMinLanesLog2 = 3;  // 8 lanes x 16 bytes: a 128-byte line
  const int64_t ctas = (b.num_pairs * (int64_t{1} << p) + kThreads - 1) / kThreads;
  // The grid's bound also keeps P <= 2^18, so a block's vectors (<= 4P) fit the thread's
  // 32-bit offsets.
  if (lanes < kMinLanesLog2 || ctas > kLeanResidentCtas) return false;
  // With P >= kThreads, num_pairs <= ctas <= 1,056: each CTA's scan reads at most that many
  // later pairs.
  if (b.scan_in_copy && (int64_t{1} << p) < kThreads) return false;
  *shape = {p, lanes, ctas};
  return true;
}

// Thread `t` of the lean copy's grid (LeanShapeFor): pair t >> pair_threads_log2, run and lane
// from the rest. Copies tokens [start, n) of that run, where start is the tokens a later pair
// writes anyway, asked in two steps: `begin(pair, s, d)`, called by every thread right after the
// pair's own indices are loaded (s, d: those indices, -1 past the batch's end), returns
// `answer`; answer(), called by every thread (also those with nothing to copy) after the first
// kEarlyLoads loads are issued, gives start, or -1 where it cannot tell cheaply. Then the thread
// stores nothing and returns false, and the caller copies the pair again in a form whose answer
// is always the start (the same for every thread of the CTA: in the kernels that scan
// themselves the answer is a barrier of the CTA, whose threads all copy one pair). The scan's
// two forms: all of it in begin, before any load (v27), or one load in begin and the vote in
// answer (v33). Holding the first loads across the whole scan took 48 registers a thread (v26's
// "B"); a call of the whole scan on the rare path made the hot path spill to local memory (v32).
template <typename V, int kEarlyLoads = kUnroll, typename Begin>
KVXFER_DEVICE_INLINE bool CopyLeanThread(const Batch& b, uint32_t t, int pair_threads_log2,
                                         int lanes_log2, Begin begin) {
  const uint32_t pair = t >> pair_threads_log2;
  const uint32_t rank = t & ((1u << pair_threads_log2) - 1);
  const uint32_t run = rank >> lanes_log2, lane = rank & ((1u << lanes_log2) - 1);
  const uint32_t row_vectors = static_cast<uint32_t>(b.g.row_bytes / sizeof(V));
  // The pair's indices and token count, loaded together, and the scan's loads with them: no
  // branch on a loaded value stands between them (one memory latency, not two).
  int64_t s = -1, d = -1;
  int32_t tokens = 0;
  if (pair < b.num_pairs) {
    s = b.src_idx[pair];
    d = b.dst_idx[pair];
    tokens = b.num_tokens[pair];
  }
  const auto answer = begin(pair, s, d);
  uint32_t per_run = 0;  // the vectors of this thread's run that the pair copies
  const V* __restrict__ src = nullptr;
  V* __restrict__ dst = nullptr;
  if (run < b.g.outer && IndicesInRange(b, s, d)) {
    per_run = static_cast<uint32_t>(TokensToCopy(tokens, b.g)) * row_vectors;
    const uint32_t first = run * static_cast<uint32_t>(b.g.tokens) * row_vectors;
    src = reinterpret_cast<const V*>(b.src.data + SlotAt(b.src, pair, s) * b.g.block_bytes) + first;
    dst = reinterpret_cast<V*>(b.dst.data + SlotAt(b.dst, pair, d) * b.g.block_bytes) + first;
  }
  const uint32_t lanes = 1u << lanes_log2;
  V v[kUnroll];
  uint32_t base = lane;
#pragma unroll
  for (int k = 0; k < kEarlyLoads; ++k) {
    if (base + k * lanes < per_run) v[k] = src[base + k * lanes];
  }
  const int32_t start = answer();
  if (start < 0) return false;  // rare: a later pair writes the same block, or the batch is long
#pragma unroll
  for (int k = kEarlyLoads; k < kUnroll; ++k) {
    if (base + k * lanes < per_run) v[k] = src[base + k * lanes];
  }
  const uint32_t from = static_cast<uint32_t>(start) * row_vectors;
  while (base < per_run) {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const uint32_t at = base + k * lanes;
      if (at >= from && at < per_run) dst[at] = v[k];
    }
    base += lanes * kUnroll;
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (base + k * lanes < per_run) v[k] = src[base + k * lanes];
    }
  }
  return true;
}

// One copy of the copy engines' plan: `height` rows of `width` bytes, `pitch` bytes apart
// (height 1: a contiguous range, possibly several adjacent blocks).
struct DmaCopy {
  char* dst;
  const char* src;
  size_t width;
  size_t pitch;
  size_t height;
};

// The copy engines' plan for a batch (dma=true; the handler reads the indices on the host):
// out-of-range pairs skipped as by the kernel, whole blocks adjacent in both pools merged into
// one copy, a partial block one strided copy, in pair order. Returns whether two valid pairs
// write one block (the copies must then run in this order). Host code.
inline bool PlanDmaCopies(const Batch& b, std::vector<DmaCopy>* out) {
  const PoolGeometry& g = b.g;
  std::vector<DmaCopy>& copies = *out;
  std::vector<bool> written(static_cast<size_t>(b.dst_blocks), false);
  bool duplicates = false;
  int64_t last_s = -2, last_d = -2;
  bool last_whole = false;
  for (int64_t i = 0; i < b.num_pairs; ++i) {
    const int64_t s = b.src_idx[i], d = b.dst_idx[i];
    if (!IndicesInRange(b, s, d)) continue;
    duplicates = duplicates || written[d];
    written[d] = true;
    const int64_t n = PairTokens(b, i);
    const bool whole = n == g.tokens;
    const int64_t from = b.src.by_pair ? i : s;  // a staged source holds pair i's block at i
    if (whole && last_whole && from == last_s + 1 && d == last_d + 1) {
      copies.back().width += static_cast<size_t>(g.block_bytes);
    } else if (whole) {
      copies.push_back({b.dst.data + d * g.block_bytes, b.src.data + from * g.block_bytes,
                        static_cast<size_t>(g.block_bytes), 0, 1});
    } else {
      copies.push_back({b.dst.data + d * g.block_bytes, b.src.data + from * g.block_bytes,
                        static_cast<size_t>(n * g.row_bytes),
                        static_cast<size_t>(g.tokens * g.row_bytes),
                        static_cast<size_t>(g.outer)});
    }
    last_s = from;
    last_d = d;
    last_whole = whole;
  }
  return duplicates;
}

}  // namespace kvxfer
