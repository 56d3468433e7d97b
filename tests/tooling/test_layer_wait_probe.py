"""scripts/layer_wait_probe.py's reading of an optimized program (the layer waits' order, a
program against another pool size's), and one small run of it on the CPU."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "scripts"))
import layer_wait_probe as probe

WAIT = ('  %ffi_call.{k} = s32[8]{{0}} custom-call(%b.{k}), '
        'custom_call_target="jax_kvxfer_wait_layers"')
LOOP = '  %while.{k} = (s32[], bf16[{n},32,2,8,16,128]{{5,4,3,2,1,0}}) while(%tuple.{k})'


def _program(ops: str, blocks: int, salt: str = "") -> str:
    """An optimized program's text whose entry runs `ops` ("w": a wait, "l": a group's loop)
    over a pool of `blocks` blocks."""
    lines = [f'HloModule m, frontend_attributes={{fingerprint_before_lhs="{salt or "f"}"}}',
             f"%body (p: bf16[{blocks},32,2,8,16,128]) -> s32[] {{", "}", "",
             f"ENTRY %main (pool: bf16[{blocks},32,2,8,16,128]) -> s32[] {{"]
    for k, op in enumerate(ops):
        lines.append((WAIT if op == "w" else LOOP).format(k=k, n=blocks))
    return "\n".join(lines + ["}"])


def test_the_waits_order_is_read_off_the_entry():
    assert probe._wait_order(_program("wlwlwl", 64), on_cpu=False) == ", in order"
    assert probe._wait_order(_program("wwwlll", 64), on_cpu=False) == ", out of order"
    assert "no matter on a CPU" in probe._wait_order(_program("lwlw", 64), on_cpu=True)
    assert probe._wait_order(_program("www", 64), on_cpu=False) == \
        ", their groups' loops flattened"


def test_a_program_is_the_same_but_for_the_pool_size():
    rng = np.random.default_rng()
    small, large = sorted(int(x) for x in rng.choice(np.arange(2, 1 << 16), 2, replace=False))
    ops = "".join(rng.choice(["wl", "l"], 4))
    first = (small, _program(ops, small, salt="a"))
    assert probe._same_program(first, small, first[1]) == ""
    # another pool size and another fingerprint: the same program
    assert probe._same_program(first, large, _program(ops, large, salt="b")) == \
        f"; the program as at {small} blocks"
    # one op more, last or first (a line that only one of them has): another program
    assert probe._same_program(first, large, _program(ops + "l", large)) == \
        f"; another program than at {small} blocks (1 lines differ)"
    lines = _program(ops, large).split("\n")
    lines.insert(next(i for i, line in enumerate(lines) if line.startswith("ENTRY")) + 1,
                 WAIT.format(k=99))
    assert probe._same_program(first, large, "\n".join(lines)) == \
        f"; another program than at {small} blocks (1 lines differ)"


def test_the_probe_runs_on_the_cpu(capsys):
    assert probe.main(["--blocks", "64,96", "--groups", "0,2", "--wait-on", "layers,pool",
                       "--repeats", "1", "--width", "4", "--prefill-rows", "2"]) == 0
    assert probe.demo_model._over_layers is probe.MODEL_LOOP  # the model's loop given back
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6, lines
    assert all("pool copies in the program 0" in line for line in lines), lines
    # the pool's size changes nothing in the program, with waits or without
    assert all("the program as at 64 blocks" in line for line in lines[3:]), lines
