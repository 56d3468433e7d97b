// Kernel probe (issue 4): which launch shape of an SM-issued block copy gets closest to the
// contiguous-memcpy ceiling, host<->device and device->device, for 256 scattered whole blocks.
// Standalone CUDA (no JAX, no XLA): GPU time between CUDA events, after a spin kernel so the
// host's enqueue time is not counted, median of repeats, ceiling measured in the same run.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/kernel_probe.cu -o /tmp/kernel_probe
//   /tmp/kernel_probe [repeats]
//
// Variants:
//   per-pair   the shape of ffi/block_copy_cuda.cu: ceil(block / 16 KiB) CTAs of 256 threads per
//              block, each thread 4 x 16-byte vectors.
//   grid Gx T xU  a persistent grid of G CTAs of T threads that walks tiles of T*16*U bytes.
//   dma-loop   one cudaMemcpyAsync per block (TensorRT-LLM's shape).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "probe_timer.h"

namespace {

// The shape of the library's kernel for whole blocks.
__global__ void PerPair(char* dst, const char* src, const int* si, const int* di, int64_t bytes,
                        int64_t ctas_per_pair) {
  const int64_t pair = blockIdx.x / ctas_per_pair, cta = blockIdx.x % ctas_per_pair;
  const uint4* s = reinterpret_cast<const uint4*>(src + si[pair] * bytes);
  uint4* d = reinterpret_cast<uint4*>(dst + di[pair] * bytes);
  const int64_t n = bytes / 16, stride = ctas_per_pair * blockDim.x;
  for (int64_t base = cta * blockDim.x + threadIdx.x; base < n; base += stride * 4) {
    probe::CopyVectors<4>(d, s, base, stride, n);
  }
}

// A persistent grid walking tiles of blockDim.x * 16 * U bytes (tiles never cross blocks).
template <int U>
__global__ void Grid(char* dst, const char* src, const int* si, const int* di, int64_t bytes,
                     int64_t pairs) {
  const int64_t tile = int64_t{blockDim.x} * 16 * U;
  const int64_t tiles_per_block = (bytes + tile - 1) / tile;
  const int64_t n = bytes / 16;
  for (int64_t t = blockIdx.x; t < pairs * tiles_per_block; t += gridDim.x) {
    const int64_t pair = t / tiles_per_block;
    const uint4* s = reinterpret_cast<const uint4*>(src + si[pair] * bytes);
    uint4* d = reinterpret_cast<uint4*>(dst + di[pair] * bytes);
    const int64_t base = (t % tiles_per_block) * (tile / 16) + threadIdx.x;
    probe::CopyVectors<U>(d, s, base, blockDim.x, n);
  }
}

struct Pools {
  char *dev_a, *dev_b, *host;
};

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 7;
  const int64_t pairs = 256;
  const int64_t sizes[] = {16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20};
  const int64_t max_bytes = pairs * (4 << 20);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# kernel probe on %s, %d SMs, %lld blocks per batch, median of %d\n", prop.name,
              prop.multiProcessorCount, static_cast<long long>(pairs), repeats);

  Pools p;
  CHECK(cudaMalloc(&p.dev_a, max_bytes));
  CHECK(cudaMalloc(&p.dev_b, max_bytes));
  CHECK(cudaHostAlloc(&p.host, max_bytes, cudaHostAllocDefault));
  CHECK(cudaMemset(p.dev_a, 1, max_bytes));
  std::memset(p.host, 2, max_bytes);

  std::mt19937 rng(7);
  const std::vector<int> si = probe::Shuffled(pairs, rng), di = probe::Shuffled(pairs, rng);
  int* d_si = probe::ToDevice(si);
  int* d_di = probe::ToDevice(di);
  probe::Timer timer = probe::MakeTimer(repeats);
  const int sms = prop.multiProcessorCount;

  struct Dir {
    const char* name;
    char *dst, *src;
  } dirs[] = {{"d2h", p.host, p.dev_a}, {"h2d", p.dev_b, p.host}, {"d2d", p.dev_b, p.dev_a}};

  for (const Dir& dir : dirs) {
    for (int64_t bytes : sizes) {
      const int64_t total = pairs * bytes;
      auto gbps = [&](double s) { return total / s / 1e9; };
      const double ceiling = timer.Median(
          [&] { CHECK(cudaMemcpyAsync(dir.dst, dir.src, total, cudaMemcpyDefault, timer.stream)); });
      std::printf("%s %5lld KiB  memcpy %7.1f GB/s\n", dir.name,
                  static_cast<long long>(bytes >> 10), gbps(ceiling));
      auto report = [&](const std::string& what, double s) {
        std::printf("%s %5lld KiB  %-18s %7.1f GB/s  %5.1f%%\n", dir.name,
                    static_cast<long long>(bytes >> 10), what.c_str(), gbps(s),
                    100.0 * ceiling / s);
      };
      report("dma-loop", timer.Median([&] {
        for (int64_t i = 0; i < pairs; ++i)
          CHECK(cudaMemcpyAsync(dir.dst + di[i] * bytes, dir.src + si[i] * bytes, bytes,
                                cudaMemcpyDefault, timer.stream));
      }));
      const int64_t ctas_per_pair = std::max<int64_t>(1, bytes / (256 * 16 * 4));
      report("per-pair", timer.Median([&] {
        PerPair<<<pairs * ctas_per_pair, 256, 0, timer.stream>>>(dir.dst, dir.src, d_si, d_di,
                                                                 bytes, ctas_per_pair);
      }));
      for (int threads : {256, 512, 1024}) {
        for (int mult : {1, 2, 4, 8}) {
          const int grid = sms * mult * 256 / threads;  // `mult` x 256-thread CTAs per SM
          if (grid < 8) continue;
          char name[64];
          std::snprintf(name, sizeof name, "grid %dx%d u4", grid, threads);
          report(name, timer.Median([&] {
            Grid<4><<<grid, threads, 0, timer.stream>>>(dir.dst, dir.src, d_si, d_di, bytes, pairs);
          }));
          if (threads == 256) {
            std::snprintf(name, sizeof name, "grid %dx%d u8", grid, threads);
            report(name, timer.Median([&] {
              Grid<8><<<grid, threads, 0, timer.stream>>>(dir.dst, dir.src, d_si, d_di, bytes,
                                                          pairs);
            }));
          }
        }
      }
      // Few SMs: how many does a transfer need? (what overlap with compute would leave free)
      for (int grid : {8, 16, 32, 66}) {
        char name[64];
        std::snprintf(name, sizeof name, "grid %dx1024 u4", grid);
        report(name, timer.Median([&] {
          Grid<4><<<grid, 1024, 0, timer.stream>>>(dir.dst, dir.src, d_si, d_di, bytes, pairs);
        }));
      }
    }
  }
  std::printf("# done\n");
  return 0;
}
