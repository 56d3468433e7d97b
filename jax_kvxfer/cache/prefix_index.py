"""Which replicas hold which prompt prefixes, from their KV events: the index a prefix-aware
router keeps (as Dynamo's KV router and llm-d's prefix scorer do), fed by each replica's
event stream in vLLM's format (`observe.events.KVEventPublisher`).

A block is held by a replica while its last `BlockStored` on one of `media` (the GPU and host
pools by default: a store that every replica reads is no reason to pick one) has no
`BlockRemoved` after it. A prompt's blocks are hashed as the block manager keys them
(`block_key`, `block_hash64`), so a match counts the full blocks of the prompt's prefix that a
replica holds, in order from the first.

Each stream is numbered: a batch that arrives after a gap (a subscriber that joined late, a
full queue) makes the index ask the publisher's replay socket for the batches missed; what the
replay no longer holds is counted (`lost_batches`), and the index is then only a guess for
that replica until its blocks turn over. A stream that numbers from below again is a
restarted replica: what it held is forgotten (`restarts`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Self

from ..observe import events as kv_events
from .block_cache import ROOT_KEY, block_key

REPLAY_TIMEOUT_S = 1.0  # how long a replay may take before its batches count as lost


class _Stream:
    """One replica's subscription: its SUB socket, its replay socket's address, the next
    sequence number expected (None before the first batch) and the blocks it holds (hash ->
    the media it is on)."""

    def __init__(self, sock, replay_endpoint: str | None) -> None:
        self.sock, self.replay_endpoint = sock, replay_endpoint
        self.next_seq: int | None = None
        self.held: dict[int, set[str]] = {}


class PrefixIndex:
    """The blocks each replica holds, from their KV events; `matched_blocks(tokens)` says
    how much of a prompt each one holds.

    ```
    index = PrefixIndex(tokens_per_block=16)
    index.subscribe("replica-0", publisher.endpoint, replay_endpoint=publisher.replay_endpoint)
    index.poll()                       # applies what has arrived (waits for none)
    index.matched_blocks(prompt)       # {"replica-0": 12}
    ```
    """

    def __init__(self, tokens_per_block: int,
                 media: Sequence[str] = (kv_events.MEDIUM_GPU, kv_events.MEDIUM_CPU)) -> None:
        """Args:
          tokens_per_block: the block managers' (a prompt is hashed in blocks of it).
          media: the media whose blocks count as held.

        Raises:
          TypeError, ValueError: a bad argument, named. ImportError: pyzmq or msgspec missing.
        """
        if isinstance(tokens_per_block, bool) or not isinstance(tokens_per_block, int):
            raise TypeError(f"tokens_per_block must be an int, got {tokens_per_block!r}")
        if tokens_per_block < 1:
            raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
        if isinstance(media, str) or not all(isinstance(m, str) for m in media):
            raise TypeError(f"media must be a sequence of medium names, got {media!r}")
        try:
            import msgspec
            import zmq
        except ImportError as e:
            raise ImportError(f"PrefixIndex needs pyzmq and msgspec ({e}); "
                              'pip install "jax_kvxfer[events]"') from e
        self.tokens_per_block, self.media = tokens_per_block, frozenset(media)
        self._zmq = zmq
        self._decode = msgspec.msgpack.Decoder(kv_events.wire_types()["KVEventBatch"]).decode
        self._streams: dict[Hashable, _Stream] = {}
        self._poller = zmq.Poller()
        self.lost_batches = 0  # batches missed that the replay socket no longer held
        self.restarts = 0  # streams that began again from a lower number (a replica restarted)

    def subscribe(self, source: Hashable, endpoint: str, *, replay_endpoint: str | None = None,
                  topic: str = "kv-events") -> None:
        """Follows the events of `source` (a replica's name), published on `endpoint` (a
        `KVEventPublisher`'s bound address), with its replay socket, if any.

        Raises:
          KeyError: `source` is followed already. zmq.ZMQError: a bad endpoint.
        """
        if source in self._streams:
            raise KeyError(f"source {source!r} is subscribed already")
        zmq = self._zmq
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        sock.connect(endpoint)
        self._streams[source] = _Stream(sock, replay_endpoint)
        self._poller.register(sock, zmq.POLLIN)

    def poll(self, timeout_s: float = 0.0) -> int:
        """Applies every batch that has arrived (waiting up to `timeout_s` for the first);
        returns how many were applied."""
        applied = 0
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        for stream in self._streams.values():
            if stream.sock not in ready:
                continue
            while True:
                try:
                    _, seq, payload = stream.sock.recv_multipart(flags=self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                applied += self._receive(stream, int.from_bytes(seq, "big"), payload)
        return applied

    def matched_blocks(self, tokens: Sequence[int]) -> dict[Hashable, int]:
        """Per source, how many of the prompt's full blocks it holds, in order from the
        first (the last token is left out, as a block manager computes it always)."""
        t = self.tokens_per_block
        hashes, key = [], ROOT_KEY
        for i in range((len(tokens) - 1) // t):
            key = block_key(key, tuple(tokens[i * t:(i + 1) * t]))
            hashes.append(kv_events.block_hash64(key))
        out = {}
        for source, stream in self._streams.items():
            n = 0
            while n < len(hashes) and hashes[n] in stream.held:
                n += 1
            out[source] = n
        return out

    def held_blocks(self, source: Hashable) -> int:
        """How many blocks `source` holds on the index's media."""
        return len(self._streams[source].held)

    def close(self) -> None:
        """Closes the subscriptions. Idempotent."""
        for stream in self._streams.values():
            self._poller.unregister(stream.sock)
            stream.sock.close()
        self._streams.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- applying a stream ------------------------------------------------------------------------

    def _receive(self, stream: _Stream, seq: int, payload: bytes) -> int:
        """Applies one batch that arrived live, the missed ones before it first (from the
        replay). One numbered below the next expected is a restarted publisher's: what its
        replica held is forgotten (its new block manager starts empty) and it is followed
        anew."""
        if stream.next_seq is None:
            stream.next_seq = 0  # the stream's first batch is 0: earlier ones were missed
        if seq < stream.next_seq:  # live batches never repeat: a restarted publisher
            stream.held.clear()
            stream.next_seq = 0
            self.restarts += 1
        applied = 0
        if seq > stream.next_seq:
            for old_seq, old_payload in self._replay(stream, stream.next_seq):
                if stream.next_seq <= old_seq < seq:
                    applied += self._apply(stream, old_seq, old_payload)
        return applied + self._apply(stream, seq, payload)

    def _apply(self, stream: _Stream, seq: int, payload: bytes) -> int:
        """Applies batch `seq` (at least the next expected: those between were lost)."""
        self.lost_batches += seq - stream.next_seq
        held, media = stream.held, self.media
        for event in self._decode(payload).events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                held.clear()
            elif event.medium in media:
                if kind == "BlockStored":
                    for h in event.block_hashes:
                        held.setdefault(h, set()).add(event.medium)
                else:  # BlockRemoved
                    for h in event.block_hashes:
                        on = held.get(h)
                        if on is not None:
                            on.discard(event.medium)
                            if not on:
                                del held[h]
        stream.next_seq = seq + 1
        return 1

    def _replay(self, stream: _Stream, start: int) -> list[tuple[int, bytes]]:
        """The batches from `start` on that the publisher's replay socket still holds, in
        order ([] without one, or when it does not answer in REPLAY_TIMEOUT_S)."""
        if stream.replay_endpoint is None:
            return []
        zmq = self._zmq
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        out = []
        try:
            sock.connect(stream.replay_endpoint)
            sock.send_multipart((b"", start.to_bytes(8, "big")))
            while sock.poll(int(REPLAY_TIMEOUT_S * 1000)):
                _, seq, payload = sock.recv_multipart()
                if seq == kv_events.END_SEQ:
                    break
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            sock.close()
        return out
