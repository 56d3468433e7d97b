// Partial-copy probe (issue 4, target 3): which way of copying the first n tokens of 256
// scattered blocks device->device gets closest to the contiguous-memcpy ceiling. A block is
// `outer` runs (layers x K/V x heads) of T token rows; a partial copy moves the first n rows of
// every run, so it is `outer` short runs of n * row bytes, T * row bytes apart.
// Standalone CUDA (no JAX, no XLA): GPU time between CUDA events after a spin kernel, median of
// repeats, the ceiling (one contiguous cudaMemcpyAsync of the bytes moved) in the same run.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 benchmarks/partial_probe.cu -o /tmp/partial_probe
//   /tmp/partial_probe [repeats]
//
// Variants:
//   warp-run uU Cc  the library's shape for runs of >= 32 vectors: C CTAs of 256 threads per
//                   pair, one warp per run at a time, U 16-byte vectors in flight per lane.
//   flat uU         every thread takes vectors of the pair's moved bytes by linear index
//                   (one 32-bit division per vector to find its run), U in flight.
//   tile XxY uU     2-D CTAs: X lanes along a run, Y runs side by side, U runs per thread.
//   memcpy2d        one cudaMemcpy2DAsync per block (the copy engines).
//   whole           the whole blocks instead (moves T/n times the bytes; the fallback bound).
// Every variant's result is checked against a host reference copy once.
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

#define CHECK(x)                                                                   \
  do {                                                                             \
    cudaError_t e = (x);                                                           \
    if (e != cudaSuccess) {                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x,               \
                   cudaGetErrorString(e));                                         \
      std::exit(1);                                                                \
    }                                                                              \
  } while (0)

namespace {

struct Geo {
  int64_t outer, tokens, row_bytes;
  __host__ __device__ int64_t block_bytes() const { return outer * tokens * row_bytes; }
};

struct Args {
  char* dst;
  const char* src;
  const int* si;
  const int* di;
  Geo g;
  int64_t n;  // tokens copied per run
};

__global__ void Spin(long long cycles) {
  long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

template <int U>
__global__ void WarpRun(Args a, int64_t ctas_per_pair) {
  const int64_t pair = blockIdx.x / ctas_per_pair, cta = blockIdx.x % ctas_per_pair;
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t pitch = a.g.tokens * a.g.row_bytes, per_run = a.n * a.g.row_bytes / 16;
  const char* s0 = a.src + a.si[pair] * a.g.block_bytes();
  char* d0 = a.dst + a.di[pair] * a.g.block_bytes();
  for (int64_t r = cta * warps + warp; r < a.g.outer; r += ctas_per_pair * warps) {
    const uint4* s = reinterpret_cast<const uint4*>(s0 + r * pitch);
    uint4* d = reinterpret_cast<uint4*>(d0 + r * pitch);
    for (int64_t base = lane; base < per_run; base += 32 * U) {
      uint4 v[U];
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (base + k * 32 < per_run) v[k] = s[base + k * 32];
#pragma unroll
      for (int k = 0; k < U; ++k)
        if (base + k * 32 < per_run) d[base + k * 32] = v[k];
    }
  }
}

template <int U>
__global__ void Flat(Args a, int64_t ctas_per_pair) {
  const int64_t pair = blockIdx.x / ctas_per_pair, cta = blockIdx.x % ctas_per_pair;
  const uint32_t pitch_v = static_cast<uint32_t>(a.g.tokens * a.g.row_bytes / 16);
  const uint32_t per_run = static_cast<uint32_t>(a.n * a.g.row_bytes / 16);
  const uint32_t total = static_cast<uint32_t>(a.g.outer) * per_run;
  const uint4* s = reinterpret_cast<const uint4*>(a.src + a.si[pair] * a.g.block_bytes());
  uint4* d = reinterpret_cast<uint4*>(a.dst + a.di[pair] * a.g.block_bytes());
  const uint32_t stride = static_cast<uint32_t>(ctas_per_pair * blockDim.x);
  for (uint32_t base = cta * blockDim.x + threadIdx.x; base < total; base += stride * U) {
    uint4 v[U];
    uint32_t off[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const uint32_t i = base + k * stride;
      off[k] = i / per_run * pitch_v + i % per_run;
      if (i < total) v[k] = s[off[k]];
    }
#pragma unroll
    for (int k = 0; k < U; ++k)
      if (base + k * stride < total) d[off[k]] = v[k];
  }
}

template <int U>
__global__ void Tile(Args a, int64_t ctas_per_pair) {
  const int64_t pair = blockIdx.x / ctas_per_pair, cta = blockIdx.x % ctas_per_pair;
  const int64_t pitch = a.g.tokens * a.g.row_bytes, per_run = a.n * a.g.row_bytes / 16;
  const char* s0 = a.src + a.si[pair] * a.g.block_bytes();
  char* d0 = a.dst + a.di[pair] * a.g.block_bytes();
  const int64_t run_stride = ctas_per_pair * blockDim.y;
  for (int64_t r0 = cta * blockDim.y + threadIdx.y; r0 < a.g.outer; r0 += run_stride * U) {
    for (int64_t x = threadIdx.x; x < per_run; x += blockDim.x) {
      uint4 v[U];
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int64_t r = r0 + k * run_stride;
        if (r < a.g.outer) v[k] = reinterpret_cast<const uint4*>(s0 + r * pitch)[x];
      }
#pragma unroll
      for (int k = 0; k < U; ++k) {
        const int64_t r = r0 + k * run_stride;
        if (r < a.g.outer) reinterpret_cast<uint4*>(d0 + r * pitch)[x] = v[k];
      }
    }
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

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 7;
  const int64_t pairs = 256;
  // The bench's 256 KiB, 1 MiB and 4 MiB blocks (bf16, size_per_head 64 or 128).
  const Geo geos[] = {{128, 16, 128}, {512, 16, 128}, {512, 32, 256}};
  const int64_t max_bytes = pairs * (4 << 20);
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# partial probe on %s, %d SMs, %lld blocks per batch, median of %d\n", prop.name,
              prop.multiProcessorCount, static_cast<long long>(pairs), repeats);

  char *src, *dst;
  CHECK(cudaMalloc(&src, max_bytes));
  CHECK(cudaMalloc(&dst, max_bytes));
  std::vector<unsigned char> host_src(max_bytes);
  std::mt19937 rng(7);
  for (auto& c : host_src) c = static_cast<unsigned char>(rng());
  CHECK(cudaMemcpy(src, host_src.data(), max_bytes, cudaMemcpyHostToDevice));

  std::vector<int> si(pairs), di(pairs);
  std::iota(si.begin(), si.end(), 0);
  std::iota(di.begin(), di.end(), 0);
  std::shuffle(si.begin(), si.end(), rng);
  std::shuffle(di.begin(), di.end(), rng);
  int *d_si, *d_di;
  CHECK(cudaMalloc(&d_si, pairs * sizeof(int)));
  CHECK(cudaMalloc(&d_di, pairs * sizeof(int)));
  CHECK(cudaMemcpy(d_si, si.data(), pairs * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_di, di.data(), pairs * sizeof(int), cudaMemcpyHostToDevice));

  Timer timer{};
  CHECK(cudaStreamCreateWithFlags(&timer.stream, cudaStreamNonBlocking));
  CHECK(cudaEventCreate(&timer.a));
  CHECK(cudaEventCreate(&timer.b));
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  timer.spin_cycles = static_cast<long long>(clock_khz) * 3;  // ~3 ms
  timer.repeats = repeats;
  std::vector<unsigned char> got(max_bytes);

  for (const Geo& g : geos) {
    for (int64_t n : {g.tokens / 2, g.tokens - 1}) {
      const int64_t moved = pairs * g.outer * n * g.row_bytes;
      const int64_t bb = g.block_bytes();
      const double ceiling = timer.Median(
          [&] { CHECK(cudaMemcpyAsync(dst, src, moved, cudaMemcpyDeviceToDevice, timer.stream)); });
      std::printf("d2d %5lld KiB n=%-3lld memcpy of the moved bytes %7.1f GB/s\n",
                  static_cast<long long>(bb >> 10), static_cast<long long>(n),
                  moved / ceiling / 1e9);
      const Args args{dst, src, d_si, d_di, g, n};
      // Checks the first n rows of every run of two pairs against the source.
      auto verify = [&](const std::string& what) {
        CHECK(cudaMemset(dst, 0, max_bytes));
        CHECK(cudaStreamSynchronize(timer.stream));
        return [&, what](auto&& enqueue) {
          enqueue();
          CHECK(cudaStreamSynchronize(timer.stream));
          CHECK(cudaMemcpy(got.data(), dst, max_bytes, cudaMemcpyDeviceToHost));
          for (int64_t p : {int64_t{0}, pairs - 1}) {
            for (int64_t r = 0; r < g.outer; ++r) {
              const int64_t off = r * g.tokens * g.row_bytes, len = n * g.row_bytes;
              if (std::memcmp(&got[di[p] * bb + off], &host_src[si[p] * bb + off], len) != 0) {
                std::printf("  %s: WRONG (pair %lld, run %lld)\n", what.c_str(),
                            static_cast<long long>(p), static_cast<long long>(r));
                return false;
              }
            }
          }
          return true;
        };
      };
      auto run = [&](const std::string& what, auto&& enqueue) {
        if (!verify(what)(enqueue)) return;
        const double s = timer.Median(enqueue);
        std::printf("d2d %5lld KiB n=%-3lld %-22s %7.1f GB/s  %5.1f%%\n",
                    static_cast<long long>(bb >> 10), static_cast<long long>(n), what.c_str(),
                    moved / s / 1e9, 100.0 * ceiling / s);
      };
      for (int64_t cpp : {1, 2, 4, 8, 16, 64}) {  // CTAs per pair
        if (cpp * 8 > g.outer) continue;          // every warp gets a run
        char name[64];
        std::snprintf(name, sizeof name, "warp-run u4 c%lld", static_cast<long long>(cpp));
        run(name, [&] { WarpRun<4><<<pairs * cpp, 256, 0, timer.stream>>>(args, cpp); });
        std::snprintf(name, sizeof name, "warp-run u8 c%lld", static_cast<long long>(cpp));
        run(name, [&] { WarpRun<8><<<pairs * cpp, 256, 0, timer.stream>>>(args, cpp); });
        std::snprintf(name, sizeof name, "flat u4 c%lld", static_cast<long long>(cpp));
        run(name, [&] { Flat<4><<<pairs * cpp, 256, 0, timer.stream>>>(args, cpp); });
        std::snprintf(name, sizeof name, "flat u8 c%lld", static_cast<long long>(cpp));
        run(name, [&] { Flat<8><<<pairs * cpp, 256, 0, timer.stream>>>(args, cpp); });
      }
      const int64_t per_run = n * g.row_bytes / 16;
      for (int x : {16, 32, 64}) {
        if (x > per_run * 2) continue;
        for (int64_t cpp : {int64_t{1}, int64_t{4}}) {
          const int y = 256 / x;
          char name[64];
          std::snprintf(name, sizeof name, "tile %dx%d u4 c%lld", x, y,
                        static_cast<long long>(cpp));
          run(name, [&] { Tile<4><<<pairs * cpp, dim3(x, y), 0, timer.stream>>>(args, cpp); });
        }
      }
      run("memcpy2d", [&] {
        for (int64_t i = 0; i < pairs; ++i)
          CHECK(cudaMemcpy2DAsync(dst + di[i] * bb, g.tokens * g.row_bytes, src + si[i] * bb,
                                  g.tokens * g.row_bytes, n * g.row_bytes, g.outer,
                                  cudaMemcpyDeviceToDevice, timer.stream));
      });
      Args whole = args;
      whole.n = g.tokens;
      const int64_t cpp = std::max<int64_t>(1, bb / (16 << 10));
      run("whole (bound)", [&] { WarpRun<4><<<pairs * cpp, 256, 0, timer.stream>>>(whole, cpp); });
    }
  }
  std::printf("# done\n");
  return 0;
}
