#!/usr/bin/env python3
"""What a step's layer waits cost with nothing to wait for: the demo model's decode step, with
and without `--layer-groups`, over GPU pools of several sizes, no transfers at all.

    python scripts/layer_wait_probe.py --preset h200 --blocks 4096,24576   # on the GPU machine
    python scripts/layer_wait_probe.py --preset cpu --blocks 256,2048      # a quick CPU look
    python scripts/layer_wait_probe.py --wait-on layers,pool,nothing --hlo-dir /tmp/hlo

On the H200 the documents' oracle (a 47.6 GiB pool) took 10 ms longer a step with 4 or 8 layer
groups, and `offload` (8 GiB) about nothing (docs/performance.md, "Long documents against the
oracle"), while the model's waits took the pool itself. Per pool size and groups: the median
step over `--repeats` steps of `--batch` rows each holding `--width` blocks, XLA's temporary
memory, the copies of a pool-shaped array in its optimized program, and its waits: whether
they run in order (each after the previous group's loop, before its own). With `--deviceless`
(scripts/gpu-compile-check.sh) it compiles for a GPU on a machine without one and reports the
programs alone: XLA's memory estimate where it passes the device's, and whether a program is
the one compiled for the first pool size.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvxfer import layer_group_bounds, wait_for_layers
from jax_kvxfer.demo import model as demo_model
from jax_kvxfer.demo import sizes
from jax_kvxfer.demo.model import Rows, create_pool, init_params, make_step

MODEL_LOOP = demo_model._over_layers


def _loop_waiting_on(what: str):
    """The demo model's loop over its layers (`model._over_layers`) with each group's wait
    on `what`: "layers" (the model's own: the group's layer indices), "pool" (the pool
    itself, as the model waited before: XLA's memory estimate then counts the pool three
    times) or "nothing" (the groups' scans alone, no waits)."""
    if what == "layers":
        return MODEL_LOOP

    def loop(layer, carry, num_layers, layer_groups):
        groups = max(layer_groups, 1)
        for g in range(groups):
            lo, hi = layer_group_bounds(g, groups, num_layers)
            if layer_groups and what == "pool":
                carry = (wait_for_layers(carry[0], hi), carry[1])
            carry, _ = jax.lax.scan(layer, carry, jnp.arange(lo, hi))
        return carry
    return loop


def _wait_order(text: str, on_cpu: bool) -> str:
    """Whether the optimized program (scheduled) runs each wait before its group's loop and
    after the previous group's: its top-level waits and loops alternate, a wait first."""
    entry = text[text.index("\nENTRY"):]
    ops = re.findall(r"(?m)jax_kvxfer_wait_layers|^  %\S+ = \([^\n]* while\(", entry)
    kinds = ["wait" if op.startswith("jax") else "loop" for op in ops]
    if kinds.count("loop") < kinds.count("wait"):
        return ", their groups' loops flattened"
    if kinds == ["wait", "loop"] * (len(kinds) // 2):
        return ", in order"
    return ", out of order" + (" (no matter on a CPU, whose copies are done in line)"
                               if on_cpu else "")


def _compiled(step, args: tuple, hlo_path: str | None) -> tuple[Any, str, list[str]]:
    """The step compiled, its optimized program, and what XLA logged meanwhile about memory
    (its C++ log, read off this process's stderr)."""
    with tempfile.TemporaryFile("w+") as log:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        try:
            compiled = step.lower(*args).compile()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        log.seek(0)
        xla_log = log.read()
    sys.stderr.write(xla_log)
    text = compiled.as_text() or ""
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(text)
    return compiled, text, re.findall(r"only reduced to ([\d.]+GiB)", xla_log)


def _deviceless(target_config: str) -> Any:
    """A sharding on an H200-like GPU that XLA compiles for without one (the target's
    description, a GpuTargetConfigProto in text); needs jax's CUDA plugin installed."""
    from jax.experimental import topologies
    with open(target_config) as f:
        topology = topologies.get_topology_desc(topology_name="", platform="cuda",
                                                target_config=f.read(), topology="1x1x1")
    return jax.sharding.SingleDeviceSharding(topology.devices[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(sizes.PRESETS), default="cpu")
    p.add_argument("--blocks", default="256,2048", help="GPU pool sizes in blocks, comma-separated")
    p.add_argument("--groups", default="0,4,8", help="layer groups to compare, comma-separated")
    p.add_argument("--batch", type=int, default=8, help="decode rows")
    p.add_argument("--prefill-rows", type=int, default=0,
                   help="a packed prefill segment of this many rows of the preset's chunk beside "
                        "the decodes, as in a step that admits prompts (default: none)")
    p.add_argument("--width", type=int, default=128, help="blocks each row holds")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--wait-on", default="layers",
                   help="with groups, what each group's wait takes, comma-separated: layers (the "
                        "model's: its layer indices), pool (the pool itself), nothing (split "
                        "scans without waits)")
    p.add_argument("--hlo-dir", help="write each optimized program there")
    p.add_argument("--deviceless", metavar="TARGET",
                   help="compile for the GPU this GpuTargetConfigProto file describes, without "
                        "one (scripts/gpu-compile-check.sh), and run nothing; prefill chunks "
                        "attend with paged_attention, not cuDNN's (which needs the GPU)")
    args = p.parse_args(argv)

    cfg = dict(sizes.PRESETS[args.preset])
    model = sizes.toy_model(cfg)
    t = cfg["tokens_per_block"]
    gpu = _deviceless(args.deviceless) if args.deviceless else None
    params = (jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=gpu),
                           jax.eval_shape(lambda: init_params(model)))
              if gpu else init_params(model))
    first_programs: dict[tuple[int, str], tuple[int, str]] = {}
    try:
        for blocks in (int(b) for b in args.blocks.split(",")):
            rng = np.random.default_rng(0)
            tables = rng.integers(0, blocks, (args.batch, args.width)).astype(np.int32)
            pos = np.full((args.batch, 1), args.width * t - 1, np.int32)
            segments = (Rows(np.ones((args.batch, 1), np.int32), pos, tables,
                             np.zeros(args.batch, np.int32)),)
            if args.prefill_rows:  # prompts' chunks, each in the middle of its sequence
                rows, chunk = args.prefill_rows, cfg["chunk"]
                positions = np.full((rows, 1), args.width // 2 * t, np.int32) + np.arange(chunk)
                segments = (Rows(np.ones((rows, chunk), np.int32), positions.astype(np.int32),
                                 tables[np.arange(rows) % args.batch],
                                 np.full(rows, chunk - 1, np.int32)), *segments)
            if gpu:
                pool = None
                segments = tuple(Rows(*(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=gpu)
                                        for x in seg)) for seg in segments)
                primary = jax.ShapeDtypeStruct((blocks, model.num_layers, 2, model.num_kv_heads, t,
                                                model.head_dim), model.dtype, sharding=gpu)
            else:
                pool = create_pool(model, tokens_per_block=t, num_primary_blocks=blocks,
                                   num_secondary_blocks=0)
                primary = pool.primary
            pool_type = re.escape(str(np.dtype(primary.dtype)).replace("bfloat16", "bf16")
                                  .replace("float32", "f32") + "["
                                  + ",".join(map(str, primary.shape)) + "]")
            gib = np.prod(primary.shape) * np.dtype(primary.dtype).itemsize / 2**30
            for groups, wait_on in [(g, w) for g in (int(g) for g in args.groups.split(","))
                                    for w in (args.wait_on.split(",") if g else ["layers"])]:
                demo_model._over_layers = _loop_waiting_on(wait_on)
                demo_model._jitted_step.cache_clear()
                # a GPU's defaults, which make_step picks by the backend it runs on, but for
                # cuDNN's fused attention of prefill chunks, which needs a GPU to compile
                step = (make_step(model, greedy=True, layer_groups=groups, fused_attention=False,
                                  attention_tile=1024) if gpu
                        else make_step(model, pool, greedy=True, layer_groups=groups))
                compiled, text, over = _compiled(
                    step, (params, primary, segments),
                    args.hlo_dir and f"{args.hlo_dir}/step-{blocks}-{groups}-{wait_on}.txt")
                # a copy: an instruction, or on a GPU a fusion wrapping one
                copies = len(re.findall(pool_type + r"\S* (?:copy\(|fusion\([^\n]*calls=%\S*copy)",
                                        text))
                waits = text.count("jax_kvxfer_wait_layers")
                order = _wait_order(text, on_cpu=not gpu) if waits else ""
                same = _same_program(first_programs.setdefault((groups, wait_on), (blocks, text)),
                                     blocks, text)
                timing = "" if gpu else _timed(step, params, pool, segments, args.repeats) + "; "
                print(f"pool {blocks} blocks ({gib:.1f} GiB), layer groups {groups}"
                      + (f", waits on {wait_on}" if groups else "") + f": {timing}XLA's temp "
                      f"{compiled.memory_analysis().temp_size_in_bytes / 2**30:.2f} GiB"
                      + (f", its memory estimate over the device's ({over[0]})" if over else "")
                      + f", pool copies in the program {copies}, waits {waits}{order}{same}",
                      flush=True)
            del pool
    finally:  # the model's own loop back, and no step compiled with another kept
        demo_model._over_layers = MODEL_LOOP
        demo_model._jitted_step.cache_clear()
    return 0


def _same_program(first: tuple[int, str], blocks: int, text: str) -> str:
    """Whether a step's optimized program is the one compiled for the first pool size, but
    for the pool's size: XLA compiles another where its memory estimate passes the device's."""
    first_blocks, first_text = first
    if first_blocks == blocks:
        return ""
    def lines(program):  # the block counts and the module's fingerprints taken out
        program = re.sub(r'fingerprint\w*="\w+"', "", program)
        return re.sub(rf"\b({first_blocks}|{blocks})\b", "N", program).splitlines()
    a, b = collections.Counter(lines(first_text)), collections.Counter(lines(text))
    differ = sum((a - b).values()) + sum((b - a).values())  # lines only in one of them
    return (f"; the program as at {first_blocks} blocks" if not differ else
            f"; another program than at {first_blocks} blocks ({differ} lines differ)")


def _timed(step, params, pool, segments: tuple, repeats: int) -> str:
    """The step's median and fastest time over `repeats` steps, after a warm one."""
    times = []
    for k in range(repeats + 2):
        t0 = time.perf_counter()
        _, pool.primary = step(params, pool.primary, segments)
        pool.primary.block_until_ready()
        if k >= 2:  # after the compile and one warm step
            times.append(time.perf_counter() - t0)
    return f"step {1e3 * float(np.median(times)):.2f} ms (min {1e3 * min(times):.2f})"


if __name__ == "__main__":
    sys.exit(main())
