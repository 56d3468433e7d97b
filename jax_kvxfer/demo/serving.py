"""The demo's serving loop: requests that arrive over time, continuous batching, a BlockManager.

Conversations (workloads.py) arrive at their start times; each turn is a request whose prompt
is the conversation so far. Up to `batch` requests run at once. Every step is one jitted model
step of segments of fixed shapes: every request in decode contributes its last token (`[batch,
1]`), and the requests still in prefill their next prompt tokens, so prefill chunks and decodes
share the step. With a `prefill_budget` (tokens a step computes for prefill, as vLLM's chunked
prefill), the prefilling requests, in admission order, fill one segment `[budget / chunk,
chunk]` (model.pack_prefill): each row one chunk of one request's prompt, aligned to absolute
positions (row k of a prompt holds its positions [k * chunk, (k + 1) * chunk)), so that how a
prompt is cut into rows depends on the prompt alone, not on its cache hits or the other
requests; one matrix product a weight for all of them, the segment whole in every step that
prefills. Without a budget, each of up to `prefill_rows` prefilling requests contributes its
next chunk as a segment of its own (`[1, chunk]`), so a step costs one segment more per
prefilling request. Either way a token's K/V do not depend on which others were batched with
it (model.forward, tests/demo/test_model.py). A request is admitted when a row is free and
the primary pool can hold all it will ever need beside the running requests (so no running
request runs out of blocks). At each step boundary the block manager's transfers are synced
without blocking: the step waits on the GPU for the onboards it reads, offloads go on beside.

With stores (a disk tier below the host pool), every block offloaded to the host is written
through to them in the background, and a prompt whose prefix only a store holds reads it into
host rows at admission and onboards it like host hits. The next request, once it has arrived
and waits for a row, has that read started early (`BlockManager.prefetch`), so that it
overlaps the steps of the running requests. At the end of the run the block manager is
closed: the writes are durable, and a later run over the same stores finds them.

Time is the loop's own clock: its wall time (steps, transfers, scheduling), plus jumps over
idle time to the next arrival; with several processes, process 0's, so that all of them
schedule alike. TTFT is a turn's first token time less its arrival; the next turn of a
conversation arrives its think time after the reply's last token.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import numpy as np

from ..cache import BlockManager, BlockManagerStats, PoolExhaustedError
from ..connector.tiers import read_rate
from ..stores import Store, StoreStats
from ..transfer.manager import KVCacheTransferManager, TransferStats
from ..transfer.pool import KVCacheBlock
from .model import (
    RECORD_TOP_K,
    ModelConfig,
    Rows,
    budget_chunks,
    create_pool,
    make_step,
    max_layer_groups,
    pack_prefill,
    unpack_records,
)
from .workloads import Conversation

LOW_PRIORITY = 20  # below the default secondary_offload_min_priority (30): dropped, not offloaded
# How long (wall time) a request waits for the prefix another replica writes to a shared store
# (Request.expect_tokens) before it computes what is missing.
PREFIX_WAIT_S = 5.0
# Where a step's host wall time goes (RunResult.step_seconds): the block manager's calls
# (admission, allocation, prefix matching, appending and releasing; the transfers it queues),
# the step boundary's sync_transfers (the queued copies checked and dispatched, the lanes'
# joins), building and dispatching the model step, and waiting for its records (the device's
# time not hidden behind the host's, and whatever the step waits for on the device).
STEP_PHASES = ("block manager", "transfers", "model dispatch", "model wait")
# Parts of those phases, for a breakdown: of "block manager", admitting requests (prefix
# matching, allocation, onboarding) and collecting a step's tokens (appending, releasing);
# of "model dispatch", the step's rows (token, position and block-table arrays).
STEP_DETAIL = ("admit", "collect", "rows")
# XLA compiles in this process so far, [count, seconds] (jax.monitoring's backend-compile
# event): a run's clock must start after every shape it needs is compiled, which the serving
# loop checks by the compiles it sees while it runs.
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = [0, 0.0]


def _count_compile(event: str, duration: float, **_) -> None:
    if event == _BACKEND_COMPILE_EVENT:
        _compiles[0] += 1
        _compiles[1] += duration


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@dataclasses.dataclass
class TurnResult:
    """One request: when it arrived, got its first token and ended; what it reused."""

    arrival_s: float
    first_token_s: float
    done_s: float
    prompt_tokens: int
    gpu_hit_tokens: int  # prompt tokens whose K/V were in the primary pool
    host_hit_tokens: int  # ... onboarded from the secondary pool
    store_hit_tokens: int  # ... read from a store into host rows, then onboarded
    tokens: list[int]  # the reply
    # Of each reply token's logits, what `compare` checks (model.TokenRecord), a row per
    # token: the RECORD_KEPT (64) largest in the model's dtype, largest first `[n, K]`, their
    # token ids `[n, K]` int32 and the fingerprint of the whole row `[n, 2]` uint32.
    top_logits: np.ndarray
    top_logit_tokens: np.ndarray
    logits_fingerprints: np.ndarray
    key: tuple[int, int] | None = None  # (conversation, turn)
    # when it was admitted (rows and blocks given): it waited from arrival_s in the queue
    admitted_s: float | None = None

    @property
    def computed_prompt_tokens(self) -> int:
        return (self.prompt_tokens - self.gpu_hit_tokens - self.host_hit_tokens
                - self.store_hit_tokens)


@dataclasses.dataclass
class RunResult:
    """Everything one run produced, keyed by (conversation, turn)."""

    turns: dict[tuple[int, int], TurnResult]
    block_stats: BlockManagerStats
    transfer_stats: TransferStats
    steps: int
    seconds: float  # the loop's clock at the end (compilation excluded)
    compile_seconds: float
    primary_blocks: int
    secondary_blocks: int
    # What compute did not hide: with the GPU's transfer lanes, the time the model's stream
    # waited for transfers (CUDA events); otherwise the copies run in line with the steps and
    # the wall time issuing and syncing them counts whole.
    exposed_transfer_seconds: float = 0.0
    # The steps whose prefill segment was full (without a budget: every row a whole chunk;
    # with one: every row of the packed segment holding tokens, padding in partly filled rows
    # counted as time, not work): their matrix products' operations and wall time, for the
    # rate prefill reaches.
    full_prefill_flops: int = 0
    full_prefill_seconds: float = 0.0
    # The stores' statistics over the run, summed over them (None: the run had no store), and
    # the wall time the block manager's close took at the end (its writes made durable).
    store_stats: StoreStats | None = None
    store_close_seconds: float = 0.0
    # A run of several replicas (replicas.py): each one's own result, and the turns whose
    # previous turn ran on another replica.
    replicas: list[RunResult] | None = None
    moved: frozenset[tuple[int, int]] = frozenset()
    # XLA compiles while the clock ran (none, when the warm-up compiled every shape), and their
    # seconds; and the offloads the admission policy declined.
    run_compiles: int = 0
    run_compile_seconds: float = 0.0
    offloads_declined: int = 0
    admission: str = "always"
    # Where the steps' wall time went, in seconds over the run (STEP_PHASES, and "step": the
    # steps' wall time in all, so that what is not in a phase is the serving loop's own).
    step_seconds: dict[str, float] = dataclasses.field(default_factory=dict)

    def metrics(self) -> dict[str, object]:
        """TTFT, TPOT, throughput and cache figures, as the demo reports them."""
        res = list(self.turns.values())
        ttft = np.array([r.first_token_s - r.arrival_s for r in res])
        tpot = np.array([(r.done_s - r.first_token_s) / (len(r.tokens) - 1)
                         for r in res if len(r.tokens) > 1])
        out_tokens = sum(len(r.tokens) for r in res)
        t = self.transfer_stats

        def pct(x: np.ndarray, q: float) -> float:
            return float(np.percentile(x, q)) if x.size else 0.0
        waits = np.array([r.admitted_s - r.arrival_s for r in res if r.admitted_s is not None])
        return {
            "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            # TTFT's first part: from arrival to admission (a row and the blocks free)
            "queue_wait_s": {"p50": pct(waits, 50), "p90": pct(waits, 90)},
            "tpot_s": {"p50": pct(tpot, 50)},
            "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / self.seconds if self.seconds else 0.0,
            "computed_prefill_tokens": sum(r.computed_prompt_tokens for r in res),
            "gpu_hit_tokens": sum(r.gpu_hit_tokens for r in res),
            "host_hit_tokens": sum(r.host_hit_tokens for r in res),
            "store_hit_tokens": sum(r.store_hit_tokens for r in res),
            "onboarded_bytes": t.onboarded_bytes, "offloaded_bytes": t.offloaded_bytes,
            "exposed_transfer_s": self.exposed_transfer_seconds,
            "seconds": self.seconds, "steps": self.steps,
            "compiles_during_run": self.run_compiles,
            "compile_seconds_during_run": self.run_compile_seconds,
            "full_prefill_tflop_per_s": (self.full_prefill_flops / self.full_prefill_seconds / 1e12
                                         if self.full_prefill_seconds else None),
            "step_ms": {k: 1e3 * v / self.steps for k, v in self.step_seconds.items()}
            if self.steps else {},
            "store": None if self.store_stats is None else {
                **dataclasses.asdict(self.store_stats), "close_seconds": self.store_close_seconds},
        }


@dataclasses.dataclass
class _Running:
    conv: int
    turn: int
    arrival_s: float
    prompt: list[int]
    next: int  # the next prompt position to compute
    reserved: int  # primary blocks it may need in all
    gpu_hits: int
    host_hits: int
    store_hits: int
    output_len: int = 0  # the reply's length, unless it ends on the stop token
    admitted_s: float = 0.0
    first_token_s: float = 0.0
    out: list[int] = dataclasses.field(default_factory=list)
    # each reply token's (top logits, their token ids, fingerprint): rows of its step's record
    records: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = dataclasses.field(
        default_factory=list)


def max_request_blocks(conversations: Sequence[Conversation], tokens_per_block: int) -> int:
    """The most primary blocks one request of these conversations can need (its last turn)."""
    return max(math.ceil((len(c.prefix) + sum(len(t.user) + t.output_len for t in c.turns))
                         / tokens_per_block) for c in conversations)


def working_set_blocks(conversations: Sequence[Conversation], tokens_per_block: int) -> int:
    """The blocks the conversations ever store, each distinct block once: the full blocks of
    each conversation's first prompt (its prefix and first user turn, known in advance) by
    their content and position, so that a system prompt, a document or a trace's shared
    blocks count once; and, per conversation, every block after those, plus two per turn (a
    turn's partly filled last block of prompt and of reply)."""
    seen: set[int] = set()
    total = 0
    for c in conversations:
        first = list(c.prefix) + (list(c.turns[0].user) if c.turns else [])
        full = len(first) // tokens_per_block
        chain = 0
        for b in range(full):
            chain = hash((chain, tuple(first[b * tokens_per_block:(b + 1) * tokens_per_block])))
            seen.add(chain)
        length = len(c.prefix) + sum(len(t.user) + t.output_len for t in c.turns)
        total += math.ceil(length / tokens_per_block) - full + 2 * len(c.turns)
    return total + len(seen)


def blocks_to_never_evict(conversations: Sequence[Conversation], batch: int,
                          tokens_per_block: int) -> int:
    """A primary pool that holds every block the conversations ever store
    (`working_set_blocks`), plus room for `batch` requests at once: no block is ever
    evicted."""
    return (working_set_blocks(conversations, tokens_per_block)
            + batch * max_request_blocks(conversations, tokens_per_block))


def prefill_budget_for(conversations: Sequence[Conversation], budget: int) -> tuple[int, str]:
    """The prefill schedule for a workload, and why: `budget` tokens packed in one segment a
    step where its prompts average at least half of it, else 0 (a segment `[1, chunk]` per
    prefilling request). A packed segment costs its full size whenever a prompt waits, so short
    prompts leave it mostly padding: on the H200 a public conversation trace of ~400-token
    prompts ran 1.5x slower to first token with a 2,048-token budget than with 0, and the
    bursts workload (prompts of 200-450 tokens) 1.5x; the chats (prompts of 2-6k tokens) and a
    trace of 0.7-2k-token prompts ran faster packed (docs/performance.md). The choice is the
    same for every run of a workload, so that each run computes a token in the same shape of
    segment, and runs agree bit for bit."""
    if not budget:
        return 0, "a segment [1, chunk] per request"
    lengths = []  # each turn's prompt: the prefix, the turns before with their replies, its own
    for c in conversations:
        history = len(c.prefix)
        for turn in c.turns:
            lengths.append(history + len(turn.user))
            history += len(turn.user) + turn.output_len
    mean = sum(lengths) / max(len(lengths), 1)
    if mean >= budget / 2:
        return budget, (f"{budget} prompt tokens a step in one packed segment (prompts average "
                        f"{mean:,.0f} tokens)")
    return 0, (f"a segment [1, chunk] per request, not the preset's {budget}-token packed "
               f"segment (prompts average {mean:,.0f} tokens, under half of it)")


def run(model: ModelConfig, params: dict, conversations: Sequence[Conversation], *,
        batch: int, chunk: int, tokens_per_block: int, primary_blocks: int,
        secondary_blocks: int, prefill_rows: int = 1, prefill_budget: int = 0,
        priorities: Sequence[int] | None = None,
        progress: Callable[[int, int], None] | None = None,
        mesh: jax.sharding.Mesh | None = None, dma: bool | str = "auto",
        stop_token: int | None = None, fixed_step_s: float | None = None,
        stores: Sequence[Store] = (), admission: str | None = None,
        name: str | None = None, layer_groups: int = 0) -> RunResult:
    """Serves the conversations once on fresh pools; `dma`: the transfer manager's. Up to
    `batch` requests run at once; a step decodes those whose prompt is computed and prefills
    the others: up to `prefill_budget` prompt tokens packed across them in rows of `chunk`
    (a multiple of `chunk`), or, with a budget of 0, `chunk` tokens of up to `prefill_rows` of
    them, a segment each. A turn's reply ends after its `output_len` tokens, or once it
    generates `stop_token` (kept).
    `fixed_step_s`: the clock advances by this much per step instead of the wall time, so
    that the schedule is the same on every machine and in every run (tests).
    `stores`: tiers below the host pool (`jax_kvxfer.stores`), for the block manager; they need
    a host pool (`secondary_blocks` > 0) on one device (no `mesh`). They stay open (the
    caller's to close); the block manager is closed at the end, so their writes are durable.
    `admission`: the block manager's admission policy for offloads (None: always).
    `name`: the block manager's, its label in the metrics (the demo's: the run's name).
    `layer_groups`: 0, or each step's layers wait for their onboards in this many groups
    (`Server`).

    Raises:
      PoolExhaustedError: the primary pool cannot hold one request.
    """
    server = Server(model, params, max_blocks=max_request_blocks(conversations, tokens_per_block),
                    batch=batch, chunk=chunk, tokens_per_block=tokens_per_block,
                    primary_blocks=primary_blocks, secondary_blocks=secondary_blocks,
                    prefill_rows=prefill_rows, prefill_budget=prefill_budget, mesh=mesh,
                    dma=dma, stop_token=stop_token,
                    stores=stores, admission=admission, name=name, layer_groups=layer_groups)
    priorities = list(priorities) if priorities is not None else [35] * len(conversations)
    print(f"host memory, {name or 'run'} ready: {_host_memory()}", file=sys.stderr)
    try:
        loop = _serve(server, conversations, priorities=priorities, progress=progress,
                      fixed_step_s=fixed_step_s)
    finally:
        server.close()
    print(f"host memory, {name or 'run'} done: {_host_memory()}", file=sys.stderr)
    res = server.result(loop.results, steps=loop.steps, seconds=loop.clock,
                        full_flops=loop.full_flops, full_seconds=loop.full_seconds,
                        step_seconds=loop.step_seconds)
    return dataclasses.replace(res, run_compiles=loop.compiles,
                               run_compile_seconds=loop.compile_seconds)


def _host_memory() -> str:
    """This process's resident memory now and at its peak (Linux's /proc; else unknown)."""
    try:
        with open("/proc/self/status") as f:
            kb = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f)
                  if k in ("VmRSS", "VmHWM")}
        return f"RSS {kb['VmRSS'] / 1e6:.1f} GB, peak {kb['VmHWM'] / 1e6:.1f} GB"
    except (OSError, KeyError, ValueError):
        return "unknown"


@dataclasses.dataclass
class Request:
    """A turn to serve: its prompt, reply length and priority, when it arrived (on the
    driver's clock), and how many of the prompt's tokens to wait for (`expect_tokens`: another
    replica's blocks, on their way to a shared store) before it is admitted."""

    key: tuple[int, int]  # (conversation, turn)
    arrival_s: float
    prompt: list[int]
    output_len: int
    priority: int = 35
    expect_tokens: int = 0
    wait_until: float = 0.0  # time.monotonic() after which it stops waiting for them


class Server:
    """One serving process's model step, pools, transfer manager and block manager, and the
    requests it runs: `submit` requests as they arrive, `step` the model, then `collect` what
    the step produced at the clock the driver keeps. `run` drives one over a workload; the
    demo's replicas (replicas.py) drive one per process from a router."""

    def __init__(self, model: ModelConfig, params: dict, *, max_blocks: int, batch: int,
                 chunk: int, tokens_per_block: int, primary_blocks: int,
                 secondary_blocks: int, prefill_rows: int = 1, prefill_budget: int = 0,
                 mesh: jax.sharding.Mesh | None = None, dma: bool | str = "auto",
                 stop_token: int | None = None, stores: Sequence[Store] = (),
                 store_on_release: bool = False, admission: str | None = None,
                 name: str | None = None, layer_groups: int = 0) -> None:
        """`max_blocks`: the most primary blocks one request needs (block tables' width);
        `prefill_budget`: prompt tokens a step computes, packed across requests in one segment
        `[prefill_budget / chunk, chunk]` (a multiple of `chunk`; 0: a segment `[1, chunk]`
        for each of up to `prefill_rows` requests); `store_on_release`: the block manager
        writes a finished turn's blocks to the stores at once (replicas sharing a store), not
        only once they are evicted to the host; `name`: the block manager's (`run`'s);
        `layer_groups`: see `_layer_groups`."""
        if isinstance(prefill_budget, bool) or not isinstance(prefill_budget, int) or \
                prefill_budget < 0 or prefill_budget % chunk:
            raise ValueError(f"prefill_budget must be 0 or a positive multiple of chunk "
                             f"({chunk}), got {prefill_budget!r}")
        layer_groups = _layer_groups(layer_groups, model, mesh, secondary_blocks)
        if max_blocks > primary_blocks:
            raise PoolExhaustedError(f"a request may need {max_blocks} primary blocks, but the "
                                     f"pool has {primary_blocks}")
        pool = create_pool(model, tokens_per_block=tokens_per_block,
                           num_primary_blocks=primary_blocks,
                           num_secondary_blocks=secondary_blocks, mesh=mesh)
        if mesh is not None:  # tensor parallel: weights on every device, the pool split by heads
            params = jax.device_put(params, jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec()))
        transfers = KVCacheTransferManager([pool], dma=dma, layer_groups=max(layer_groups, 1))
        self.layer_groups = layer_groups
        self._pool = pool
        self._block_nbytes = pool.block_nbytes  # what a store read moves a block
        self.model, self.batch, self.chunk = model, batch, chunk
        self.primary_blocks, self.secondary_blocks = primary_blocks, secondary_blocks
        self.prefill_rows = min(prefill_rows, batch)
        self.prefill_budget = prefill_budget
        self.budget_rows = prefill_budget // chunk  # rows of the packed segment (0: none)
        self.stop_token, self.stores = stop_token, tuple(stores)
        self.bm: BlockManager | None = None  # made once the transfers are compiled
        self.step_seconds = dict.fromkeys(STEP_PHASES + STEP_DETAIL, 0.0)  # host time, summed
        self.max_blocks, self._params = max_blocks, params
        self._model_step = make_step(model, pool, greedy=True, layer_groups=layer_groups)
        t0 = time.perf_counter()
        # compiles every kind of step (no writes): with a budget, with and without the packed
        # segment; without, with 0 to prefill_rows segments
        for k in range(2 if self.budget_rows else self.prefill_rows + 1):
            self._forward([], [], segments=k)
        t1 = time.perf_counter()
        _warm_up_transfers(transfers, pool, min(primary_blocks, batch * max_blocks))
        self.compile_seconds = time.perf_counter() - t0
        print(f"compiled: model step {t1 - t0:.1f} s, transfer buckets "
              f"{self.compile_seconds - t1 + t0:.1f} s", file=sys.stderr)
        self.bm = BlockManager(pool, transfer_manager=transfers, stores=stores,
                               store_on_release=store_on_release, admission=admission,
                               name=name)
        # Replicas sharing a store read a block only where the read beats recomputing it: the
        # block manager is given what a prompt token costs here, measured over the steps that
        # prefill a full segment (the whole step over its prompt tokens: an upper bound, so a
        # read is preferred where the two are close).
        self._token_seconds: float | None = None
        self._measure_recompute = store_on_release
        self.waiting: list[Request] = []  # arrived, not admitted yet, in arrival order
        self.running: list[_Running] = []
        self._reserved = 0
        self._priority: dict[tuple[int, int], int] = {}
        # prefetched[key]: the prompt positions [lo, hi) its prefetch read from a store
        self._prefetched: dict[tuple[int, int], tuple[int, int]] = {}
        self._prefetch_asked: set[tuple[int, int]] = set()  # requests `_prefetch_next` matched
        # the requests that found their expected prefix and wait for its prefetch to end
        self._reading: set[tuple[int, int]] = set()
        self._step: tuple | None = None  # the last step's rows and records, for collect
        self.full_step_flops = 0  # the last step's, when its prefill segment was full
        self._closed = False
        # (the compiles' waits not counted)
        self.step_seconds = dict.fromkeys(STEP_PHASES + STEP_DETAIL, 0.0)
        self.transfer_stats: TransferStats | None = None
        self.close_seconds = 0.0

    def _segment(self, rows: list[tuple[tuple[int, int], list[int], int]], width: int,
                 length: int) -> Rows:
        """rows (seq_id, tokens, first position) padded to `width` rows of `length` tokens."""
        tok = np.zeros((width, length), np.int32)
        pos = np.full((width, length), -1, np.int32)
        tables = np.zeros((width, self.max_blocks), np.int32)
        last = np.zeros(width, np.int32)
        for r, (sid, toks, start) in enumerate(rows):
            tok[r, :len(toks)] = toks
            pos[r, :len(toks)] = np.arange(start, start + len(toks))
            last[r] = len(toks) - 1
            table = self.bm.block_table(sid)
            tables[r, :len(table)] = table
        return Rows(tok, pos, tables, last)

    def _forward(self, prefills: list, decodes: list, *, segments: int) -> tuple[list, list]:
        """One step of `segments` prefill segments and the decode segment: (record, token) of
        each prefill's last token, then of each decode (`_wait`'s rows). With a budget, at most
        one prefill segment, packing every prefill (aligned rows); without, one request's
        chunk each, the first `len(prefills)` of them real."""
        t = time.perf_counter()
        pool, decode = self._pool, self._segment(decodes, self.batch, 1)
        if self.budget_rows:
            packed, last_rows = pack_prefill(
                [(toks, start, self.bm.block_table(sid)) for sid, toks, start in prefills],
                rows=self.budget_rows, row_tokens=self.chunk, max_blocks=self.max_blocks,
                aligned=True)
            self.step_seconds["rows"] += time.perf_counter() - t
            out, pool.primary = self._model_step(self._params, pool.primary,
                                                 (packed,) * segments + (decode,))
        else:  # segment i's one row is the step's row i
            last_rows = range(len(prefills))
            rows = [self._segment(prefills[i:i + 1], 1, self.chunk) for i in range(segments)]
            self.step_seconds["rows"] += time.perf_counter() - t
            out, pool.primary = self._model_step(self._params, pool.primary, (*rows, decode))
        row = self._wait(out)
        first_decode = len(out) - self.batch  # the decode segment's rows come last
        return ([row(r) for r in last_rows],
                [row(first_decode + i) for i in range(len(decodes))])

    def _wait(self, out) -> Callable[[int], tuple[tuple, int]]:
        """The step's records (model.pack_records: every row of its segments, in order) on the
        host, as a function of a row: `((top logits, their token ids, fingerprint), token)`.
        The time until they are is the device's (and what it waits for), the time before it
        the host's, building and dispatching."""
        t = time.perf_counter()
        host = np.asarray(out)  # one small copy: no row of the vocabulary's size
        self.step_seconds["model wait"] += time.perf_counter() - t
        record = unpack_records(host, self.model.dtype)
        tokens = record.tokens.tolist()
        return lambda r: ((record.top_logits[r], record.top_logit_tokens[r],
                           record.fingerprints[r]), tokens[r])

    @property
    def busy(self) -> bool:
        """Whether requests run or wait."""
        return bool(self.running or self.waiting)

    def submit(self, request: Request) -> None:
        """Queues an arrived request (admitted in arrival order as rows and blocks allow)."""
        if request.expect_tokens and not request.wait_until:
            request.wait_until = time.monotonic() + self._prefix_wait_s(request.expect_tokens)
        self.waiting.append(request)

    def _prefix_wait_s(self, tokens: int) -> float:
        """How long a request waits for `tokens` of its prefix that another replica is
        writing to the store: PREFIX_WAIT_S at most, and once a prompt token's cost is
        measured, no longer than recomputing them would take less reading them (by the
        store's measured reads, where known): a wait that cannot pay is not made."""
        if self._token_seconds is None:
            return PREFIX_WAIT_S
        budget = tokens * self._token_seconds
        read = read_rate(self.stores[0]).seconds(
            -(-tokens // self.bm.tokens_per_block) * self._block_nbytes) if self.stores else None
        return max(0.0, min(PREFIX_WAIT_S, budget - (read or 0.0)))

    def _waits_for_prefix(self, req: Request) -> bool:
        """Whether `req` still waits for its expected prefix: fewer of its tokens are found
        than expected, until its deadline (then it computes what is missing); once found, a
        part that only a store holds is prefetched, and `req` waits until that read is done.
        The read then overlaps the steps of the running requests, instead of holding up the
        step that admits `req` (the replicas on the H200 spent their store reads there)."""
        bm = self.bm
        if req.key in self._reading:  # its prefix found, the store's part still read
            if bm.prefetch_pending(req.prompt):
                return True
            self._reading.discard(req.key)
            return False
        if req.expect_tokens <= 0:
            return False
        match = bm.match_prefix(req.prompt)
        # (blocks found that the read-or-recompute rule leaves to recompute count as found)
        found = match.num_tokens + match.store_skipped_blocks * bm.tokens_per_block
        if found < req.expect_tokens and time.monotonic() < req.wait_until:
            return True
        req.expect_tokens = 0
        if req.key not in self._prefetched and self._start_prefetch(req, match):
            self._reading.add(req.key)
            return True
        return False

    def _start_prefetch(self, req: Request, match) -> bool:
        """Starts reading from the stores the part of `req`'s prefix that only they hold, if
        it is within a quarter of the host pool: blocks read ahead hold their host rows until
        `req` is admitted. Whether a read started."""
        bm = self.bm
        if not (0 < match.store_blocks <= bm.num_secondary_blocks // 4):
            return False
        lo = (match.primary_blocks + match.secondary_blocks) * bm.tokens_per_block
        self._prefetched[req.key] = (lo, lo + bm.prefetch(req.prompt))
        return True

    def _admit(self, clock: float) -> None:
        """Admits waiting requests in order while a row is free and the primary pool can
        hold all they will need; a request waiting for its prefix lets the next ones go
        first. `clock`: the driver's, now."""
        t_block = self.bm.tokens_per_block
        bm = self.bm
        for req in list(self.waiting):
            if len(self.running) >= self.batch:
                break
            if self._waits_for_prefix(req):
                continue
            need = math.ceil((len(req.prompt) + req.output_len) / t_block)
            if self._reserved + need > self.primary_blocks:
                break  # it waits until running requests end and give their blocks back
            self.waiting.remove(req)
            self._prefetch_asked.discard(req.key)
            prompt = req.prompt
            match = bm.match_prefix(prompt)  # waits for a prefetch of this prompt still reading
            partial = match.partial_tokens
            gpu = match.primary_blocks * t_block + (partial if match.partial_source_is_primary
                                                    else 0)
            host = match.secondary_blocks * t_block + (
                partial if match.partial_source_is_primary is False else 0)
            early = (self._prefetched_host_tokens(prompt, self._prefetched.pop(req.key), match)
                     if req.key in self._prefetched else 0)
            start = bm.add_sequence(req.key, prompt, priority=req.priority)
            # Beyond the GPU and host hits: blocks read from a store now, at most those that
            # match_prefix found there (fewer when some turn out missing or corrupt, or the
            # host pool has too few rows to stage them in), and those it left to recompute
            # where add_sequence reads them all the same (the block manager's probe read, now
            # and then: connector.tiers.READ_PROBE_EVERY).
            read = start - gpu - host
            from_store = match.store_blocks * t_block + (
                partial if match.partial_from_store else 0)  # a reply's tail, say
            probed = match.store_skipped_blocks * t_block
            assert 0 <= read <= from_store + probed and (
                probed or read % t_block == 0 or read == from_store), (start, match)
            self._reserved += need
            self.running.append(_Running(req.key[0], req.key[1], req.arrival_s, prompt, start,
                                         need, gpu, host - early, read + early,
                                         output_len=req.output_len, admitted_s=clock))

    def _prefetch_next(self) -> None:
        """Starts reading from the stores the prefix of the next request, if one waits (for a
        row, or for primary blocks): the read overlaps the next steps, and admission onboards
        it like host hits. Once per request, one request at a time, and only a prefix within a
        quarter of the host pool: blocks read ahead hold their host rows until their request
        is admitted, rows that offloads and the reads at admission then lack (prefetching the
        next few requests, or into half the host pool, measured fewer hits in all)."""
        if not self.waiting or self._prefetched or self.waiting[0].key in self._prefetch_asked:
            return
        req = self.waiting[0]
        self._prefetch_asked.add(req.key)  # once: a match asks the stores (a round trip each)
        self._start_prefetch(req, self.bm.match_prefix(req.prompt))

    def _prefetched_host_tokens(self, prompt: list[int], span: tuple[int, int], match) -> int:
        """Of the full host blocks `match` found, the tokens within `span`, which this
        request's prefetch read from a store (those since onboarded by another request are
        GPU hits here)."""
        lo, hi = span
        t_block = self.bm.tokens_per_block
        end = min(hi, (match.primary_blocks + match.secondary_blocks) * t_block)
        if end <= lo:
            return 0
        # the same full blocks, matched up to `end` and up to `lo` (the last token of a prompt
        # is never matched: one more)
        return (self.bm.match_prefix(prompt[:end + 1]).secondary_blocks
                - self.bm.match_prefix(prompt[:lo + 1]).secondary_blocks) * t_block

    def step(self, clock: float) -> bool:
        """Admits what it can, then runs one model step over the running requests; False
        (and nothing run) when none runs. `clock`: the driver's at the step's start."""
        t0 = time.perf_counter()
        self._admit(clock)
        self.step_seconds["admit"] += time.perf_counter() - t0
        if not self.running:
            self._step = None
            return False
        bm, chunk = self.bm, self.chunk
        pending = [r for r in self.running if r.next < len(r.prompt)]
        if self.budget_rows:  # the budget's rows to the prefilling requests in admission order
            take = budget_chunks([len(r.prompt) - r.next for r in pending],
                                 rows=self.budget_rows, row_tokens=chunk,
                                 starts=[r.next for r in pending])
        else:  # a chunk to each of the first prefill_rows
            take = [chunk] * min(len(pending), self.prefill_rows)
        prefilling = [r for r, n in zip(pending, take) if n]
        prefills = [((r.conv, r.turn), r.prompt[r.next:r.next + n], r.next)
                    for r, n in zip(pending, take) if n]
        decoding = [r for r in self.running if r.next >= len(r.prompt)]
        # decode: the last token, appended to the sequence after the last step
        decodes = [((r.conv, r.turn), r.out[-1:], bm.num_tokens((r.conv, r.turn)) - 1)
                   for r in decoding]
        t1 = time.perf_counter()
        # the step boundary: after allocation, before the step (which, with layer groups,
        # waits for the onboards itself, group by group)
        bm.sync_transfers(block=False, layer_wise=self.layer_groups > 0)
        t2 = time.perf_counter()
        segments = min(len(prefills), 1) if self.budget_rows else len(prefills)
        waited = self.step_seconds["model wait"]
        prefill_out, decode_out = self._forward(prefills, decodes, segments=segments)
        phases = self.step_seconds
        phases["block manager"] += t1 - t0
        phases["transfers"] += t2 - t1
        phases["model dispatch"] += (time.perf_counter() - t2) - (phases["model wait"] - waited)
        self.full_step_flops = 0
        if self.budget_rows:  # full: every row of the packed segment holds tokens
            full = prefills and sum(_aligned_rows(start, len(toks), chunk)
                                    for _, toks, start in prefills) == self.budget_rows
        else:  # full: prefill_rows segments, each a whole chunk
            full = len(prefills) == self.prefill_rows and all(len(toks) == chunk
                                                              for _, toks, _ in prefills)
        if full and self._measure_recompute:
            per_token = (time.perf_counter() - t0) / sum(len(toks) for _, toks, _ in prefills)
            self._token_seconds = per_token if self._token_seconds is None else (
                0.8 * self._token_seconds + 0.2 * per_token)  # recent steps weigh more
            bm.set_recompute_cost(self._token_seconds)
        if full:
            model = self.model
            self.full_step_flops = (
                sum(model.token_flops(p + 1) for _, toks, start in prefills
                    for p in range(start, start + len(toks)))
                + sum(model.token_flops(p + 1) for _, _, p in decodes))
        self._step = (prefilling, prefills, decoding, prefill_out, decode_out)
        return True

    def collect(self, clock: float, *, prefetch: bool = True) -> list[TurnResult]:
        """What the last step produced, at `clock` (the driver's, after the step): the first
        token of each request whose prefill ended, the next of each decode; the turns that
        ended (keyed as `TurnResult.key`), their sequences released for reuse. Before that,
        with stores, starts the prefetch of the next waiting request (`prefetch`)."""
        if self._step is None:
            return []
        t0 = time.perf_counter()
        if prefetch and self.stores:  # after the step, whose transfers are done
            self._prefetch_next()
        prefilling, prefills, decoding, prefill_out, decode_out = self._step
        self._step = None
        finished = []
        for r, (_, toks, start) in zip(prefilling, prefills):
            r.next = start + len(toks)
        done_prefill = [(i, r) for i, r in enumerate(prefilling) if r.next >= len(r.prompt)]
        for i, r in done_prefill + list(enumerate(decoding)):
            record, token = prefill_out[i] if not r.out else decode_out[i]
            if not r.out:
                r.first_token_s = clock
            r.out.append(token)
            r.records.append(record)
            if len(r.out) == r.output_len or token == self.stop_token:
                finished.append(r)
            else:
                self.bm.append_tokens((r.conv, r.turn), [token])
        results = []
        for r in finished:
            self.running.remove(r)
            self._reserved -= r.reserved
            self.bm.release_sequence((r.conv, r.turn))
            # the records as arrays of their own (not views holding whole step arrays)
            top, ids, prints = (np.stack(x) for x in zip(*r.records))
            results.append(TurnResult(r.arrival_s, r.first_token_s, clock, len(r.prompt),
                                      r.gpu_hits, r.host_hits, r.store_hits, r.out,
                                      top, ids, prints, key=(r.conv, r.turn),
                                      admitted_s=r.admitted_s))
        if finished:  # a router learns of the released blocks now (KV events, if published)
            self.bm.publish_events()
        took = time.perf_counter() - t0
        self.step_seconds["block manager"] += took
        self.step_seconds["collect"] += took
        return results

    def close(self) -> None:
        """Joins the transfers and closes the block manager (the stores' writes durable)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.bm.sync_transfers()
            self.transfer_stats = self.bm.transfer_manager.get_and_reset_transfer_stats()
        finally:
            t_close = time.perf_counter()
            self.bm.close()  # the stores' writes durable, the block manager's threads stopped
            self.close_seconds = time.perf_counter() - t_close
            # The pools' memory back now, not once the garbage collector finds this server
            # (its step closure holds it in a cycle): a process serving runs one after another
            # (a load sweep, --events-overhead) would otherwise hold a host pool per run.
            for array in (self._pool.primary, self._pool.secondary):
                if isinstance(array, jax.Array):
                    array.delete()

    def result(self, turns: dict[tuple[int, int], TurnResult], *, steps: int, seconds: float,
               full_flops: int = 0, full_seconds: float = 0.0,
               step_seconds: float = 0.0) -> RunResult:
        """The run's result once closed: `turns` and the driver's figures (`step_seconds`:
        the steps' wall time in all), with this server's statistics."""
        self.close()
        bm = self.bm
        store_stats = None
        if self.stores:
            store_stats = StoreStats()
            for stats in bm.store_stats().values():
                store_stats.add(stats)
        transfer_stats = self.transfer_stats or TransferStats()
        return RunResult(
            turns=turns, block_stats=bm.stats, transfer_stats=transfer_stats,
            steps=steps, seconds=seconds, compile_seconds=self.compile_seconds,
            primary_blocks=self.primary_blocks, secondary_blocks=self.secondary_blocks,
            exposed_transfer_seconds=(transfer_stats.exposed_seconds
                                      if bm.transfer_manager.on_lanes
                                      else bm.stats.transfer_seconds),
            full_prefill_flops=full_flops, full_prefill_seconds=full_seconds,
            store_stats=store_stats, store_close_seconds=self.close_seconds if self.stores
            else 0.0, offloads_declined=bm.admission.declined, admission=bm.admission.name,
            step_seconds={**self.step_seconds, "step": step_seconds})


def _layer_groups(layer_groups: int, model: ModelConfig, mesh: jax.sharding.Mesh | None,
                  secondary_blocks: int) -> int:
    """A Server's groups of layers: 0 (the step boundary joins the onboards), or the onboards
    land in this many groups of layers and each step's layers wait only for their own group
    (`model.forward`), so that a step computes its first layers while the later ones arrive;
    on one device, at least 2 layers a group. A run without a host pool onboards nothing,
    and its steps wait for nothing (0): the oracle's steps stay as they were."""
    if isinstance(layer_groups, bool) or not isinstance(layer_groups, int) or \
            not 0 <= layer_groups <= max_layer_groups(model.num_layers):
        raise ValueError(f"layer_groups must be 0 or at most half the model's "
                         f"{model.num_layers} layers, got {layer_groups!r}")
    if layer_groups and mesh is not None:
        raise ValueError("layer_groups takes a pool on one device; this one is split over "
                         f"{mesh.size} devices")
    return layer_groups if secondary_blocks else 0


def _aligned_rows(start: int, n: int, row_tokens: int) -> int:
    """Rows of `row_tokens` that positions [start, start + n) take, cut at absolute multiples
    of `row_tokens` (pack_prefill's aligned layout)."""
    return -(-(start % row_tokens + n) // row_tokens)


@dataclasses.dataclass
class _Loop:
    """What the serving loop produced."""

    results: dict[tuple[int, int], TurnResult]
    steps: int
    clock: float
    full_flops: int
    full_seconds: float
    compiles: int = 0  # XLA compiles while the loop ran, and their seconds
    compile_seconds: float = 0.0
    step_seconds: float = 0.0  # the steps' wall time: each from its start to its collect's end


def _serve(server: Server, conversations: Sequence[Conversation], *, priorities: list[int],
           progress: Callable[[int, int], None] | None,
           fixed_step_s: float | None) -> _Loop:
    """The serving loop (see `run`): hands the server the requests as they arrive, steps it
    until every turn is done; a turn's next turn arrives its think time after it ends."""
    pending = [(c.start_s, i, 0) for i, c in enumerate(conversations)]
    heapq.heapify(pending)
    history = [list(c.prefix) for c in conversations]
    total = sum(len(c.turns) for c in conversations)
    results: dict[tuple[int, int], TurnResult] = {}
    clock, steps = 0.0, 0
    full_flops, full_seconds, step_seconds = 0, 0.0, 0.0
    agreed = _agreed_across_processes() if fixed_step_s is None else (lambda seconds: seconds)

    def submit_arrived() -> None:
        while pending and pending[0][0] <= clock:
            arrival, c, t = heapq.heappop(pending)
            turn = conversations[c].turns[t]
            server.submit(Request((c, t), arrival, history[c] + list(turn.user),
                                  turn.output_len, priorities[c]))

    compiled = list(_compiles)
    mark = time.perf_counter()  # the clock's wall time so far runs from here
    while pending or server.busy:
        submit_arrived()
        if not server.step(clock):  # idle until the next arrival
            now = time.perf_counter()
            step_seconds += now - mark  # the last step's collect, whose phase is counted too
            elapsed = 0.0 if fixed_step_s is not None else now - mark
            clock = agreed(max(clock + elapsed, pending[0][0]))
            mark = time.perf_counter()
            continue
        steps += 1
        # the step's tokens exist from here; what follows counts towards the next step
        step_seconds += time.perf_counter() - mark
        elapsed = fixed_step_s if fixed_step_s is not None else time.perf_counter() - mark
        if server.full_step_flops:
            full_seconds += elapsed
            full_flops += server.full_step_flops
        clock = agreed(clock + elapsed)
        mark = time.perf_counter()
        submit_arrived()  # those that arrived during the step: the next one's prefetch
        for res in server.collect(clock):
            c, t = res.key
            results[(c, t)] = res
            history[c] = history[c] + list(conversations[c].turns[t].user) + res.tokens
            turns = conversations[c].turns
            if t + 1 < len(turns):
                heapq.heappush(pending, (clock + turns[t + 1].think_s, c, t + 1))
            if progress:
                progress(len(results), total)
    step_seconds += time.perf_counter() - mark  # the last collect
    return _Loop(results, steps, clock, full_flops, full_seconds,
                 _compiles[0] - compiled[0], _compiles[1] - compiled[1], step_seconds)


def _agreed_across_processes() -> Callable[[float], float]:
    """With one JAX process per host, every process must make the same scheduling decisions
    (their steps and transfers are programs spanning all of them), so they all take process
    0's clock: one broadcast per step. In one process, the clock as it is."""
    if jax.process_count() == 1:
        return lambda seconds: seconds
    from jax.experimental import multihost_utils

    return lambda seconds: float(multihost_utils.broadcast_one_to_all(np.float64(seconds)))


def _warm_up_transfers(tm: KVCacheTransferManager, pool, max_pairs: int) -> None:
    """Compiles the transfer manager's copies for every batch bucket up to `max_pairs`, in
    every form a run issues them: offloads, onboards from the host and copies within the GPU
    pool, of whole blocks and of partial ones, each with and without waiting for the other
    transfer lane (an onboard reading a host row that a pending offload writes, an offload
    writing a row that a pending onboard reads or snapshotting a slot that one writes), and
    the joins of the step boundary and of a pool read while copies are pending. Each of these
    is its own compiled program; one first met in a timed run would count its compile there.

    The pools are still all zeros, so copying their blocks around changes nothing; the
    statistics are reset afterwards. Keeps compilation out of the measured run.
    """
    p, s = pool.num_primary_blocks, pool.num_secondary_blocks

    def pairs(src_primary: bool, src_lo: int, dst_primary: bool, dst_lo: int, n: int):
        return [(KVCacheBlock(0, src_lo + i, src_primary), KVCacheBlock(0, dst_lo + i, dst_primary))
                for i in range(n)]

    size = 1
    while True:
        n = 1 if size == 1 else size // 2 + 1  # the smallest batch padded to this bucket
        if n > max_pairs:
            break
        if 2 * n <= p:  # within the GPU pool (partial reuse), partial and whole
            tm.onboard_blocks(pairs(True, 0, True, n, n), 1)
            tm.onboard_blocks(pairs(True, 0, True, n, n))
            _ = pool.primary
            tm.sync_transfers(block=False)
        if n <= min(p, s):
            tm.offload_blocks(pairs(True, 0, False, 0, n))  # no wait
            _ = pool.secondary  # a read of a pool whose rows a lane writes: a join
            tm.offload_blocks(pairs(True, 0, False, 0, n))
            tm.onboard_blocks(pairs(False, 0, True, 0, n), 1)  # waits for the offload lane
            tm.onboard_blocks(pairs(False, 0, True, 0, n))
            tm.offload_blocks(pairs(True, 0, False, 0, n))  # waits for the onboard lane, and
            # XLA's stream for it (its sources are being onboarded)
            if 2 * n <= p:  # waits for the onboard lane only
                tm.offload_blocks(pairs(True, n, False, 0, n))
            if 2 * n <= s:  # XLA's stream waits, the lane does not
                tm.offload_blocks(pairs(True, 0, False, n, n))
            _ = pool.primary
            tm.sync_transfers(block=False)  # the step boundary's join
            tm.onboard_blocks(pairs(False, 0, True, 0, n), 1)
            tm.sync_transfers()
            tm.onboard_blocks(pairs(False, 0, True, 0, n), 1)  # nothing pending: no wait
            tm.onboard_blocks(pairs(False, 0, True, 0, n))
            tm.sync_transfers(block=False)
            tm.offload_and_onboard(pairs(True, 0, False, 0, n), pairs(False, 0, True, 0, n))
            tm.sync_transfers()
        size *= 2
    tm.sync_transfers()
    tm.get_and_reset_transfer_stats()  # and the exposed time of the warm-up


class Comparison(NamedTuple):
    """`compare`'s answer."""

    exact: bool
    # the largest |difference| of the top logits of tokens whose bits differ (inf: a token
    # among one run's RECORD_TOP_K largest is not among the other's kept ones, "top-K differ")
    max_diff: float
    first_bad: tuple[int, int] | None  # the first (conversation, turn) not within tolerance
    rows_bits_differ: int  # reply tokens (of turns with the same tokens) whose bits differ
    # turns that differ where they, or an earlier turn of their chat, computed what `ref`
    # reused: a recompute's bits, not a failure (see `compare`)
    recomputed_turns_differ: int = 0


def compare(run: RunResult, ref: RunResult, *, atol: float = 1e-4,
            rtol: float = 1e-4) -> Comparison:
    """Whether `run` computed what `ref` did, turn by turn: the same reply tokens, and for each
    token, every logit's bits by fingerprint and the RECORD_TOP_K (32) largest logits within
    tolerance (`TurnResult`'s records, model.token_record).

    A token whose fingerprints are equal has the same bits in every logit of its row:
    difference 0. One whose fingerprints differ differs somewhere in its row, and is judged by
    its largest logits: each of the 32 largest of either run's row, matched by token id in the
    other run's kept ones (RECORD_KEPT, 64), must be within `atol + rtol * |b|` of it (b:
    ref's); its difference is the largest |a - b| over them. A token of either's 32 largest
    that the other did not keep is a real difference, not a near-tie's reordering: difference
    infinite, "top-K differ". So runs whose logits are bit-identical (the GPU's bfloat16 runs)
    pass on their fingerprints alone; runs that round apart (float32 on a CPU, ~1e-6) are
    judged by their 32 largest logits, the rest of those rows unchecked beyond
    `rows_bits_differ` counting them.

    A turn that computed more of its prompt than `ref`'s did (a block evicted from every tier,
    or left to recompute by the read-or-recompute rule), or follows such a turn in its chat
    (it reads that K/V), may differ without failing: a GPU's prefill of those tokens rounds
    apart from the decode steps or the other chunks that computed them in `ref` (a CPU's does
    not), and a rounding may flip a greedy token. Such a turn must still agree as a recompute
    does (`_agrees_as_recompute`: up to its first other token, the 32 largest logits within
    RECOMPUTE_TOLERANCE), which wrong K/V, changing which tokens are largest, does not; it is
    counted in `recomputed_turns_differ`, its differences left out of `max_diff` and
    `rows_bits_differ`. Exact: every turn of `ref` in `run`, every turn within tolerance or,
    where it recomputed, agreeing as a recompute."""
    max_diff, first_bad, bits_differ, excused = 0.0, None, 0, 0
    recomputed: set[int] = set()  # chats with a turn that computed what ref reused
    for key in sorted(ref.turns):
        a, b = run.turns.get(key), ref.turns[key]
        ok, diff, differ = a is not None and a.tokens == b.tokens, 0.0, 0
        if ok:
            same_bits = np.all(a.logits_fingerprints == b.logits_fingerprints, axis=1)
            top_diff, within = _top_differences(a, b, atol=atol, rtol=rtol)
            differ = int(np.count_nonzero(~same_bits))
            diff = float(np.where(same_bits, 0.0, top_diff).max(initial=0.0))
            ok = bool(np.all(same_bits | within))
        if a is not None and (key[0] in recomputed
                              or a.computed_prompt_tokens > b.computed_prompt_tokens):
            recomputed.add(key[0])
            if not ok and _agrees_as_recompute(a, b):
                excused += 1
                continue
        bits_differ += differ
        max_diff = max(max_diff, diff)
        if not ok and first_bad is None:
            first_bad = key
    exact = first_bad is None and set(run.turns) == set(ref.turns)
    return Comparison(exact, max_diff, first_bad, bits_differ, excused)


# How far a recomputed turn's 32 largest logits may be from the reference's (atol and rtol):
# a bfloat16 prefill of tokens the reference computed in decode steps differed by up to 0.13
# on the H200 (8B shapes); K/V read wrong changes which tokens are largest ("top-K differ").
RECOMPUTE_TOLERANCE = 0.25


def _agrees_as_recompute(run: TurnResult, ref: TurnResult) -> bool:
    """Whether `run`, a turn that recomputed K/V `ref` reused, agrees with it as a recompute
    rounding apart does: the same reply tokens up to the first that differs (a near-tie
    flipped), and each token up to that one with its 32 largest logits within
    RECOMPUTE_TOLERANCE of `ref`'s, by token id."""
    n = min(len(run.tokens), len(ref.tokens))
    if n == 0:
        return len(run.tokens) == len(ref.tokens)
    first = next((i for i in range(n) if run.tokens[i] != ref.tokens[i]), n - 1)
    _, within = _top_differences(run, ref, atol=RECOMPUTE_TOLERANCE, rtol=RECOMPUTE_TOLERANCE,
                                 rows=first + 1)
    return bool(np.all(within))


def _top_differences(run: TurnResult, ref: TurnResult, *, atol: float, rtol: float,
                     rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per reply token (the first `rows`; all by default): the largest |run - ref| over the
    RECORD_TOP_K largest logits of either row, each matched by token id among the other's
    kept ones (inf where one is not there), and whether each is within `atol + rtol * |ref|`."""
    k = min(RECORD_TOP_K, run.top_logits.shape[1])
    got, want = [], []
    for mine, other, mine_is_run in ((run, ref, True), (ref, run, False)):
        ids = mine.top_logit_tokens[:rows, :k]
        match = ids[:, :, None] == other.top_logit_tokens[:rows, None, :]  # [n, k, kept]
        there = np.take_along_axis(other.top_logits[:rows].astype(np.float32),
                                   match.argmax(axis=2), axis=1)
        there[~match.any(axis=2)] = np.nan  # not kept by the other: no value to compare
        values = mine.top_logits[:rows, :k].astype(np.float32)
        got.append(values if mine_is_run else there)
        want.append(there if mine_is_run else values)
    got, want = np.concatenate(got, axis=1), np.concatenate(want, axis=1)
    diff = np.abs(got - want)
    within = np.all(diff <= atol + rtol * np.abs(want), axis=1)  # (NaN: not within)
    return np.where(np.isnan(diff), np.inf, diff).max(axis=1), within
