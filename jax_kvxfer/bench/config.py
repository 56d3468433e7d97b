"""Benchmark configuration: sizes and presets, block geometry, size parsing, and the CLI options."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import jax.numpy as jnp

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
DTYPE = jnp.bfloat16
ITEMSIZE = 2
DIRECTIONS = ("d2h", "h2d", "d2d")
SWEEP_PATHS = ("ceiling", "ours", "unique", "dma", "manager", "eager", "xla", "naive",
               "trtllm")
SECTIONS = ("host", "overlap", "bidir", "sharded", "step", "layers")
# sections that run only when --only names them (they write to a disk, not the GPU's links)
OPT_IN = ("stores",)
ALL_ONLY = SWEEP_PATHS + SECTIONS + OPT_IN

# block bytes -> (layers, kv_factor, heads, tokens_per_block, size_per_head), bf16
PRESETS: dict[int, tuple[int, int, int, int, int]] = {
    4 * KiB: (1, 2, 1, 16, 64),
    16 * KiB: (1, 2, 4, 16, 64),
    64 * KiB: (2, 2, 4, 32, 64),
    256 * KiB: (8, 2, 8, 16, 64),
    1 * MiB: (8, 2, 8, 32, 128),
    4 * MiB: (32, 2, 8, 32, 128),      # a 32-layer model with 8 KV heads of 128, 32-token blocks
}


# ----------------------------------------------------------------------------------------------
# geometry


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv: int
    heads: int
    tokens: int
    head_dim: int

    @property
    def outer(self) -> int:
        return self.layers * self.kv * self.heads

    @property
    def row_bytes(self) -> int:
        return self.head_dim * ITEMSIZE

    @property
    def block_bytes(self) -> int:
        return self.outer * self.tokens * self.row_bytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, self.kv, self.heads, self.tokens, self.head_dim)

    def pool_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks,) + self.block_shape

    def moved(self, n: int) -> int:
        """Bytes one block's copy moves for n tokens (n <= 0 or >= T: the whole block)."""
        n = self.tokens if n <= 0 or n >= self.tokens else n
        return self.outer * n * self.row_bytes

    def as_dict(self) -> dict[str, int]:
        return {"layers": self.layers, "kv_factor": self.kv, "heads": self.heads,
                "tokens_per_block": self.tokens, "size_per_head": self.head_dim,
                "block_bytes": self.block_bytes, "row_bytes": self.row_bytes}


def geometry_for(nbytes: int) -> Geometry:
    if nbytes in PRESETS:
        return Geometry(*PRESETS[nbytes])
    unit = 2 * 16 * 64 * ITEMSIZE  # kv=2, T=16, D=64: 4 KiB per layer-head
    if nbytes <= 0 or nbytes % unit:
        raise ValueError(f"block size {nbytes} bytes is not a positive multiple of 4 KiB")
    units = nbytes // unit
    heads = 1
    while heads < 8 and units % (heads * 2) == 0:
        heads *= 2
    return Geometry(units // heads, 2, heads, 16, 64)


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = 1
    if t and t[-1] in "KMG":
        mult = {"K": KiB, "M": MiB, "G": GiB}[t[-1]]
        t = t[:-1]
    return int(float(t) * mult)


def fmt_size(nbytes: int) -> str:
    for unit, div in (("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return str(nbytes)


def n_cases(tokens: int) -> list[tuple[str, int]]:
    """(label, n) for n in T, T-1, T/2, 1 with duplicates (small T) removed."""
    out: list[tuple[str, int]] = []
    for label, n in (("T", tokens), ("T-1", tokens - 1), ("T/2", tokens // 2), ("1", 1)):
        if n >= 1 and all(n != m for _, m in out):
            out.append((label, n))
    return out


# ----------------------------------------------------------------------------------------------
# configuration


@dataclass
class Config:
    quick: bool
    sizes: list[int]
    blocks: int
    repeats: int
    warmup: int
    only: set[str]
    out: str
    deadline_s: float
    plot: bool
    seed: int
    # per-sample sizing (bytes): one jit call / one timed sample
    call_target_host: int
    call_target_d2d: int
    sample_target_host: int
    sample_target_d2d: int
    kmax: int
    max_pipe: int
    # sections
    overlap_bytes: int
    overlap_block: int
    matmul_dim: int
    bidir_block: int
    bidir_blocks: int
    host_block: int
    host_block_dma: int  # the manager's variant that dma="auto" sends to the copy engines
    host_pool_blocks: int
    host_batch: int
    host_calls: int
    sharded_block: int
    sharded_blocks: int
    sharded_calls: int
    step_bytes: int  # the step section: bytes of each transfer beside the step
    step_ms: float  # the step's length alone, at least
    step_overhead_blocks: int  # 64 KiB blocks per call of its host-overhead figures
    stores_bytes: int  # the stores section: bytes per case (2 MiB rows; 64 KiB rows a quarter)
    stores_path: str | None  # the folder on the disk under test (None: a new one in `out`)
    stores_threads: int | None  # FileStore's threads in the N-thread cases (None: its default)
    stores_restart: list[int]  # block counts of the restart figures


def parse_args(argv: list[str]) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m jax_kvxfer bench",
        description="Benchmark jax_kvxfer block transfers against memcpy ceilings and baselines "
                    "(see the module docstring for what each path measures).")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and few repeats (a smoke run; runs on CPU in seconds)")
    p.add_argument("--sizes", default=None,
                   help="comma-separated block sizes, e.g. 16K,64K,256K,1M,4M "
                        "(default: those; --quick: 4K,16K)")
    p.add_argument("--blocks", type=int, default=None,
                   help="blocks per batch (default 256; --quick 16)")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed samples per case, median reported (default 5; --quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed samples after compiling")
    p.add_argument("--only", default=None,
                   help="comma-separated subset of: " + ",".join(ALL_ONLY)
                        + " (also 'sweep' = the first eight). Ceilings always run with the sweep.")
    p.add_argument("--out", default="bench-results",
                   help="directory for the JSON and PNG (default bench-results/)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="soft wall-clock budget: cases that would start after it are skipped and "
                        "recorded as such (default 230 for a full run, none for --quick; 0 = none)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap-bytes", default=None, help="bytes offloaded in the overlap test "
                   "(default 2G; --quick 1M)")
    p.add_argument("--matmul-dim", type=int, default=None,
                   help="square bf16 matmul size of the compute step (default 8192; --quick 64)")
    p.add_argument("--step-bytes", default=None, help="bytes of each manager transfer in the "
                   "step section (default 512M; --quick 4M)")
    p.add_argument("--step-ms", type=float, default=None,
                   help="the step section's compute step lasts at least this long alone "
                        "(default 40; --quick 1)")
    p.add_argument("--stores-bytes", default=None, help="bytes per case of the stores section "
                   "(only with --only stores; default 256M; --quick 16M)")
    p.add_argument("--stores-path", default=None, help="a folder on the disk the stores "
                   "section measures (default: a new folder in --out)")
    p.add_argument("--stores-threads", type=int, default=None,
                   help="FileStore threads of the stores section's N-thread cases "
                        "(default: FileStore's default)")
    p.add_argument("--stores-restart", default=None, help="comma-separated block counts of "
                   "the stores section's restart times (default 10000,100000; --quick 1000)")
    a = p.parse_args(argv)

    q = a.quick
    sizes = ([parse_size(s) for s in a.sizes.split(",") if s.strip()] if a.sizes
             else ([4 * KiB, 16 * KiB] if q else [16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB]))
    for s in sizes:
        geometry_for(s)  # validates
    only: set[str] = set()
    if a.only:
        for item in a.only.split(","):
            item = item.strip().lower()
            if not item:
                continue
            if item == "sweep":
                only.update(SWEEP_PATHS)
            elif item in ALL_ONLY:
                only.add(item)
            else:
                p.error(f"--only: unknown path {item!r}; choose from {', '.join(ALL_ONLY)}, sweep")
    else:
        only = set(SWEEP_PATHS + SECTIONS)
    if only & {"ours", "unique", "dma", "manager", "eager", "xla", "naive", "trtllm"}:
        only.add("ceiling")
    deadline = a.deadline_s if a.deadline_s is not None else (0.0 if q else 230.0)
    blocks = a.blocks if a.blocks is not None else (16 if q else 256)
    if blocks < 1:
        p.error("--blocks must be >= 1")
    repeats = a.repeats if a.repeats is not None else (2 if q else 5)
    if repeats < 1:
        p.error("--repeats must be >= 1")
    return Config(
        quick=q, sizes=sizes, blocks=blocks, repeats=repeats, warmup=max(0, a.warmup),
        only=only, out=a.out, deadline_s=deadline, plot=not a.no_plot, seed=a.seed,
        # A jitted call costs ~50 us to dispatch and the GPU idles ~5 us between executions,
        # and each sample pays one dispatch before the GPU starts and one sync at the end
        # (H200): a call holds enough copies (k) to outlast its
        # dispatch, and a sample enough calls that the start and the sync are a few percent,
        # as the memcpy ceiling's events behind a spin kernel leave them out altogether.
        call_target_host=(128 * KiB if q else 128 * MiB),
        call_target_d2d=(256 * KiB if q else 2 * GiB),
        sample_target_host=(128 * KiB if q else 1 * GiB),
        sample_target_d2d=(128 * KiB if q else 8 * GiB),
        kmax=(2 if q else 32), max_pipe=(2 if q else 16),
        overlap_bytes=parse_size(a.overlap_bytes) if a.overlap_bytes else (1 * MiB if q else 2 * GiB),
        overlap_block=(16 * KiB if q else 1 * MiB),
        matmul_dim=a.matmul_dim or (64 if q else 8192),
        bidir_block=(16 * KiB if q else 1 * MiB),
        bidir_blocks=(16 if q else 256),
        host_block=(4 * KiB if q else 64 * KiB),
        host_block_dma=(16 * KiB if q else 1 * MiB),
        host_pool_blocks=(128 if q else 256),
        host_batch=64,
        host_calls=(30 if q else 200),
        sharded_block=(16 * KiB if q else 1 * MiB),
        sharded_blocks=(16 if q else 256),
        sharded_calls=(2 if q else 8),
        step_bytes=parse_size(a.step_bytes) if a.step_bytes else (4 * MiB if q else 512 * MiB),
        step_ms=a.step_ms or (1.0 if q else 40.0),
        step_overhead_blocks=(32 if q else 1024),
        stores_bytes=parse_size(a.stores_bytes) if a.stores_bytes else (
            16 * MiB if q else 256 * MiB),
        stores_path=a.stores_path,
        stores_threads=a.stores_threads,
        stores_restart=[int(float(n)) for n in a.stores_restart.split(",") if n.strip()]
        if a.stores_restart is not None else ([1000] if q else [10_000, 100_000]),
    )
