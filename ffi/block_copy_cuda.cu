// CUDA handler of the jax_kvxfer block copy: one call copies a whole batch of (partial) blocks.
//
// Pools may live in device memory or in pinned host memory (XLA hands a `pinned_host` operand's
// host pointer to the handler); the kernel reaches both through unified addressing.
//
// Two ways to copy:
//  - the copy kernel (CopyKernel): any batch; it reads the indices on the GPU, and its loads
//    and stores occupy SMs for as long as the copy lasts. Where destinations may repeat, a
//    scan kernel (LaterWriterTokensKernel) first finds what a later pair overwrites anyway;
//  - the copy engines (dma=true): cudaMemcpyBatchAsync / cudaMemcpy2DAsync, no SMs. Only
//    between device and pinned host memory, and only when the index arrays (and the token
//    counts, unless every pair copies whole blocks) are in pinned host memory: the handler
//    reads them on the host while it enqueues the copies. They must therefore hold their final
//    values when the program is dispatched (jit arguments written on the host, as the manager's
//    plan ring is), and these handlers must never be recorded into a CUDA graph, which would
//    replay the first call's indices.
#include "block_copy_cuda.h"
#include "targets.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace nb = nanobind;
namespace kvxfer {

std::atomic<int64_t> dma_batches{0};

bool IsHostMemory(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer CUDA knows: clear the error
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

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

// SMs per device, read when the module loads: the handlers run inside CUDA graph capture, where
// device queries are not allowed.
constexpr int kMaxDevices = 64;
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

template <typename V>
void LaunchWith(cudaStream_t stream, const Batch& b, int64_t max_ctas, bool scan) {
  const int64_t units_per_pair = UnitsPerPair(b.g, b.num_pairs, b.whole_blocks, WaveCtas());
  const auto [ctas, threads] = Grid(b.num_pairs * units_per_pair, max_ctas);
  CopyKernel<V><<<ctas, threads, 0, stream>>>(b, units_per_pair, scan);
}

template <typename V>
void LaunchPartsWith(cudaStream_t stream, const PartsLaunch& p, int64_t max_ctas) {
  const auto [ctas, threads] = Grid(p.first_unit[p.count], max_ctas);
  PartsKernel<V><<<ctas, threads, 0, stream>>>(p);
}

// Calls f with a value of the vector type of `bytes` (VectorBytes: 16, 8, 4 or 1).
template <typename F>
void WithVector(int bytes, F&& f) {
  switch (bytes) {
    case 16:
      return f(uint4{});
    case 8:
      return f(uint2{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint8_t{});
  }
}

// The copy kernel over batch `b` on `stream`; max_ctas > 0 caps the grid (CTAs of 1024 threads).
// `scan`: the kernel applies the duplicate-destination rule itself (an uncapped grid only).
ffi::Error LaunchCopyKernel(cudaStream_t stream, const Batch& b, int64_t max_ctas,
                            bool scan = false) {
  WithVector(VectorBytes(b), [&](auto v) { LaunchWith<decltype(v)>(stream, b, max_ctas, scan); });
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "copy kernel launch");
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
      WithVector(VectorBytes(parts[begin]),
                 [&](auto v) { LaunchPartsWith<decltype(v)>(stream, p, max_ctas); });
      if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
        return CudaError(err, "copy kernel launch (parts)");
      }
    }
    begin = end;
  }
  return ffi::Error::Success();
}

ffi::Error CopyParts(cudaStream_t stream, std::vector<Batch> parts, int32_t* superseded,
                     bool unique_dst, int64_t max_ctas) {
  if (parts.size() == 1) return CopyBatch(stream, parts[0], superseded, unique_dst, max_ctas);
  const Batch& first = parts[0];
  if (first.num_pairs > 1 && !unique_dst) {
    // The parts share their pairs and tokens per block, so one scan answers for all of them.
    LaterWriterTokensKernel<<<static_cast<unsigned>(first.num_pairs), kThreads, 0, stream>>>(
        first, superseded);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
      return CudaError(err, "duplicate-scan kernel launch");
    }
    for (Batch& part : parts) part.superseded = superseded;
  }
  return LaunchPartsKernel(stream, parts, max_ctas);
}

namespace {

cudaError_t EnqueueOne(cudaStream_t stream, const DmaCopy& c) {
  if (c.height == 1) return cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDefault, stream);
  return cudaMemcpy2DAsync(c.dst, c.pitch, c.src, c.pitch, c.width, c.height, cudaMemcpyDefault,
                           stream);
}

// Copies per batch call. The copy engines start after the first call and then run while the
// host enqueues the rest. Measured on the H200 (CUDA 13), 2,048 copies of 64 KiB: 0.5 us of host
// time per copy in calls of 256 (0.7 us in calls of 64); one call of all 2,048 delays the start
// (37 GB/s instead of 52).
constexpr size_t kCopiesPerBatchCall = 256;

// Contiguous copies in any order, as batches where the runtime has batched copies.
cudaError_t EnqueueBatch(cudaStream_t stream, std::vector<void*>& dsts,
                         std::vector<const void*>& srcs, std::vector<size_t>& sizes) {
#if CUDART_VERSION >= 13000
  if (sizes.size() > 1) {
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // earlier work may write the source
    size_t attr_index = 0;
    cudaError_t err = cudaSuccess;
    for (size_t k = 0; k < sizes.size() && err == cudaSuccess; k += kCopiesPerBatchCall) {
      const size_t count = std::min(kCopiesPerBatchCall, sizes.size() - k);
      err = cudaMemcpyBatchAsync(dsts.data() + k, srcs.data() + k, sizes.data() + k, count,
                                 &attr, &attr_index, 1, stream);
      if (k == 0 && (err == cudaErrorNotSupported || err == cudaErrorInvalidValue)) break;
    }
    if (err != cudaErrorNotSupported && err != cudaErrorInvalidValue) return err;
    (void)cudaGetLastError();  // no batched copies here: one copy each, below
  }
#endif
  for (size_t k = 0; k < sizes.size(); ++k) {
    if (cudaError_t err = cudaMemcpyAsync(dsts[k], srcs[k], sizes[k], cudaMemcpyDefault, stream);
        err != cudaSuccess) {
      return err;
    }
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t EnqueueDmaCopies(cudaStream_t stream, const std::vector<Batch>& parts, bool in_order) {
  // The parts write bytes of their own, so their plans run in any order relative to each other,
  // one after another where a part's own pairs must keep theirs.
  std::vector<DmaCopy> copies;
  for (const Batch& part : parts) in_order = PlanDmaCopies(part, &copies) || in_order;
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (const DmaCopy& c : copies) {
    if (in_order || c.height != 1) {
      if (cudaError_t err = EnqueueOne(stream, c); err != cudaSuccess) return err;
      continue;
    }
    dsts.push_back(c.dst);
    srcs.push_back(c.src);
    sizes.push_back(c.width);
  }
  return EnqueueBatch(stream, dsts, srcs, sizes);
}

ffi::Error CopyOnStream(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                        ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                        ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer out,
                        ffi::Buffer<ffi::S32> superseded, ffi::Buffer<ffi::U8> staging,
                        const CopyOptions& options) {
  PoolGeometry g;
  int64_t num_pairs = 0;
  if (auto err = CheckPools(dst, src, out, src_idx, dst_idx, num_tokens, &g, &num_pairs);
      err.failure()) {
    return err;
  }
  const int64_t dst_blocks = dst.dimensions()[0], src_blocks = src.dimensions()[0];
  char* out_data = static_cast<char*>(out.untyped_data());
  if (out_data != dst.untyped_data() && dst_blocks > 0) {  // XLA did not alias
    cudaError_t err = cudaMemcpyAsync(out_data, dst.untyped_data(), dst_blocks * g.block_bytes,
                                      cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return CudaError(err, "cudaMemcpyAsync");
  }
  if (num_pairs == 0 || dst_blocks == 0 || src_blocks == 0 || g.block_bytes == 0) {
    return ffi::Error::Success();
  }
  const bool stage = src.untyped_data() == out_data && !options.hazard_free;
  if (auto err = CheckWorkspaces(num_pairs, g, stage, superseded.element_count(),
                                 staging.element_count());
      err.failure()) {
    return err;
  }
  Batch b = PoolBatch(out_data, static_cast<char*>(src.untyped_data()), src_idx.typed_data(),
                      dst_idx.typed_data(), num_tokens.typed_data(), num_pairs, src_blocks,
                      dst_blocks, g, options.whole_blocks);
  if (options.dma && !stage && IsHostMemory(b.src_idx) && IsHostMemory(b.dst_idx) &&
      (b.whole_blocks || IsHostMemory(b.num_tokens)) &&
      IsHostMemory(b.dst.data) != IsHostMemory(b.src.data)) {
    dma_batches.fetch_add(1, std::memory_order_relaxed);
    cudaError_t err = EnqueueDmaCopies(stream, {b}, false);
    return err == cudaSuccess ? ffi::Error::Success()
                              : CudaError(err, "block copy on the copy engines");
  }
  // Every pair reads the source as it was before the call. When the source is the pool being
  // written and a block may be both read and written, gather the sources out first.
  if (stage) {
    Batch gather = b;
    gather.dst = {reinterpret_cast<char*>(staging.typed_data()), g.block_bytes, true};
    if (auto err = LaunchCopyKernel(stream, gather, options.max_ctas); err.failure()) return err;
    b.src = {reinterpret_cast<char*>(staging.typed_data()), g.block_bytes, true};
  }
  return CopyBatch(stream, b, superseded.typed_data(), options.unique_dst, options.max_ctas);
}

ffi::Error CopyBatch(cudaStream_t stream, Batch b, int32_t* superseded, bool unique_dst,
                     int64_t max_ctas) {
  const bool scan = b.num_pairs > 1 && !unique_dst;
  const int64_t units_per_pair = UnitsPerPair(b.g, b.num_pairs, b.whole_blocks, WaveCtas());
  if (scan && ScanInCopy(b, units_per_pair, max_ctas)) {
    return LaunchCopyKernel(stream, b, max_ctas, true);
  }
  if (scan) {
    b.superseded = superseded;
    LaterWriterTokensKernel<<<static_cast<unsigned>(b.num_pairs), kThreads, 0, stream>>>(
        b, superseded);
    if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) {
      return CudaError(err, "duplicate-scan kernel launch");
    }
  }
  return LaunchCopyKernel(stream, b, max_ctas);
}

namespace {

// kInGraph: the handler of a command-buffer compatible target, which XLA may record into a
// CUDA graph and replay without running this code, so it must not take the copy engines' path;
// the Python side sends dma=true to the "nograph" targets only.
template <bool kInGraph>
ffi::Error BlockCopy(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                     ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                     ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                     ffi::Result<ffi::Buffer<ffi::U8>> staging, CopyOptions options) {
  if (kInGraph && options.dma) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer block copy: dma=true goes through the target jax_kvxfer_block_copy_nograph");
  }
  return CopyOnStream(stream, dst, src, src_idx, dst_idx, num_tokens, *out, *superseded,
                      *staging, options);
}

// Copies within one pool. One operand rather than the same array passed twice: XLA would copy
// a donated operand that another operand of the same call also reads.
template <bool kInGraph>
ffi::Error BlockCopyWithin(cudaStream_t stream, ffi::AnyBuffer pool,
                           ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                           ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                           ffi::Result<ffi::Buffer<ffi::U8>> staging, CopyOptions options) {
  return BlockCopy<kInGraph>(stream, pool, pool, src_idx, dst_idx, num_tokens, out, superseded,
                             staging, options);
}

}  // namespace

// The kernel-only targets may be recorded into a CUDA graph (XLA's command buffers, which then
// replay chained copies without running the handler): they read nothing on the host, and XLA
// records them again whenever one of their buffers moves. The "nograph" targets run the same
// handlers without the trait, for what a graph must not hold: dma=true copies and copies on a
// stream of their own (a graph on the compute stream would serialize them).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyCuda, BlockCopy<true>, BindCopy(KVXFER_POOLS_2),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyWithinCuda, BlockCopyWithin<true>,
                              BindCopy(KVXFER_POOLS_1), {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyNoGraphCuda, BlockCopy<false>, BindCopy(KVXFER_POOLS_2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyWithinNoGraphCuda, BlockCopyWithin<false>,
                              BindCopy(KVXFER_POOLS_1));

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

NB_MODULE(_kvxfer_cuda, m) {
  m.doc() = "CUDA XLA FFI handlers of jax_kvxfer";
  kvxfer::ReadSmCounts();
  m.def("registrations", []() {
    nb::dict d;
#define KVXFER_REGISTER(name, cuda, cpu) \
  d[name] = nb::capsule(reinterpret_cast<void*>(kvxfer::k##cuda##Cuda));
    KVXFER_TARGETS(KVXFER_REGISTER)
#undef KVXFER_REGISTER
    return d;
  });
  m.def("dma_batches", []() { return kvxfer::dma_batches.load(std::memory_order_relaxed); },
        "How many batches the CUDA handlers have copied on the copy engines (for tests).");
  kvxfer::DefineLaneFunctions(m);
}
