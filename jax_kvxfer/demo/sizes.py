"""The demo's sizes and what its runs hold: the presets and each workload's sizes, the model
and the conversations of given sizes, the runs (their names, in the order they are reported)
and each run's pools, the host memory at the peak, and the check, allocating nothing, that
every run fits; and the stores' namespace, the model's identity.

--help (each preset's memory), the options' checks, the runs and scripts/model_bench.py read
these; nothing here parses options or serves."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import os

import jax

from ..transfer.limits import (
    HOST_LIMIT_ENV,
    available_host_bytes,
    free_device_bytes,
    pinned_host_limit_bytes,
)
from . import serving, workloads
from .model import RECORD_KEPT, ModelConfig, kv_block_nbytes

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
# Conversations of --model smollm2, cycled: a user message per turn.
CHAT_TEXT = (
    ("What is the capital of France?", "What is it famous for?", "Name one museum there."),
    ("Give me one tip for learning Python.", "Why does that help?", "Show a tiny example."),
    ("What is a black hole?", "Can light escape it?", "How are they found?"),
    ("Suggest a name for a cat.", "Another one, please.", "Which is your favourite?"),
)
# The runs' names (RUNS: every run, in the order the report shows them)
DISK, RESTARTED = "offload+disk", "offload+disk (restarted)"
SHARED, ALONE = "replicas+store", "replicas"  # --replicas: with a shared store, without one
# --router prefix (both: all four): the same, routed by prefix
ROUTED_SHARED, ROUTED_ALONE = "prefix-routed+store", "prefix-routed"
# --scale-out (instead of those two): replica B, joining after replica A, with A's store and
# without a store
JOINED, JOINED_ALONE = "replica B+store", "replica B"
RUNS = ("offload", DISK, RESTARTED, SHARED, ALONE, ROUTED_SHARED, ROUTED_ALONE, JOINED,
        JOINED_ALONE, "drop", "never_evict")  # as reported
# they run first: before this process takes GPU memory
REPLICA_RUNS = (SHARED, ALONE, ROUTED_SHARED, ROUTED_ALONE, JOINED, JOINED_ALONE)
STORE_RUNS = (SHARED, ROUTED_SHARED, JOINED)  # the replica runs that share a store
PREFIX_ROUTED = (ROUTED_SHARED, ROUTED_ALONE)


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


def chat_text_workload(tokenizer, cfg: dict, seed: int) -> list[workloads.Conversation]:
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
        return f"{n:,} blocks ({size_text(n * block_bytes)})"

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
            + "; never_evict's GPU pool "
            + blocks(max(cfg['primary_blocks'], sizing['never_evict_blocks'])))


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
        router = cfg.get("router", "round-robin")
        runs = (JOINED, JOINED_ALONE) if cfg.get("scale_out") else \
            ((SHARED, ALONE) if router != "prefix" else ()) + \
            ((ROUTED_SHARED, ROUTED_ALONE) if router != "round-robin" else ())
        pools.update(dict.fromkeys(runs, replica_pools(cfg)))
    return {run: pools[run] for run in RUNS if run in pools}


def replica_pools(cfg: dict) -> tuple[int, int]:
    """One replica's (primary, secondary) blocks: its share of the offload run's."""
    n = cfg["replicas"]
    return cfg["primary_blocks"] // n, cfg["secondary_blocks"] // n


def size_text(nbytes: float) -> str:
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
    return (f"{name}: weights {size_text(model.weights_nbytes)}, GPU pool "
            f"{size_text(pools['offload'][0] * block)} (never_evict's "
            f"{size_text(pools['never_evict'][0] * block)}) in device memory, host pool "
            f"{size_text(pools['offload'][1] * block)} pinned, held on the host "
            f"{size_text(host_peak(model, cfg, convs)[0])}")


def kept_records_nbytes(model: ModelConfig, convs: list[workloads.Conversation]) -> int:
    """What one run keeps on the host until the runs are compared: per generated token, its
    record (model.TokenRecord: its largest logits, their token ids and a fingerprint)."""
    tokens = sum(turn.output_len for conv in convs for turn in conv.turns)
    kept = min(RECORD_KEPT, model.vocab_size)
    return tokens * (kept * (jax.numpy.dtype(model.dtype).itemsize + 4) + 8)


def host_peak(model: ModelConfig, cfg: dict, convs: list[workloads.Conversation]
              ) -> tuple[int, dict[str, int]]:
    """The host memory the runs of this process hold at their peak, and each run's: its own
    pinned host pool (the previous run's is released before it starts) and the token records
    of every run so far (kept to compare them at the end). Not counted: the runtime, compiled
    code, and on CPU the device's memory (weights, GPU pools), which memory_shortfall checks."""
    block = kv_block_nbytes(model, cfg["tokens_per_block"])
    records = kept_records_nbytes(model, convs)
    each, kept = {}, 0
    for name, (_, secondary) in run_pools(cfg, convs).items():
        kept += records  # (replicas: their pools are other processes'; their records come back)
        if name not in REPLICA_RUNS:
            each[name] = secondary * block + kept
    return max(each.values(), default=kept), each


PINNED_MARGIN_GIB = 4  # pinned host memory beside the host pools: plan rings, XLA's staging


def cap_pinned_host(model: ModelConfig, cfg: dict, convs: list[workloads.Conversation]
                    ) -> int | None:
    """Sets XLA's pinned-host limit (HOST_LIMIT_ENV, read when JAX starts its GPU client) to
    the largest host pool of the runs plus PINNED_MARGIN_GIB, unless it is set already; the
    GiB it set, or None. Why: XLA's pinned-host allocator grows by regions as large as the
    largest request so far, up to that limit (64 GiB by default), so after a 32 GiB host pool
    the first small pinned array (the transfer manager's plan ring) took a second 32 GiB
    region: the h200 chats preset held 74 GB of host memory for a 32 GiB pool. Capped, a new
    region is at most what is left under the limit. Replicas inherit it (their pools are
    smaller shares)."""
    if HOST_LIMIT_ENV in os.environ:
        return None
    block = kv_block_nbytes(model, cfg["tokens_per_block"])
    largest = max((secondary * block for _, secondary in run_pools(cfg, convs).values()),
                  default=0)
    gib = -(-largest // 2**30) + PINNED_MARGIN_GIB
    os.environ[HOST_LIMIT_ENV] = str(gib)
    return gib


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
                              "GPU pool": f"{primary} blocks of {size_text(block)}",
                              "host pool": f"{secondary} blocks of {size_text(block)}"}[what]
                    if what == "GPU pool" and run == "never_evict" and primary == chats:
                        detail += ", every block of the chats"
                    if what == "GPU pool" and len(devices) > 1:
                        detail += f", split over {len(devices)} devices"
                    if copies > 1:
                        detail += f", in each of {copies} replicas"
                    after = (f" ({size_text(budget)} less {size_text(used)} for the "
                             f"{' and '.join(held)})" if held else "")
                    need_text, left_text = size_text(nbytes), size_text(left)
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
