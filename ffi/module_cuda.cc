// The CUDA module: registers every target of the table (targets.h) with its handler
// (block_copy_cuda.cu: on XLA's stream; lanes_cuda.cu: on the library's own streams), and the
// functions the Python side calls on the stream runtime (streams.h).
#include <stdexcept>
#include <string>

#include "block_copy_cuda.h"
#include "nanobind/nanobind.h"
#include "streams.h"
#include "targets.h"

namespace nb = nanobind;

#define KVXFER_DECLARE(name, cuda, cpu) XLA_FFI_DECLARE_HANDLER_SYMBOL(k##cuda##Cuda);
KVXFER_TARGETS(KVXFER_DECLARE)
#undef KVXFER_DECLARE

NB_MODULE(_kvxfer_cuda, m) {
  m.doc() = "CUDA XLA FFI handlers of jax_kvxfer";
  kvxfer::ReadSmCounts();
  m.def("registrations", []() {
    nb::dict d;
#define KVXFER_REGISTER(name, cuda, cpu) d[name] = nb::capsule(reinterpret_cast<void*>(k##cuda##Cuda));
    KVXFER_TARGETS(KVXFER_REGISTER)
#undef KVXFER_REGISTER
    return d;
  });
  m.def("dma_batches", []() { return kvxfer::dma_batches.load(std::memory_order_relaxed); },
        "How many batches the CUDA handlers have copied on the copy engines (for tests).");
  m.def("staged_onboards",
        []() { return kvxfer::staged_onboards.load(std::memory_order_relaxed); },
        "How many lane onboards went through a staging buffer in device memory (for tests).");
  m.def("stage_onboards_below", [](int64_t row_bytes) {
    return kvxfer::staged_onboard_below.exchange(row_bytes, std::memory_order_relaxed);
  }, "Onboards of host rows smaller than this many bytes, in runs, are staged in device "
     "memory (0: never); returns the previous limit.");
  m.def("wait_lanes", []() {
    cudaError_t err = cudaSuccess;
    {
      nb::gil_scoped_release released;
      err = kvxfer::WaitLanes();
    }
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("jax_kvxfer: waiting for the transfer lanes: ") +
                               cudaGetErrorString(err));
    }
  }, "Blocks until every copy enqueued on the transfer lanes so far is done.");
  m.def("lanes_idle", &kvxfer::LanesIdle,
        "Whether every copy enqueued on the transfer lanes so far is done (does not wait).");
  m.def("take_exposed_seconds", &kvxfer::TakeExposedSeconds,
        "Seconds XLA's streams spent on the lanes' account (waits at joins, offload snapshots) "
        "in the timed work that has completed since the last call.");
}
