// The stream runtime (streams.h).
#include "streams.h"


namespace kvxfer {
namespace {

std::mutex registry_mu;
auto* by_device = new std::unordered_map<int, DeviceStreams*>;  // never destroyed

cudaError_t Create(int device, DeviceStreams* s) {
  s->device = device;
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < kLanes && err == cudaSuccess; ++i) {
    err = cudaStreamCreateWithFlags(&s->lane[i], cudaStreamNonBlocking);
    if (err == cudaSuccess) err = cudaEventCreateWithFlags(&s->done[i], cudaEventDisableTiming);
  }
  if (err == cudaSuccess) err = cudaEventCreateWithFlags(&s->ready, cudaEventDisableTiming);
  if (err != cudaSuccess) return err;
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  err = cudaMemPoolCreate(&s->staging, &props);
  // Keep freed snapshots for the next ones instead of returning them to the driver at every
  // synchronization: the pool then holds at most the largest batch in flight.
  uint64_t keep = UINT64_MAX;
  if (err == cudaSuccess) {
    err = cudaMemPoolSetAttribute(s->staging, cudaMemPoolAttrReleaseThreshold, &keep);
  }
  return err;
}

}  // namespace

ffi::Error StreamsFor(cudaStream_t stream, DeviceStreams** streams) {
  int device = 0;
  if (cudaError_t err = cudaStreamGetDevice(stream, &device); err != cudaSuccess) {
    return CudaStatus(err, "cudaStreamGetDevice");
  }
  std::lock_guard<std::mutex> lock(registry_mu);
  DeviceStreams*& entry = (*by_device)[device];
  if (entry == nullptr) {
    ScopedDevice on_device(device);
    auto* made = new DeviceStreams;
    if (cudaError_t err = Create(device, made); err != cudaSuccess) {
      return CudaStatus(err, "creating the transfer lanes");  // leaks `made`
    }
    entry = made;
  }
  *streams = entry;
  return ffi::Error::Success();
}

void DeviceStreams::SumExposed() {
  size_t kept = 0;
  for (auto& [before, after] : exposed) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, before, after) == cudaSuccess) {
      exposed_seconds += ms * 1e-3;
      spare_events.push_back(before);
      spare_events.push_back(after);
    } else {
      (void)cudaGetLastError();  // not complete yet: cudaErrorNotReady
      exposed[kept++] = {before, after};
    }
  }
  exposed.resize(kept);
}

// An event pair (reused once summed), its first event recorded; null events where creation
// failed.
std::pair<cudaEvent_t, cudaEvent_t> DeviceStreams::BeginExposed(cudaStream_t stream) {
  if (exposed.size() >= 256) SumExposed();  // bounded, whoever reads the sum
  cudaEvent_t pair[2] = {nullptr, nullptr};
  for (cudaEvent_t& e : pair) {
    if (!spare_events.empty()) {
      e = spare_events.back();
      spare_events.pop_back();
    } else if (cudaEventCreate(&e) != cudaSuccess) {
      e = nullptr;
    }
  }
  if (pair[0] != nullptr) (void)cudaEventRecord(pair[0], stream);
  return {pair[0], pair[1]};
}

void DeviceStreams::EndExposed(std::pair<cudaEvent_t, cudaEvent_t> timing, cudaStream_t stream) {
  auto [before, after] = timing;
  if (after != nullptr) (void)cudaEventRecord(after, stream);
  if (before != nullptr && after != nullptr) {
    exposed.emplace_back(before, after);
    return;
  }
  for (cudaEvent_t e : {before, after}) {
    if (e != nullptr) spare_events.push_back(e);
  }
}

cudaError_t WaitLanes() {
  std::vector<cudaStream_t> lanes;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    for (auto& [device, s] : *by_device) {
      if (s != nullptr) lanes.insert(lanes.end(), s->lane, s->lane + kLanes);
    }
  }
  for (cudaStream_t lane : lanes) {
    if (cudaError_t err = cudaStreamSynchronize(lane); err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

bool LanesIdle() {
  std::lock_guard<std::mutex> lock(registry_mu);
  for (auto& [device, s] : *by_device) {
    for (int i = 0; s != nullptr && i < kLanes; ++i) {
      if (cudaEventQuery(s->done[i]) != cudaSuccess) {
        (void)cudaGetLastError();  // cudaErrorNotReady is not an error to keep
        return false;
      }
    }
  }
  return true;
}

double TakeExposedSeconds() {
  double seconds = 0;  // pairs still running count at the next call
  std::lock_guard<std::mutex> lock(registry_mu);
  for (auto& [device, s] : *by_device) {
    if (s == nullptr) continue;
    std::lock_guard<std::mutex> streams_lock(s->mu);
    ScopedDevice on_device(device);
    s->SumExposed();
    seconds += s->exposed_seconds;
    s->exposed_seconds = 0;
  }
  return seconds;
}

}  // namespace kvxfer
