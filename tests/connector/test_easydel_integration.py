"""What of the eSurge integration runs without easydel: the keys it gives pages
(`integrations.easydel.page_key`), the same in every process whatever its PYTHONHASHSEED
(eSurge's own page hashes are not) and naming the whole prefix; its arguments' checks. The
integration itself runs against eSurge in scripts/easydel-check.sh (its `--disk --restart`
case: a new engine with other page hashes finds the first engine's pages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jax_kvxfer.integrations.easydel import ROOT_KEY, enable_offloading, page_key

PAGE = 16
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def chain(pages, extra=None) -> list[bytes]:
    keys, parent = [], ROOT_KEY
    for tokens in pages:
        parent = page_key(parent, tokens, extra)
        keys.append(parent)
    return keys


def test_keys_are_the_same_in_a_process_of_another_hash_seed():
    rng = np.random.default_rng()
    pages = rng.integers(0, 2**31 - 1, (6, PAGE)).tolist()
    extra = ("image", "a3f9", 7)  # a str's builtin hash changes with PYTHONHASHSEED
    code = ("import json, sys\nfrom tests.connector.test_easydel_integration import chain\n"
            "pages, extra = json.load(sys.stdin)\n"
            "print(json.dumps([[k.hex() for k in chain(pages, tuple(extra))], hash(extra[1])]))")
    here = [k.hex() for k in chain(pages, extra)]
    builtin = set()
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code], input=json.dumps([pages, extra]),
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, cwd=REPO)
        keys, str_hash = json.loads(out.stdout)
        assert keys == here
        builtin.add(str_hash)
    assert len(builtin) == 2  # the processes' builtin hashes did differ


def test_a_key_names_the_whole_prefix():
    rng = np.random.default_rng()
    pages = rng.integers(0, 50_000, (8, PAGE)).tolist()
    keys = chain(pages)
    assert len(set(keys)) == len(keys) and all(len(k) == 16 for k in keys)
    for i in range(len(pages)):  # one token changed in page i: page i's key and all after it
        changed = [list(p) for p in pages]
        changed[i][int(rng.integers(PAGE))] += 1
        other = chain(changed)
        assert other[:i] == keys[:i]
        assert all(a != b for a, b in zip(other[i:], keys[i:]))
    # the same page's tokens after another prefix, or with extra keys, get another key
    assert page_key(keys[0], pages[1]) == keys[1]
    assert page_key(keys[2], pages[1]) != keys[1]
    assert page_key(keys[0], pages[1], ("lora", 1)) not in (keys[1], page_key(
        keys[0], pages[1], ("lora", 2)))


def test_random_pages_get_distinct_keys():
    rng = np.random.default_rng()
    pages = rng.integers(0, 256, (20_000, 4)).tolist()  # small vocabulary: many near-equal pages
    keys = {page_key(ROOT_KEY, p) for p in pages}
    assert len(keys) == len({tuple(p) for p in pages})


@pytest.mark.parametrize("bad, error", [("measure", ValueError), (0.0, ValueError),
                                        (float("nan"), ValueError), (True, TypeError),
                                        ([1e-4], TypeError)])
def test_a_bad_recompute_cost_is_named_before_the_engine_is_touched(bad, error):
    engine = object()  # not an engine: the argument is refused before the engine is looked at
    with pytest.raises(error, match="recompute_s_per_token"):
        enable_offloading(engine, num_host_blocks=4, recompute_s_per_token=bad)
