"""RedisStore's read path: a minimal RESP2 client that receives each GET's value straight into a
buffer of the caller's (`ValueReader`), without redis-py's reply objects.

Why (measured on Valkey 8.1, 2 MiB values, loopback; docs/stores.md has the table):

- redis-py (even with hiredis) reads a reply into its own buffer, then makes a `bytes` of it,
  which the store then copied into the row: per GB received it spent 0.45 to 1.5 s of client
  CPU, this reader 0.3 s. It hands the value's 64-byte header to the store first, which
  checks it (fingerprint, key, length) and gives the row to receive the rest into: one
  `recv_into` per socket read, no copy; the CRC-32 is checked after.
- Valkey copies every reply into its output buffers before writing them: a pipeline of 8 GETs
  of 2 MiB made it hold 16 MiB of fresh replies and spend 0.6 to 0.9 s per GB, against 0.22
  to 0.3 s when a connection asks for the next value only once the reply before it has begun
  (one value in flight). So reads keep about one 2 MiB value's worth of GETs in flight per
  connection (`WINDOW_BYTES`) and use several connections (the store's threads) instead of
  deep pipelines. Small values need more of them in flight to cover the round trip: 16 KiB
  values read at 0.34-0.46 GB/s with 64 or 128 in flight against 0.26-0.30 with one (a
  2-core machine, interleaved runs).
- A large receive buffer (SO_RCVBUF, 4 MiB) lets the server write a whole value in one go.

TLS (rediss://) and clusters read through redis-py instead (RedisStore decides).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Sequence
from typing import Any

RCVBUF_BYTES = 4 << 20  # a 2 MiB block (and its header) in the socket buffer at once
WINDOW_BYTES = 2 << 20  # value bytes asked ahead of the reply being read (the docstring)
_LINE_BUF = 1 << 16  # the buffer for replies' first lines (and what a recv brings past them)


class RespError(Exception):
    """An error reply of the server (`-WRONGTYPE ...`, `-NOPERM ...`): an answer, not a fault."""


class RespFault(ConnectionError):
    """The connection broke, the server refused it (a wrong password) or answered something
    that is not RESP: the connection is closed; the caller counts a fault. `stale`: it
    broke before the first reply (a connection the server had closed: worth one retry)."""

    stale = False


class ValueReader:
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

    def get_each(self, names: Sequence[bytes], head_nbytes: int, value_nbytes: int,
                 head: Callable[[int, Any], Any], body: Callable[[int], None],
                 ranges: Sequence[tuple[int, int]] | None = None) -> None:
        """GETs `names` in order, `WINDOW_BYTES` of values (one at least) ahead of the reply
        being read. Per name, `head(i, reply)` with reply: the value's first `head_nbytes`
        bytes (a value of `value_nbytes`), None (absent), an int (a value of another length:
        skipped) or a `RespError`. For a value, `head` returns a writable buffer of the rest
        of it, which is received straight into it, then `body(i)`; or None: the rest is
        skipped. Raises RespFault (the
        connection closed) on a fault: the names before it were answered, the buffer `head`
        gave for the one it broke in may be partly filled. A connection kept from an earlier
        call that breaks before its first reply (the server closed it meanwhile, or
        restarted) is replaced once, as redis-py's pool does. `ranges`: per name, (first
        byte, bytes) of the value to read (GETRANGE) instead of all of it; a reply of another
        length (a value shorter than the range, or none: 0) is then skipped as above."""
        reused = self._sock is not None
        if not reused:
            self.connect()
        if ranges is None:
            commands = [[b"GET", name] for name in names]
            lengths = [value_nbytes] * len(names)
        else:
            commands = [[b"GETRANGE", name, start, start + n - 1]
                        for name, (start, n) in zip(names, ranges)]
            lengths = [n for _, n in ranges]
        args = (commands, lengths, head_nbytes, head, body)
        try:
            self._get_each(*args)
        except RespFault as fault:
            if not (reused and fault.stale):
                raise
            self.connect()
            self._get_each(*args)

    def _get_each(self, commands: list[list[Any]], lengths: list[int], head_nbytes: int,
                  head: Callable[[int, Any], Any], body: Callable[[int], None]) -> None:
        window = max(1, WINDOW_BYTES // max(lengths, default=1))
        i = 0
        try:
            self._send(commands[:window])
            for i in range(len(commands)):
                line = self._line()
                if i + window < len(commands):  # the server prepares it while we receive
                    self._send(commands[i + window:i + window + 1])
                self._reply(i, line, head_nbytes, lengths[i], head, body)
        except (OSError, ValueError) as e:
            self.close()
            fault = e if isinstance(e, RespFault) else RespFault(f"{type(e).__name__}: {e}")
            # closed or reset before anything was answered (not a timeout: a slow server)
            fault.stale = i == 0 and isinstance(e, ConnectionError)
            raise fault from None
        except BaseException:  # a reply half read: the connection cannot be reused
            self.close()
            raise

    # --- the protocol -------------------------------------------------------------------------

    def _send(self, commands: list[list[Any]]) -> None:
        parts = []
        for args in commands:
            parts.append(b"*%d\r\n" % len(args))
            for arg in args:
                b = arg if isinstance(arg, bytes) else str(arg).encode()
                parts.append(b"$%d\r\n%s\r\n" % (len(b), b))
        assert self._sock is not None
        self._sock.sendall(b"".join(parts))

    def _reply(self, i: int, line: bytes, head_nbytes: int, value_nbytes: int,
               head: Callable[[int, Any], Any], body: Callable[[int], None]) -> None:
        """Reads the reply of GET `i`, whose first line was `line` (see get_each)."""
        kind, rest = line[:1], line[1:]
        if kind == b"-":
            head(i, RespError(rest.decode(errors="replace")))
            return
        if kind == b"_":  # RESP3's null (a server speaking RESP3 by default)
            head(i, None)
            return
        if kind != b"$":
            raise RespFault(f"a reply that is not a GET's: {line[:40]!r}")
        n = int(rest)
        if n < 0:
            head(i, None)
        elif n != value_nbytes:
            self._skip(n + 2)
            head(i, n)
        else:
            while self._hi - self._lo < head_nbytes:
                self._fill()
            dst = head(i, bytes(self._mv[self._lo:self._lo + head_nbytes]))
            self._lo += head_nbytes
            if dst is None:
                self._skip(n - head_nbytes + 2)
                return
            dst = memoryview(dst).cast("B")
            if len(dst) != n - head_nbytes:
                raise AssertionError(f"head gave a buffer of {len(dst)} bytes for the "
                                     f"{n - head_nbytes} after the head")
            self._exactly(dst)
            self._skip(2)  # the value's \r\n
            body(i)

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

    def _exactly(self, dst: memoryview) -> None:
        """Fills `dst`: first with what _buf holds, then straight from the socket."""
        have = min(len(dst), self._hi - self._lo)
        dst[:have] = self._mv[self._lo:self._lo + have]
        self._lo += have
        assert self._sock is not None
        while have < len(dst):
            n = self._sock.recv_into(dst[have:])
            if not n:
                raise RespFault("the server closed the connection")
            have += n

    def _skip(self, n: int) -> None:
        """Drops the next `n` bytes."""
        while n:
            if self._lo == self._hi:
                self._lo = self._hi = 0
                self._fill()
            k = min(n, self._hi - self._lo)
            self._lo += k
            n -= k
