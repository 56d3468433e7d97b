"""The compiled modules (`_kvxfer_cpu`, `_kvxfer_cuda`, which the build puts at the package's
top level): loaded here and nowhere else (tests/test_layering.py checks), their FFI handlers
registered with XLA once, at import, and the table of the targets they register. What else the
rest of the library calls in them goes through the functions at the end."""

from __future__ import annotations

import jax

from .. import _kvxfer_cpu

try:  # built only where a CUDA compiler was found
    from .. import _kvxfer_cuda
except ImportError:  # pragma: no cover - depends on the build
    _kvxfer_cuda = None

# The table of the FFI targets: every name the library's custom calls use, spelled here only
# (for C++: ffi/targets.h, which both compiled modules' registrations expand).
# tests/test_layering.py checks that the two lists agree and that no other module spells a
# target; tests/native/test_targets.py, that the compiled modules register exactly TARGETS.
BLOCK_COPY_TARGET = "jax_kvxfer_block_copy"  # (dst, src, src_idx, dst_idx, num_tokens)
BLOCK_COPY_WITHIN_TARGET = "jax_kvxfer_block_copy_within"  # (pool, src_idx, dst_idx, num_tokens)
# The same two without the command-buffer trait of the two above (which lets XLA replay chained
# copies in a CUDA graph): for dma=True (the GPU handler reads the indices on the host as it
# enqueues: a graph would replay them with the indices of its capture).
BLOCK_COPY_NOGRAPH_TARGET = "jax_kvxfer_block_copy_nograph"
BLOCK_COPY_WITHIN_NOGRAPH_TARGET = "jax_kvxfer_block_copy_within_nograph"

# Between an engine's per-layer arrays and a pool's host rows (_layers.py): (src_idx, dst_idx,
# num_tokens, host, *layers)
LAYER_COPY_TARGET = "jax_kvxfer_layer_copy"
LAYER_LANE_COPY_TARGET = "jax_kvxfer_layer_lane_copy"  # the same on a transfer lane

# The manager's copies beside compute (_lanes.py): (dst, src, ...) and (pool, ...), and the join.
LANE_COPY_TARGET = "jax_kvxfer_lane_copy"
LANE_COPY_WITHIN_TARGET = "jax_kvxfer_lane_copy_within"
JOIN_LANES_TARGET = "jax_kvxfer_join_lanes"
# A step's wait for the onboarded layers it reads next: (array)
WAIT_LAYERS_TARGET = "jax_kvxfer_wait_layers"

TARGETS: tuple[str, ...] = (
    BLOCK_COPY_TARGET, BLOCK_COPY_WITHIN_TARGET, BLOCK_COPY_NOGRAPH_TARGET,
    BLOCK_COPY_WITHIN_NOGRAPH_TARGET, LAYER_COPY_TARGET, LAYER_LANE_COPY_TARGET,
    LANE_COPY_TARGET, LANE_COPY_WITHIN_TARGET, JOIN_LANES_TARGET, WAIT_LAYERS_TARGET)
"""Every target above: both builds (CPU and CUDA) register exactly these."""

# The attributes each target's handler decodes (ffi/block_copy.h: the option structs and their
# XLA_FFI_REGISTER_STRUCT_ATTR_DECODING lists). tests/native/test_targets.py checks this table
# against those lists and against the attributes the emitters pass in a lowered program.
_COPY = frozenset({"hazard_free", "unique_dst", "max_ctas", "dma", "whole_blocks"})
_LANE = frozenset({"lane", "wait_lane", "stream_wait_lane", "whole_blocks", "layer_groups"})
_LAYERED = frozenset({"offload", "views"})
TARGET_ATTRIBUTES: dict[str, frozenset[str]] = {
    BLOCK_COPY_TARGET: _COPY, BLOCK_COPY_WITHIN_TARGET: _COPY,
    BLOCK_COPY_NOGRAPH_TARGET: _COPY, BLOCK_COPY_WITHIN_NOGRAPH_TARGET: _COPY,
    LAYER_COPY_TARGET: _LAYERED | _COPY - {"hazard_free"},
    LAYER_LANE_COPY_TARGET: _LAYERED | _LANE,
    LANE_COPY_TARGET: _LANE, LANE_COPY_WITHIN_TARGET: _LANE,
    JOIN_LANES_TARGET: frozenset({"lanes"}), WAIT_LAYERS_TARGET: frozenset({"layers"}),
}

HAS_CUDA_HANDLERS: bool = _kvxfer_cuda is not None
"""True when this build carries the CUDA handlers (built with a CUDA compiler present)."""

for _name, _capsule in _kvxfer_cpu.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if _kvxfer_cuda is not None:
    for _name, _capsule in _kvxfer_cuda.registrations().items():
        jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def require_cuda_handlers() -> None:
    """Raises a RuntimeError explaining how to build the CUDA handlers when they are missing."""
    if _kvxfer_cuda is None:
        raise RuntimeError(
            "jax_kvxfer was built without its CUDA handlers, so it cannot run on a GPU. Rebuild "
            "on a machine with nvcc: pip install --no-build-isolation -C cmake.define.KVXFER_CUDA=ON ."
        )


# -- the compiled modules' other functions --------------------------------------------------

def slot_columns(pairs, block_type, num_primary, num_secondary, index, primary):
    """A batch of (src, dst) blocks read and checked in one native pass (ffi/slot_columns.cc):
    fills `index` and `primary` ([2, n]: sources, destinations) and returns (direction,
    unique_dst), or None where some pair is not two in-range blocks of `block_type`."""
    return _kvxfer_cpu.slot_columns(pairs, block_type, num_primary, num_secondary, index,
                                    primary)


def receive_replies(fd, commands, window, lengths, head_nbytes, heads, expected, mask, dsts,
                    replies, lengths_out, crcs, timeout_ms):
    """A batch of GET replies received on socket `fd` with the GIL released
    (ffi/store_io.cc; stores/resp.py's `RespConnection.get_into` calls it): returns
    (answered, fault or None, closed by the peer, {i: error reply text})."""
    return _kvxfer_cpu.receive_replies(fd, commands, window, lengths, head_nbytes, heads,
                                       expected, mask, dsts, replies, lengths_out, crcs,
                                       timeout_ms)


def send_values(fd, prefixes, values, suffix, replies, timeout_ms):
    """Commands of a prefix and a value each, and a suffix they share (SET name value),
    pipelined on socket `fd` and their simple replies read, with the GIL released
    (ffi/store_io.cc; stores/resp.py's `RespConnection.set_each` calls it): returns
    (answered, fault or None, closed by the peer, {i: error reply text})."""
    return _kvxfer_cpu.send_values(fd, prefixes, values, suffix, replies, timeout_ms)


def stage_values(staged, heads, rows, crc_offset):
    """Each row after its head into `staged` (one value a row), the CRC-32 of the copy written
    into the head at `crc_offset`, with the GIL released (ffi/store_io.cc; the stores'
    puts call it)."""
    _kvxfer_cpu.stage_values(staged, heads, rows, crc_offset)


def wait_lanes() -> None:
    """Blocks the host until every copy enqueued on the transfer lanes so far is done (no-op
    without the CUDA handlers)."""
    if _kvxfer_cuda is not None:
        _kvxfer_cuda.wait_lanes()


def lanes_idle() -> bool:
    """Whether every copy enqueued on the transfer lanes so far is done, without waiting."""
    return _kvxfer_cuda is None or _kvxfer_cuda.lanes_idle()


def take_exposed_seconds() -> float:
    """GPU seconds XLA's streams spent on the lanes' account since the last call (0.0
    without the CUDA handlers)."""
    return _kvxfer_cuda.take_exposed_seconds() if _kvxfer_cuda is not None else 0.0


def dma_batches() -> int | None:
    """Batches the CUDA handlers have copied with the copy engines so far, in this process
    (None without the CUDA handlers)."""
    return None if _kvxfer_cuda is None else _kvxfer_cuda.dma_batches()


def staged_onboards() -> int | None:
    """Lane onboards that went through a staging buffer in device memory so far, in this
    process (None without the CUDA handlers)."""
    return None if _kvxfer_cuda is None else _kvxfer_cuda.staged_onboards()


def stage_onboards_below(row_bytes: int) -> int | None:
    """Stages the lanes' onboards of host rows smaller than `row_bytes` that come in runs (one
    copy per run over the link, then a scatter in device memory); 0: never. Returns the
    previous limit (None without the CUDA handlers: nothing to set)."""
    return None if _kvxfer_cuda is None else _kvxfer_cuda.stage_onboards_below(int(row_bytes))


def registered_targets() -> dict[str, list[str]]:
    """The target names each compiled module registers, by platform ("cpu", and "cuda" where
    this build has the CUDA handlers), sorted."""
    found = {"cpu": sorted(_kvxfer_cpu.registrations())}
    if _kvxfer_cuda is not None:
        found["cuda"] = sorted(_kvxfer_cuda.registrations())
    return found
