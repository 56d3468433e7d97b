// The FFI targets both compiled modules register, in one X-macro: X(name, cuda, cpu) registers
// `name` with the handler symbol k<cuda>Cuda (block_copy_cuda.cu, lanes_cuda.cu; registered by
// module_cuda.cc) or k<cpu>Cpu (block_copy_cpu.cc). The CPU has no command buffers, so its
// nograph targets are the same handlers as the others. jax_kvxfer/_native.py spells the same names for Python;
// tests/test_layering.py checks that the two lists agree and that no other C++ file spells a
// target, tests/native/test_targets.py that the compiled modules register exactly these.
#pragma once

#define KVXFER_TARGETS(X)                                                            \
  X("jax_kvxfer_block_copy", BlockCopy, BlockCopy)                                   \
  X("jax_kvxfer_block_copy_within", BlockCopyWithin, BlockCopyWithin)                \
  X("jax_kvxfer_block_copy_nograph", BlockCopyNoGraph, BlockCopy)                    \
  X("jax_kvxfer_block_copy_within_nograph", BlockCopyWithinNoGraph, BlockCopyWithin) \
  X("jax_kvxfer_layer_copy", LayerCopy, LayerCopy)                                   \
  X("jax_kvxfer_layer_lane_copy", LayerLaneCopy, LayerLaneCopy)                      \
  X("jax_kvxfer_lane_copy", LaneCopy, LaneCopy)                                      \
  X("jax_kvxfer_lane_copy_within", LaneCopyWithin, LaneCopyWithin)                   \
  X("jax_kvxfer_join_lanes", JoinLanes, JoinLanes)                                  \
  X("jax_kvxfer_wait_layers", WaitLayers, WaitLayers)
