"""RedisStore's connections for its reads and writes (`RespConnection`): a minimal RESP2 client
that receives each GET's value straight into a buffer of the caller's, without redis-py's
reply objects, and sends a batch of SETs; both loops in native code with the GIL released.

Why (measured on Valkey 8.1, 2 MiB values, loopback; docs/stores.md has the table):

- redis-py (even with hiredis) reads a reply into its own buffer, then makes a `bytes` of it,
  which the store then copied into the row: per GB received it spent 0.45 to 1.5 s of client
  CPU, this reader 0.3 s. It receives the value's 64-byte header first and checks it against
  the one the store expects (fingerprint, key, length), then the rest straight into the row:
  no copy; the store checks the CRC-32 after.
- Valkey copies every reply into its output buffers before writing them: a pipeline of 8 GETs
  of 2 MiB made it hold 16 MiB of fresh replies and spend 0.6 to 0.9 s per GB, against 0.22
  to 0.3 s when a connection asks for the next value only once the reply before it has begun
  (one value in flight). So reads keep about one 2 MiB value's worth of GETs in flight per
  connection (`WINDOW_BYTES`) and use several connections (the store's threads) instead of
  deep pipelines. Small values need more of them in flight to cover the round trip: 16 KiB
  values read at 0.34-0.46 GB/s with 64 or 128 in flight against 0.26-0.30 with one (a
  2-core machine, interleaved runs).
- A large receive buffer (SO_RCVBUF, 4 MiB) lets the server write a whole value in one go.
- A batch of replies is received in native code with the GIL released (ffi/store_io.cc),
  the head checked there against the one expected, each row's CRC-32 computed as it lands:
  a reader thread needs the GIL a few times a batch, not after every socket call. Received
  in Python, the reads ran at 0.07-0.16x of their speed while another thread of the process
  ran Python; sent through redis-py's pipelines, the writes at 0.23-0.39x (docs/stores.md).

TLS (rediss://) reads through redis-py instead (RedisStore decides).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..ops import receive_replies, send_values

# receive_replies's outcomes (ffi/store_io.cc: Reply)
_VALUE, _ABSENT, _OTHER_LENGTH, _HEAD_MISMATCH = 0, 1, 2, 3
RCVBUF_BYTES = 4 << 20  # a 2 MiB block (and its header) in the socket buffer at once
WINDOW_BYTES = 2 << 20  # value bytes asked ahead of the reply being read (the docstring)
_LINE_BUF = 1 << 16  # the buffer for replies' first lines (and what a recv brings past them)


def _bulk(arg: Any) -> bytes:
    """An argument as RESP sends it: a bulk string."""
    b = arg if isinstance(arg, bytes) else str(arg).encode()
    return b"$%d\r\n%s\r\n" % (len(b), b)


def _command(args: list[Any]) -> bytes:
    """A command as RESP sends it: an array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(_bulk(arg) for arg in args)


class Received(NamedTuple):
    """A value `RespConnection.get_into` received: its head (its first `head_nbytes` bytes), and
    the CRC-32 (zlib's) of the rest, which went into the caller's buffer."""

    head: bytes
    crc: int


class RespError(Exception):
    """An error reply of the server (`-WRONGTYPE ...`, `-NOPERM ...`): an answer, not a fault."""


class RespFault(ConnectionError):
    """The connection broke, the server refused it (a wrong password) or answered something
    that is not RESP: the connection is closed; the caller counts a fault. `stale`: it
    broke before the first reply (a connection the server had closed: worth one retry)."""

    stale = False


class RespConnection:
    """One connection to one server (TCP or a Unix socket), authenticated and on its database;
    used by one thread at a time. Every wait is bounded by `timeout_s` (a `socket.timeout`,
    an OSError, is a fault)."""

    def __init__(self, params: dict[str, Any], timeout_s: float) -> None:
        """params: `redis.connection.parse_url(url)`'s (host, port, path, db, username,
        password; other keys are ignored)."""
        self._params = params
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buf = bytearray(_LINE_BUF)
        self._mv = memoryview(self._buf)
        self._lo = self._hi = 0  # the unread bytes of _buf

    def connect(self) -> None:
        p = self._params
        if p.get("path"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            target: Any = p["path"]
        else:
            sock = socket.socket(socket.AF_INET6 if ":" in str(p.get("host", "")) else
                                 socket.AF_INET, socket.SOCK_STREAM)
            target = (p.get("host") or "localhost", int(p.get("port") or 6379))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
        sock.settimeout(self._timeout_s)
        try:
            sock.connect(target)
        except OSError:
            sock.close()
            raise
        self._sock, self._lo, self._hi = sock, 0, 0
        hello = []
        if p.get("password"):
            hello.append([b"AUTH", *([p["username"]] if p.get("username") else []),
                          p["password"]])
        if int(p.get("db") or 0):
            hello.append([b"SELECT", str(int(p["db"]))])
        if not hello:
            return
        try:
            self._send(hello)
            for command in hello:
                line = self._line()
                if line[:1] != b"+":
                    raise RespFault(f"{command[0].decode()} refused: "
                                    f"{line[1:].decode(errors='replace')}")
        except BaseException:  # half set up: not kept
            self.close()
            raise

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def get_into(self, names: Sequence[bytes], dsts: Sequence[np.ndarray],
                 each: Callable[[int, Any], None], *, head_nbytes: int = 0,
                 expected_heads: np.ndarray | None = None, head_mask: np.ndarray | None = None,
                 ranges: Sequence[tuple[int, int]] | None = None) -> None:
        """GETs `names` in order, `WINDOW_BYTES` of values (one at least) ahead of the reply
        being read, all received with the GIL released (ffi/store_io.cc): a value's first
        `head_nbytes` bytes into a buffer of its own, the rest straight into `dsts[i]` (a
        writable C-contiguous uint8 array; a value's length is `head_nbytes` + its size).
        Then `each(i, reply)` for every name answered, in order, with reply: a `Received`
        where the value was received, None (absent), an int (a value of another length:
        skipped), False (a head that differs from `expected_heads[i]` where `head_mask` is 1:
        skipped) or a `RespError`. A skipped value leaves its `dsts[i]` untouched.

        Raises RespFault (the connection closed) on a fault, after `each` for the names
        answered before it; the `dsts[i]` of the one it broke in may be partly filled. A
        connection kept from an earlier call that breaks before its first reply (the server
        closed it meanwhile, or restarted) is replaced once, as redis-py's pool does.
        `ranges`: per name, (first byte, bytes) of the value to read (GETRANGE) instead of
        all of it; a reply of another length (a value shorter than the range, or none: 0) is
        then skipped as above."""
        n = len(names)
        if ranges is None:
            commands = [_command([b"GET", name]) for name in names]
        else:
            commands = [_command([b"GETRANGE", name, start, start + k - 1])
                        for name, (start, k) in zip(names, ranges)]
        lengths = np.array([head_nbytes + d.nbytes for d in dsts], np.int64)
        if expected_heads is None:
            expected_heads = np.zeros((n, head_nbytes), np.uint8)
        if head_mask is None:
            head_mask = np.zeros(head_nbytes, np.uint8)
        self._retried(self._receive, commands, lengths, head_nbytes, expected_heads, head_mask,
                      list(dsts), each)

    def set_each(self, names: Sequence[bytes], values: Sequence[np.ndarray],
                 px_ms: int | None = None) -> list[Any]:
        """SETs `values[i]` (C-contiguous uint8 arrays) under `names[i]` (with `PX px_ms`),
        pipelined, sent and answered with the GIL released (ffi/store_io.cc). Per name: True
        (written) or the server's `RespError` (refused: out of memory, ...). Raises RespFault
        (the connection closed) on a fault: none of them is known written. A connection kept
        from an earlier call that breaks before its first reply is replaced once (a SET sent
        twice writes the same value)."""
        count, tail = (3, b"\r\n") if px_ms is None else (5, b"\r\n$2\r\nPX\r\n" + _bulk(px_ms))
        prefixes = [b"*%d\r\n$3\r\nSET\r\n%s$%d\r\n" % (count, _bulk(name), value.nbytes)
                    for name, value in zip(names, values)]
        return self._retried(self._set, prefixes, list(values), tail)

    def _retried(self, attempt: Callable[..., Any], *args: Any) -> Any:
        """attempt(*args) on this connection (made if there is none), and once more on a new
        one if a connection kept from an earlier call broke before its first reply (the
        server closed it meanwhile, or restarted), as redis-py's pool does."""
        reused = self._sock is not None
        if not reused:
            self.connect()
        try:
            return attempt(*args)
        except RespFault as fault:
            if not (reused and fault.stale):
                raise
            self.connect()
            return attempt(*args)

    def _run(self, loop: Callable[..., tuple], n: int, *args: Any
             ) -> tuple[int, dict[int, str], RespFault | None]:
        """loop(fd, *args, timeout_ms), a native loop over `n` commands on this connection:
        the replies answered, the error replies' texts, and the fault that stopped it before
        the last reply (None: none did). A connection that faulted is closed."""
        assert self._sock is not None and self._lo == self._hi
        try:
            answered, fault, closed, errors = loop(self._sock.fileno(), *args,
                                                   max(1, round(self._timeout_s * 1000)))
        except BaseException:  # bad arguments: nothing sent, or the batch half done
            self.close()
            raise
        if fault is not None:  # the connection cannot be reused
            self.close()
        if answered == n:
            return answered, errors, None
        error = RespFault(fault)
        # closed or reset before anything was answered (not a timeout: a slow server)
        error.stale = answered == 0 and closed
        return answered, errors, error

    def _set(self, prefixes: list[bytes], values: list[np.ndarray], tail: bytes
             ) -> list[Any]:
        """One try of `set_each` on the connection as it is."""
        replies = np.empty(len(prefixes), np.int8)
        _, errors, fault = self._run(send_values, len(prefixes), prefixes, values, tail,
                                     replies)
        if fault is not None:
            raise fault
        return [True if r == 0 else RespError(errors[i]) for i, r in enumerate(replies)]

    def _receive(self, commands: list[bytes], lengths: np.ndarray, head_nbytes: int,
                 expected_heads: np.ndarray, head_mask: np.ndarray, dsts: list[np.ndarray],
                 each: Callable[[int, Any], None]) -> None:
        """One try of `get_into` on the connection as it is."""
        n = len(commands)
        heads = np.empty((n, head_nbytes), np.uint8)
        replies = np.empty(n, np.int8)
        lengths_out = np.zeros(n, np.int64)
        crcs = np.zeros(n, np.uint32)
        window = max(1, WINDOW_BYTES // int(lengths.max(initial=1)))
        answered, errors, fault = self._run(
            receive_replies, n, commands, window, lengths, head_nbytes, heads, expected_heads,
            head_mask, dsts, replies, lengths_out, crcs)
        for i in range(answered):
            kind = replies[i]
            each(i, Received(bytes(heads[i]), int(crcs[i])) if kind == _VALUE else
                 None if kind == _ABSENT else
                 int(lengths_out[i]) if kind == _OTHER_LENGTH else False
                 if kind == _HEAD_MISMATCH else RespError(errors[i]))
        if fault is not None:
            raise fault

    # --- the protocol -------------------------------------------------------------------------

    def _send(self, commands: list[list[Any]]) -> None:
        assert self._sock is not None
        self._sock.sendall(b"".join(_command(args) for args in commands))

    def _fill(self) -> None:
        """Receives more bytes into _buf (moving the unread ones to its start first)."""
        if self._lo:
            self._buf[:self._hi - self._lo] = self._buf[self._lo:self._hi]
            self._hi -= self._lo
            self._lo = 0
        if self._hi == len(self._buf):
            raise RespFault("a reply line longer than 64 KiB")
        assert self._sock is not None
        n = self._sock.recv_into(self._mv[self._hi:])
        if not n:
            raise RespFault("the server closed the connection")
        self._hi += n

    def _line(self) -> bytes:
        while True:
            end = self._buf.find(b"\r\n", self._lo, self._hi)
            if end >= 0:
                line = bytes(self._mv[self._lo:end])
                self._lo = end + 2
                return line
            self._fill()
