// What the standalone probes share: error checks and a GPU-time median that does not count
// the host's enqueue time (the timed work waits behind a spin kernel).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
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

}  // namespace probe
