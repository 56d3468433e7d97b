"""KV-cache events in vLLM's wire format, for the routers that send a request to the replica
holding its prefix (Dynamo's and llm-d's KV routers consume vLLM's stream as it is).

`KVEventPublisher(endpoint)` is a ZMQ PUB socket, and optionally a ROUTER socket that replays
missed batches; pass it as `BlockManager(..., events=publisher)`. The block manager gathers a
step's events and hands them over at the step boundary (`sync_transfers`); a thread of the
publisher encodes and sends them, so serving never waits for it:

- `publish` only appends to a bounded queue (`max_queue_size`): when it is full the batch is
  dropped and counted (`dropped_batches`);
- the PUB socket drops what a slow subscriber does not take (ZMQ's high-water mark, `hwm`);
- every batch has a sequence number taken when it is published, so a subscriber sees a drop
  as a gap, and may ask the replay socket for the batches it missed (those still in the
  bounded replay buffer, `buffer_steps`).

The wire format is vLLM's (`vllm/distributed/kv_events.py`, `ZmqEventPublisher`; v0.10 to
v0.23, when every struct was `array_like`):

- a message is three frames: the topic, the sequence number (8 bytes, unsigned big-endian) and
  the payload;
- the payload is msgpack of `KVEventBatch(ts, events, data_parallel_rank)`, msgspec structs
  with `array_like=True, omit_defaults=True, tag=True` (the events), so a batch is
  `[ts, [event, ...], data_parallel_rank]` and an event is a tagged array:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`;
- the replay socket (ROUTER) takes `[identity, b"", start_seq]` (8 bytes big-endian, what a
  REQ or DEALER socket sends) and answers `[identity, b"", seq, payload]` for every buffered
  batch from `start_seq` on, then `[identity, b"", -1 (8 bytes, signed), b""]`.

Block hashes are 64-bit unsigned integers (Dynamo's router takes 64-bit hashes, signed or
unsigned): `block_hash64(key)`, the first 8 bytes of the block manager's 16-byte chained key
(a BLAKE2b digest of the parent's key and the block's token ids) read big-endian.

pyzmq and msgspec are imported when a publisher is made, not before
(`pip install "jax_kvxfer[events]"`).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Self

__all__ = ["MEDIUM_CPU", "MEDIUM_GPU", "KVEventPublisher", "block_hash64", "default_publisher",
           "publish_by_default", "wire_types"]

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"  # vLLM's MEDIUM_GPU: the primary pool
MEDIUM_CPU = "CPU"  # vLLM's offloading connector's CPU tier: the pinned host pool
# stores: their `tier` ("DISK" for FileStore, "REDIS" for RedisStore)

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay marker

# Raw events, as the block manager queues them (cheap tuples; the publisher's thread turns
# them into vLLM's structs): (STORED, medium, key, parent_key or None, tokens, block_size),
# (REMOVED, medium, key), (CLEARED,).
STORED, REMOVED, CLEARED = 0, 1, 2


def block_hash64(key: bytes) -> int:
    """The 64-bit hash of a block in its events: the first 8 bytes of its 16-byte chained key
    (cache.block_cache.block_key), read big-endian, unsigned."""
    return int.from_bytes(key[:8], "big")


_WIRE: dict[str, Any] = {}
_default: KVEventPublisher | None = None


def publish_by_default(publisher: KVEventPublisher | None) -> None:
    """Makes every BlockManager created from now on without `events=` publish to
    `publisher` (None: stops). For a program that makes its block managers deep inside (the
    demo's `--kv-events`); passing `events=` is the usual way.

    Raises:
      TypeError: not a KVEventPublisher or None.
    """
    global _default
    if publisher is not None and not isinstance(publisher, KVEventPublisher):
        raise TypeError("publisher must be a KVEventPublisher or None, got "
                        f"{type(publisher).__name__}")
    _default = publisher


def default_publisher() -> KVEventPublisher | None:
    """The publisher set by `publish_by_default`, if any."""
    return _default


def wire_types() -> dict[str, Any]:
    """vLLM's msgspec structs, as vLLM declares them (imports msgspec): `KVEventBatch`,
    `BlockStored`, `BlockRemoved`, `AllBlocksCleared`."""
    if _WIRE:
        return _WIRE
    import msgspec

    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False,
                       tag=True):
        """Base class for all KV cache-related events."""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    # (the events' types given as objects: this module's annotations are strings, and
    # msgspec resolves those in the module's globals, where these local classes are not)
    KVEventBatch = msgspec.defstruct(
        "KVEventBatch", [("events", list[BlockStored | BlockRemoved | AllBlocksCleared])],
        bases=(EventBatch,), module=__name__)

    _WIRE.update(KVEventBatch=KVEventBatch, BlockStored=BlockStored, BlockRemoved=BlockRemoved,
                 AllBlocksCleared=AllBlocksCleared)
    return _WIRE


def to_structs(raw: Sequence[tuple]) -> list:
    """Raw events -> vLLM's event structs; consecutive stores on one medium that continue one
    chain (each block's parent the previous block) become one BlockStored, consecutive
    removals on one medium one BlockRemoved, as vLLM batches a request's blocks."""
    w = wire_types()
    out: list = []
    last = None  # the struct the next raw event may extend, and its last key
    last_key = None
    for ev in raw:
        kind = ev[0]
        if kind == STORED:
            _, medium, key, parent, tokens, block_size = ev
            if (last is not None and type(last) is w["BlockStored"] and last.medium == medium
                    and parent is not None and parent == last_key):
                last.block_hashes.append(block_hash64(key))
                last.token_ids.extend(tokens)
            else:
                last = w["BlockStored"](
                    [block_hash64(key)], None if parent is None else block_hash64(parent),
                    list(tokens), block_size, None, medium, None)
                out.append(last)
            last_key = key
        elif kind == REMOVED:
            _, medium, key = ev
            if (last is not None and type(last) is w["BlockRemoved"]
                    and last.medium == medium):
                last.block_hashes.append(block_hash64(key))
            else:
                last = w["BlockRemoved"]([block_hash64(key)], medium)
                out.append(last)
            last_key = None
        elif kind == CLEARED:
            last, last_key = None, None
            out.append(w["AllBlocksCleared"]())
        else:
            raise ValueError(f"unknown raw event {ev!r}")
    return out


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value!r}")
    return value


def _check_endpoint(name: str, value: Any) -> str:
    if not isinstance(value, str) or "://" not in value:
        raise ValueError(f"{name} must be a ZMQ endpoint string such as 'tcp://*:5557' or "
                         f"'ipc:///tmp/kv-events', got {value!r}")
    return value


class KVEventPublisher:
    """Publishes KV-cache event batches on a ZMQ PUB socket, in vLLM's format, from a thread of
    its own; optionally replays missed batches on a ROUTER socket.

    vLLM: `ZmqEventPublisher` (the same frames, sockets, endpoint rule and replay protocol).
    Serving never waits for it: `publish` appends to a bounded queue and drops (and counts) a
    batch when the queue is full; the PUB socket drops what a slow subscriber does not take.
    Sequence numbers are taken at `publish`, so either drop shows as a gap.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str = "kv-events", buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, data_parallel_rank: int = 0) -> None:
        """Args:
          endpoint: the PUB socket's address; bound when it holds `*` or `::` or is `ipc://`
            or `inproc://` (`tcp://*:5557`), connected otherwise (`tcp://router-host:5557`),
            vLLM's rule. A bound `tcp://host:*` takes a free port: see `endpoint` after.
          replay_endpoint: the ROUTER socket's address (bound), None for no replay.
          topic: the first frame of every message (subscribers filter on its prefix).
          buffer_steps: batches kept for replay (the newest).
          hwm: the PUB socket's send high-water mark (messages queued per subscriber).
          max_queue_size: batches waiting for the publisher's thread before `publish` drops.
          data_parallel_rank: the batches' `data_parallel_rank`.

        Raises:
          TypeError, ValueError: a bad argument, named. ImportError: pyzmq or msgspec missing.
          zmq.ZMQError: an endpoint cannot be bound or connected.
        """
        _check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            _check_endpoint("replay_endpoint", replay_endpoint)
        if not isinstance(topic, str):
            raise TypeError(f"topic must be a str, got {topic!r}")
        self.buffer_steps = _check_int("buffer_steps", buffer_steps, 1)
        self.hwm = _check_int("hwm", hwm, 0)
        max_queue_size = _check_int("max_queue_size", max_queue_size, 1)
        self.data_parallel_rank = _check_int("data_parallel_rank", data_parallel_rank, 0)
        try:
            import msgspec
            import zmq
        except ImportError as e:
            raise ImportError(f"KVEventPublisher needs pyzmq and msgspec ({e}); "
                              'pip install "jax_kvxfer[events]"') from e
        self._zmq = zmq
        self._encoder = msgspec.msgpack.Encoder()
        wire_types()
        self.topic = topic
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self.buffer_steps)
        self._seq = itertools.count()
        self._publish_lock = threading.Lock()
        self.dropped_batches = 0  # batches `publish` dropped: the queue was full
        self.sent_batches = 0  # batches handed to the PUB socket
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, self.hwm)
            self._pub.setsockopt(zmq.LINGER, 100)
            if ("*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))):
                self._pub.bind(endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(endpoint)
                self.endpoint = endpoint
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 100)
                self._replay.bind(replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvxfer-kv-events")
        self._thread.start()

    # -- the serving thread's side ------------------------------------------------------------

    def publish(self, events: Sequence[tuple], ts: float | None = None) -> int:
        """Queues one batch of raw events (see STORED, REMOVED, CLEARED) and returns its
        sequence number, or -1 when the queue is full (the batch is dropped and counted: the
        number it would have had is skipped). Never blocks.

        Raises:
          RuntimeError: the publisher is closed.
        """
        if self._closed:
            raise RuntimeError("KVEventPublisher is closed")
        ts = time.time() if ts is None else ts
        with self._publish_lock:  # numbers in queue order, from any thread
            seq = next(self._seq)
            try:
                self._queue.put_nowait((seq, ts, events))
            except queue.Full:
                self.dropped_batches += 1
                return -1
        return seq

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued (for up to `timeout` seconds), stops the thread and closes the
        sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        while True:  # the sentinel, without blocking for ever on a full queue
            try:
                self._queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
                break
            except queue.Full:
                if time.monotonic() >= deadline:
                    break
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.5)
        if self._thread.is_alive():
            log.warning("KVEventPublisher: the publisher thread did not stop in %.1f s",
                        timeout)
            return  # the thread still owns the sockets
        self._close_sockets()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"KVEventPublisher({self.endpoint!r}, replay_endpoint="
                f"{self.replay_endpoint!r}, topic={self.topic!r})")

    # -- the publisher's thread ------------------------------------------------------------------

    def encode(self, ts: float, events: Sequence[tuple]) -> bytes:
        """The payload of one batch of raw events: msgpack of vLLM's KVEventBatch."""
        batch = wire_types()["KVEventBatch"](ts, to_structs(events), self.data_parallel_rank)
        return self._encoder.encode(batch)

    def _run(self) -> None:
        zmq = self._zmq
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:
                    log.exception("KVEventPublisher: replay request failed")
            try:
                item = self._queue.get(timeout=0.02 if self._replay is not None else 0.2)
            except queue.Empty:
                continue
            if item is None:
                break
            seq, ts, events = item
            try:
                payload = self.encode(ts, events)
                self._buffer.append((seq, payload))
                # NOBLOCK: at the high-water mark a PUB socket drops rather than blocks anyway
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                         flags=zmq.NOBLOCK)
                self.sent_batches += 1
            except zmq.Again:
                pass
            except Exception:
                log.exception("KVEventPublisher: batch %d not published", seq)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KVEventPublisher: invalid replay request of %d frames", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close()
