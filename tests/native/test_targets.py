"""The table of FFI targets (jax_kvxfer/_native.py, read through jax_kvxfer.testing) against
what the compiled modules register with XLA: the CPU module always, the CUDA one where this
build has it. Both read ffi/targets.h, which tests/test_layering.py checks against the table
in the sources, so a CUDA build is covered there even where it is not built."""

import jax_kvxfer as kvx
from jax_kvxfer import testing


def test_every_target_in_the_table_once():
    assert len(testing.TARGETS) == len(set(testing.TARGETS)), testing.TARGETS
    assert all(name.startswith("jax_kvxfer_") for name in testing.TARGETS), testing.TARGETS


def test_the_compiled_registrations_are_the_table():
    registered = testing.registered_targets()
    assert set(registered) == ({"cpu", "cuda"} if kvx.HAS_CUDA_HANDLERS else {"cpu"})
    for platform, names in registered.items():
        assert names == sorted(testing.TARGETS), platform
