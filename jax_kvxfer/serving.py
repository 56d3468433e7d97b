"""The demo's serving loop: multi-turn conversations over a paged KV cache and a BlockManager.

Each turn re-sends the conversation so far, as chat clients do. Conversations run in waves of
`batch`; per step the loop allocates (add_sequence / append_tokens), syncs transfers at the
step boundary, then runs one jitted model step of fixed shape `[batch, chunk]` (prefill chunks
and decode steps alike, so a token's K/V does not depend on how it was batched).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable

import jax
import numpy as np

from .block_manager import BlockManager, BlockManagerStats
from .manager import KVCacheTransferManager, TransferStats
from .model import ModelConfig, create_pool, make_step
from .pool import KVCacheBlock

LOW_PRIORITY = 20  # below the default secondary_offload_min_priority (30): dropped, not offloaded


@dataclasses.dataclass(frozen=True)
class Workload:
    """Conversations: a shared system prompt, then per turn a user message and a reply."""

    system: tuple[int, ...]
    user: tuple[tuple[tuple[int, ...], ...], ...]  # [conversation][turn] token ids
    gen_tokens: int
    priorities: tuple[int, ...]  # per conversation

    @property
    def max_len(self) -> int:
        return len(self.system) + max(sum(map(len, turns)) for turns in self.user) + (
            len(self.user[0]) * self.gen_tokens)


def make_workload(*, vocab_size: int, conversations: int, turns: int, system_tokens: int,
                  user_tokens: int, gen_tokens: int, low_priority_every: int,
                  seed: int) -> Workload:
    """A seeded workload; user messages have user_tokens // 2 .. user_tokens tokens."""
    rng = np.random.default_rng(seed)
    system = tuple(int(t) for t in rng.integers(0, vocab_size, system_tokens))
    lo = max(1, user_tokens // 2)
    user = tuple(
        tuple(tuple(int(t) for t in rng.integers(0, vocab_size, rng.integers(lo, user_tokens + 1)))
              for _ in range(turns))
        for _ in range(conversations))
    priorities = tuple(
        LOW_PRIORITY if low_priority_every and i % low_priority_every == low_priority_every - 1
        else 35 for i in range(conversations))
    return Workload(system, user, gen_tokens, priorities)


@dataclasses.dataclass
class RunResult:
    """Everything one run produced: tokens and logits per reply, statistics and timings."""

    tokens: list[list[int]]  # per (turn, conversation) reply, in run order
    logits: list[np.ndarray]  # [gen_tokens, vocab] per reply
    block_stats: BlockManagerStats
    transfer_stats: TransferStats
    computed_tokens: int  # prompt tokens computed (not reused) + decoded tokens
    generated_tokens: int
    steps: int
    seconds: float  # the loop's wall time (compilation excluded)
    compile_seconds: float
    primary_blocks: int
    secondary_blocks: int
    # What compute did not hide: with the GPU's transfer lanes, the time the model's stream
    # waited for transfers (CUDA events); otherwise the copies run in line with the steps and
    # the wall time issuing and syncing them counts whole.
    exposed_transfer_seconds: float = 0.0


def run(model: ModelConfig, params: dict, workload: Workload, *, batch: int, chunk: int,
        tokens_per_block: int, primary_blocks: int, secondary_blocks: int,
        progress: Callable[[int, int], None] | None = None,
        mesh: jax.sharding.Mesh | None = None, dma: bool | str = "auto") -> RunResult:
    """Runs the whole workload once on fresh pools; `dma`: the transfer manager's (True, False
    or "auto").

    Raises:
      PoolExhaustedError: the primary pool cannot hold one wave of conversations.
    """
    pool = create_pool(model, tokens_per_block=tokens_per_block, num_primary_blocks=primary_blocks,
                       num_secondary_blocks=secondary_blocks, mesh=mesh)
    if mesh is not None:  # tensor parallel: weights on every device, the pool split by heads
        params = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    bm = BlockManager(pool, transfer_manager=KVCacheTransferManager([pool], dma=dma))
    max_blocks = math.ceil(workload.max_len / tokens_per_block)
    t0 = time.perf_counter()
    shapes = [jax.ShapeDtypeStruct((batch, chunk), np.int32)] * 2 + [
        jax.ShapeDtypeStruct((batch, max_blocks), np.int32),
        jax.ShapeDtypeStruct((batch,), np.int32)]
    step = make_step(model, pool).lower(params, pool.primary, *shapes).compile()
    t1 = time.perf_counter()
    _warm_up_transfers(bm, pool, min(primary_blocks, batch * max_blocks))
    compile_seconds = time.perf_counter() - t0
    print(f"compiled: model step {t1 - t0:.1f} s, transfer buckets {compile_seconds - t1 + t0:.1f} s",
          file=sys.stderr)

    n_conv, n_turns = len(workload.user), len(workload.user[0])
    waves = [list(range(i, min(i + batch, n_conv))) for i in range(0, n_conv, batch)]
    history = [list(workload.system) for _ in range(n_conv)]
    out_tokens, out_logits = [], []
    counts = {"computed": 0, "steps": 0}

    def forward(rows: list[tuple[int, list[int], int]]) -> np.ndarray:
        """rows: (seq_id, tokens, first position); returns each row's last token's logits."""
        tok = np.zeros((batch, chunk), np.int32)
        pos = np.full((batch, chunk), -1, np.int32)
        tables = np.zeros((batch, max_blocks), np.int32)
        last = np.zeros(batch, np.int32)
        for r, (sid, toks, start) in enumerate(rows):
            if toks:
                tok[r, :len(toks)] = toks
                pos[r, :len(toks)] = np.arange(start, start + len(toks))
                last[r] = len(toks) - 1
                table = bm.block_table(sid)
                tables[r, :len(table)] = table
        logits, pool.primary = step(params, pool.primary, tok, pos, tables, last)
        counts["computed"] += int((pos >= 0).sum())
        counts["steps"] += 1
        return np.asarray(logits)

    t0 = time.perf_counter()
    done = 0
    for turn in range(n_turns):
        for wave in waves:
            prompts = [history[c] + list(workload.user[c][turn]) for c in wave]
            sids = [(c, turn) for c in wave]
            nxt = [bm.add_sequence(s, p, priority=workload.priorities[c])
                   for s, p, c in zip(sids, prompts, wave)]
            # The step boundary, after allocation and before the forward pass: the step waits on
            # the GPU for the onboards it reads; offloads go on beside it.
            bm.sync_transfers(block=False)
            replies = [[] for _ in wave]
            logits_out = [[] for _ in wave]
            while any(n < len(p) for n, p in zip(nxt, prompts)):  # chunked prefill
                rows = [(s, p[n:n + chunk], n) for s, p, n in zip(sids, prompts, nxt)]
                logits = forward(rows)
                for r, (_, toks, start) in enumerate(rows):
                    if toks and start + len(toks) == len(prompts[r]):
                        logits_out[r].append(logits[r])
                    nxt[r] = start + len(toks)
            for r in range(len(wave)):
                replies[r].append(int(np.argmax(logits_out[r][0])))
            for _ in range(workload.gen_tokens - 1):  # decode: one token per sequence
                for s, reply in zip(sids, replies):
                    bm.append_tokens(s, reply[-1:])
                bm.sync_transfers(block=False)
                rows = [(s, reply[-1:], bm.num_tokens(s) - 1) for s, reply in zip(sids, replies)]
                logits = forward(rows)
                for r, reply in enumerate(replies):
                    logits_out[r].append(logits[r])
                    reply.append(int(np.argmax(logits[r])))
            for r, (c, s) in enumerate(zip(wave, sids)):
                history[c] = prompts[r] + replies[r]
                bm.release_sequence(s)
                out_tokens.append(replies[r])
                out_logits.append(np.stack(logits_out[r]))
            done += 1
            if progress:
                progress(done, n_turns * len(waves))
    bm.sync_transfers()
    seconds = time.perf_counter() - t0
    transfer_stats = bm.transfer_manager.get_and_reset_transfer_stats()
    return RunResult(
        tokens=out_tokens, logits=out_logits, block_stats=bm.stats,
        transfer_stats=transfer_stats,
        exposed_transfer_seconds=(transfer_stats.exposed_seconds
                                  if bm.transfer_manager.on_lanes else bm.stats.transfer_seconds),
        computed_tokens=counts["computed"],
        generated_tokens=sum(len(t) for t in out_tokens), steps=counts["steps"],
        seconds=seconds, compile_seconds=compile_seconds, primary_blocks=primary_blocks,
        secondary_blocks=secondary_blocks)


def _warm_up_transfers(bm: BlockManager, pool, max_pairs: int) -> None:
    """Compiles the transfer manager's copies for every batch bucket up to `max_pairs`.

    The pools are still all zeros, so copying their blocks around changes nothing; the
    statistics are reset afterwards. Keeps compilation out of the measured transfer time.
    """
    tm, p, s = bm.transfer_manager, pool.num_primary_blocks, pool.num_secondary_blocks
    size = 1
    while True:
        n = 1 if size == 1 else size // 2 + 1  # the smallest batch padded to this bucket
        if n > max_pairs:
            break
        if 2 * n <= p:
            tm.onboard_blocks([(KVCacheBlock(0, i, True), KVCacheBlock(0, n + i, True))
                               for i in range(n)], 1)
        if n <= min(p, s):
            tm.offload_blocks([(KVCacheBlock(0, i, True), KVCacheBlock(0, i, False))
                               for i in range(n)])
            tm.onboard_blocks([(KVCacheBlock(0, i, False), KVCacheBlock(0, i, True))
                               for i in range(n)], 1)
        size *= 2
    tm.sync_transfers()
    tm.get_and_reset_transfer_stats()  # and the exposed time of the warm-up


def blocks_to_never_evict(workload: Workload, batch: int, tokens_per_block: int) -> int:
    """A primary pool size that holds every block the workload ever stores, plus one wave."""
    per_conv = math.ceil(workload.max_len / tokens_per_block) + len(workload.user[0])
    return len(workload.user) * per_conv + batch * per_conv


def compare(run_a: RunResult, run_b: RunResult, *, atol: float = 1e-4,
            rtol: float = 1e-4) -> tuple[bool, float, int]:
    """(exact, max |logit difference|, first differing reply or -1) between two runs."""
    max_diff, first_bad = 0.0, -1
    for i, (ta, tb, la, lb) in enumerate(zip(run_a.tokens, run_b.tokens, run_a.logits,
                                             run_b.logits)):
        ok = ta == tb and la.shape == lb.shape
        if la.shape == lb.shape:
            diff = np.abs(la - lb)
            max_diff = max(max_diff, float(diff.max()))
            ok = ok and bool(np.all(diff <= atol + rtol * np.abs(lb)))
        if not ok and first_bad < 0:
            first_bad = i
    exact = first_bad < 0 and len(run_a.tokens) == len(run_b.tokens)
    return exact, max_diff, first_bad
