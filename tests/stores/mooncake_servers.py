"""Real Mooncake masters for the MooncakeStore tests: `LocalMooncake` (jax_kvxfer.stores.mooncake,
the launcher the demo and the bench use), here with fault control a user never needs: kill the
master, restart it on the same port, send it a signal. No mocks: the store talks to a real master.
(Helpers only: a conftest.py in this folder would shadow tests/conftest.py.)"""

from __future__ import annotations

import signal
import time

from jax_kvxfer.stores.mooncake import DEFAULT_HOLDER_BYTES, LocalMooncake


class Mooncake(LocalMooncake):
    """A `LocalMooncake` with `kill_master()`, `restart_master()` and `signal_master()`."""

    def restart_master(self, timeout: float = 30.0) -> None:
        """Starts the master again on the same port (after `kill_master()`: empty); waits
        until the holder has mounted its segment into it again."""
        self._start_master(timeout)
        if self.holder is not None:
            self._wait(lambda: (self.capacity() or 0) >= self.segment_bytes, timeout,
                       "the holder's segment after a master restart", self.master)

    def kill_master(self) -> None:
        """SIGKILL the master (its metadata goes: a restarted master starts empty)."""
        if self.master is not None and self.master.poll() is None:
            self.master.kill()
            self.master.wait()

    def signal_master(self, sig: int) -> None:
        """Sends `sig` to the master (SIGSTOP / SIGCONT: a master that stops answering). After
        SIGSTOP, returns once the master has stopped (at most 5 s): a signal is delivered when
        the process next runs, and on a loaded machine a request sent at once could still be
        answered."""
        if self.master is None or self.master.poll() is not None:
            return
        self.master.send_signal(sig)
        if sig == signal.SIGSTOP:
            deadline = time.monotonic() + 5.0
            while (time.monotonic() < deadline
                   and process_state(self.master.pid) not in ("T", "t", "?")):
                time.sleep(0.005)


def process_state(pid: int) -> str:
    """The state letter of `pid` in /proc (R, S, T for stopped, ...); "?" where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return "?"


def start_master(segment_bytes: int = DEFAULT_HOLDER_BYTES, *, timeout: float = 30.0,
                 **kw) -> Mooncake:
    """`start_local_master` with fault control: a started `Mooncake`."""
    return Mooncake(segment_bytes, **kw).start(timeout)
