"""What a step's logits cost to bring to the host: the old greedy step's outputs (each row in the
model's dtype and its argmax, all to the host) against model.token_record's (argmax, its 64 largest logits,
fingerprint), for the demo's segments at the h200 preset's vocabulary. Also the record's device
time alone (what it adds to a step). Median and p10-p90 of `--reps` after a warm-up.

    python scripts/record_bench.py                  # [16, 128256] and [8, 128256] bf16
    python scripts/record_bench.py --vocab 1024 --dtype float32
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_kvxfer.demo.model import token_record


def timed(fn, reps: int) -> str:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    p10, p50, p90 = 1e6 * np.percentile(ts, [10, 50, 90])
    return f"{p50:8.0f} us ({p10:.0f}-{p90:.0f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    dtype = args.dtype

    @jax.jit
    def old(x):
        return x.astype(dtype), jnp.argmax(x, axis=-1).astype(jnp.int32)

    new = jax.jit(lambda x: token_record(x, dtype))
    print(jax.devices()[0].device_kind)
    for rows in (16, 8):
        x = jax.device_put(np.random.default_rng(rows).standard_normal(
            (rows, args.vocab)).astype(np.float32))
        print(f"[{rows}, {args.vocab}] {dtype}:")
        print("  old: rows + argmax to host  ", timed(lambda x=x: jax.device_get(old(x)), args.reps))
        print("  new: record to host         ", timed(lambda x=x: jax.device_get(new(x)), args.reps))
        print("  new: record on device only  ",
              timed(lambda x=x: jax.block_until_ready(new(x)), args.reps))
        print("  old: cast + argmax on device",
              timed(lambda x=x: jax.block_until_ready(old(x)), args.reps))


if __name__ == "__main__":
    main()
