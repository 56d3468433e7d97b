// The handlers on the library's own streams (streams.h): the transfer lanes' copies and their
// join, and a step's wait for onboarded layers. docs/design.md ("The native side") tells what each
// orders after what and what must outlive a call; the comments here say how.
#include <tuple>
#include <utility>
#include <vector>

#include "layer_copy.h"
#include "streams.h"

namespace kvxfer {

// Measured on the H200 (bench --only peers, rows in runs of 4): staged, 16 KiB rows onboard at
// 72-84 % of memcpy against 41-58 % one copy each; 64 KiB rows at 73-87 % against 81-95 %.
std::atomic<int64_t> staged_onboard_below{int64_t{64} << 10};
std::atomic<int64_t> staged_onboards{0};

namespace {

// A staged onboard takes at most this many copies per pair: rows in runs of two on average.
constexpr double kStagedCopiesPerPair = 0.5;
// The staged onboard's kernel grid, in CTAs of 1024 threads: a few of the GPU's SMs, beside the
// model step (a device-to-device scatter needs few to keep ahead of PCIe).
constexpr int64_t kStagingCtas = 16;

// `first` (a part of a batch over whole blocks) seen as the batch of whole host rows of
// `row_bytes` it belongs to, between `dst` and `src`: one run of a row per pair.
Batch WholeRows(Batch first, Side dst, Side src, int64_t row_bytes) {
  first.dst = dst;
  first.src = src;
  first.g.outer = 1;
  first.g.block_bytes = row_bytes;
  return first;
}

// Plans an onboard of whole host rows through a staging buffer in device memory, where its rows
// come in runs and are smaller than staged_onboard_below: `runs` get the copies from the host
// rows into the staging rows (one per pair), and `parts` (rows of `row_bytes`, part k at
// offsets[k] of a row) read the staging rows and a device copy of the indices, which XLA's
// stream makes here: once XLA's stream has passed this call, the manager may hand the plan
// ring's slot out again, while the lane's kernel reads the indices later. `*staging` stays null,
// with nothing enqueued, where the onboard is not staged (then: one copy per pair).
ffi::Error StageOnboard(cudaStream_t stream, DeviceStreams* lanes, std::vector<Batch>* parts,
                        const std::vector<int64_t>& offsets, int64_t row_bytes,
                        std::vector<DmaCopy>* runs, void** staging) {
  const Batch first = (*parts)[0];
  if (!first.whole_blocks || row_bytes >= staged_onboard_below.load(std::memory_order_relaxed)) {
    return ffi::Error::Success();
  }
  const Batch rows = WholeRows(first, first.dst, {first.src.data - offsets[0], row_bytes, false},
                               row_bytes);
  std::vector<StagedRun> planned;
  if (!PlanStagedSources(rows, kStagedCopiesPerPair, &planned)) return ffi::Error::Success();
  const int64_t n = first.num_pairs;
  const int64_t index_at = (n * row_bytes + 15) / 16 * 16;
  if (cudaMallocFromPoolAsync(staging, index_at + 2 * n * sizeof(int32_t), lanes->staging,
                              stream) != cudaSuccess) {
    (void)cudaGetLastError();  // no room: one copy per pair instead
    *staging = nullptr;
    return ffi::Error::Success();
  }
  char* base = static_cast<char*>(*staging);
  int32_t* indices = reinterpret_cast<int32_t*>(base + index_at);
  cudaError_t err = cudaMemcpyAsync(indices, first.src_idx, n * sizeof(int32_t),
                                    cudaMemcpyDefault, stream);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(indices + n, first.dst_idx, n * sizeof(int32_t), cudaMemcpyDefault,
                          stream);
  }
  if (err != cudaSuccess) {
    (void)cudaFreeAsync(*staging, stream);
    *staging = nullptr;
    return CudaStatus(err, "lane copy: staging the indices");
  }
  for (size_t k = 0; k < parts->size(); ++k) {
    Batch& part = (*parts)[k];
    part.src = {base + offsets[k], row_bytes, true};
    part.src_idx = indices;
    part.dst_idx = indices + n;
  }
  runs->clear();
  for (const StagedRun& r : planned) {
    runs->push_back({base + r.pair * row_bytes, r.src, r.bytes, r.bytes, 1});
  }
  staged_onboards.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

// Enqueues an onboard split by layers (SplitLayerGroups) on `lane_stream`: each group's copies,
// then its event, marked for AwaitLayers once every group's is recorded.
cudaError_t EnqueueLayerGroups(DeviceStreams* lanes, cudaStream_t lane_stream,
                               const std::vector<std::vector<Batch>>& groups,
                               const std::vector<int64_t>& ends) {
  lanes->layer_marks = 0;  // until every group's event is recorded: waits take done[] instead
  while (lanes->layer_events.size() < groups.size()) {
    cudaEvent_t event = nullptr;
    if (cudaError_t err = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        err != cudaSuccess) {
      return err;
    }
    lanes->layer_events.push_back(event);
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    cudaError_t err = EnqueueDmaCopies(lane_stream, groups[g], false);
    if (err == cudaSuccess) err = cudaEventRecord(lanes->layer_events[g], lane_stream);
    if (err != cudaSuccess) return err;
  }
  lanes->layer_ends = ends;
  lanes->layer_marks = groups.size();
  return cudaSuccess;
}

// Enqueues `parts` (one batch, or a layered copy's batch per layer and slab) on lane
// options.lane, behind XLA's stream. An offload (a source in device memory, not `within` one
// pool) first gathers every part's sources on XLA's stream into a snapshot of one row of
// `row_bytes` per pair, part k at `offsets[k]` of the row; with whole blocks the lane then copies
// whole rows, one copy per pair (adjacent rows merged). `unaliased`: (result, operand, bytes) of
// the destinations, copied first where XLA did not alias them. An onboard of whole host rows in
// runs may go through staging instead (StageOnboard), or, with options.layer_groups, be split by
// the layers `part_layers` names for each part (first, count) instead.
ffi::Error EnqueueOnLane(cudaStream_t stream, const LaneOptions& options,
                         const std::vector<std::tuple<void*, const void*, size_t>>& unaliased,
                         std::vector<Batch> parts, const std::vector<int64_t>& offsets,
                         int64_t row_bytes, bool within,
                         const std::vector<std::pair<int64_t, int64_t>>& part_layers) {
  const auto lane_ok = [](int64_t l) { return l >= 0 && l < kLanes; };
  if (!lane_ok(options.lane) || (options.wait_lane >= 0 && !lane_ok(options.wait_lane)) ||
      (options.stream_wait_lane >= 0 && !lane_ok(options.stream_wait_lane))) {
    return ffi::Error::InvalidArgument("jax_kvxfer lane copy: lane numbers must be 0 or 1");
  }
  if (IndicesOffHost(parts[0]) != nullptr) {
    return ffi::Error::InvalidArgument(
        "jax_kvxfer lane copy: the indices must be in pinned host memory (the manager's plan "
        "ring), where the handler reads them");
  }
  DeviceStreams* lanes = nullptr;
  KVXFER_RETURN_IF_ERROR(StreamsFor(stream, &lanes));
  ScopedDevice on_device(lanes->device);
  std::lock_guard<std::mutex> lock(lanes->mu);
  // XLA's stream waits for stream_wait_lane (where a snapshot reads what that lane writes).
  cudaError_t err = lanes->Await(stream, options.stream_wait_lane >= 0
                                             ? int64_t{1} << options.stream_wait_lane : 0);
  for (auto& [out, in, bytes] : unaliased) {
    if (err == cudaSuccess) err = CopyUnaliased(stream, out, in, bytes);
  }
  KVXFER_RETURN_IF_ERROR(CudaStatus(err, "lane copy: before the copy"));
  const Batch first = parts[0];
  if (NothingToCopy(first)) return ffi::Error::Success();
  const cudaStream_t lane_stream = lanes->lane[options.lane];
  void* staging = nullptr;  // an offload's snapshot, or a staged onboard's rows
  std::vector<DmaCopy> staged_runs;
  std::vector<std::vector<Batch>> layer_groups;  // an onboard split by layers
  std::vector<int64_t> group_ends;
  if (!within && !IsHostMemory(first.src.data)) {
    // An offload: gather the source blocks on XLA's stream (a device-to-device copy, a small
    // part of the transfer's time), then copy the gathered blocks to the host on the lane.
    err = cudaMallocFromPoolAsync(&staging, first.num_pairs * row_bytes, lanes->staging, stream);
    if (err != cudaSuccess) {
      // No room for a snapshot: copy on XLA's stream instead, after both lanes (the copy
      // must come after the pending ones), ordered like any other op from then on.
      (void)cudaGetLastError();
      err = lanes->Await(stream, (1 << kLanes) - 1);
      if (err == cudaSuccess) err = EnqueueDmaCopies(stream, parts, false);
      return CudaStatus(err, "lane copy (in line)");
    }
    char* rows = static_cast<char*>(staging);
    std::vector<Batch> gathers = parts;
    for (size_t k = 0; k < parts.size(); ++k) gathers[k].dst = {rows + offsets[k], row_bytes, true};
    const auto timing = lanes->BeginExposed(stream);
    ffi::Error launched = LaunchPartsKernel(stream, gathers, 0);  // one slot per pair: no duplicates
    lanes->EndExposed(timing, stream);
    if (launched.failure()) {
      (void)cudaFreeAsync(staging, stream);
      return launched;
    }
    if (first.whole_blocks) {  // the snapshot holds whole rows
      parts.assign(1, WholeRows(first, {first.dst.data - offsets[0], row_bytes, false},
                                {rows, row_bytes, true}, row_bytes));
    } else {
      for (size_t k = 0; k < parts.size(); ++k) parts[k].src = {rows + offsets[k], row_bytes, true};
    }
  } else if (!within) {
    std::vector<LayeredPart> layered;
    for (size_t k = 0; k < parts.size(); ++k) {
      layered.push_back({parts[k], part_layers[k].first, part_layers[k].second});
    }
    if (options.layer_groups < 2 ||
        !SplitLayerGroups(layered, options.layer_groups, &layer_groups, &group_ends)) {
      KVXFER_RETURN_IF_ERROR(
          StageOnboard(stream, lanes, &parts, offsets, row_bytes, &staged_runs, &staging));
    }
  }
  // The lane starts behind XLA's stream, and behind wait_lane (where their slots meet).
  err = lanes->Follow(lane_stream, stream);
  if (err == cudaSuccess && options.wait_lane >= 0 && options.wait_lane != options.lane) {
    err = lanes->Await(lane_stream, int64_t{1} << options.wait_lane);
  }
  ffi::Error launched = ffi::Error::Success();
  if (err == cudaSuccess && !staged_runs.empty()) {  // a staged onboard
    err = EnqueuePlannedCopies(lane_stream, staged_runs, false);
    if (err == cudaSuccess) launched = LaunchPartsKernel(lane_stream, parts, kStagingCtas);
  } else if (err == cudaSuccess && !layer_groups.empty()) {
    err = EnqueueLayerGroups(lanes, lane_stream, layer_groups, group_ends);
  } else if (err == cudaSuccess) {
    err = EnqueueDmaCopies(lane_stream, parts, within);
  }
  if (options.lane == kOnboardLane && layer_groups.empty()) {
    lanes->layer_marks = 0;  // this copy is not split: a layer wait waits for all of it
  }
  if (staging != nullptr) {
    // Freed in the lane's order even if enqueueing failed: nothing may leak.
    cudaError_t freed = cudaFreeAsync(staging, err == cudaSuccess ? lane_stream : stream);
    if (err == cudaSuccess) err = freed;
  }
  if (err == cudaSuccess) err = cudaEventRecord(lanes->done[options.lane], lane_stream);
  KVXFER_RETURN_IF_ERROR(launched);
  return CudaStatus(err, "lane copy");
}

ffi::Error LaneCopy(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                    ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                    ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                    LaneOptions options) {
  Batch b;
  KVXFER_RETURN_IF_ERROR(
      PoolBatch(dst, src, *out, src_idx, dst_idx, num_tokens, options.whole_blocks, &b));
  // Within one pool: start from dst's contents, and copy within the result.
  const bool within = src.untyped_data() == dst.untyped_data();
  if (within) b.src.data = b.dst.data;
  return EnqueueOnLane(stream, options,
                       {{b.dst.data, dst.untyped_data(), b.dst_blocks * b.g.block_bytes}}, {b},
                       {0}, b.g.block_bytes, within, {{0, dst.dimensions()[1]}});
}

// The layered copy (layer_copy.h) on a lane: per layer and slab a part; an offload's snapshot
// holds whole host rows, so that whole blocks go to the host one row per pair.
ffi::Error LayerLaneCopy(cudaStream_t stream, ffi::Buffer<ffi::S32> src_idx,
                         ffi::Buffer<ffi::S32> dst_idx, ffi::Buffer<ffi::S32> num_tokens,
                         ffi::RemainingArgs arrays, ffi::RemainingRets outs,
                         Layered<LaneOptions> options) {
  LayerCopyPlan plan;
  KVXFER_RETURN_IF_ERROR(PlanLayerCopy(src_idx, dst_idx, num_tokens, arrays, outs, options, &plan));
  std::vector<std::pair<int64_t, int64_t>> part_layers;
  for (int64_t layer : plan.part_layers) part_layers.emplace_back(layer, 1);
  return EnqueueOnLane(stream, options.o, plan.destinations, plan.parts, plan.row_offsets,
                       plan.row_bytes, false, part_layers);
}

// XLA's stream waits as `await_lanes(lanes)` enqueues it (timed as what the lanes cost it), then
// `array` is handed on as `out`: the lanes' join and a step's wait for layers. `what` names the
// wait in an error.
template <typename AwaitLanes>
ffi::Error WaitThenHandOn(cudaStream_t stream, ffi::AnyBuffer array,
                          ffi::Result<ffi::AnyBuffer> out, const char* what,
                          AwaitLanes await_lanes) {
  DeviceStreams* lanes = nullptr;
  KVXFER_RETURN_IF_ERROR(StreamsFor(stream, &lanes));
  ScopedDevice on_device(lanes->device);
  std::lock_guard<std::mutex> lock(lanes->mu);
  const auto timing = lanes->BeginExposed(stream);
  cudaError_t err = await_lanes(lanes);
  lanes->EndExposed(timing, stream);
  if (err == cudaSuccess) {
    err = CopyUnaliased(stream, out->untyped_data(), array.untyped_data(), array.size_bytes());
  }
  return CudaStatus(err, what);
}

// XLA's stream waits for everything enqueued so far on the lanes of its device that `lanes`
// names (bit i: lane i).
ffi::Error JoinLanes(cudaStream_t stream, ffi::AnyBuffer array, ffi::Result<ffi::AnyBuffer> out,
                     int64_t lane_mask) {
  return WaitThenHandOn(stream, array, out, "join the transfer lanes",
                        [&](DeviceStreams* lanes) { return lanes->Await(stream, lane_mask); });
}

// XLA's stream waits until the first `layers` layers of everything enqueued on the onboard lane
// so far have landed (DeviceStreams::AwaitLayers): a model step's wait before those layers.
ffi::Error WaitLayers(cudaStream_t stream, ffi::AnyBuffer array, ffi::Result<ffi::AnyBuffer> out,
                      int64_t layers) {
  return WaitThenHandOn(stream, array, out, "wait for the onboarded layers",
                        [&](DeviceStreams* lanes) { return lanes->AwaitLayers(stream, layers); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyCuda, LaneCopy, BindLaneCopy(KVXFER_POOLS_2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLaneCopyWithinCuda, Within<LaneCopy>{}, BindLaneCopy(KVXFER_POOLS_1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kLayerLaneCopyCuda, LayerLaneCopy, BindLayerLaneCopy(KVXFER_STREAM));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kJoinLanesCuda, JoinLanes, BindJoinLanes(KVXFER_POOLS_1));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kWaitLayersCuda, WaitLayers, BindWaitLayers(KVXFER_POOLS_1));

}  // namespace kvxfer
