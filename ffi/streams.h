// The library's own streams, one runtime per device: the transfer lanes (lanes_cuda.cu), two
// for the manager's copies beside compute (0: offloads, 1: onboards). A handler enqueues on a
// lane behind XLA's stream (an event: the lane reads what earlier work wrote) and returns; XLA's
// stream waits for the lane where a later call asks it to (an event again: the manager's join).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "block_copy_cuda.h"

namespace kvxfer {

constexpr int kLanes = 2;  // the manager's lanes

struct DeviceStreams {
  int device = 0;
  std::mutex mu;  // handlers for one device may run on several threads: held while enqueueing
  cudaStream_t lane[kLanes] = {};
  cudaEvent_t done[kLanes] = {};  // the last copy enqueued on each of the manager's lanes
  cudaEvent_t ready = nullptr;    // where XLA's stream was when a lane last followed it
  // Where the onboard lane's last copy was split by layers (lanes_cuda.cu): layer_events[g] is
  // recorded once the layers before layer_ends[g] have landed, for the first `layer_marks`
  // groups; 0 where that copy was not split (then only done[kOnboardLane] says anything).
  std::vector<cudaEvent_t> layer_events;
  std::vector<int64_t> layer_ends;
  size_t layer_marks = 0;
  cudaMemPool_t staging = nullptr;  // offload snapshots, freed in a lane's order
  // Timed event pairs around what the lanes cost XLA's stream (a join's wait, a snapshot),
  // recorded there and summed once both have completed (SumExposed).
  std::vector<std::pair<cudaEvent_t, cudaEvent_t>> exposed;
  std::vector<cudaEvent_t> spare_events;
  double exposed_seconds = 0;  // of the pairs summed so far

  // `follower` waits for everything enqueued on `stream` so far.
  cudaError_t Follow(cudaStream_t follower, cudaStream_t stream) {
    cudaError_t err = cudaEventRecord(ready, stream);
    return err == cudaSuccess ? cudaStreamWaitEvent(follower, ready, 0) : err;
  }
  // `waiter` waits for the last copy enqueued on each lane that `mask` names (bit i: lane i).
  cudaError_t Await(cudaStream_t waiter, int64_t mask) {
    cudaError_t err = cudaSuccess;
    for (int i = 0; i < kLanes && err == cudaSuccess; ++i) {
      if (mask & (int64_t{1} << i)) err = cudaStreamWaitEvent(waiter, done[i], 0);
    }
    return err;
  }
  // `waiter` waits until the first `layers` layers of everything enqueued on the onboard lane
  // so far have landed: the event of the last copy's first group that ends at or after them
  // (the lane runs in order, so it follows every earlier copy whole), else done[kOnboardLane].
  cudaError_t AwaitLayers(cudaStream_t waiter, int64_t layers) {
    for (size_t g = 0; g < layer_marks; ++g) {
      if (layer_ends[g] >= layers) return cudaStreamWaitEvent(waiter, layer_events[g], 0);
    }
    return cudaStreamWaitEvent(waiter, done[kOnboardLane], 0);
  }
  // Times what is enqueued on `stream` between the two calls as the lanes' cost.
  std::pair<cudaEvent_t, cudaEvent_t> BeginExposed(cudaStream_t stream);
  void EndExposed(std::pair<cudaEvent_t, cudaEvent_t> timing, cudaStream_t stream);
  // Adds the completed pairs' times to exposed_seconds and frees their events for reuse.
  void SumExposed();
};

// The streams of the device of XLA's `stream`, made on its first use and never destroyed
// (handlers may run late). Callers make that device current and hold `mu` while enqueueing.
ffi::Error StreamsFor(cudaStream_t stream, DeviceStreams** streams);

// Onboards of whole host rows smaller than this (bytes; 64 KiB) go through a staging buffer in
// device memory where their rows come in runs: one copy per run over the link, then the copy kernel
// scatters the blocks (lanes_cuda.cu, StageOnboard). 0: never. Set from the Python side (the
// bench compares both ways).
extern std::atomic<int64_t> staged_onboard_below;
extern std::atomic<int64_t> staged_onboards;  // onboards that went through staging (for tests)

// For the Python side, over every device: blocks until the manager's lanes have done what was
// enqueued so far; whether they have (without waiting); the exposed seconds since the last call.
cudaError_t WaitLanes();
bool LanesIdle();
double TakeExposedSeconds();

}  // namespace kvxfer
