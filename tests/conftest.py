"""Shared helpers of the jax_kvxfer op tests: random pools, a NumPy reference, bitwise checks.

The suite runs on whatever backend JAX picks by default (CPU in CI, a GPU on a GPU machine).
Tests that only make sense on a GPU are marked `requires_gpu`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

# Several virtual CPU devices, for the sharded-pool tests; must be set before JAX starts. On a
# GPU machine this only adds CPU devices: the GPU stays the default backend.
_FLAG = "--xla_force_host_platform_device_count=4"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_kvxfer as kvx
from jax_kvxfer.stores import FileStore

PLATFORM = jax.devices()[0].platform
ON_GPU = PLATFORM == "gpu"
requires_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a GPU (default backend is not 'gpu')")

# ---------------------------------------------------------------------------------------------
# dtypes

FOUR_BIT_DTYPES = tuple(jnp.dtype(t) for t in (jnp.int4, jnp.uint4, jnp.float4_e2m1fn))
ALL_DTYPES = tuple(
    jnp.dtype(t)
    for t in (
        jnp.float32, jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2,
        jnp.int8, jnp.uint8, jnp.int32, jnp.int64, jnp.bool_,
        jnp.int4, jnp.uint4, jnp.float4_e2m1fn,
    )
)
# A few representative dtypes for tests that sweep something else (shapes, memory kinds, ...).
SOME_DTYPES = tuple(jnp.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.uint8, jnp.bool_))


def dtype_id(dtype: Any) -> str:
    return jnp.dtype(dtype).name


def is_four_bit(dtype: Any) -> bool:
    return jnp.dtype(dtype) in FOUR_BIT_DTYPES


def needs_x64(dtype: Any) -> bool:
    return jnp.dtype(dtype).itemsize == 8


def x64_if_needed(dtype: Any):
    """jax.enable_x64 for 64-bit dtypes (off by default, int64 pools would become int32)."""
    return jax.enable_x64(True) if needs_x64(dtype) else contextlib.nullcontext()


@pytest.fixture(params=ALL_DTYPES, ids=dtype_id)
def dtype(request):
    """Every supported dtype; 64-bit ones run with x64 enabled. Narrow with indirect=True."""
    dt = jnp.dtype(request.param)
    with x64_if_needed(dt):
        yield dt


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


# Every test case draws its own data from a seed of its id and KVXFER_TEST_SEED (set it to vary
# the data between runs; a failure is reproduced with the seed shown in the report header).
BASE_SEED = int(os.environ.get("KVXFER_TEST_SEED", "0"))


def pytest_report_header(config):
    return (f"jax_kvxfer: backend {PLATFORM}, HAS_CUDA_HANDLERS={kvx.HAS_CUDA_HANDLERS}, "
            f"KVXFER_TEST_SEED={BASE_SEED}")


def seed_for(*parts: Any) -> int:
    """A seed per test case: fresh data for every case, reproducible across runs."""
    return zlib.crc32(repr((BASE_SEED,) + parts).encode())


@pytest.fixture
def rng(request):
    return np.random.default_rng(seed_for(request.node.nodeid))


# ---------------------------------------------------------------------------------------------
# data


def random_values(rng: np.random.Generator, shape: Sequence[int], dtype: Any) -> np.ndarray:
    """Random bits (never all zeros) of `dtype`: every byte pattern for byte-sized types,
    random 0/1 for bool and random in-range values for the 4-bit types."""
    dt = jnp.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    if dt == jnp.dtype(jnp.int4):
        return np.asarray(rng.integers(-8, 8, shape), dtype=jnp.int4)
    if dt == jnp.dtype(jnp.uint4):
        return np.asarray(rng.integers(0, 16, shape), dtype=jnp.uint4)
    if dt == jnp.dtype(jnp.float4_e2m1fn):
        # All 16 encodings (float4_e2m1fn has no NaN/inf, so every nibble is a value).
        return rng.integers(0, 16, shape, dtype=np.uint8).view(jnp.float4_e2m1fn)
    nbytes = int(np.prod(shape)) * dt.itemsize
    return rng.integers(0, 256, nbytes, dtype=np.uint8).view(dt).reshape(shape)


def sharding(memory_kind: str | None = None) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=memory_kind)


def put(x: np.ndarray, memory_kind: str | None = None) -> jax.Array:
    """A fresh JAX array holding a private copy of x (so donating it never touches x)."""
    arr = jax.device_put(np.array(x, copy=True), sharding(memory_kind))
    assert arr.dtype == x.dtype, (arr.dtype, x.dtype)
    return arr


def as_bytes(x: Any) -> np.ndarray:
    """The raw bytes of x: shape + (itemsize,), uint8. NaNs compare like any other bits."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.view(np.uint8).reshape(a.shape + (a.dtype.itemsize,))


def assert_bitwise_equal(actual: Any, expected: Any, what: str = "result") -> None:
    a, e = np.asarray(actual), np.asarray(expected)
    assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
    assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
    ab, eb = as_bytes(a), as_bytes(e)
    if not np.array_equal(ab, eb):
        diff = np.argwhere(np.any(ab != eb, axis=-1))
        blocks = sorted({int(i[0]) for i in diff}) if a.ndim else []
        raise AssertionError(
            f"{what}: {len(diff)} elements differ bitwise (blocks {blocks[:10]}); first at "
            f"{tuple(int(v) for v in diff[0])}: got {ab[tuple(diff[0])]} "
            f"expected {eb[tuple(diff[0])]}"
        )


def assert_unchanged(arr: jax.Array, before: np.ndarray, what: str) -> None:
    assert not arr.is_deleted(), f"{what} was deleted"
    assert_bitwise_equal(arr, before, what)


# ---------------------------------------------------------------------------------------------
# the reference


def normalize_tokens_ref(num_tokens: Any, batch: int) -> list[int]:
    if num_tokens is None:
        return [0] * batch
    if np.ndim(num_tokens) == 0:
        return [int(num_tokens)] * batch
    return [int(n) for n in np.asarray(num_tokens)]


def reference_copy_blocks(dst: np.ndarray, src: np.ndarray, src_indices: Any, dst_indices: Any,
                          num_tokens: Any = None) -> np.ndarray:
    """The semantics of kvx.copy_blocks as a plain loop on bytes, independent of the op.

    Pairs apply in order to a copy of dst and read a snapshot of src taken before the first
    pair (so dst and src may be one array); out-of-range or negative pairs are skipped.
    """
    out = as_bytes(np.array(dst, copy=True)).copy()
    snap = as_bytes(np.array(src, copy=True)).copy()
    si = [int(v) for v in np.asarray(src_indices).reshape(-1)]
    di = [int(v) for v in np.asarray(dst_indices).reshape(-1)]
    assert len(si) == len(di)
    tokens_per_block = dst.shape[4]
    for s, d, n in zip(si, di, normalize_tokens_ref(num_tokens, len(si))):
        if not (0 <= s < snap.shape[0] and 0 <= d < out.shape[0]):
            continue
        if n <= 0 or n >= tokens_per_block:
            n = tokens_per_block
        out[d, :, :, :, :n] = snap[s, :, :, :, :n]
    return out.view(dst.dtype).reshape(dst.shape)


def reference_partial_block_copy(dst: np.ndarray, src: np.ndarray, num_tokens: int) -> np.ndarray:
    return reference_copy_blocks(dst[None], src[None], [0], [0], [int(num_tokens)])[0]


def four_bit_error(block_shape: Sequence[int], dtype: Any, tokens: Sequence[int] | None,
                   traced_tokens: bool = False) -> str | None:
    """The ValueError message fragment the sub-byte rule predicts, or None when the copy is legal.

    4-bit blocks need an even element count; partial copies need an even size_per_head.
    """
    if not is_four_bit(dtype):
        return None
    if int(np.prod(block_shape)) % 2:
        return "even number of elements"
    tokens_per_block = block_shape[3]
    partial = traced_tokens or (
        tokens is not None and any(0 < n < tokens_per_block for n in tokens)
    )
    if partial and block_shape[-1] % 2:
        return "even size_per_head"
    return None


# ---------------------------------------------------------------------------------------------
# cached jitted entry points (traced indices / token counts)


def _copy(dst, src, si, di, nt):
    return kvx.copy_blocks(dst, src, si, di, nt)


def _copy_whole(dst, src, si, di):
    return kvx.copy_blocks(dst, src, si, di)


def _copy_intra(pool, si, di, nt):
    return kvx.copy_blocks(pool, pool, si, di, nt)


def _partial(dst, src, n):
    return kvx.partial_block_copy(dst, src, n)


jit_copy = jax.jit(_copy)
jit_copy_donated = jax.jit(_copy, donate_argnums=0)
jit_copy_whole = jax.jit(_copy_whole)
jit_copy_intra = jax.jit(_copy_intra)
jit_copy_intra_donated = jax.jit(_copy_intra, donate_argnums=0)
jit_partial = jax.jit(_partial)


def run_copy_blocks(mode: str, dst: np.ndarray, src: np.ndarray, si: Any, di: Any,
                    num_tokens: Any = None, dst_kind: str | None = None,
                    src_kind: str | None = None) -> jax.Array:
    """Runs copy_blocks on fresh device copies of dst/src: eagerly, or jitted with the indices
    and token counts traced (optionally donating the destination)."""
    d, s = put(dst, dst_kind), put(src, src_kind)
    if mode == "eager":
        return kvx.copy_blocks(d, s, si, di, num_tokens)
    si, di = np.asarray(si, np.int32), np.asarray(di, np.int32)
    if num_tokens is None:
        return jit_copy_whole(d, s, si, di)
    nt = np.asarray(normalize_tokens_ref(num_tokens, len(si)), np.int32)
    if mode == "jit":
        return jit_copy(d, s, si, di, nt)
    if mode == "jit_donated":
        out = jit_copy_donated(d, s, si, di, nt)
        assert d.is_deleted(), "the donated destination was not consumed"
        return out
    raise ValueError(mode)


def make_pools(rng: np.random.Generator, shape: Sequence[int], dtype: Any,
               src_blocks: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    shape = tuple(shape)
    src_shape = shape if src_blocks is None else (src_blocks,) + shape[1:]
    return random_values(rng, shape, dtype), random_values(rng, src_shape, dtype)


# ---------------------------------------------------------------------------------------------
# stores

class DelayedFileStore(FileStore):
    """A real FileStore whose reads run on a thread of their own after `_delay(keys)`: a slower
    tier, as the subclass makes it."""

    def _delay(self, keys) -> None:
        raise NotImplementedError

    def get(self, keys, rows) -> Future:
        out = Future()

        def read():
            self._delay(keys)
            try:
                out.set_result(FileStore.get(self, keys, rows).result())
            except BaseException as e:  # noqa: BLE001 - the caller's future carries it
                out.set_exception(e)

        threading.Thread(target=read, daemon=True).start()
        return out


class SlowFileStore(DelayedFileStore):
    """A real FileStore whose every read takes `latency` seconds more, and `per_block` more
    for each block: a slower tier, of a known speed."""

    def __init__(self, *args, latency: float, per_block: float = 0.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.latency, self.per_block = latency, per_block

    def _delay(self, keys) -> None:
        time.sleep(self.latency + self.per_block * len(keys))


class HeldFileStore(DelayedFileStore):
    """A real FileStore whose reads start only once `release` is set: a slow tier, held
    for as long as a test needs."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.release = threading.Event()

    def _delay(self, keys) -> None:
        self.release.wait(30)


# ---------------------------------------------------------------------------------------------
# the demo

def demo_error_line(argv: list[str], capsys) -> str:
    """Runs `python -m jax_kvxfer demo ARGV`, which must refuse it: exit status 2 and one line
    on stderr, returned."""
    from jax_kvxfer import demo

    with pytest.raises(SystemExit) as e:
        demo.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err
