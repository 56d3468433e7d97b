#!/usr/bin/env python3
"""What a step's layer waits cost with nothing to wait for: the demo model's decode step, with
and without `--layer-groups`, over GPU pools of several sizes, no transfers at all.

    python scripts/layer_wait_probe.py --preset h200 --blocks 4096,24576   # on the GPU machine
    python scripts/layer_wait_probe.py --preset cpu --blocks 256,2048      # a quick CPU look
    python scripts/layer_wait_probe.py --wait-on pool,activations,nothing --hlo-dir /tmp/hlo

On the H200 the documents' oracle (a 47.6 GiB pool) took 10 ms longer a step with 4 or 8 layer
groups, and `offload` (8 GiB) about nothing (docs/performance.md, "Long documents against the
oracle"). Per pool size and groups: the median step over `--repeats` steps of `--batch` rows
each holding `--width` blocks, and what XLA's optimized program holds that grows with the
pool: copies of a pool-shaped array, and the custom calls of the waits.
"""

from __future__ import annotations

import argparse
import re
import sys
import time

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
    on `what`: "pool" (the model's own), "activations" (the hidden states the next group's
    scan carries in: the scan starts after the wait all the same, and the pool is not the
    custom call's operand) or "nothing" (the groups' scans alone, no waits)."""
    if what == "pool":
        return MODEL_LOOP

    def loop(layer, carry, num_layers, layer_groups):
        groups = max(layer_groups, 1)
        for g in range(groups):
            lo, hi = layer_group_bounds(g, groups, num_layers)
            if layer_groups and what == "activations":
                xs = carry[1]
                carry = (carry[0], (wait_for_layers(xs[0], hi), *xs[1:]))
            carry, _ = jax.lax.scan(layer, carry, jnp.arange(lo, hi))
        return carry
    return loop


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(sizes.PRESETS), default="cpu")
    p.add_argument("--blocks", default="256,2048", help="GPU pool sizes in blocks, comma-separated")
    p.add_argument("--groups", default="0,4,8", help="layer groups to compare, comma-separated")
    p.add_argument("--batch", type=int, default=8, help="decode rows")
    p.add_argument("--width", type=int, default=128, help="blocks each row holds")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--wait-on", default="pool",
                   help="with groups, what each group's wait orders, comma-separated: pool (the "
                        "model's), activations, nothing (split scans without waits)")
    p.add_argument("--hlo-dir", help="write each optimized program there")
    args = p.parse_args(argv)

    cfg = dict(sizes.PRESETS[args.preset])
    model = sizes.toy_model(cfg)
    t = cfg["tokens_per_block"]
    params = init_params(model)
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    for blocks in (int(b) for b in args.blocks.split(",")):
        pool = create_pool(model, tokens_per_block=t, num_primary_blocks=blocks,
                           num_secondary_blocks=0)
        rng = np.random.default_rng(0)
        tables = rng.integers(0, blocks, (args.batch, args.width)).astype(np.int32)
        pos = np.full((args.batch, 1), args.width * t - 1, np.int32)
        decode = Rows(np.ones((args.batch, 1), np.int32), pos, tables,
                      np.zeros(args.batch, np.int32))
        pool_type = re.escape(str(pool.primary.dtype).replace("bfloat16", "bf16")
                              .replace("float32", "f32") + "["
                              + ",".join(map(str, pool.primary.shape)) + "]")
        gib = pool.primary.nbytes / 2**30
        cases = [(g, w) for g in (int(g) for g in args.groups.split(","))
                 for w in (args.wait_on.split(",") if g else ["pool"])]
        for groups, wait_on in cases:
            demo_model._over_layers = _loop_waiting_on(wait_on)
            demo_model._jitted_step.cache_clear()
            step = make_step(model, pool, greedy=True, layer_groups=groups)
            text = step.lower(params, pool.primary, (decode,)).compile().as_text() or ""
            if args.hlo_dir:
                with open(f"{args.hlo_dir}/step-{blocks}-{groups}-{wait_on}.txt", "w") as f:
                    f.write(text)
            # a copy: an instruction, or on a GPU a fusion wrapping one
            copies = len(re.findall(pool_type + r"\S* (?:copy\(|fusion\([^\n]*calls=%\S*copy)",
                                    text))
            waits = text.count("jax_kvxfer_wait_layers")
            times = []
            for k in range(args.repeats + 2):
                t0 = time.perf_counter()
                _, pool.primary = step(params, pool.primary, (decode,))
                pool.primary.block_until_ready()
                if k >= 2:  # after the compile and one warm step
                    times.append(time.perf_counter() - t0)
            log(f"pool {blocks} blocks ({gib:.1f} GiB), layer groups {groups}"
                + (f", waits on {wait_on}" if groups else "") + ": step "
                f"{1e3 * float(np.median(times)):.2f} ms (min {1e3 * min(times):.2f}); "
                f"pool copies in the program {copies}, waits {waits}")
        del pool
    return 0


if __name__ == "__main__":
    sys.exit(main())
