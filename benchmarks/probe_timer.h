// What the standalone probes share: error checks, a GPU-time median that does not count the
// host's enqueue time (the timed work waits behind a spin kernel), and a vector copy step.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <vector>

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,               \
                   cudaGetErrorString(e));                                         \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

namespace probe {

__global__ void Spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

struct Timer {
  cudaStream_t stream;
  cudaEvent_t a, b;
  long long spin_cycles;
  int repeats;

  template <typename F>
  double Median(F&& enqueue) {
    std::vector<double> ms;
    for (int r = -2; r < repeats; ++r) {  // two warm-ups
      Spin<<<1, 1, 0, stream>>>(spin_cycles);
      CHECK(cudaEventRecord(a, stream));
      enqueue();
      CHECK(cudaEventRecord(b, stream));
      CHECK(cudaEventSynchronize(b));
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, a, b));
      if (r >= 0) ms.push_back(t);
    }
    CHECK(cudaGetLastError());
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1e-3;
  }
};

// A timer on a non-blocking stream of its own; the spin kernel lasts about 3 ms.
inline Timer MakeTimer(int repeats) {
  Timer timer{};
  CHECK(cudaStreamCreateWithFlags(&timer.stream, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&timer.a));
  CHECK(cudaEventCreate(&timer.b));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  timer.spin_cycles = static_cast<long long>(clock_khz) * 3;
  timer.repeats = repeats;
  return timer;
}

// 0..n-1 in a random order (scattered block indices).
inline std::vector<int> Shuffled(int64_t n, std::mt19937& rng) {
  std::vector<int> v(n);
  std::iota(v.begin(), v.end(), 0);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

// Copies the U 16-byte vectors `step` apart from `base` that lie below `end`: all loaded, then
// all stored, so that the loads are in flight together.
template <int U>
__device__ __forceinline__ void CopyVectors(uint4* __restrict__ d, const uint4* __restrict__ s,
                                            int64_t base, int64_t step, int64_t end) {
  uint4 v[U];
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (base + k * step < end) v[k] = s[base + k * step];
#pragma unroll
  for (int k = 0; k < U; ++k)
    if (base + k * step < end) d[base + k * step] = v[k];
}

inline int* ToDevice(const std::vector<int>& v) {
  int* d = nullptr;
  CHECK(cudaMalloc(&d, v.size() * sizeof(int)));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice));
  return d;
}

}  // namespace probe
