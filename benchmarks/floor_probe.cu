// Floor probe (issue 4, target 3): how fast can *any* copy of a small device->device batch be on
// this GPU, measured the way the bench measures `ours` (K copies chained on one stream, time per
// copy) against the bench's ceiling (one contiguous cudaMemcpyAsync of the whole batch)? It asks
// whether 80 % of that ceiling is within reach for 256 blocks of 16 and 64 KiB with n = T/2,
// where the library's kernel stops at 46-69 %.
// Standalone CUDA (no JAX, no XLA): GPU time between CUDA events after a spin kernel, median of
// repeats, every ratio against the ceiling of the same run; beside it the host's time to issue
// the chain, per copy.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/floor_probe.cu -o /tmp/floor_probe
//     [-DKVXFER_PROBE_LIBRARY -I ffi -I $(python -c "import jax.ffi; print(jax.ffi.include_dir())")]
//   /tmp/floor_probe [repeats]
//
// Variants, each chained K times on the stream, as one captured graph ("graph") and as a graph
// of child graphs, one per launch ("children": how XLA's command buffers hold custom calls):
//   memcpy          cudaMemcpyAsync of the bytes moved, contiguous (the vendor's copy).
//   empty           a kernel of the same grid that copies nothing (launch and drain alone).
//   contig uU       an SM copy of the bytes moved, contiguous, no indices: the floor of any
//                   kernel that moves these bytes.
//   indexed uU      the copy the batch asks for: 256 scattered blocks, `outer` runs of n rows
//                   each, block indices loaded from device memory before the data.
//   params uU       the same with the indices passed as a kernel parameter (no index load).
//   indexed u4x128  CTAs of 128 threads, 4 vectors each (the library's small units' shape).
//   indexed +div    the pair found by a 64-bit division (as the library's units find it).
//   indexed +tokens each pair's token count read with its indices, bounding the copy.
//   library         the library's general copy units (ffi/copy_units.cuh's CopyUnit, launched
//                   as ffi/block_copy_cuda.cu's LaunchWith launches them for distinct
//                   destinations; since v25 the handler gives such partial batches of up to
//                   1,056 CTAs its lean kernel instead, and the general units only whole
//                   blocks); built only with -DKVXFER_PROBE_LIBRARY and the include paths of
//                   ffi/ and of jax.ffi.include_dir(). Partial copies also as "library x2"
//                   (twice the work units per pair), "library 256" (units of 256 threads, as
//                   the fused-scan kernel has), "library 256 x2" and "library upp1" (one unit
//                   per pair).
//   library lean    the handler's lean kernel (CopyLeanKernel), as it copies a partial batch
//                   with distinct destinations promised; "library lean scan" as it copies the
//                   same batch by default, each CTA scanning for later writers of its pair
//                   and voting after its first two loads (v33); "lean scan first" with the
//                   whole scan before its first loads instead (v27, the fallback's form).
//                   Probe only: "lean early +barrier" (a bare barrier where the vote is),
//                   "lean early vote 1 later" and "lean early vote replicated" (the vote with
//                   its later destination loaded by broadcast, or from a copy per pair): where
//                   the scan's cost goes (LeanStart below).
// The indexed variants are checked against a host reference once.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "probe_timer.h"
#ifdef KVXFER_PROBE_LIBRARY
#include "copy_units.cuh"
#include "later_writer_scan.cuh"
#endif

namespace {

constexpr int kPairs = 256;
constexpr int kThreads = 256;
constexpr int kChain = 32;

struct Geo {
  int64_t outer, tokens, row_bytes;
  int64_t block_bytes() const { return outer * tokens * row_bytes; }
};

struct Indices {
  int src[kPairs], dst[kPairs];
};

__global__ void Empty() {}

// Vectors [U * (blockIdx * threads) + threadIdx + k * threads], contiguous.
template <int U>
__global__ void Contig(uint4* __restrict__ dst, const uint4* __restrict__ src, int64_t vecs) {
  const int64_t base = int64_t{blockIdx.x} * blockDim.x * U + threadIdx.x;
  probe::CopyVectors<U>(dst, src, base, blockDim.x, vecs);
}

// The flat shape: a thread's U vectors lie in one pair (pair_vecs is a multiple of U * threads
// for the geometries below); each vector finds its run by a shift.
struct Partial {
  char* dst;
  const char* src;
  int64_t block_bytes, run_stride;   // bytes
  int64_t row_vecs;                   // vectors per token row
  int run_vecs_log2, pair_vecs_log2;  // vectors per run / per pair moved, powers of two
};

// `moved_vecs`: the vectors of each run to copy (a token count read from memory, "+tokens");
// the others are left alone.
template <int U>
__device__ void CopyPair(const Partial& p, int s, int d, int64_t in_pair, int64_t moved_vecs) {
  const char* sb = p.src + s * p.block_bytes;
  char* db = p.dst + d * p.block_bytes;
  uint4 v[U];
  int64_t off[U];
  bool in[U];
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int64_t vec = in_pair + k * blockDim.x;
    const int64_t run = vec >> p.run_vecs_log2, in_run = vec & ((1 << p.run_vecs_log2) - 1);
    off[k] = run * p.run_stride + in_run * 16;
    in[k] = in_run < moved_vecs;
    if (in[k]) v[k] = *reinterpret_cast<const uint4*>(sb + off[k]);
  }
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (in[k]) *reinterpret_cast<uint4*>(db + off[k]) = v[k];
}

// kDivide: the pair found by a 64-bit division by a run-time count (as the library's units
// find theirs) rather than by a shift. tokens: each pair's token count, read with its indices
// ("+tokens"), or null.
template <int U, bool kDivide = false>
__global__ void Indexed(Partial p, const int* __restrict__ si, const int* __restrict__ di,
                        const int* __restrict__ tokens = nullptr, int64_t ctas_per_pair = 0) {
  const int64_t first = int64_t{blockIdx.x} * blockDim.x * U;
  const int64_t pair = kDivide ? blockIdx.x / ctas_per_pair : first >> p.pair_vecs_log2;
  const int64_t in_pair = (first & ((int64_t{1} << p.pair_vecs_log2) - 1)) + threadIdx.x;
  const int s = si[pair], d = di[pair];
  const int64_t moved = tokens ? tokens[pair] * p.row_vecs : int64_t{1} << p.run_vecs_log2;
  CopyPair<U>(p, s, d, in_pair, moved);
}

template <int U>
__global__ void Params(Partial p, const __grid_constant__ Indices ix) {
  const int64_t first = int64_t{blockIdx.x} * kThreads * U;
  const int pair = static_cast<int>(first >> p.pair_vecs_log2);
  const int64_t in_pair = (first & ((int64_t{1} << p.pair_vecs_log2) - 1)) + threadIdx.x;
  CopyPair<U>(p, ix.src[pair], ix.dst[pair], in_pair, int64_t{1} << p.run_vecs_log2);
}

#ifdef KVXFER_PROBE_LIBRARY
// CopyPairsKernel<uint4, kUnitThreads, false, kUnitThreads> of ffi/block_copy_cuda.cu: one work
// unit per CTA, no duplicate scan.
template <int kUnitThreads>
__global__ void __launch_bounds__(kUnitThreads) Library(kvxfer::Batch b, int64_t units_per_pair) {
  const int64_t units = b.num_pairs * units_per_pair;
  for (int64_t u = blockIdx.x; u < units; u += gridDim.x) {
    kvxfer::CopyUnit<uint4, kUnitThreads>(b, u, units_per_pair, threadIdx.x, 0);
  }
}

// How the lean copy finds where to start: it need not (CopyLeanKernel<false, false> of
// ffi/block_copy_cuda.cu, distinct destinations promised), or by the CTA's scan for later
// writers (the default copy): voting after its first two loads (kScan: CopyLeanKernel<true,
// true>, v33, the handler's), or before its first loads (kScanFirst: CopyLeanKernel<true,
// false>, v27). kEarlyBarrier (probe only): the first form's barrier with no scan (does a CTA
// barrier after the first loads cost at eight CTAs an SM? 10:43: no, 4.07 us against 4.01 at
// 64 KiB T/2).
// kEarlyOneLater and kEarlyReplicated (probe only): the v33 vote with its later destination
// loaded from one address per CTA (dst_idx[pair + 1]: a broadcast, one sector a warp), or from
// a copy of dst_idx[pair + 1 + t] laid out per pair (no two CTAs read the same line): is the
// scan's cost its load's latency, or every CTA reading the same few lines of dst_idx? Both
// answer as the real vote does for the probe's distinct destinations.
enum class LeanStart { kNone, kScan, kScanFirst, kEarlyBarrier, kEarlyOneLater, kEarlyReplicated };

// kEarlyReplicated's array: [pair][t] = dst_idx[pair + 1 + t] (-1 past the batch), set up in main.
__device__ const int32_t* g_replicated_later = nullptr;

// CopyLeanKernel of ffi/block_copy_cuda.cu.
template <bool kScanInCopy, bool kEarlyLoads>
__global__ void __launch_bounds__(kvxfer::kThreads, 8)
    LibraryLean(kvxfer::Batch b, int pair_threads_log2, int lanes_log2) {
  kvxfer::CopyLeanKernelBody<kScanInCopy, kEarlyLoads>(b, pair_threads_log2, lanes_log2);
}

// CopyLeanThread's `begin` for kEarlyBarrier: the answer is 0 after a barrier of the CTA.
struct EarlyBarrierOnly {
  __device__ auto operator()(uint32_t, int64_t, int64_t) const {
    return []() { return __syncthreads_or(0) ? int32_t{-1} : int32_t{0}; };
  }
};

// CopyLeanThread's `begin` for kEarlyOneLater / kEarlyReplicated: the v33 vote with the later
// destination loaded as described above.
template <bool kReplicated>
struct EarlyVoteProbe {
  const kvxfer::Batch& b;
  __device__ __forceinline__ auto operator()(uint32_t i, int64_t s, int64_t d) const {
    const uint32_t j = i + 1 + (kReplicated ? threadIdx.x : 0);
    const int32_t later =
        j >= b.num_pairs ? -1
        : kReplicated    ? g_replicated_later[i * kvxfer::kThreads + threadIdx.x]
                         : b.dst_idx[j];
    const kvxfer::Batch& batch = b;
    return [&batch, i, s, d, later]() { return kvxfer::LaterWriterVote(batch, i, s, d, later); };
  }
};

template <bool kReplicated>
__global__ void __launch_bounds__(kvxfer::kThreads, 8)
    ProbeLeanEarlyVote(kvxfer::Batch b, int pair_threads_log2, int lanes_log2) {
  const uint32_t t = blockIdx.x * kvxfer::kThreads + threadIdx.x;
  if (!kvxfer::CopyLeanThread<uint4, 2>(b, t, pair_threads_log2, lanes_log2,
                                        EarlyVoteProbe<kReplicated>{b})) {
    __trap();  // distinct destinations: the vote always answers 0
  }
}

__global__ void __launch_bounds__(kvxfer::kThreads, 8)
    ProbeLeanEarlyBarrier(kvxfer::Batch b, int pair_threads_log2, int lanes_log2) {
  const uint32_t t = blockIdx.x * kvxfer::kThreads + threadIdx.x;
  kvxfer::CopyLeanThread<uint4, 2>(b, t, pair_threads_log2, lanes_log2, EarlyBarrierOnly{});
}

// The floor probe's rows of the lean kernel.
const std::pair<LeanStart, std::string> kLeanRows[] = {
    {LeanStart::kNone, "library lean"},
    {LeanStart::kScan, "library lean scan"},
    {LeanStart::kScanFirst, "lean scan first"},
    {LeanStart::kEarlyBarrier, "lean early +barrier"},
    {LeanStart::kEarlyOneLater, "lean early vote 1 later"},
    {LeanStart::kEarlyReplicated, "lean early vote replicated"},
};

// Launches the lean kernel as LaunchWith does (the scan only where LeanShapeFor takes a batch
// that scans in the copy); false (nothing launched) where LeanShapeFor declines the batch.
bool LaunchLibraryLean(cudaStream_t stream, kvxfer::Batch b, LeanStart start) {
  b.scan_in_copy = start != LeanStart::kNone;
  kvxfer::LeanShape lean;
  if (!kvxfer::LeanShapeFor(b, 16, 0, &lean)) return false;
  const auto copy = start == LeanStart::kScan               ? LibraryLean<true, true>
                    : start == LeanStart::kScanFirst        ? LibraryLean<true, false>
                    : start == LeanStart::kEarlyBarrier     ? ProbeLeanEarlyBarrier
                    : start == LeanStart::kEarlyOneLater    ? ProbeLeanEarlyVote<false>
                    : start == LeanStart::kEarlyReplicated  ? ProbeLeanEarlyVote<true>
                                                            : LibraryLean<false, false>;
  copy<<<static_cast<unsigned>(lean.ctas), kvxfer::kThreads, 0, stream>>>(
      b, lean.pair_threads_log2, lean.lanes_log2);
  return true;
}

// Launches it as the handler's LaunchWith does for a batch of distinct destinations, with
// `scale` times the work units per pair that UnitsPerPair gives ("library xN"), or with
// `threads` threads per unit instead of the handler's choice.
void LaunchLibrary(cudaStream_t stream, const kvxfer::Batch& b, int64_t scale = 1,
                   int threads = 0) {
  const bool small = threads ? threads == kvxfer::kSmallUnitThreads : kvxfer::SmallUnits(b, 0);
  threads = small ? kvxfer::kSmallUnitThreads : kvxfer::kThreads;
  const int64_t upp = scale * kvxfer::UnitsPerPair(b.g, b.num_pairs, b.whole_blocks, threads);
  const auto ctas = static_cast<unsigned>(b.num_pairs * upp);
  if (small) {
    Library<kvxfer::kSmallUnitThreads><<<ctas, kvxfer::kSmallUnitThreads, 0, stream>>>(b, upp);
  } else {
    Library<kvxfer::kThreads><<<ctas, kvxfer::kThreads, 0, stream>>>(b, upp);
  }
}
#endif

int Log2(int64_t x) {
  int l = 0;
  while ((int64_t{1} << l) < x) ++l;
  if ((int64_t{1} << l) != x) {
    std::fprintf(stderr, "not a power of two: %lld\n", static_cast<long long>(x));
    std::exit(1);
  }
  return l;
}

// How K chained launches are issued: on the stream, replayed from one captured graph (kernel
// nodes), or as XLA records custom calls into its command buffers: each launch captured into a
// graph of its own and added to the parent graph as a child-graph node, chained.
enum class Issue { kStream, kGraph, kChildGraphs };
const char* IssueName(Issue how) {
  return how == Issue::kStream ? " stream" : how == Issue::kGraph ? " graph" : " children";
}

// The host's seconds per copy to issue the last PerCopy's chain (the K launches, or the one
// graph launch), median of the timed samples; < 0 once reported.
double last_host_s = -1;

// Per-copy GPU seconds of K chained launches (and their host cost in last_host_s).
template <typename F>
double PerCopy(probe::Timer& timer, Issue how, F&& launch) {
  std::vector<double> host;
  auto timed = [&](auto&& issue) {
    const auto t0 = std::chrono::steady_clock::now();
    issue();
    host.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  };
  auto median_host = [&] {
    std::sort(host.begin(), host.end());
    last_host_s = host[host.size() / 2] / kChain;
  };
  if (how == Issue::kStream) {
    const double s = timer.Median([&] {
      timed([&] {
        for (int k = 0; k < kChain; ++k) launch();
      });
    }) / kChain;
    median_host();
    return s;
  }
  cudaGraph_t g;
  std::vector<cudaGraph_t> children;
  if (how == Issue::kGraph) {
    CHECK(cudaStreamBeginCapture(timer.stream, cudaStreamCaptureModeThreadLocal));
    for (int k = 0; k < kChain; ++k) launch();
    CHECK(cudaStreamEndCapture(timer.stream, &g));
  } else {
    CHECK(cudaGraphCreate(&g, 0));
    cudaGraphNode_t previous = nullptr;
    for (int k = 0; k < kChain; ++k) {
      cudaGraph_t child;
      CHECK(cudaStreamBeginCapture(timer.stream, cudaStreamCaptureModeThreadLocal));
      launch();
      CHECK(cudaStreamEndCapture(timer.stream, &child));
      cudaGraphNode_t node;
      CHECK(cudaGraphAddChildGraphNode(&node, g, previous ? &previous : nullptr,
                                       previous ? 1 : 0, child));
      previous = node;
      children.push_back(child);
    }
  }
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, g, 0));
  const double s = timer.Median([&] {
    timed([&] { CHECK(cudaGraphLaunch(exec, timer.stream)); });
  }) / kChain;
  median_host();
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(g));
  for (cudaGraph_t child : children) CHECK(cudaGraphDestroy(child));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 21;
  // The bench's 16 and 64 KiB geometries (bf16, row = 64 x 2 bytes): outer runs of T rows.
  const Geo geos[] = {{8, 16, 128}, {16, 32, 128}};
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# floor probe on %s, %d SMs, %d blocks per batch, %d chained copies, median of %d\n",
              prop.name, prop.multiProcessorCount, kPairs, kChain, repeats);

  const int64_t max_bytes = kPairs * (64 << 10);
  char *a, *b;
  CHECK(cudaMalloc(&a, max_bytes));
  CHECK(cudaMalloc(&b, max_bytes));
  std::vector<unsigned char> host(max_bytes);
  std::mt19937 rng(11);
  for (auto& x : host) x = static_cast<unsigned char>(rng());
  CHECK(cudaMemcpy(a, host.data(), max_bytes, cudaMemcpyHostToDevice));
  Indices ix;
  {
    const std::vector<int> s = probe::Shuffled(kPairs, rng), d = probe::Shuffled(kPairs, rng);
    for (int i = 0; i < kPairs; ++i) ix.src[i] = s[i], ix.dst[i] = d[i];
  }
  int* d_si = probe::ToDevice(std::vector<int>(ix.src, ix.src + kPairs));
  int* d_di = probe::ToDevice(std::vector<int>(ix.dst, ix.dst + kPairs));
#ifdef KVXFER_PROBE_LIBRARY
  {
    std::vector<int> later(size_t{kPairs} * kvxfer::kThreads, -1);
    for (int i = 0; i < kPairs; ++i)
      for (int t = 0; i + 1 + t < kPairs && t < kvxfer::kThreads; ++t)
        later[size_t{i} * kvxfer::kThreads + t] = ix.dst[i + 1 + t];
    const int* d_later = probe::ToDevice(later);
    CHECK(cudaMemcpyToSymbol(g_replicated_later, &d_later, sizeof(d_later)));
  }
#endif
  probe::Timer timer = probe::MakeTimer(repeats);
  int failures = 0;

  for (const Geo& geo : geos) {
    const int64_t block = geo.block_bytes(), total = kPairs * block;
    const double ceiling = timer.Median(
        [&] { CHECK(cudaMemcpyAsync(b, a, total, cudaMemcpyDeviceToDevice, timer.stream)); });
    std::printf("%3lld KiB  ceiling (one memcpy of %lld KiB) %7.1f GB/s  %.2f us\n",
                static_cast<long long>(block >> 10), static_cast<long long>(total >> 10),
                total / ceiling / 1e9, ceiling * 1e6);
    for (int64_t n : {geo.tokens, geo.tokens / 2}) {
      const int64_t moved = kPairs * geo.outer * n * geo.row_bytes, vecs = moved / 16;
      int* d_nt = probe::ToDevice(std::vector<int>(kPairs, static_cast<int>(n)));
      const int grid2 = static_cast<int>(vecs / (kThreads * 2));  // CTAs of 256 x 2 vectors
      const Partial p{b, a, block, geo.tokens * geo.row_bytes, geo.row_bytes / 16,
                      Log2(n * geo.row_bytes / 16), Log2(vecs / kPairs)};
#ifdef KVXFER_PROBE_LIBRARY
      kvxfer::Batch lb{{b, false}, {a, false}, d_si, d_di, d_nt, nullptr, kPairs, kPairs, kPairs,
                       kvxfer::PoolGeometry{geo.outer, geo.tokens, geo.row_bytes, block}};
      lb.whole_blocks = n == geo.tokens;
#endif
      auto report = [&](const std::string& what, double s) {
        char host[32] = "";
        if (last_host_s >= 0) std::snprintf(host, sizeof host, "  host %5.2f us/copy", last_host_s * 1e6);
        last_host_s = -1;
        std::printf("%3lld KiB n=%-2lld  %-20s %6.2f us/copy  %7.1f GB/s  %5.1f%% of ceiling%s\n",
                    static_cast<long long>(block >> 10), static_cast<long long>(n), what.c_str(),
                    s * 1e6, moved / s / 1e9, 100.0 * (moved / s) / (total / ceiling), host);
      };
      report("memcpy single", timer.Median([&] {
        CHECK(cudaMemcpyAsync(b, a, moved, cudaMemcpyDeviceToDevice, timer.stream));
      }));
      for (Issue issue : {Issue::kStream, Issue::kGraph, Issue::kChildGraphs}) {
        const std::string how = IssueName(issue);
        report("memcpy" + how, PerCopy(timer, issue, [&] {
                 CHECK(cudaMemcpyAsync(b, a, moved, cudaMemcpyDeviceToDevice, timer.stream));
               }));
        report("empty" + how, PerCopy(timer, issue, [&] {
                 Empty<<<grid2, kThreads, 0, timer.stream>>>();
               }));
        report("contig u2" + how, PerCopy(timer, issue, [&] {
                 Contig<2><<<grid2, kThreads, 0, timer.stream>>>(
                     reinterpret_cast<uint4*>(b), reinterpret_cast<const uint4*>(a), vecs);
               }));
        report("contig u4" + how, PerCopy(timer, issue, [&] {
                 Contig<4><<<grid2 / 2, kThreads, 0, timer.stream>>>(
                     reinterpret_cast<uint4*>(b), reinterpret_cast<const uint4*>(a), vecs);
               }));
        report("indexed u2" + how, PerCopy(timer, issue, [&] {
                 Indexed<2><<<grid2, kThreads, 0, timer.stream>>>(p, d_si, d_di);
               }));
        report("indexed u4x128" + how, PerCopy(timer, issue, [&] {
                 Indexed<4><<<grid2, 128, 0, timer.stream>>>(p, d_si, d_di);
               }));
        report("indexed +div" + how, PerCopy(timer, issue, [&] {
                 Indexed<2, true><<<grid2, kThreads, 0, timer.stream>>>(p, d_si, d_di, nullptr,
                                                                         grid2 / kPairs);
               }));
        report("indexed +tokens" + how, PerCopy(timer, issue, [&] {
                 Indexed<2><<<grid2, kThreads, 0, timer.stream>>>(p, d_si, d_di, d_nt);
               }));
        report("params u2" + how, PerCopy(timer, issue, [&] {
                 Params<2><<<grid2, kThreads, 0, timer.stream>>>(p, ix);
               }));
#ifdef KVXFER_PROBE_LIBRARY
        report("library" + how, PerCopy(timer, issue, [&] { LaunchLibrary(timer.stream, lb); }));
        if (!lb.whole_blocks) {
          report("library x2" + how,
                 PerCopy(timer, issue, [&] { LaunchLibrary(timer.stream, lb, 2); }));
          report("library 256" + how, PerCopy(timer, issue, [&] {
                   LaunchLibrary(timer.stream, lb, 1, kvxfer::kThreads);
                 }));
          report("library 256 x2" + how, PerCopy(timer, issue, [&] {
                   LaunchLibrary(timer.stream, lb, 2, kvxfer::kThreads);
                 }));
          report("library upp1" + how, PerCopy(timer, issue, [&] {
                   Library<kvxfer::kSmallUnitThreads>
                       <<<kPairs, kvxfer::kSmallUnitThreads, 0, timer.stream>>>(lb, 1);
                 }));
          for (const auto& row : kLeanRows) {
            const LeanStart start = row.first;
            if (!LaunchLibraryLean(timer.stream, lb, start)) continue;  // declined: no row
            report(row.second + how,
                   PerCopy(timer, issue, [&] { LaunchLibraryLean(timer.stream, lb, start); }));
          }
        }
#endif
      }
      // Check a copy once: fresh destination, one launch (unless `launch` declines the batch and
      // returns false), compare with the host.
      auto check = [&](auto&& launch) {
        CHECK(cudaMemset(b, 0, max_bytes));
        if (!launch()) return;
        CHECK(cudaDeviceSynchronize());
        std::vector<unsigned char> out(total);
        CHECK(cudaMemcpy(out.data(), b, total, cudaMemcpyDeviceToHost));
        for (int i = 0; i < kPairs; ++i)
          for (int64_t r = 0; r < geo.outer; ++r) {
            const int64_t off = r * geo.tokens * geo.row_bytes, len = n * geo.row_bytes;
            if (std::memcmp(out.data() + ix.dst[i] * block + off,
                            host.data() + ix.src[i] * block + off, len) != 0)
              ++failures;
          }
      };
      check([&] {
        Indexed<2><<<grid2, kThreads>>>(p, d_si, d_di);
        return true;
      });
#ifdef KVXFER_PROBE_LIBRARY
      check([&] {
        LaunchLibrary(0, lb);
        return true;
      });
      for (const auto& row : kLeanRows) {
        check([&] { return LaunchLibraryLean(0, lb, row.first); });
      }
#endif
    }
  }
  std::printf("# done, %d runs differ from the reference\n", failures);
  return failures == 0 ? 0 : 1;
}
