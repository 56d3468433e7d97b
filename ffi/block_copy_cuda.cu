// CUDA handler of the jax_kvxfer block copy: one launch copies a whole batch of (partial) blocks.
//
// Pools may live in device memory or in pinned host memory (XLA hands a `pinned_host` operand's
// host pointer to the handler); the kernel reaches both through unified addressing. JAX offers
// no other memory kind on GPUs (no pageable host memory), and the Python side checks kinds, so
// the kernel path does not query pointer attributes.
//
// Two ways to copy:
//  - the kernel (CopyPairsKernel; CopyLeanKernel for the partial batches LeanShapeFor takes):
//    any batch; it reads the indices on the GPU, and its loads and stores occupy SMs for as
//    long as the copy lasts;
//  - the copy engines (dma=true, TryDma): cudaMemcpyBatchAsync / cudaMemcpy2DAsync, no SMs, so
//    a copy on a stream of its own leaves every SM to compute running beside it. Only between
//    device and pinned host memory, and only when the index arrays (and the token counts,
//    unless every pair copies whole blocks) are in pinned host memory: the handler reads them
//    on the host while it enqueues the copies. They must therefore hold their final values
//    when the program is dispatched (jit arguments written on the host, as the manager's plan
//    ring is), never values computed earlier in the same program; and these handlers must
//    never be declared command-buffer compatible, since a captured graph would replay the
//    first call's indices.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "block_copy.h"
#include "copy_units.cuh"
#include "later_writer_scan.cuh"
#include "nanobind/nanobind.h"

namespace nb = nanobind;
namespace kvxfer {
namespace {

// A capped grid (max_ctas > 0) uses CTAs of 1024 threads, four work units each: on an H200,
// 8 such CTAs keep PCIe busy in both directions (benchmarks/kernel_probe.cu), so a copy to or
// from host memory can leave the other SMs to compute running beside it on another stream.
constexpr int kCappedCtaThreads = 1024;

std::atomic<int64_t> dma_batches{0};  // batches copied by the copy engines (read by tests)

// Block: kCtaThreads threads (a multiple of kUnitThreads), one work unit per kUnitThreads.
// Grid: any size; the CTAs walk the units, so a capped grid copies the same bytes as a full one.
// One vector type per kernel keeps the registers of the widest path only. kScanInCopy: one
// kThreads-thread unit per CTA (a grid of exactly num_pairs * units_per_pair), which scans for
// later writers of its pair's block itself, instead of a scan kernel launched before.
template <typename V, int kCtaThreads, bool kScanInCopy, int kUnitThreads = kThreads>
__global__ void __launch_bounds__(kCtaThreads) CopyPairsKernel(Batch b, int64_t units_per_pair) {
  if constexpr (kScanInCopy) {
    static_assert(kCtaThreads == kThreads && kUnitThreads == kThreads);
    const int64_t u = blockIdx.x, pair = PairOfUnit(u, units_per_pair);
    if (b.whole_blocks) {  // loads first, then the scan (CopyWholeUnit)
      CopyWholeUnit<V>(b, u, units_per_pair, threadIdx.x,
                       [&] { return LaterWriterTokens(b, pair) >= b.g.tokens; });
    } else {
      CopyUnit<V>(b, u, units_per_pair, threadIdx.x, LaterWriterTokens(b, pair));
    }
  } else {
    constexpr int per_cta = kCtaThreads / kUnitThreads;
    const int64_t units = b.num_pairs * units_per_pair;
    for (int64_t u = int64_t{blockIdx.x} * per_cta + threadIdx.x / kUnitThreads; u < units;
         u += int64_t{gridDim.x} * per_cta) {
      CopyUnit<V, kUnitThreads>(b, u, units_per_pair, threadIdx.x % kUnitThreads,
                                SupersededTokens(b, PairOfUnit(u, units_per_pair)));
    }
  }
}

// LeanShapeFor's batches: one thread per (pair, run, lane); 8 CTAs per SM at most 32 registers.
// The handler launches <false, false> (nothing to scan) and <true, true> (the scan's vote after
// the first loads); the floor probe also times <true, false>, the whole scan before them.
template <bool kScanInCopy, bool kEarlyLoads>
__global__ void __launch_bounds__(kThreads, 8)
    CopyLeanKernel(Batch b, int pair_threads_log2, int lanes_log2) {
  CopyLeanKernelBody<kScanInCopy, kEarlyLoads>(b, pair_threads_log2, lanes_log2);
}

// Grid: ceil(num_pairs / kThreads) of kThreads. last[d]: the greatest valid pair writing d, or
// -1 as set before (ClaimLastWriter).
__global__ void __launch_bounds__(kThreads) ClaimLastWritersKernel(Batch b, int32_t* last) {
  ClaimLastWriter(b, int64_t{blockIdx.x} * kThreads + threadIdx.x, last,
                  [](int32_t* address, int32_t j) { atomicMax(address, j); });
}

// Grid: (num_pairs). first[i] = LaterWriterTokens(i): every pair scans the later ones.
__global__ void SupersededTokensKernel(Batch b, int32_t* first) {
  const int32_t m = LaterWriterTokens(b, blockIdx.x);
  if (threadIdx.x == 0) first[blockIdx.x] = m;
}

// Whether the copy kernel can scan for later writers itself (kScanInCopy): a full grid, and a
// batch small enough that every CTA reading the later pairs' indices (num_pairs^2 *
// units_per_pair entries in all, from L2) costs less than the launch of a scan kernel.
constexpr int64_t kScanInCopyMaxReads = int64_t{1} << 22;
bool FusedScanFits(const Batch& b, int64_t max_ctas) {
  return max_ctas <= 0 && b.num_pairs <= kScanInCopyMaxReads / b.num_pairs /
                                             UnitsPerPair(b.g, b.num_pairs, b.whole_blocks);
}

ffi::Error CudaError(cudaError_t err, const char* what) {
  return ffi::Error::Internal(std::string("jax_kvxfer block copy: ") + what + ": " +
                              cudaGetErrorString(err));
}

template <typename V>
void LaunchWith(cudaStream_t stream, const Batch& b, int64_t max_ctas) {
  if (LeanShape lean; LeanShapeFor(b, sizeof(V), max_ctas, &lean)) {  // 16-byte vectors only
    const auto copy = b.scan_in_copy ? CopyLeanKernel<true, true> : CopyLeanKernel<false, false>;
    copy<<<static_cast<unsigned>(lean.ctas), kThreads, 0, stream>>>(b, lean.pair_threads_log2,
                                                                    lean.lanes_log2);
    return;
  }
  if (SmallUnits(b, max_ctas)) {
    const int64_t units_per_pair = UnitsPerPair(b.g, b.num_pairs, false, kSmallUnitThreads);
    const int64_t ctas = std::min<int64_t>(b.num_pairs * units_per_pair, int64_t{1} << 30);
    CopyPairsKernel<V, kSmallUnitThreads, false, kSmallUnitThreads>
        <<<static_cast<unsigned>(ctas), kSmallUnitThreads, 0, stream>>>(b, units_per_pair);
    return;
  }
  const int64_t units_per_pair = UnitsPerPair(b.g, b.num_pairs, b.whole_blocks);
  const int64_t units = b.num_pairs * units_per_pair;
  if (b.scan_in_copy) {  // FusedScanFits: units <= 2^22, one CTA each
    CopyPairsKernel<V, kThreads, true><<<static_cast<unsigned>(units), kThreads, 0, stream>>>(
        b, units_per_pair);
  } else if (max_ctas > 0) {
    constexpr int64_t per_cta = kCappedCtaThreads / kThreads;
    const int64_t ctas = std::min((units + per_cta - 1) / per_cta, max_ctas);
    CopyPairsKernel<V, kCappedCtaThreads, false>
        <<<static_cast<unsigned>(ctas), kCappedCtaThreads, 0, stream>>>(b, units_per_pair);
  } else {
    const int64_t ctas = std::min<int64_t>(units, int64_t{1} << 30);
    CopyPairsKernel<V, kThreads, false><<<static_cast<unsigned>(ctas), kThreads, 0, stream>>>(
        b, units_per_pair);
  }
}

// max_ctas <= 0: one CTA per work unit (what a device-to-device copy needs to fill HBM);
// otherwise at most max_ctas CTAs of kCappedCtaThreads threads.
ffi::Error Launch(cudaStream_t stream, const Batch& b, int64_t max_ctas) {
  switch (VectorBytes(b)) {
    case 16:
      LaunchWith<uint4>(stream, b, max_ctas);
      break;
    case 8:
      LaunchWith<uint2>(stream, b, max_ctas);
      break;
    case 4:
      LaunchWith<uint32_t>(stream, b, max_ctas);
      break;
    default:
      LaunchWith<uint8_t>(stream, b, max_ctas);
  }
  cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "copy kernel launch");
}

bool IsHostMemory(const void* p) {
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // not a pointer CUDA knows: clear the error, use the kernel
    return false;
  }
  return attr.type == cudaMemoryTypeHost;
}

cudaError_t EnqueueOne(cudaStream_t stream, const DmaCopy& c) {
  if (c.height == 1) return cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDefault, stream);
  return cudaMemcpy2DAsync(c.dst, c.pitch, c.src, c.pitch, c.width, c.height, cudaMemcpyDefault,
                           stream);
}

// Copies per batch call. The runtime spends about 0.8 us of host time per copy of a batch
// before any of it starts (H200, CUDA 13); in batches of this many the copy engines start
// after the first and then run while the host enqueues the rest, so a batch of small blocks
// costs the larger of the two times instead of their sum.
constexpr size_t kCopiesPerBatchCall = 64;

// Contiguous copies in any order, as batches where the runtime has batched copies.
cudaError_t EnqueueBatch(cudaStream_t stream, std::vector<void*>& dsts,
                         std::vector<const void*>& srcs, std::vector<size_t>& sizes) {
  if (sizes.empty()) return cudaSuccess;
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

// Enqueues PlanDmaCopies' copies on `stream`. With distinct destinations they may run in any
// order (one batch); when two pairs write one block, or with `in_order` (a copy within one
// pool, where a pair may overwrite a block that an earlier pair reads), every copy is enqueued
// on its own, in pair order: the later pair wins on the tokens it writes, as with the kernel,
// and every read comes before the later writes.
cudaError_t EnqueueDmaCopies(cudaStream_t stream, const Batch& b, bool in_order) {
  std::vector<DmaCopy> copies;
  in_order = PlanDmaCopies(b, &copies) || in_order;
  cudaError_t err = cudaSuccess;
  if (in_order) {
    for (size_t k = 0; k < copies.size() && err == cudaSuccess; ++k) {
      err = EnqueueOne(stream, copies[k]);
    }
    return err;
  }
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<size_t> sizes;
  for (const DmaCopy& c : copies) {
    if (c.height != 1) {
      if (err = EnqueueOne(stream, c); err != cudaSuccess) return err;
      continue;
    }
    dsts.push_back(c.dst);
    srcs.push_back(c.src);
    sizes.push_back(c.width);
  }
  return EnqueueBatch(stream, dsts, srcs, sizes);
}

// Enqueues the batch on the copy engines and returns true, or returns false having enqueued
// nothing when the batch does not qualify (see the top of this file).
bool TryDma(cudaStream_t stream, const Batch& b, ffi::Error* error) {
  if (!IsHostMemory(b.src_idx) || !IsHostMemory(b.dst_idx) ||
      (!b.whole_blocks && !IsHostMemory(b.num_tokens)) ||
      IsHostMemory(b.dst.data) == IsHostMemory(b.src.data)) {
    return false;
  }
  if (cudaError_t err = EnqueueDmaCopies(stream, b, false); err != cudaSuccess) {
    *error = CudaError(err, "block copy on the copy engines");
  }
  dma_batches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// kInGraph: the handler of a command-buffer compatible target, which XLA may record into a
// CUDA graph and replay without running this code, so it must not take the copy engines' path
// (that reads the indices on the host as it enqueues); Python sends dma=True elsewhere.
template <bool kInGraph>
ffi::Error BlockCopyCuda(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                         ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                         ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                         ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                         ffi::Result<ffi::Buffer<ffi::U8>> staging, bool hazard_free,
                         bool unique_dst, int64_t max_ctas, bool dma, bool whole_blocks) {
  if (kInGraph && dma) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer block copy: dma=true goes through the target jax_kvxfer_block_copy_nograph");
  }
  PoolGeometry g;
  int64_t num_pairs = 0;
  if (auto err = CheckPools(dst, src, *out, src_idx, dst_idx, num_tokens, &g, &num_pairs);
      err.failure()) {
    return err;
  }
  const int64_t dst_blocks = dst.dimensions()[0], src_blocks = src.dimensions()[0];
  char* out_data = static_cast<char*>(out->untyped_data());
  if (out_data != dst.untyped_data() && dst_blocks > 0) {  // XLA did not alias
    cudaError_t err = cudaMemcpyAsync(out_data, dst.untyped_data(), dst_blocks * g.block_bytes,
                                      cudaMemcpyDefault, stream);
    if (err != cudaSuccess) return CudaError(err, "cudaMemcpyAsync");
  }
  if (num_pairs == 0 || dst_blocks == 0 || src_blocks == 0 || g.block_bytes == 0) {
    return ffi::Error::Success();
  }
  const bool stage = src.untyped_data() == out_data && !hazard_free;
  if (auto err = CheckWorkspaces(num_pairs, g, stage, superseded->element_count(),
                                 staging->element_count());
      err.failure()) {
    return err;
  }

  Batch b{{out_data, false},
          {static_cast<char*>(src.untyped_data()), false},
          src_idx.typed_data(),
          dst_idx.typed_data(),
          num_tokens.typed_data(),
          nullptr,
          num_pairs,
          src_blocks,
          dst_blocks,
          g};
  b.whole_blocks = whole_blocks;
  if (dma && !stage) {
    ffi::Error error = ffi::Error::Success();
    if (TryDma(stream, b, &error)) return error;
  }
  if (num_pairs > 1 && !unique_dst && FusedScanFits(b, max_ctas)) {
    b.scan_in_copy = true;
  } else if (num_pairs > 1 && !unique_dst) {
    // A large batch or a capped grid: the scan runs before the copy. Each block's last writer
    // is found with atomics, and the copy's units look their pair's start up from it, so a
    // batch of distinct destinations costs O(num_pairs) (at 4096 pairs: memset and claims
    // 0.8 + 1.4 us, where every pair scanning the later ones took 4096^2 / 2 reads). Except
    // where the workspace is in pinned host memory (XLA places it with the destination pool,
    // and Python then gives it no entries per block): there the atomics would cross PCIe
    // (9-27 us at 4096 pairs), so every pair scans the later pairs first instead, for a copy
    // that PCIe bounds anyway.
    int32_t* first = superseded->typed_data();
    const size_t with_claims = static_cast<size_t>(num_pairs + dst_blocks);
    if (superseded->element_count() < with_claims || IsHostMemory(first)) {
      SupersededTokensKernel<<<static_cast<unsigned>(num_pairs), kThreads, 0, stream>>>(b, first);
      b.first = first;
    } else {
      const auto one_thread_per_pair = static_cast<unsigned>((num_pairs + kThreads - 1) / kThreads);
      int32_t* last = first + num_pairs;  // dst_blocks entries (copy_results)
      if (cudaError_t err = cudaMemsetAsync(last, 0xFF, dst_blocks * sizeof(int32_t), stream);
          err != cudaSuccess) {
        return CudaError(err, "cudaMemsetAsync");
      }
      ClaimLastWritersKernel<<<one_thread_per_pair, kThreads, 0, stream>>>(b, last);
      b.first = last;
      b.claims = true;
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return CudaError(err, "duplicate-scan kernel launch");
  }
  // Every pair reads the source as it was before the call. When the source is the pool being
  // written and a block may be both read and written, gather the sources out first.
  if (stage) {
    Batch gather = b;
    gather.dst = {reinterpret_cast<char*>(staging->typed_data()), true};
    gather.first = nullptr;
    gather.claims = false;
    gather.scan_in_copy = false;  // every pair reads its whole source block out
    if (auto err = Launch(stream, gather, max_ctas); err.failure()) return err;
    b.src = {reinterpret_cast<char*>(staging->typed_data()), true};
  }
  return Launch(stream, b, max_ctas);
}

// Copies within one pool. One operand rather than the same array passed twice: XLA would copy
// a donated operand that another operand of the same call also reads.
template <bool kInGraph>
ffi::Error BlockCopyWithinCuda(cudaStream_t stream, ffi::AnyBuffer pool,
                               ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                               ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                               ffi::Result<ffi::Buffer<ffi::U8>> staging, bool hazard_free,
                               bool unique_dst, int64_t max_ctas, bool dma, bool whole_blocks) {
  return BlockCopyCuda<kInGraph>(stream, pool, pool, src_idx, dst_idx, num_tokens, out,
                                 superseded, staging, hazard_free, unique_dst, max_ctas, dma,
                                 whole_blocks);
}

// -- both ways at once: a fork/join pair of custom calls ------------------------------------
//
// copy_blocks_both_ways runs an offload and an onboard between the same two pools as two calls,
// `new_b = fork(b, a, ...)` then `new_a = join(a, new_b, ..., ticket, ...)`: each aliases one
// pool only (XLA's host offloader rejects a custom call that aliases a pinned_host pool and
// another output), and the second reads the first's result, so XLA sees no cycle and copies
// no pool. To run the two at the same time, the fork enqueues its copy on a side stream of its
// own and returns at once; the join enqueues its copy on XLA's stream and then makes that
// stream wait for the fork's copy, so everything after the join (and the optimization barrier
// the Python side puts over both results) sees both copies done. The Python side uses the
// pair only when no block is written by one direction and read by the other. The join takes
// the fork's operands and results as extra operands, so that XLA keeps them alive (and does not
// reuse their memory) until the fork's copy has finished.

struct ForkJoinState {
  std::mutex mu;
  std::unordered_map<int, cudaStream_t> side_streams;           // by device
  std::unordered_map<const void*, cudaEvent_t> pending_joins;  // by ticket buffer
};

ForkJoinState& ForkJoin() {
  static ForkJoinState* state = new ForkJoinState;  // never destroyed: handlers may run late
  return *state;
}

// Sets the current device for the scope (events and streams belong to one device).
class ScopedDevice {
 public:
  explicit ScopedDevice(int device) {
    (void)cudaGetDevice(&previous_);
    if (previous_ != device) (void)cudaSetDevice(device);
  }
  ~ScopedDevice() { (void)cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

ffi::Error SideStreamFor(cudaStream_t stream, int* device, cudaStream_t* side) {
  if (cudaError_t err = cudaStreamGetDevice(stream, device); err != cudaSuccess) {
    return CudaError(err, "cudaStreamGetDevice");
  }
  ForkJoinState& state = ForkJoin();
  std::lock_guard<std::mutex> lock(state.mu);
  auto it = state.side_streams.find(*device);
  if (it == state.side_streams.end()) {
    ScopedDevice on_device(*device);  // the side stream belongs to the device of XLA's stream
    cudaStream_t created = nullptr;
    if (cudaError_t err = cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking);
        err != cudaSuccess) {
      return CudaError(err, "cudaStreamCreateWithFlags");
    }
    it = state.side_streams.emplace(*device, created).first;
  }
  *side = it->second;
  return ffi::Error::Success();
}

ffi::Error BlockCopyForkCuda(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                             ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                             ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                             ffi::Result<ffi::Buffer<ffi::U8>> staging,
                             ffi::Result<ffi::AnyBuffer> ticket, bool hazard_free, bool unique_dst,
                             int64_t max_ctas, bool dma, bool whole_blocks) {
  int device = 0;
  cudaStream_t side = nullptr;
  if (auto err = SideStreamFor(stream, &device, &side); err.failure()) return err;
  ScopedDevice on_device(device);
  // Were the result not the destination's own buffer, the copy would first fill all of it,
  // which the join (reading it) must not overlap: then the copy stays on XLA's stream.
  if (out->untyped_data() != dst.untyped_data()) side = stream;
  cudaEvent_t fork = nullptr, join = nullptr;
  if (cudaError_t err = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
      err != cudaSuccess) {
    return CudaError(err, "cudaEventCreateWithFlags");
  }
  // The side stream starts where XLA's stream is (after whatever produced the operands).
  cudaError_t err = cudaEventRecord(fork, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(side, fork, 0);
  (void)cudaEventDestroy(fork);  // released once recorded work completes
  if (err != cudaSuccess) return CudaError(err, "fork onto the side stream");
  if (auto copy = BlockCopyCuda<false>(side, dst, src, src_idx, dst_idx, num_tokens, out,
                                       superseded, staging, hazard_free, unique_dst, max_ctas,
                                       dma, whole_blocks);
      copy.failure()) {
    return copy;
  }
  if (err = cudaEventCreateWithFlags(&join, cudaEventDisableTiming); err != cudaSuccess) {
    return CudaError(err, "cudaEventCreateWithFlags");
  }
  if (err = cudaEventRecord(join, side); err != cudaSuccess) {
    (void)cudaEventDestroy(join);
    return CudaError(err, "cudaEventRecord");
  }
  ForkJoinState& state = ForkJoin();
  std::lock_guard<std::mutex> lock(state.mu);
  auto [it, inserted] = state.pending_joins.emplace(ticket->untyped_data(), join);
  if (!inserted) {  // a ticket buffer reused before its join ran: cannot happen through XLA
    (void)cudaEventDestroy(it->second);
    it->second = join;
  }
  return ffi::Error::Success();
}

ffi::Error BlockCopyJoinCuda(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                             ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                             ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer ticket,
                             ffi::RemainingArgs /*kept alive*/, ffi::Result<ffi::AnyBuffer> out,
                             ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                             ffi::Result<ffi::Buffer<ffi::U8>> staging, bool hazard_free,
                             bool unique_dst, int64_t max_ctas, bool dma, bool whole_blocks,
                             bool wait) {
  ffi::Error copy = BlockCopyCuda<false>(stream, dst, src, src_idx, dst_idx, num_tokens, out,
                                         superseded, staging, hazard_free, unique_dst, max_ctas,
                                         dma, whole_blocks);
  if (!wait) return copy;  // ordered by its operands only
  cudaEvent_t join = nullptr;
  {
    ForkJoinState& state = ForkJoin();
    std::lock_guard<std::mutex> lock(state.mu);
    auto it = state.pending_joins.find(ticket.untyped_data());
    if (it == state.pending_joins.end()) {
      return ffi::Error::InvalidArgument(
          "jax_kvxfer both-ways copy: the second half found no first half to wait for (its "
          "ticket operand must be the first half's ticket result)");
    }
    join = it->second;
    state.pending_joins.erase(it);
  }
  // Wait even if this half failed, so that nothing after it runs beside the first half.
  cudaError_t err = cudaStreamWaitEvent(stream, join, 0);
  (void)cudaEventDestroy(join);
  if (copy.failure()) return copy;
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "join the side stream");
}

// -- transfer lanes: the manager's copies beside compute ------------------------------------
//
// TensorRT-LLM's discipline for JAX. Each device has two lanes, streams of the library's own:
// lane 0 carries offloads (device -> pinned host), lane 1 onboards and copies within the GPU
// pool. A lane copy is one custom call on XLA's stream that returns once its copy is enqueued
// on the lane, behind everything XLA's stream had before it (an event), so it reads what
// earlier work wrote; XLA's later work (the model step) runs beside it. JoinLanes, on XLA's
// stream, makes everything after it wait for both lanes: the manager's sync_transfers.
//
// What the lane reads after this call returns must outlive XLA's idea of the call:
//  - an offload's source blocks are snapshotted first, on XLA's stream, into a buffer of the
//    lanes' own memory pool (freed in the lane's order once copied), so the step may overwrite
//    them at once;
//  - the indices are read here, on the host (the copy engines are handed addresses), so the
//    plan's buffer is free when the call returns;
//  - the pools' buffers stay the pools': while a lane may still use them, the pool refuses an
//    assigned array in another buffer (pool.py), so XLA never frees them under a lane.
// The lanes copy with the copy engines only, so they take no SMs from the step.
// Across lanes, the manager asks for a wait (wait_lane) where one lane's copy touches slots
// that the other's pending copies touch, and for XLA's stream to wait (stream_wait_lane) where
// a snapshot reads blocks that lane 1 is still writing.

constexpr int kLanes = 2;

struct DeviceLanes {
  std::mutex mu;  // handlers for one device may run on several threads
  cudaStream_t stream[kLanes] = {};
  cudaEvent_t done[kLanes] = {};  // the last copy enqueued on each lane
  cudaEvent_t ready = nullptr;    // where XLA's stream was when a lane copy was enqueued
  cudaMemPool_t staging = nullptr;
  // Timed event pairs around what the lanes cost XLA's stream (a join's wait, a snapshot),
  // recorded there and summed once both have completed (SumExposed).
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> exposed;
  std::vector<cudaEvent_t> spare_events;
  double exposed_seconds = 0;  // of the pairs summed so far
};

// Adds the completed pairs' times to exposed_seconds and frees their events for reuse.
void SumExposed(DeviceLanes* lanes) {
  auto& pairs = lanes->exposed;
  size_t kept = 0;
  for (auto& [before, after] : pairs) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, before, after) == cudaSuccess) {
      lanes->exposed_seconds += ms * 1e-3;
      lanes->spare_events.push_back(before);
      lanes->spare_events.push_back(after);
    } else {
      (void)cudaGetLastError();  // not complete yet: cudaErrorNotReady
      pairs[kept++] = {before, after};
    }
  }
  pairs.resize(kept);
}

// An event pair for `exposed` (reused once summed); null events where creation failed.
std::pair<cudaEvent_t, cudaEvent_t> TimingPair(DeviceLanes* lanes) {
  if (lanes->exposed.size() >= 256) SumExposed(lanes);  // bounded, whoever reads the sum
  cudaEvent_t pair[2] = {nullptr, nullptr};
  for (cudaEvent_t& e : pair) {
    if (!lanes->spare_events.empty()) {
      e = lanes->spare_events.back();
      lanes->spare_events.pop_back();
    } else if (cudaEventCreate(&e) != cudaSuccess) {
      e = nullptr;
    }
  }
  return {pair[0], pair[1]};
}

// Records `work` between the two events of a timing pair on `stream`.
template <typename Work>
cudaError_t Exposed(DeviceLanes* lanes, cudaStream_t stream, Work&& work) {
  auto [before, after] = TimingPair(lanes);
  if (before != nullptr) (void)cudaEventRecord(before, stream);
  cudaError_t err = work();
  if (after != nullptr) (void)cudaEventRecord(after, stream);
  if (before != nullptr && after != nullptr) {
    lanes->exposed.emplace_back(before, after);
  } else {
    for (cudaEvent_t e : {before, after}) {
      if (e != nullptr) lanes->spare_events.push_back(e);
    }
  }
  return err;
}

std::mutex lanes_mu;
auto* lanes_by_device = new std::unordered_map<int, DeviceLanes*>;  // never destroyed

ffi::Error LanesFor(cudaStream_t stream, int* device, DeviceLanes** lanes) {
  std::mutex& mu = lanes_mu;
  auto* by_device = lanes_by_device;
  if (cudaError_t err = cudaStreamGetDevice(stream, device); err != cudaSuccess) {
    return CudaError(err, "cudaStreamGetDevice");
  }
  std::lock_guard<std::mutex> lock(mu);
  DeviceLanes*& entry = (*by_device)[*device];
  if (entry != nullptr) {
    *lanes = entry;
    return ffi::Error::Success();
  }
  ScopedDevice on_device(*device);
  auto* made = new DeviceLanes;
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < kLanes && err == cudaSuccess; ++i) {
    err = cudaStreamCreateWithFlags(&made->stream[i], cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&made->done[i], cudaEventDisableTiming);
  }
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&made->ready, cudaEventDisableTiming);
  if (err == cudaSuccess) {
    cudaMemPoolProps props = {};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = *device;
    err = cudaMemPoolCreate(&made->staging, &props);
  }
  if (err == cudaSuccess) {
    // Keep freed snapshots for the next ones instead of returning them to the driver at
    // every synchronization: the pool then holds at most the largest batch in flight.
    uint64_t keep = UINT64_MAX;
    err = cudaMemPoolSetAttribute(made->staging, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  if (err != cudaSuccess) return CudaError(err, "creating the transfer lanes");  // leaks `made`
  entry = made;
  *lanes = made;
  return ffi::Error::Success();
}

ffi::Error LaneCopy(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                    ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                    ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                    int64_t lane, int64_t wait_lane, int64_t stream_wait_lane,
                    bool whole_blocks) {
  PoolGeometry g;
  int64_t num_pairs = 0;
  if (auto err = CheckPools(dst, src, *out, src_idx, dst_idx, num_tokens, &g, &num_pairs);
      err.failure()) {
    return err;
  }
  auto lane_ok = [](int64_t l, bool optional) { return (optional && l < 0) || (l >= 0 && l < kLanes); };
  if (!lane_ok(lane, false) || !lane_ok(wait_lane, true) || !lane_ok(stream_wait_lane, true)) {
    return ffi::Error::InvalidArgument("jax_kvxfer lane copy: lane numbers must be 0 or 1");
  }
  if (!IsHostMemory(src_idx.typed_data()) || !IsHostMemory(dst_idx.typed_data()) ||
      (!whole_blocks && !IsHostMemory(num_tokens.typed_data()))) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer lane copy: the indices must be in pinned host memory (the manager's plan "
        "ring), where the handler reads them");
  }
  int device = 0;
  DeviceLanes* lanes = nullptr;
  if (auto err = LanesFor(stream, &device, &lanes); err.failure()) return err;
  ScopedDevice on_device(device);
  const int64_t dst_blocks = dst.dimensions()[0], src_blocks = src.dimensions()[0];
  char* out_data = static_cast<char*>(out->untyped_data());
  const bool within = src.untyped_data() == dst.untyped_data();
  std::lock_guard<std::mutex> lock(lanes->mu);
  cudaError_t err = cudaSuccess;
  if (stream_wait_lane >= 0) err = cudaStreamWaitEvent(stream, lanes->done[stream_wait_lane], 0);
  if (err == cudaSuccess && out_data != dst.untyped_data() && dst_blocks > 0) {
    // XLA did not alias: start from dst's contents, and copy within the result.
    err = cudaMemcpyAsync(out_data, dst.untyped_data(), dst_blocks * g.block_bytes,
                          cudaMemcpyDefault, stream);
  }
  if (err != cudaSuccess) return CudaError(err, "lane copy: before the copy");
  if (num_pairs == 0 || dst_blocks == 0 || src_blocks == 0 || g.block_bytes == 0) {
    return ffi::Error::Success();
  }
  Batch b{{out_data, false},
          {within ? out_data : static_cast<char*>(src.untyped_data()), false},
          src_idx.typed_data(),
          dst_idx.typed_data(),
          num_tokens.typed_data(),
          nullptr,
          num_pairs,
          src_blocks,
          dst_blocks,
          g};
  b.whole_blocks = whole_blocks;
  const cudaStream_t lane_stream = lanes->stream[lane];
  void* snapshot = nullptr;
  if (!within && !IsHostMemory(b.src.data)) {
    // An offload: gather the source blocks on XLA's stream (a device-to-device copy, a small
    // part of the transfer's time), then copy the gathered blocks to the host on the lane.
    err = cudaMallocFromPoolAsync(&snapshot, num_pairs * g.block_bytes, lanes->staging, stream);
    if (err != cudaSuccess) {
      // No room for a snapshot: copy on XLA's stream instead, after both lanes (the copy
      // must come after the pending ones), ordered like any other op from then on.
      (void)cudaGetLastError();
      err = cudaSuccess;
      for (int i = 0; i < kLanes && err == cudaSuccess; ++i) {
        err = cudaStreamWaitEvent(stream, lanes->done[i], 0);
      }
      if (err == cudaSuccess) err = EnqueueDmaCopies(stream, b, false);
      dma_batches.fetch_add(1, std::memory_order_relaxed);
      return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "lane copy (in line)");
    }
    Batch gather = b;
    gather.dst = {static_cast<char*>(snapshot), true};
    ffi::Error launched = ffi::Error::Success();
    (void)Exposed(lanes, stream, [&] {
      launched = Launch(stream, gather, 0);
      return cudaSuccess;
    });
    if (launched.failure()) {
      (void)cudaFreeAsync(snapshot, stream);
      return launched;
    }
    b.src = {static_cast<char*>(snapshot), true};
  }
  err = cudaEventRecord(lanes->ready, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(lane_stream, lanes->ready, 0);
  if (err == cudaSuccess && wait_lane >= 0 && wait_lane != lane) {
    err = cudaStreamWaitEvent(lane_stream, lanes->done[wait_lane], 0);
  }
  if (err == cudaSuccess) err = EnqueueDmaCopies(lane_stream, b, within);
  if (snapshot != nullptr) {
    // Freed in the lane's order even if enqueueing failed: nothing may leak.
    cudaError_t freed = cudaFreeAsync(snapshot, err == cudaSuccess ? lane_stream : stream);
    if (err == cudaSuccess) err = freed;
  }
  if (err == cudaSuccess) err = cudaEventRecord(lanes->done[lane], lane_stream);
  dma_batches.fetch_add(1, std::memory_order_relaxed);
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "lane copy");
}

ffi::Error LaneCopyWithin(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src_idx,
                          ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                          ffi::Result<ffi::AnyBuffer> out, int64_t lane, int64_t wait_lane,
                          int64_t stream_wait_lane, bool whole_blocks) {
  return LaneCopy(stream, pool, pool, src_idx, dst_idx, num_tokens, out, lane, wait_lane,
                  stream_wait_lane, whole_blocks);
}

// XLA's stream waits for everything enqueued so far on the lanes of its device that `lanes`
// names (bit i: lane i).
ffi::Error JoinLanes(cudaStream_t stream, ffi::AnyBuffer array, ffi::Result<ffi::AnyBuffer> out,
                     int64_t lane_mask) {
  int device = 0;
  DeviceLanes* lanes = nullptr;
  if (auto err = LanesFor(stream, &device, &lanes); err.failure()) return err;
  ScopedDevice on_device(device);
  std::lock_guard<std::mutex> lock(lanes->mu);
  cudaError_t err = Exposed(lanes, stream, [&] {
    cudaError_t waited = cudaSuccess;
    for (int i = 0; i < kLanes && waited == cudaSuccess; ++i) {
      if (lane_mask & (int64_t{1} << i)) waited = cudaStreamWaitEvent(stream, lanes->done[i], 0);
    }
    return waited;
  });
  if (err == cudaSuccess && out->untyped_data() != array.untyped_data()) {
    err = cudaMemcpyAsync(out->untyped_data(), array.untyped_data(), array.size_bytes(),
                          cudaMemcpyDefault, stream);
  }
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "join the transfer lanes");
}

}  // namespace

// The kernel-only targets may be recorded into a CUDA graph (XLA's command buffers, which then
// replay chained copies without running the handler): they read nothing on the host, and XLA
// traces them again whenever one of their buffers moves (the launch depends on addresses).
// The "nograph" targets run the same handlers without the trait, for what a graph must not
// hold: dma=true copies (they read the indices on the host as they enqueue) and copies on a
// stream of their own (a graph on the compute stream would serialize them).
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyWithinCuda, BlockCopyWithinCuda<true>,
                              BindIndicesResultsAndAttrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                             .Arg<ffi::AnyBuffer>()),  // pool
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyForkCuda, BlockCopyForkCuda,
                              BindForkCopy(ffi::Ffi::Bind()
                                               .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                               .Arg<ffi::AnyBuffer>()    // dst pool
                                               .Arg<ffi::AnyBuffer>()));  // src pool

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyJoinCuda, BlockCopyJoinCuda,
                              BindJoinCopy(ffi::Ffi::Bind()
                                               .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                               .Arg<ffi::AnyBuffer>()    // dst pool
                                               .Arg<ffi::AnyBuffer>()));  // src pool

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyCuda, BlockCopyCuda<true>,
                              BindIndicesResultsAndAttrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                             .Arg<ffi::AnyBuffer>()     // dst pool
                                                             .Arg<ffi::AnyBuffer>()),   // src pool
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyNoGraphCuda, BlockCopyCuda<false>,
                              BindIndicesResultsAndAttrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                             .Arg<ffi::AnyBuffer>()    // dst pool
                                                             .Arg<ffi::AnyBuffer>()));  // src pool

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyCuda, LaneCopy,
                              BindLaneAttrs(BindIndices(ffi::Ffi::Bind()
                                                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                            .Arg<ffi::AnyBuffer>()     // dst pool
                                                            .Arg<ffi::AnyBuffer>())    // src pool
                                                .Ret<ffi::AnyBuffer>()));  // new dst pool

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyWithinCuda, LaneCopyWithin,
                              BindLaneAttrs(BindIndices(ffi::Ffi::Bind()
                                                            .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                            .Arg<ffi::AnyBuffer>())    // pool
                                                .Ret<ffi::AnyBuffer>()));  // new pool

XLA_FFI_DEFINE_HANDLER_SYMBOL(kJoinLanesCuda, JoinLanes,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()    // any array: a pool
                                  .Ret<ffi::AnyBuffer>()    // the same, aliased
                                  .Attr<int64_t>("lanes"));  // bit i: wait for lane i

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyWithinNoGraphCuda, BlockCopyWithinCuda<false>,
                              BindIndicesResultsAndAttrs(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()
                                                             .Arg<ffi::AnyBuffer>()));  // pool

}  // namespace kvxfer

NB_MODULE(_kvxfer_cuda, m) {
  m.doc() = "CUDA XLA FFI handlers of jax_kvxfer";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_kvxfer_block_copy"] = nb::capsule(reinterpret_cast<void*>(kvxfer::kBlockCopyCuda));
    d["jax_kvxfer_block_copy_within"] =
        nb::capsule(reinterpret_cast<void*>(kvxfer::kBlockCopyWithinCuda));
    d["jax_kvxfer_block_copy_nograph"] =
        nb::capsule(reinterpret_cast<void*>(kvxfer::kBlockCopyNoGraphCuda));
    d["jax_kvxfer_block_copy_within_nograph"] =
        nb::capsule(reinterpret_cast<void*>(kvxfer::kBlockCopyWithinNoGraphCuda));
    d["jax_kvxfer_block_copy_fork"] =
        nb::capsule(reinterpret_cast<void*>(kvxfer::kBlockCopyForkCuda));
    d["jax_kvxfer_block_copy_join"] =
        nb::capsule(reinterpret_cast<void*>(kvxfer::kBlockCopyJoinCuda));
    d["jax_kvxfer_lane_copy"] = nb::capsule(reinterpret_cast<void*>(kvxfer::kLaneCopyCuda));
    d["jax_kvxfer_lane_copy_within"] =
        nb::capsule(reinterpret_cast<void*>(kvxfer::kLaneCopyWithinCuda));
    d["jax_kvxfer_join_lanes"] = nb::capsule(reinterpret_cast<void*>(kvxfer::kJoinLanesCuda));
    return d;
  });
  m.def("wait_lanes", []() {
    std::vector<cudaStream_t> streams;
    {
      std::lock_guard<std::mutex> lock(kvxfer::lanes_mu);
      for (auto& [device, lanes] : *kvxfer::lanes_by_device) {
        for (cudaStream_t s : lanes->stream) streams.push_back(s);
      }
    }
    nb::gil_scoped_release released;
    for (cudaStream_t s : streams) {
      if (cudaError_t err = cudaStreamSynchronize(s); err != cudaSuccess) {
        throw std::runtime_error(std::string("jax_kvxfer: waiting for the transfer lanes: ") +
                                 cudaGetErrorString(err));
      }
    }
  }, "Blocks until every copy enqueued on the transfer lanes so far is done.");
  m.def("lanes_idle", []() {
    std::lock_guard<std::mutex> lock(kvxfer::lanes_mu);
    for (auto& [device, lanes] : *kvxfer::lanes_by_device) {
      for (cudaEvent_t e : lanes->done) {
        if (cudaEventQuery(e) != cudaSuccess) {
          (void)cudaGetLastError();  // cudaErrorNotReady is not an error to keep
          return false;
        }
      }
    }
    return true;
  }, "Whether every copy enqueued on the transfer lanes so far is done (does not wait).");
  m.def("take_exposed_seconds", []() {
    double seconds = 0;  // pairs still running count at the next call
    std::lock_guard<std::mutex> lock(kvxfer::lanes_mu);
    for (auto& [device, lanes] : *kvxfer::lanes_by_device) {
      std::lock_guard<std::mutex> lanes_lock(lanes->mu);
      kvxfer::ScopedDevice on_device(device);
      kvxfer::SumExposed(lanes);
      seconds += lanes->exposed_seconds;
      lanes->exposed_seconds = 0;
    }
    return seconds;
  }, "Seconds XLA's streams spent on the lanes' account (waits at joins, offload snapshots) in "
     "the timed work that has completed since the last call.");
  m.def("dma_batches", []() { return kvxfer::dma_batches.load(std::memory_order_relaxed); },
        "How many batches the CUDA handlers have copied on the copy engines (for tests).");
}
