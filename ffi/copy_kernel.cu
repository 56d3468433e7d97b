// The copy kernel over any batch (indices read on the GPU; SMs busy while it copies), the same
// over a layered copy's parts, the duplicate scan, and their launches. The per-thread work is
// copy_units.cuh's, which the host emulation tests.
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "block_copy_cuda.h"

namespace kvxfer {
namespace {

// The duplicate-destination rule on the GPU ("the later pair wins for the tokens it writes"):
// the most tokens that a later valid pair writing pair i's block copies (0: none), so that pair
// i copies only the tokens above them and no two CTAs write the same bytes. Every thread of a
// kThreads-thread CTA calls it, and every one gets the answer. Written for latency, since in
// the copy kernel it stands before the first load: one barrier answers whether any later pair
// writes the block (the usual case: no), and only then are the matches' token counts read.
__device__ __forceinline__ int32_t LaterWriterTokens(const Batch& b, int64_t i) {
  __shared__ int32_t warp_most[kThreads / 32];
  int64_t s = -1, d = -1;
  if (i < b.num_pairs) {
    s = b.src_idx[i];
    d = b.dst_idx[i];
  }
  bool written_again = false;
  for (int64_t j = i + 1 + threadIdx.x; j < b.num_pairs; j += kThreads) {
    written_again |= b.dst_idx[j] == d;
  }
  if (!__syncthreads_or(IndicesInRange(b, s, d) && written_again)) return 0;
  int32_t most = 0;
  for (int64_t j = i + 1 + threadIdx.x; j < b.num_pairs; j += kThreads) {
    if (b.dst_idx[j] == d && b.src_idx[j] >= 0 && b.src_idx[j] < b.src_blocks) {
      most = max(most, static_cast<int32_t>(PairTokens(b, j)));
    }
  }
  for (int lanes = 16; lanes > 0; lanes /= 2) {
    most = max(most, __shfl_xor_sync(0xffffffffu, most, lanes));
  }
  if (threadIdx.x % 32 == 0) warp_most[threadIdx.x / 32] = most;
  __syncthreads();
  for (int w = 0; w < kThreads / 32; ++w) most = max(most, warp_most[w]);
  return most;
}

// The CTAs walk the work units, blockDim.x / kThreads per CTA, so a capped grid copies the same
// bytes as a full one. `scan`: each CTA (of kThreads, one unit, a grid of exactly the units)
// finds its pair's start itself, which for a small batch costs less than a scan kernel's launch
// before the copy (256 x 16 KiB, n = 1, to the host: 58 -> 86 % of a memcpy).
template <typename V>
__global__ void __launch_bounds__(1024) CopyKernel(Batch b, int64_t units_per_pair, bool scan) {
  if (scan) {
    const int64_t u = blockIdx.x;
    CopyUnit<V>(b, u, units_per_pair, threadIdx.x, LaterWriterTokens(b, u / units_per_pair));
    return;
  }
  const int per_cta = blockDim.x / kThreads;
  const int64_t units = b.num_pairs * units_per_pair;
  for (int64_t u = int64_t{blockIdx.x} * per_cta + threadIdx.x / kThreads; u < units;
       u += int64_t{gridDim.x} * per_cta) {
    CopyUnit<V>(b, u, units_per_pair, threadIdx.x % kThreads);
  }
}

// The same rule for a batch too large for every CTA to scan it: one CTA of kThreads per pair.
__global__ void __launch_bounds__(kThreads) LaterWriterTokensKernel(Batch b, int32_t* superseded) {
  const int32_t most = LaterWriterTokens(b, blockIdx.x);
  if (threadIdx.x == 0) superseded[blockIdx.x] = most;
}

// The copy kernel over the parts of a PartsLaunch (copy_units.cuh), as CopyKernel without the scan.
// __grid_constant__: the parts are read where they were passed, not copied per thread.
template <typename V>
__global__ void __launch_bounds__(1024) PartsKernel(const __grid_constant__ PartsLaunch p) {
  const int per_cta = blockDim.x / kThreads;
  const int64_t units = p.first_unit[p.count];
  for (int64_t u = int64_t{blockIdx.x} * per_cta + threadIdx.x / kThreads; u < units;
       u += int64_t{gridDim.x} * per_cta) {
    const int k = PartOf(p, u);
    CopyUnit<V>(p.part[k], u - p.first_unit[k], p.units_per_pair[k], threadIdx.x % kThreads);
  }
}

constexpr int kMaxDevices = 64;  // SMs per device: ReadSmCounts
int sm_counts[kMaxDevices] = {};

// A wave of the copy kernel's CTAs on the current device (XLA's, while it runs a handler):
// 8 per SM. Only the work split depends on it, never the bytes copied.
int64_t WaveCtas() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) (void)cudaGetLastError();
  const int sms = device >= 0 && device < kMaxDevices ? sm_counts[device] : 0;
  return 8 * int64_t{sms > 0 ? sms : 132};
}

// Whether the copy kernel finds the pairs' starts itself (`scan`): a full grid, and a batch small
// enough that every CTA reading the later pairs' indices (num_pairs^2 * units_per_pair entries
// in all, from L2) costs less than a scan kernel's launch.
bool ScanInCopy(const Batch& b, int64_t units_per_pair, int64_t max_ctas) {
  constexpr int64_t kMaxReads = int64_t{1} << 22;
  return max_ctas <= 0 && b.num_pairs <= kMaxReads / b.num_pairs / units_per_pair;
}

// The grid for `units` work units. Uncapped: one CTA per unit, what a device-to-device copy
// needs to fill HBM. Capped: CTAs of 1024 threads (about an SM each); on an H200, 8 keep PCIe
// busy for whole blocks, leaving the other SMs to compute running beside the copy.
std::pair<unsigned, int> Grid(int64_t units, int64_t max_ctas) {
  const int threads = max_ctas > 0 ? 4 * kThreads : kThreads;
  const int64_t ctas = std::min((units * kThreads + threads - 1) / threads,
                                max_ctas > 0 ? max_ctas : int64_t{1} << 30);
  return {static_cast<unsigned>(ctas), threads};
}

// Calls f with a value of the vector type of `bytes` (VectorBytes: 16, 8, 4 or 1).
template <typename F>
void WithVector(int bytes, F&& f) {
  if (bytes == 16) return f(uint4{});
  if (bytes == 8) return f(uint2{});
  if (bytes == 4) return f(uint32_t{});
  f(uint8_t{});
}

// The duplicate scan in a kernel of its own, before the copy: superseded[i] for pair i.
ffi::Error LaunchScan(cudaStream_t stream, const Batch& b, int32_t* superseded) {
  LaterWriterTokensKernel<<<static_cast<unsigned>(b.num_pairs), kThreads, 0, stream>>>(
      b, superseded);
  return CudaStatus(cudaGetLastError(), "duplicate-scan kernel launch");
}

}  // namespace

ffi::Error LaunchPartsKernel(cudaStream_t stream, const std::vector<Batch>& parts,
                             int64_t max_ctas) {
  const int64_t wave_ctas = WaveCtas();
  for (size_t begin = 0; begin < parts.size();) {
    const size_t end = LaunchEnd(parts, begin);
    const PartsLaunch p = PlanParts(parts.data() + begin, static_cast<int>(end - begin),
                                    wave_ctas);
    if (p.first_unit[p.count] > 0) {
      const std::pair<unsigned, int> grid = Grid(p.first_unit[p.count], max_ctas);
      WithVector(VectorBytes(parts[begin]), [&](auto v) {
        PartsKernel<decltype(v)><<<grid.first, grid.second, 0, stream>>>(p);
      });
      KVXFER_RETURN_IF_ERROR(CudaStatus(cudaGetLastError(), "copy kernel launch (parts)"));
    }
    begin = end;
  }
  return ffi::Error::Success();
}

ffi::Error CopyParts(cudaStream_t stream, std::vector<Batch> parts, int32_t* superseded,
                     bool unique_dst, int64_t max_ctas) {
  if (parts.size() == 1) return CopyBatch(stream, parts[0], superseded, unique_dst, max_ctas);
  if (parts[0].num_pairs > 1 && !unique_dst) {
    // The parts share their pairs and tokens per block, so one scan answers for all of them.
    KVXFER_RETURN_IF_ERROR(LaunchScan(stream, parts[0], superseded));
    for (Batch& part : parts) part.superseded = superseded;
  }
  return LaunchPartsKernel(stream, parts, max_ctas);
}

ffi::Error CopyBatch(cudaStream_t stream, Batch b, int32_t* superseded, bool unique_dst,
                     int64_t max_ctas) {
  const int64_t units_per_pair = UnitsPerPair(b.g, b.num_pairs, b.whole_blocks, WaveCtas());
  const bool scan = b.num_pairs > 1 && !unique_dst;
  const bool scan_in_copy = scan && ScanInCopy(b, units_per_pair, max_ctas);
  if (scan && !scan_in_copy) {
    b.superseded = superseded;
    KVXFER_RETURN_IF_ERROR(LaunchScan(stream, b, superseded));
  }
  // max_ctas > 0 caps the grid (CTAs of 1024 threads), which then never scans in the copy.
  const std::pair<unsigned, int> grid = Grid(b.num_pairs * units_per_pair, max_ctas);
  WithVector(VectorBytes(b), [&](auto v) {
    CopyKernel<decltype(v)><<<grid.first, grid.second, 0, stream>>>(b, units_per_pair,
                                                                     scan_in_copy);
  });
  return CudaStatus(cudaGetLastError(), "copy kernel launch");
}

void ReadSmCounts() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) count = 0;
  for (int d = 0; d < std::min(count, kMaxDevices); ++d) {
    if (cudaDeviceGetAttribute(&sm_counts[d], cudaDevAttrMultiProcessorCount, d) != cudaSuccess) {
      sm_counts[d] = 0;
    }
  }
  (void)cudaGetLastError();  // no GPU here: the handlers are never called
}

}  // namespace kvxfer
