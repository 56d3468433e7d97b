// Both ways at once: the fork/join pair of custom calls behind copy_blocks_both_ways.
//
// An offload and an onboard between the same two pools run as two calls,
// `new_b = fork(b, a, ...)` then `new_a = join(a, new_b, ..., ticket, ...)`: each aliases one
// pool only (XLA's host offloader rejects a custom call that aliases a pinned_host pool and
// another output), and the second reads the first's result, so XLA sees no cycle and copies no
// pool. To run the two at the same time, the fork enqueues its copy on a side stream of its own
// and returns at once; the join enqueues its copy on XLA's stream and then makes that stream
// wait for the fork's copy, so everything after the join sees both copies done. The Python side
// uses the pair only when no block is written by one direction and read by the other. The join
// takes the fork's operands and results as extra operands, so that XLA keeps them alive (and
// does not reuse their memory) until the fork's copy has finished.
#include <mutex>
#include <unordered_map>

#include "block_copy_cuda.h"

namespace kvxfer {
namespace {

struct ForkJoinState {
  std::mutex mu;
  std::unordered_map<int, cudaStream_t> side_streams;          // by device
  std::unordered_map<const void*, cudaEvent_t> pending_joins;  // by ticket buffer
};

ForkJoinState& ForkJoin() {
  static ForkJoinState* state = new ForkJoinState;  // never destroyed: handlers may run late
  return *state;
}

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

ffi::Error Fork(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                ffi::Buffer<ffi::S32> num_tokens, ffi::Result<ffi::AnyBuffer> out,
                ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                ffi::Result<ffi::Buffer<ffi::U8>> staging, ffi::Result<ffi::AnyBuffer> ticket,
                CopyOptions options) {
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
  if (auto copy = CopyOnStream(side, dst, src, src_idx, dst_idx, num_tokens, *out, *superseded,
                               *staging, options);
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

ffi::Error Join(cudaStream_t stream, ffi::AnyBuffer dst, ffi::AnyBuffer src,
                ffi::Buffer<ffi::S32> src_idx, ffi::Buffer<ffi::S32> dst_idx,
                ffi::Buffer<ffi::S32> num_tokens, ffi::AnyBuffer ticket,
                ffi::RemainingArgs /*kept alive*/, ffi::Result<ffi::AnyBuffer> out,
                ffi::Result<ffi::Buffer<ffi::S32>> superseded,
                ffi::Result<ffi::Buffer<ffi::U8>> staging, JoinOptions options) {
  ffi::Error copy = CopyOnStream(stream, dst, src, src_idx, dst_idx, num_tokens, *out,
                                 *superseded, *staging, options.copy);
  if (!options.wait) return copy;  // ordered by its operands only
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyForkCuda, Fork, BindForkCopy(KVXFER_POOLS_2));
XLA_FFI_DEFINE_HANDLER_SYMBOL(kBlockCopyJoinCuda, Join, BindJoinCopy(KVXFER_POOLS_2));

}  // namespace kvxfer
