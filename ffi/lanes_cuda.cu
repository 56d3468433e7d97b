// The transfer lanes: the manager's copies beside compute.
//
// TensorRT-LLM's discipline for JAX. Each device has two lanes, streams of the library's own:
// lane 0 carries offloads (device -> pinned host), lane 1 onboards and copies within the GPU
// pool. A lane copy is one custom call on XLA's stream that returns once its copy is enqueued
// on the lane, behind everything XLA's stream had before it (an event), so it reads what
// earlier work wrote; XLA's later work (the model step) runs beside it. JoinLanes, on XLA's
// stream, makes everything after it wait for the lanes: the manager's sync_transfers.
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
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_copy_cuda.h"
#include "layer_copy.h"

namespace nb = nanobind;
namespace kvxfer {
namespace {

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
  if (cudaError_t err = cudaStreamGetDevice(stream, device); err != cudaSuccess) {
    return CudaError(err, "cudaStreamGetDevice");
  }
  std::lock_guard<std::mutex> lock(lanes_mu);
  DeviceLanes*& entry = (*lanes_by_device)[*device];
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

// The lane numbers, and the indices in pinned host memory (the manager's plan ring), where the
// handler reads them.
ffi::Error CheckLaneCall(const LaneOptions& o, ffi::Buffer<ffi::S32> src_idx,
                         ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens) {
  auto lane_ok = [](int64_t l, bool optional) {
    return (optional && l < 0) || (l >= 0 && l < kLanes);
  };
  if (!lane_ok(o.lane, false) || !lane_ok(o.wait_lane, true) ||
      !lane_ok(o.stream_wait_lane, true)) {
    return ffi::Error::InvalidArgument("jax_kvxfer lane copy: lane numbers must be 0 or 1");
  }
  if (!IsHostMemory(src_idx.typed_data()) || !IsHostMemory(dst_idx.typed_data()) ||
      (!o.whole_blocks && !IsHostMemory(num_tokens.typed_data()))) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer lane copy: the indices must be in pinned host memory (the manager's plan "
        "ring), where the handler reads them");
  }
  return ffi::Error::Success();
}

// Enqueues `parts` (one batch, or a layered copy's batch per layer and slab) on lane
// options.lane, behind XLA's stream. An offload (a source in device memory, not `within` one
// pool) first gathers every part's sources on XLA's stream into a snapshot of one row of
// `row_bytes` per pair, part k at `offsets[k]` of the row; with whole blocks the lane then copies
// whole rows, one copy per pair (adjacent rows merged). Called with the lanes' lock held.
ffi::Error EnqueueOnLane(cudaStream_t stream, DeviceLanes* lanes, std::vector<Batch> parts,
                         const std::vector<int64_t>& offsets, int64_t row_bytes, bool within,
                         const LaneOptions& options) {
  const cudaStream_t lane_stream = lanes->stream[options.lane];
  const Batch first = parts[0];
  cudaError_t err = cudaSuccess;
  void* snapshot = nullptr;
  if (!within && !IsHostMemory(first.src.data)) {
    // An offload: gather the source blocks on XLA's stream (a device-to-device copy, a small
    // part of the transfer's time), then copy the gathered blocks to the host on the lane.
    err = cudaMallocFromPoolAsync(&snapshot, first.num_pairs * row_bytes, lanes->staging, stream);
    if (err != cudaSuccess) {
      // No room for a snapshot: copy on XLA's stream instead, after both lanes (the copy
      // must come after the pending ones), ordered like any other op from then on.
      (void)cudaGetLastError();
      err = cudaSuccess;
      for (int i = 0; i < kLanes && err == cudaSuccess; ++i) {
        err = cudaStreamWaitEvent(stream, lanes->done[i], 0);
      }
      if (err == cudaSuccess) err = EnqueueDmaCopies(stream, parts, false);
      dma_batches.fetch_add(1, std::memory_order_relaxed);
      return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "lane copy (in line)");
    }
    char* rows = static_cast<char*>(snapshot);
    std::vector<Batch> gathers = parts;
    for (size_t k = 0; k < parts.size(); ++k) gathers[k].dst = {rows + offsets[k], row_bytes, true};
    ffi::Error launched = ffi::Error::Success();
    (void)Exposed(lanes, stream, [&] {
      launched = LaunchPartsKernel(stream, gathers, 0);  // one slot per pair: no duplicates
      return cudaSuccess;
    });
    if (launched.failure()) {
      (void)cudaFreeAsync(snapshot, stream);
      return launched;
    }
    if (first.whole_blocks) {  // the snapshot holds whole rows
      Batch whole = first;
      whole.dst = {first.dst.data - offsets[0], row_bytes, false};
      whole.src = {rows, row_bytes, true};
      whole.g.outer = 1;
      whole.g.block_bytes = row_bytes;
      parts.assign(1, whole);
    } else {
      for (size_t k = 0; k < parts.size(); ++k) parts[k].src = {rows + offsets[k], row_bytes, true};
    }
  }
  err = cudaEventRecord(lanes->ready, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(lane_stream, lanes->ready, 0);
  if (err == cudaSuccess && options.wait_lane >= 0 && options.wait_lane != options.lane) {
    err = cudaStreamWaitEvent(lane_stream, lanes->done[options.wait_lane], 0);
  }
  if (err == cudaSuccess) err = EnqueueDmaCopies(lane_stream, parts, within);
  if (snapshot != nullptr) {
    // Freed in the lane's order even if enqueueing failed: nothing may leak.
    cudaError_t freed = cudaFreeAsync(snapshot, err == cudaSuccess ? lane_stream : stream);
    if (err == cudaSuccess) err = freed;
  }
  if (err == cudaSuccess) err = cudaEventRecord(lanes->done[options.lane], lane_stream);
  dma_batches.fetch_add(1, std::memory_order_relaxed);
  return err == cudaSuccess ? ffi::Error::Success() : CudaError(err, "lane copy");
}

ffi::Error LaneCopy(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                    ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                    ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                    LaneOptions options) {
  PoolGeometry g;
  int64_t num_pairs = 0;
  if (auto err = CheckPools(dst, src, *out, src_idx, dst_idx, num_tokens, &g, &num_pairs);
      err.failure()) {
    return err;
  }
  if (auto err = CheckLaneCall(options, src_idx, dst_idx, num_tokens); err.failure()) return err;
  int device = 0;
  DeviceLanes* lanes = nullptr;
  if (auto err = LanesFor(stream, &device, &lanes); err.failure()) return err;
  ScopedDevice on_device(device);
  const int64_t dst_blocks = dst.dimensions()[0], src_blocks = src.dimensions()[0];
  char* out_data = static_cast<char*>(out->untyped_data());
  const bool within = src.untyped_data() == dst.untyped_data();
  std::lock_guard<std::mutex> lock(lanes->mu);
  cudaError_t err = cudaSuccess;
  if (options.stream_wait_lane >= 0) {
    err = cudaStreamWaitEvent(stream, lanes->done[options.stream_wait_lane], 0);
  }
  if (err == cudaSuccess && out_data != dst.untyped_data() && dst_blocks > 0) {
    // XLA did not alias: start from dst's contents, and copy within the result.
    err = cudaMemcpyAsync(out_data, dst.untyped_data(), dst_blocks * g.block_bytes,
                          cudaMemcpyDefault, stream);
  }
  if (err != cudaSuccess) return CudaError(err, "lane copy: before the copy");
  if (num_pairs == 0 || dst_blocks == 0 || src_blocks == 0 || g.block_bytes == 0) {
    return ffi::Error::Success();
  }
  const Batch b = PoolBatch(out_data, within ? out_data : static_cast<char*>(src.untyped_data()),
                            src_idx.typed_data(), dst_idx.typed_data(), num_tokens.typed_data(),
                            num_pairs, src_blocks, dst_blocks, g, options.whole_blocks);
  return EnqueueOnLane(stream, lanes, {b}, {0}, g.block_bytes, within, options);
}

ffi::Error LaneCopyWithin(cudaStream_t stream, ffi::AnyBuffer pool, ffi::Buffer<ffi::S32> src_idx,
                          ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                          ffi::Result<ffi::AnyBuffer> out, LaneOptions options) {
  return LaneCopy(stream, pool, pool, src_idx, dst_idx, num_tokens, out, options);
}

// The layered copy (layer_copy.h) on a lane: per layer and slab a part; an offload's snapshot
// holds whole host rows, so that whole blocks go to the host one row per pair.
ffi::Error LayerLaneCopy(cudaStream_t stream, ffi::Buffer<ffi::S32> src_idx,
                         ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                         ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                         LayerLaneOptions options) {
  const LaneOptions lane{options.lane, options.wait_lane, options.stream_wait_lane,
                         options.whole_blocks};
  const LayerCopyOptions copy{options.offload, options.views, true, 0, true,
                              options.whole_blocks};
  LayerCopyPlan plan;
  if (auto err = PlanLayerCopy(src_idx, dst_idx, num_tokens, arrays, outs, copy, &plan);
      err.failure()) {
    return err;
  }
  if (auto err = CheckLaneCall(lane, src_idx, dst_idx, num_tokens); err.failure()) return err;
  int device = 0;
  DeviceLanes* lanes = nullptr;
  if (auto err = LanesFor(stream, &device, &lanes); err.failure()) return err;
  ScopedDevice on_device(device);
  std::lock_guard<std::mutex> lock(lanes->mu);
  cudaError_t err = cudaSuccess;
  if (lane.stream_wait_lane >= 0) {
    err = cudaStreamWaitEvent(stream, lanes->done[lane.stream_wait_lane], 0);
  }
  for (auto& [in, out] : plan.destinations) {
    if (err == cudaSuccess && out.untyped_data() != in.untyped_data() && in.size_bytes() > 0) {
      err = cudaMemcpyAsync(out.untyped_data(), in.untyped_data(), in.size_bytes(),
                            cudaMemcpyDefault, stream);  // XLA did not alias
    }
  }
  if (err != cudaSuccess) return CudaError(err, "lane copy: before the copy");
  const Batch& first = plan.parts[0];
  if (first.num_pairs == 0 || first.src_blocks == 0 || first.dst_blocks == 0) {
    return ffi::Error::Success();
  }
  // The parts' offsets in a host row, and a row's bytes: where the parts write the rows.
  const Side& rows = options.offload ? first.dst : first.src;
  std::vector<int64_t> offsets;
  for (const Batch& part : plan.parts) {
    offsets.push_back((options.offload ? part.dst.data : part.src.data) - rows.data);
  }
  return EnqueueOnLane(stream, lanes, plan.parts, offsets, rows.stride, false, lane);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyCuda, LaneCopy, BindLaneCopy(KVXFER_POOLS_2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyWithinCuda, LaneCopyWithin, BindLaneCopy(KVXFER_POOLS_1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerLaneCopyCuda, LayerLaneCopy,
                              BindLayerOperands(
                                  ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>())
                                  .RemainingRets()  // the host array or the layers, aliased
                                  .Attrs<LayerLaneOptions>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(kJoinLanesCuda, JoinLanes,
                              KVXFER_POOLS_1                   // any array: a pool
                                  .Ret<ffi::AnyBuffer>()       // the same, aliased
                                  .Attr<int64_t>("lanes"));  // bit i: wait for lane i

void DefineLaneFunctions(nb::module_& m) {
  m.def("wait_lanes", []() {
    std::vector<cudaStream_t> streams;
    {
      std::lock_guard<std::mutex> lock(lanes_mu);
      for (auto& [device, lanes] : *lanes_by_device) {
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
    std::lock_guard<std::mutex> lock(lanes_mu);
    for (auto& [device, lanes] : *lanes_by_device) {
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
    std::lock_guard<std::mutex> lock(lanes_mu);
    for (auto& [device, lanes] : *lanes_by_device) {
      std::lock_guard<std::mutex> lanes_lock(lanes->mu);
      ScopedDevice on_device(device);
      SumExposed(lanes);
      seconds += lanes->exposed_seconds;
      lanes->exposed_seconds = 0;
    }
    return seconds;
  }, "Seconds XLA's streams spent on the lanes' account (waits at joins, offload snapshots) in "
     "the timed work that has completed since the last call.");
}

}  // namespace kvxfer
