"""`--replicas N`: N serving processes, each with its own model, pools and block manager
(serving.Server), and a router in the demo's process that spreads the conversations over them.

The router (`--router`) picks each turn's replica:
- `round-robin`: turn t of conversation c goes to replica (c + t) % N: every turn after the
  first lands on another replica than the turn before it, so its prompt's newest part (the
  previous turn's message and reply) was computed elsewhere;
- `prefix`: the replica where the turn's prefill costs least, counting what it holds of the
  prompt and the prefill routed to it and not yet done (`ByPrefix`). What each holds comes
  from its KV events (every replica publishes them; the router keeps a cache.PrefixIndex),
  so a chat's next turn mostly stays where its history is, unless that replica is busier by
  more than the history's prefill.
A turn that lands on another replica than its conversation's turn before it has moved. With a
shared store (`store`), every replica writes a finished turn's blocks to it at once
(BlockManager(store_on_release=True)), and a moved turn waits (up to serving.PREFIX_WAIT_S of
wall time, and no longer than recomputing the prefix less reading it would take:
`Server._prefix_wait_s`) until the store holds that prefix, then until its read into host rows
(BlockManager.prefetch) has landed, and onboards it like a host hit; without a store, each
replica recomputes it.

The router keeps one clock for all: in each tick, every replica admits what has arrived for
it and runs one model step (the replicas' steps run at once, on one GPU or several); the tick
lasts the longest of them (or `fixed_step_s`). Times are on that clock, as in serving.run.
Each process holds its turns' records until the end of the run; the router gets the replies'
tokens as they end (the next turns' prompts hold them).

`--scale-out` (a new replica joining): the workload is served in two parts, each a workload of
its own (`Part`). Replica A (the first N - 1 replicas, routed as above among themselves)
serves `first_part`, writing to the store; once A has ended, replica B, a new process with
empty pools, serves `follow_ups`: once reading the store A wrote to, once without a store
(recomputing). The split: A serves every turn of each chat but its last, and every question
on each document but the last one asked; B serves those last ones. So every request B serves
is the first it sees on its prefix (a chat's history, a document) and that prefix is A's:
the warm start itself, with nothing that B's own pools would serve alike with the store or
without. (The chats' shared system prompt is the exception: B without the store computes it
once, then finds it in its GPU pool.) Each part's i-th conversation starts at the workload's
i-th arrival time, so each part arrives at the workload's rate (a chat's later turns in A
come a think time after the reply before, as in a whole run). A request of B's whose prefix
the store holds waits, as a moved turn does, until that prefix is read into host rows off the
serving thread (`Part.stored`).
"""

from __future__ import annotations

import dataclasses
import heapq
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence

from ..cache import BlockManagerStats, PrefixIndex
from ..stores import StoreStats
from ..transfer.manager import TransferStats
from . import store_servers
from .model import ModelConfig
from .serving import RunResult, TurnResult
from .workloads import Conversation

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
GPU_SHARE = 0.9  # of the GPU's memory, split evenly over replicas sharing one GPU
READY_TIMEOUT_S = 1800.0  # model load and compilation (Llama-8B's shapes: minutes)
# The block manager's default secondary_offload_min_priority: blocks of a lower priority are
# never offloaded, nor written to a store.
STORED_MIN_PRIORITY = 30


ROUTERS = ("round-robin", "prefix")


def route(conversation: int, turn: int, replicas: int) -> int:
    """The replica that serves this turn: round robin per turn, so a chat moves each turn."""
    return (conversation + turn) % replicas


class RoundRobin:
    """`route`'s choice."""

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas

    def pick(self, conversation: int, turn: int, prompt: list[int]) -> int:
        return route(conversation, turn, self.replicas)

    def finished(self, conversation: int, turn: int) -> None:
        pass


class ByPrefix:
    """The replica where a prompt's prefill costs least: its tokens less those the replica
    holds (its full blocks, by the index of the replicas' KV events), plus the tokens it was
    given to compute for the turns routed to it that have not ended. Ties go to `route`'s
    choice, else the first."""

    def __init__(self, index: PrefixIndex, replicas: int) -> None:
        self.index, self.replicas = index, replicas
        self.queued = [0] * replicas  # per replica: tokens to compute of turns not ended
        self._owed: dict[tuple[int, int], tuple[int, int]] = {}

    def pick(self, conversation: int, turn: int, prompt: list[int]) -> int:
        self.index.poll()
        held = self.index.matched_blocks(prompt)
        t = self.index.tokens_per_block
        compute = [len(prompt) - held[r] * t for r in range(self.replicas)]
        cost = [c + q for c, q in zip(compute, self.queued)]
        best = min(cost)
        usual = route(conversation, turn, self.replicas)
        r = usual if cost[usual] == best else cost.index(best)
        self.queued[r] += compute[r]
        self._owed[(conversation, turn)] = (r, compute[r])
        return r

    def finished(self, conversation: int, turn: int) -> None:
        r, tokens = self._owed.pop((conversation, turn))
        self.queued[r] -= tokens


@dataclasses.dataclass(frozen=True)
class ReplicaSpec:
    """What one replica process needs (picklable)."""

    index: int
    replicas: int
    model: ModelConfig
    seed: int
    smollm2: bool
    server: dict  # serving.Server's keyword arguments but the model, params and stores
    store: store_servers.StoreSpec | None
    namespace: str
    mem_fraction: float | None  # XLA_PYTHON_CLIENT_MEM_FRACTION for the process, or None
    events: bool = False  # publish the block manager's KV events (for ByPrefix)


def _replica_main(conn, spec: ReplicaSpec) -> None:
    """A replica process: builds its server, then answers the router until "finish"."""
    if spec.mem_fraction is not None:  # before JAX's backend starts in this process
        os.environ[MEM_FRACTION_ENV] = f"{spec.mem_fraction:.3f}"
    store = publisher = None
    try:
        import jax.numpy as jnp

        from .model import init_params
        from .serving import Request, Server

        if spec.smollm2:
            from . import smollm2

            _, weights, _ = smollm2.load()
            params = {k: jnp.asarray(v) for k, v in weights.items()}
        else:
            params = init_params(spec.model, spec.seed)
        if spec.store is not None:
            store = store_servers.connect(spec.store, spec.namespace)
        endpoints = None
        if spec.events:  # the server's block manager publishes to it (a free local port)
            from ..observe.events import KVEventPublisher, publish_by_default

            publisher = KVEventPublisher("tcp://127.0.0.1:*",
                                         replay_endpoint="tcp://127.0.0.1:*")
            publish_by_default(publisher)
            endpoints = (publisher.endpoint, publisher.replay_endpoint)
        server = Server(spec.model, params, stores=(store,) if store is not None else (),
                        store_on_release=store is not None, **spec.server)
        conn.send(("ready", server.compile_seconds, endpoints))
        held: dict[tuple[int, int], TurnResult] = {}
        while True:
            command, arg = conn.recv()
            if command == "step":
                requests, clock = arg
                for fields in requests:
                    server.submit(Request(**fields))
                stepped = server.step(clock)
                conn.send((stepped, server.full_step_flops if stepped else 0, server.busy))
            elif command == "collect":
                done = server.collect(arg)
                held.update((r.key, r) for r in done)
                conn.send(([(r.key, r.tokens) for r in done], server.busy))
            elif command == "finish":
                conn.send(("result", server.result(held, **arg)))
                return
            else:
                raise ValueError(f"unknown command {command!r}")
    except BaseException as e:  # noqa: BLE001 - sent to the router, which reports it
        try:
            conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
        except (OSError, ValueError):
            pass
    finally:
        if store is not None:
            store.close()
        if publisher is not None:
            publisher.close()
        conn.close()


class ReplicaError(RuntimeError):
    """A replica process failed (the message names it and its error)."""


class _Replica:
    def __init__(self, ctx, spec: ReplicaSpec) -> None:
        self.index = spec.index
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_replica_main, args=(child, spec), daemon=True,
                                name=f"kvxfer-replica-{spec.index}")
        self.proc.start()
        child.close()
        self.busy = False

    def recv(self, timeout: float | None = None):
        if timeout is not None and not self.conn.poll(timeout):
            raise ReplicaError(f"replica {self.index} did not answer in {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise ReplicaError(f"replica {self.index} exited (status {self.proc.exitcode})"
                               ) from None
        if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
            raise ReplicaError(f"replica {self.index}: {msg[1]}")
        return msg

    def stop(self) -> None:
        self.conn.close()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def run_replicas(model: ModelConfig, conversations: Sequence[Conversation], *,
                 replicas: int, server: dict, priorities: Sequence[int], seed: int,
                 smollm2: bool = False, store: store_servers.StoreSpec | None = None,
                 namespace: str = "", fixed_step_s: float | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 mem_fraction: float | None = None, stored: Sequence[int] = (),
                 min_offload_priority: int = STORED_MIN_PRIORITY,
                 router: str = "round-robin") -> RunResult:
    """Serves the conversations on `replicas` processes (see the module's docstring); each
    gets `server` (serving.Server's sizes) and, with `store`, its own client of that store.
    `mem_fraction`: each process's XLA_PYTHON_CLIENT_MEM_FRACTION (None: JAX's default).
    `stored`: per conversation, the tokens of its first prompt the store holds already (an
    earlier run's: `Part.stored`), which its first turn waits for as a moved turn does.
    `router`: one of ROUTERS (see the module's docstring). Returns every turn as one run,
    with each replica's own result (`RunResult.replicas`) and the turns that moved
    (`RunResult.moved`). Raises ReplicaError when a replica fails."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    ctx = multiprocessing.get_context("spawn")  # JAX's runtime does not survive a fork
    procs: list[_Replica] = []
    index = PrefixIndex(server["tokens_per_block"]) if router == "prefix" else None
    try:
        # The first compiles alone, then the others: with an autotuning cache shared through
        # XLA_FLAGS, they all read the kernels it picked (the same numerics in every process).
        compile_seconds = 0.0
        for start in ([0], range(1, replicas)):
            group = [_Replica(ctx, ReplicaSpec(i, replicas, model, seed, smollm2, server, store,
                                               namespace, mem_fraction, index is not None))
                     for i in start]
            procs += group
            for p in group:
                _, seconds, endpoints = p.recv(READY_TIMEOUT_S)
                compile_seconds = max(compile_seconds, seconds)
                if index is not None:
                    index.subscribe(p.index, endpoints[0], replay_endpoint=endpoints[1])
        picker = RoundRobin(replicas) if index is None else ByPrefix(index, replicas)
        loop = _route(procs, conversations, priorities, store is not None, fixed_step_s,
                      progress, min_offload_priority, stored, picker)
        results = []
        for p in procs:
            p.conn.send(("finish", {"steps": loop["steps"], "seconds": loop["clock"]}))
        for p in procs:
            results.append(p.recv()[1])
    finally:
        for p in procs:
            p.stop()
        if index is not None:
            index.close()
    combined = _combined(results, loop, compile_seconds)
    combined.replicas, combined.moved = results, frozenset(loop["moved"])
    return combined


def _route(procs: list[_Replica], conversations: Sequence[Conversation],
           priorities: Sequence[int], shared: bool, fixed_step_s: float | None,
           progress: Callable[[int, int], None] | None, min_offload_priority: int,
           stored: Sequence[int], picker: RoundRobin | ByPrefix) -> dict:
    """The router's loop; returns its clock, ticks, the moved turns and the full-prefill
    figures."""
    where = [-1] * len(conversations)  # each conversation's last turn's replica
    pending = [(c.start_s, i, 0) for i, c in enumerate(conversations)]
    heapq.heapify(pending)
    history = [list(c.prefix) for c in conversations]
    total = sum(len(c.turns) for c in conversations)
    done = 0
    moved: set[tuple[int, int]] = set()
    clock, ticks, full_flops, full_seconds = 0.0, 0, 0, 0.0
    mark = time.perf_counter()
    while pending or any(p.busy for p in procs):
        arrived: list[list[dict]] = [[] for _ in procs]
        while pending and pending[0][0] <= clock:
            arrival, c, t = heapq.heappop(pending)
            turn = conversations[c].turns[t]
            prompt = history[c] + list(turn.user)
            r = picker.pick(c, t, prompt)
            expect = stored[c] if stored and t == 0 else 0  # an earlier run's (--scale-out)
            if t > 0 and where[c] != r:
                moved.add((c, t))
                if priorities[c] >= min_offload_priority:  # the replica before wrote it:
                    # the previous turn's sequence (its prompt and reply but the last token)
                    expect = len(history[c]) - 1
            if not shared:
                expect = 0
            arrived[r].append({"key": (c, t), "arrival_s": arrival,
                               "prompt": prompt,
                               "output_len": turn.output_len, "priority": priorities[c],
                               "expect_tokens": expect})
            where[c] = r
        for p, reqs in zip(procs, arrived):
            p.conn.send(("step", (reqs, clock)))
        replies = [p.recv() for p in procs]
        stepped = [p for p, (ran, _, _) in zip(procs, replies) if ran]
        for p, (_, _, busy) in zip(procs, replies):
            p.busy = busy
        if not stepped:
            elapsed = 0.0 if fixed_step_s is not None else time.perf_counter() - mark
            if any(p.busy for p in procs):  # only turns waiting for their prefix
                time.sleep(0.001)
                clock += elapsed
            else:  # idle until the next arrival
                clock = max(clock + elapsed, pending[0][0])
            mark = time.perf_counter()
            continue
        ticks += 1
        elapsed = fixed_step_s if fixed_step_s is not None else time.perf_counter() - mark
        flops = sum(f for _, f, _ in replies)
        if flops:
            full_flops += flops
            full_seconds += elapsed
        clock += elapsed
        mark = time.perf_counter()
        for p in stepped:
            p.conn.send(("collect", clock))
        for p in stepped:
            finished, p.busy = p.recv()
            for (c, t), tokens in finished:
                picker.finished(c, t)
                history[c] = history[c] + list(conversations[c].turns[t].user) + list(tokens)
                turns = conversations[c].turns
                if t + 1 < len(turns):
                    heapq.heappush(pending, (clock + turns[t + 1].think_s, c, t + 1))
                done += 1
                if progress:
                    progress(done, total)
    return {"clock": clock, "steps": ticks, "moved": moved, "full_flops": full_flops,
            "full_seconds": full_seconds}


@dataclasses.dataclass(frozen=True)
class Part:
    """Some of a workload's requests as a workload of their own (--scale-out): `conversations`,
    the workload's (conversation, turn) of each one's first turn (`keys`), and the tokens of
    each one's prefix that the part before wrote to the store (`stored`, whole blocks)."""

    conversations: list[Conversation]
    keys: list[tuple[int, int]]
    stored: list[int]

    def key(self, conversation: int, turn: int) -> tuple[int, int]:
        """The workload's key of this part's turn."""
        c, first = self.keys[conversation]
        return c, first + turn


def first_part(conversations: Sequence[Conversation], *, by_document: bool) -> Part:
    """Replica A's requests: every turn of each chat but its last; with `by_document` (the
    conversations are one-turn questions, a document their prefix), every question on each
    document but the last one asked. Raises ValueError for a chat of one turn, or documents
    asked one question each."""
    if by_document:
        last = _last_on_each_document(conversations)
        picked = [(c, (i, 0)) for i, c in enumerate(conversations) if last[c.prefix] != i]
    elif all(len(c.turns) > 1 for c in conversations):
        picked = [(dataclasses.replace(c, turns=c.turns[:-1]), (i, 0))
                  for i, c in enumerate(conversations)]
    else:
        picked = []
    if not picked:
        raise ValueError("--scale-out needs 2 or more turns in each chat (or questions on a "
                         "document)")
    return _part(conversations, picked, [0] * len(picked))


def follow_ups(conversations: Sequence[Conversation], *, by_document: bool,
               replies: dict[tuple[int, int], TurnResult], priorities: Sequence[int],
               tokens_per_block: int) -> Part:
    """Replica B's requests, those `first_part` leaves: each chat's last turn, its prompt the
    chat so far (A's `replies`); with `by_document`, the last question on each document.
    `stored`: the whole blocks of each one's prefix but its last token (a reply's last token
    has no K/V yet), where A wrote them (a request of A's on that prefix of a priority that
    is written, `priorities`)."""
    picked = []
    if by_document:
        last = _last_on_each_document(conversations)
        written = {conversations[i].prefix for i, p in enumerate(priorities)
                   if p >= STORED_MIN_PRIORITY and last[conversations[i].prefix] != i}
        picked = [(conversations[i], (i, 0)) for i in sorted(last.values())]
        stored = [c.prefix in written for c, _ in picked]
    else:
        for i, c in enumerate(conversations):
            history = list(c.prefix)
            for t, turn in enumerate(c.turns[:-1]):
                history += [*turn.user, *replies[(i, t)].tokens]
            picked.append((Conversation(c.start_s, tuple(history), c.turns[-1:]),
                           (i, len(c.turns) - 1)))
        stored = [priorities[i] >= STORED_MIN_PRIORITY for _, (i, _) in picked]
    blocks = [(len(c.prefix) - 1) // tokens_per_block * tokens_per_block for c, _ in picked]
    return _part(conversations, picked, [b if s else 0 for b, s in zip(blocks, stored)])


def _last_on_each_document(conversations: Sequence[Conversation]) -> dict[tuple, int]:
    """Each document (a prefix) and the last conversation asked on it."""
    return {c.prefix: i for i, c in enumerate(conversations)}


def _part(conversations: Sequence[Conversation], picked: list, stored: list[int]) -> Part:
    """The picked (conversation, key) pairs as a Part, the i-th arriving at the workload's
    i-th start time."""
    starts = [c.start_s for c in conversations]
    return Part([dataclasses.replace(c, start_s=starts[i]) for i, (c, _) in enumerate(picked)],
                [key for _, key in picked], stored)


def run_part(model: ModelConfig, part: Part, *, priorities: Sequence[int],
             **kwargs) -> RunResult:
    """Serves `part` as `run_replicas` does (its other arguments), with the priorities of the
    workload's conversations (`priorities`); its turns keyed as the workload's."""
    res = run_replicas(model, part.conversations,
                       priorities=[priorities[c] for c, _ in part.keys],
                       stored=part.stored, **kwargs)

    def rekeyed(run: RunResult) -> RunResult:
        turns = {}
        for (c, t), r in run.turns.items():
            turns[part.key(c, t)] = dataclasses.replace(r, key=part.key(c, t))
        return dataclasses.replace(run, turns=turns,
                                   moved=frozenset(part.key(c, t) for c, t in run.moved))

    out = rekeyed(res)
    out.replicas = [rekeyed(r) for r in res.replicas]
    return out


def joined(first: RunResult, follow: RunResult) -> RunResult:
    """The scale-out as one run: replica A's turns and B's (every turn of the workload, for
    the exactness check), the statistics summed over both; `replicas` [A, B], `moved` B's
    turns (their prefix was A's)."""
    loop = {"steps": first.steps + follow.steps, "clock": first.seconds + follow.seconds,
            "full_flops": first.full_prefill_flops + follow.full_prefill_flops,
            "full_seconds": first.full_prefill_seconds + follow.full_prefill_seconds}
    out = _combined([first, follow], loop, max(first.compile_seconds, follow.compile_seconds))
    out.replicas, out.moved = [first, follow], frozenset(follow.turns)
    return out


def _sum(items: list, cls):
    out = cls()
    for item in items:
        for f in dataclasses.fields(cls):
            setattr(out, f.name, getattr(out, f.name) + getattr(item, f.name))
    return out


def _combined(results: list[RunResult], loop: dict, compile_seconds: float) -> RunResult:
    """The replicas' results as one run: every turn, the statistics summed."""
    turns = {}
    for res in results:
        turns.update(res.turns)
    stores = [r.store_stats for r in results if r.store_stats is not None]
    first = results[0]
    return RunResult(
        turns=turns, block_stats=_sum([r.block_stats for r in results], BlockManagerStats),
        transfer_stats=_sum([r.transfer_stats for r in results], TransferStats),
        steps=loop["steps"], seconds=loop["clock"], compile_seconds=compile_seconds,
        primary_blocks=first.primary_blocks, secondary_blocks=first.secondary_blocks,
        exposed_transfer_seconds=sum(r.exposed_transfer_seconds for r in results),
        full_prefill_flops=loop["full_flops"], full_prefill_seconds=loop["full_seconds"],
        store_stats=_sum(stores, StoreStats) if stores else None,
        store_close_seconds=max((r.store_close_seconds for r in results), default=0.0),
        offloads_declined=sum(r.offloads_declined for r in results), admission=first.admission)
