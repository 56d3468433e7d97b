"""The table of FFI targets (jax_kvxfer/ops/_native.py, read through jax_kvxfer.testing) against
what the compiled modules register with XLA: the CPU module always, the CUDA one where this
build has it. Both read ffi/targets.h, which tests/test_layering.py checks against the table
in the sources, so a CUDA build is covered there even where it is not built. The attributes
each target takes are in the table too (TARGET_ATTRIBUTES), checked against the option
structs' decodings in ffi/block_copy.h and against what the emitters pass."""

import pathlib
import re

import jax
import jax.numpy as jnp

import jax_kvxfer as kvx
from jax_kvxfer import testing
from jax_kvxfer.ops._lowering import CopyPlan, emit
from jax_kvxfer.ops._native import TARGET_ATTRIBUTES, TARGETS
from jax_kvxfer.transfer._lanes import join_call, lane_copy_call
from jax_kvxfer.transfer._layers import layer_copy_call, layer_lane_copy_call

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_target_in_the_table_once():
    assert len(TARGETS) == len(set(TARGETS)), TARGETS
    assert all(name.startswith("jax_kvxfer_") for name in TARGETS), TARGETS


def test_the_compiled_registrations_are_the_table():
    registered = testing.registered_targets()
    assert set(registered) == ({"cpu", "cuda"} if kvx.HAS_CUDA_HANDLERS else {"cpu"})
    for platform, names in registered.items():
        assert names == sorted(TARGETS), platform


def _decodings() -> dict[str, frozenset[str]]:
    """Per option struct, the attribute names ffi/block_copy.h decodes (its macros expanded)."""
    text = (ROOT / "ffi" / "block_copy.h").read_text()
    macros = {name: re.findall(r'KVXFER_ATTR\([^,]+,\s*"(\w+)"\)', body)
              for name, body in re.findall(r"#define (KVXFER_\w+_ATTRS)((?:.*\\\n)*.*)", text)}
    out = {}
    for struct, body in re.findall(
            r"XLA_FFI_REGISTER_STRUCT_ATTR_DECODING\(([\w:<>]+),(.*?)\);", text, re.DOTALL):
        names = re.findall(r'KVXFER_ATTR\([^,]+,\s*"(\w+)"\)', body)
        for macro in re.findall(r"KVXFER_\w+_ATTRS", body):
            names += macros[macro]
        assert len(names) == len(set(names)), (struct, names)
        out[struct.replace("kvxfer::", "")] = frozenset(names)
    return out


def test_the_attribute_table_is_what_the_handlers_decode():
    decoded = _decodings()
    assert set(decoded) == {"CopyOptions", "LaneOptions", "Layered<CopyOptions>",
                            "Layered<LaneOptions>"}, decoded
    assert set(TARGET_ATTRIBUTES) == set(TARGETS)
    # the join of the lanes and the wait for layers each decode one scalar attribute of their
    # own, not a struct
    structs = set(decoded.values()) | {frozenset({"lanes"}), frozenset({"layers"})}
    for target, names in TARGET_ATTRIBUTES.items():
        assert names in structs, (target, sorted(names))


def _custom_calls(lowered) -> dict[str, set[frozenset[str]]]:
    """Per custom call target in a lowered program, the attribute name sets it is given."""
    out: dict[str, set[frozenset[str]]] = {}
    for target, config in re.findall(r"custom_call @(\w+)\(.*?mhlo\.backend_config = \{(.*?)\}",
                                     lowered.as_text()):
        out.setdefault(target, set()).add(frozenset(re.findall(r"(\w+) = ", config)))
    return out


def test_the_emitters_pass_the_table_s_attributes():
    """Every target, lowered on the CPU through the code that emits it, is given exactly the
    attributes of its row in the table."""
    pool = jnp.zeros((4, 1, 2, 1, 4, 8), jnp.float32)
    i = jnp.array([0, 1], jnp.int32)
    seen: dict[str, set[frozenset[str]]] = {}

    def lower(fn, *args):
        for target, names in _custom_calls(jax.jit(fn).lower(*args)).items():
            seen.setdefault(target, set()).update(names)

    lower(lambda a, b, s: kvx.copy_blocks(a, b, s, s + 2, 3), pool, pool, i)
    lower(lambda a, s: kvx.copy_blocks(a, a, s, s + 2, 3), pool, i)
    for within in (True, False):  # nograph: the plan dma=True takes (lowered on the CPU)
        lower(lambda a, b, s, w=within: emit(
            CopyPlan(dma=True, within=w), a, a if w else b, s, s + 2, s), pool, pool, i)
    lanes = {"lane": 1}
    lower(lambda a, b, s: lane_copy_call(a, b, s, s, s, **lanes), pool, pool, i)
    lower(lambda a, s: lane_copy_call(a, a, s, s, s, **lanes), pool, i)
    lower(lambda a: join_call(a), pool)
    lower(lambda a: kvx.wait_for_layers(a, 1), pool)
    layers = [jnp.zeros((4, 4, 2, 8), jnp.float32) for _ in range(2)]
    views = kvx.KVCacheBlockPool.from_layers(layers, token_axis=1,
                                             num_secondary_blocks=0).storage.views
    host = jnp.zeros((4, views.row_nbytes // 4), jnp.float32)
    for offload in (True, False):
        lower(lambda h, ls, s, o=offload: layer_copy_call(h, ls, s, s, s, offload=o,
                                                                  views=views), host, layers, i)
        lower(lambda h, ls, s, o=offload: layer_lane_copy_call(
            h, ls, s, s, s, offload=o, views=views, **lanes), host, layers, i)
    assert set(seen) == set(TARGETS), sorted(set(TARGETS) - set(seen))
    for target, name_sets in seen.items():
        assert name_sets == {TARGET_ATTRIBUTES[target]}, (target, name_sets)
