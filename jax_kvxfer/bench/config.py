"""The bench's options, sizes and block geometries."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import jax.numpy as jnp

KiB, MiB, GiB = 1024, 1024 ** 2, 1024 ** 3
DTYPE = jnp.bfloat16
SECTIONS = ("ops", "manager", "step", "layers", "sharded", "connector")
OPT_IN = ("stores", "peers")  # only when --only names them: stores writes to a disk; peers
# needs a GPU and takes minutes
Config = argparse.Namespace

# block bytes -> (layers, kv_factor, heads, tokens_per_block, size_per_head), bf16
PRESETS = {4 * KiB: (1, 2, 1, 16, 64), 16 * KiB: (1, 2, 4, 16, 64), 64 * KiB: (2, 2, 4, 32, 64),
           256 * KiB: (8, 2, 8, 16, 64), 1 * MiB: (8, 2, 8, 32, 128),
           4 * MiB: (32, 2, 8, 32, 128)}  # 32 layers with 8 KV heads of 128, 32-token blocks


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv: int
    heads: int
    tokens: int
    head_dim: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, self.kv, self.heads, self.tokens, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return self.moved(self.tokens)

    def moved(self, n: int) -> int:
        """Bytes one block's copy moves for n tokens (n >= T: the whole block)."""
        return self.layers * self.kv * self.heads * min(n, self.tokens) * self.head_dim * 2


def geometry_for(nbytes: int) -> Geometry:
    if nbytes in PRESETS:
        return Geometry(*PRESETS[nbytes])
    unit = 4 * KiB  # kv 2, 16 tokens of 64: one layer-head
    if nbytes <= 0 or nbytes % unit:
        raise ValueError(f"block size {nbytes} bytes is not a positive multiple of 4 KiB")
    heads = 1
    while heads < 8 and (nbytes // unit) % (heads * 2) == 0:
        heads *= 2
    return Geometry(nbytes // unit // heads, 2, heads, 16, 64)


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": KiB, "M": MiB, "G": GiB}.get(t[-1:], 1)
    return int(float(t[:-1] if mult > 1 else t) * mult)


def fmt_size(nbytes: int) -> str:
    for unit, div in (("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return str(nbytes)


def n_cases(tokens: int) -> list[tuple[str, int]]:
    """(label, n) for n in T, T-1, T/2, 1, duplicates (small T) removed."""
    out: list[tuple[str, int]] = []
    for label, n in (("T", tokens), ("T-1", tokens - 1), ("T/2", tokens // 2), ("1", 1)):
        if n >= 1 and all(n != m for _, m in out):
            out.append((label, n))
    return out


def parse_args(argv: list[str]) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m jax_kvxfer bench",
        description="Times jax_kvxfer's transfers against ceilings measured in the same run. "
                    "Sections: ops (copy_blocks over block sizes), manager (its verbs at real "
                    "geometries), step (the manager beside a model step), layers (a pool over "
                    "the arrays of each layer), sharded (pools over several devices), stores (the tiers "
                    "below the host; only with --only), peers (ours beside JAX, PyTorch and "
                    "cudaMemcpyBatchAsync; GPU, only with --only).")
    a = p.add_argument
    a("--quick", action="store_true", help="tiny sizes, few repeats: a smoke run (CPU: seconds)")
    a("--only", default=None, help="comma-separated sections: " + ", ".join(SECTIONS + OPT_IN)
      + " (default: all but stores)")
    a("--sizes", default=None, help="ops: block sizes, e.g. 16K,64K,256K,1M,4M (the default; "
      "--quick 4K,16K)")
    a("--blocks", type=int, default=None, help="ops: blocks per batch (256; --quick 16)")
    a("--repeats", type=int, default=None, help="timed samples per figure, median (5; --quick 2)")
    a("--warmup", type=int, default=1, help="untimed samples after the first (compiling) one")
    a("--out", default="bench-results", help="folder of the JSON and PNG (bench-results/)")
    a("--deadline-s", type=float, default=None, help="soft budget: cases that would start "
      "after it are skipped and recorded as such (230 s; --quick and 0: none)")
    a("--no-plot", action="store_true", help="no PNG of the ops section")
    a("--seed", type=int, default=0)
    a("--matmul-dim", type=int, default=None, help="step: square bf16 matmul size (8192; "
      "--quick 64)")
    a("--step-bytes", default=None, help="step: bytes of each transfer (512M; --quick 4M)")
    a("--step-ms", type=float, default=None, help="step: the step's least length alone (40; "
      "--quick 1)")
    a("--stores-bytes", default=None, help="stores: bytes per case (256M; --quick 16M)")
    a("--stores-path", default=None, help="stores: a folder on the disk to measure (default: "
      "a new folder in --out)")
    a("--stores-threads", type=int, default=None, help="stores: the N-thread cases' threads "
      "(default: each store's default)")
    a("--stores-restart", default=None, help="stores: comma-separated block counts of the "
      "restart times (10000,100000; --quick 1000)")
    c = p.parse_args(argv)
    q = c.quick
    only = {s.strip().lower() for s in (c.only or "").split(",") if s.strip()}
    for s in only - set(SECTIONS + OPT_IN):
        p.error(f"--only: unknown section {s!r}; choose from {', '.join(SECTIONS + OPT_IN)}")
    c.only = only or set(SECTIONS)
    c.sizes = ([parse_size(s) for s in c.sizes.split(",") if s.strip()] if c.sizes
               else [4 * KiB, 16 * KiB] if q else [16 * KiB, 64 * KiB, 256 * KiB, MiB, 4 * MiB])
    for s in c.sizes:
        geometry_for(s)  # validates
    c.blocks = c.blocks if c.blocks is not None else 16 if q else 256
    c.repeats = c.repeats if c.repeats is not None else 2 if q else 5
    if c.blocks < 1 or c.repeats < 1:
        p.error("--blocks and --repeats must be >= 1")
    c.warmup = max(0, c.warmup)
    c.deadline_s = c.deadline_s if c.deadline_s is not None else 0.0 if q else 230.0
    c.plot = not c.no_plot
    # A jitted call costs ~50 us to dispatch and each sample pays one dispatch before the GPU
    # starts and one sync at its end (H200): a call chains enough copies (k, at most kmax) to
    # outlast its dispatch, and a sample enough calls (2..max_pipe) that those are a few percent.
    c.call_target = {"host": 128 * KiB if q else 128 * MiB, "d2d": 256 * KiB if q else 2 * GiB}
    c.sample_target = {"host": 128 * KiB if q else GiB, "d2d": 128 * KiB if q else 8 * GiB}
    c.kmax, c.max_pipe = (2, 2) if q else (32, 16)
    c.matmul_dim = c.matmul_dim or (64 if q else 8192)
    c.step_bytes = parse_size(c.step_bytes) if c.step_bytes else 4 * MiB if q else 512 * MiB
    c.step_ms = c.step_ms or (1.0 if q else 40.0)
    c.stores_bytes = parse_size(c.stores_bytes) if c.stores_bytes else 16 * MiB if q \
        else 256 * MiB
    c.stores_restart = ([int(float(n)) for n in c.stores_restart.split(",") if n.strip()]
                        if c.stores_restart is not None else [1000] if q else [10_000, 100_000])
    return c
