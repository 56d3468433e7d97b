#!/usr/bin/env python3
"""The demo model's compute rate (issue 48): full-prefill steps against a large matmul measured
in the same run, and decode steps against the tokens the rows hold.

    python scripts/model_bench.py --preset h200 --json model-bench.json   # on the GPU machine
    python scripts/model_bench.py --preset cpu --width 128                 # a quick CPU look

Prefill: steps of the serving loop's per-request shape (`--prefill-budget 0`: `prefill_rows`
segments `[1, chunk]` and the decode segment `[batch, 1]`), every chunk at context `--context`;
then token-budgeted packed segments (`model.pack_prefill`: one `[rows, chunk]` segment, `rows` =
prefill_rows, twice that, and the preset's `prefill_budget / chunk`, the demo's full-prefill
shape); and the first shape with the old full-width attention (`full_width=True`, the model
before issue 48). TFLOP/s counts the prefill tokens' matrix products
(`ModelConfig.token_flops`). Peak: a bf16 `n x n` matmul (the model's dtype on a CPU).

Decode: the decode segment `[batch, 1]` with every row holding L tokens, L = the table's full
width, half, a quarter and an eighth (each row's table past its blocks is block 0, as the
serving loop's tables are), tiled and full-width; and tiled with the key-tile loop's trip count
fixed at the table's tiles (what its data-dependent count costs: on a GPU, XLA copies a loop's
condition to the host each iteration unless it knows the count; the fixed count's tiles past a
row's blocks read block 0 again and again, and change nothing).

The last line is one summary against the targets: prefill >= 35 % of the measured peak;
decode at a quarter of the width <= 50 % of the full width's step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time

import jax
import numpy as np

from jax_kvxfer.demo import serving, sizes
from jax_kvxfer.demo.model import (
    Rows,
    attention_tile_blocks,
    create_pool,
    forward,
    init_params,
    make_step,
    pack_prefill,
)
from jax_kvxfer.demo.report import matmul_rate

PREFILL_TARGET, DECODE_TARGET = 0.35, 0.50


def _time(fn, repeats: int) -> float:
    """Median seconds of `fn()` (which blocks), after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _static_trips_step(model, attention_tile: int | None, width: int, t: int):
    """The tiled step, its key-tile loop run for the table's `width` blocks whatever the rows
    hold: traced with `jax.lax.fori_loop` given that count for the model's data-dependent
    one (its only loop with a traced bound)."""
    tiles = -(-width // attention_tile_blocks(attention_tile, t))
    step = jax.jit(functools.partial(forward, config=model, attention_tile=attention_tile,
                                     fused_attention=False), donate_argnums=1)
    real = jax.lax.fori_loop

    def fixed(lower, upper, body, init, **kw):
        return real(lower, tiles if isinstance(upper, jax.core.Tracer) else upper, body, init,
                    **kw)

    def traced_fixed(*args):
        jax.lax.fori_loop = fixed
        try:
            return step(*args)
        finally:
            jax.lax.fori_loop = real
    return traced_fixed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(sizes.PRESETS), default="cpu")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's")
    p.add_argument("--width", type=int, default=None,
                   help="block table width (default: the preset's chats' longest request)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens before each prefill chunk (default: a quarter of the width)")
    p.add_argument("--peak-n", type=int, default=None, help="matmul size (8192 GPU, 1024 CPU)")
    p.add_argument("--attention-tile", type=int, default=None, help="tokens a key tile holds")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-baseline", action="store_true", help="skip the full-width steps")
    p.add_argument("--json", default=None, metavar="PATH")
    args = p.parse_args(argv)

    cfg = dict(sizes.PRESETS[args.preset])
    model = sizes.toy_model(cfg)
    if args.layers:
        model = dataclasses.replace(model, num_layers=args.layers)
    t, batch, chunk, rows = (cfg["tokens_per_block"], cfg["batch"], cfg["chunk"],
                             cfg["prefill_rows"])
    width = args.width or serving.max_request_blocks(
        sizes.synthetic_chats(cfg, model.vocab_size, 0), t)
    context = args.context if args.context is not None else width * t // 4
    context = min(context, width * t - chunk)
    gpu = jax.default_backend() == "gpu"
    peak_n = args.peak_n or (8192 if gpu else 1024)
    peak_dtype = "bfloat16" if gpu else model.dtype
    out: dict = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                 "preset": args.preset, "layers": model.num_layers, "width_blocks": width,
                 "tokens_per_block": t, "batch": batch, "chunk": chunk, "prefill_rows": rows,
                 "context": context}
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))

    out["peak_tflops"] = matmul_rate(peak_dtype, peak_n, args.repeats)
    out["peak"] = f"{peak_dtype} matmul {peak_n}^2"
    log(f"peak: {out['peak_tflops']:.3g} TFLOP/s ({out['peak']})")

    params = init_params(model)
    pool = create_pool(model, tokens_per_block=t, num_primary_blocks=batch * width,
                       num_secondary_blocks=0)
    tables = np.arange(batch * width, dtype=np.int32).reshape(batch, width)

    def decode_rows(held: int | None) -> Rows:
        """The decode segment: every row holding `held` tokens (None: padding rows), its table
        past its blocks block 0, as the serving loop's are."""
        pos = np.full((batch, 1), -1 if held is None else held - 1, np.int32)
        rows_tables = tables if held is None else np.where(
            np.arange(width) < -(-held // t), tables, 0).astype(np.int32)
        return Rows(np.ones((batch, 1), np.int32), pos, rows_tables, np.zeros(batch, np.int32))

    def timed(step, segments) -> float:
        def run():
            nonlocal_pool[0] = step(params, nonlocal_pool[0], segments)[1]
            nonlocal_pool[0].block_until_ready()
        return _time(run, args.repeats)

    nonlocal_pool = [pool.primary]
    kw = {"attention_tile": args.attention_tile}
    tiled = make_step(model, pool, **kw)
    flops_chunk = sum(model.token_flops(q + 1) for q in range(context, context + chunk))

    def prefill_case(name: str, step, segments, n_chunks: int) -> None:
        s = timed(step, segments)
        rate = n_chunks * flops_chunk / s / 1e12
        out.setdefault("prefill", {})[name] = {"step_ms": 1e3 * s, "tflops": rate,
                                               "of_peak": rate / out["peak_tflops"]}
        log(f"prefill {name}: {1e3 * s:.2f} ms, {rate:.3g} TFLOP/s "
            f"({100 * rate / out['peak_tflops']:.1f} % of peak)")

    def one_chunk(r: int) -> Rows:
        return Rows(np.ones((1, chunk), np.int32),
                    np.arange(context, context + chunk, dtype=np.int32)[None], tables[r:r + 1],
                    np.array([chunk - 1], np.int32))

    per_request = (*[one_chunk(r) for r in range(rows)], decode_rows(None))
    prefill_case(f"{rows} segments [1, {chunk}]", tiled, per_request, rows)
    budget_rows = cfg["prefill_budget"] // chunk  # the demo's packed segment
    for k in sorted({rows, 2 * rows, budget_rows} - {0}):
        if k > batch and k != budget_rows:
            continue
        seg, _ = pack_prefill([([1] * chunk, context, tables[r]) for r in range(k)], rows=k,
                              row_tokens=chunk, max_blocks=width)
        prefill_case(f"packed [{k}, {chunk}]", tiled, (seg, decode_rows(None)), k)
    if not args.no_baseline:
        before = make_step(model, pool, full_width=True, **kw)
        prefill_case(f"{rows} segments [1, {chunk}], full width (before)", before, per_request,
                     rows)

    fractions = (1.0, 0.5, 0.25, 0.125)
    # The tiled loop's trip count follows the rows' tokens (data), so on a GPU XLA copies its
    # condition to the host every tile; fixed at the table's tiles (tiles past a row's blocks
    # are exact no-ops), XLA knows it. At the full width both run the same tiles: the
    # difference is what the data-dependent count costs; below it, the fixed count's extra
    # tiles cost their launches and block 0's reads.
    static = _static_trips_step(model, args.attention_tile, width, t)
    cases = (("tiled", tiled), ("tiled, static trip count", static))
    for name, step in cases + (() if args.no_baseline else (("full width", before),)):
        for f in fractions:
            held = max(1, int(width * t * f))
            s = timed(step, (decode_rows(held),))
            out.setdefault("decode", {}).setdefault(name, {})[str(f)] = {
                "held_tokens": held, "step_ms": 1e3 * s}
            log(f"decode {name}: rows hold {held} tokens ({f:g} of the width): {1e3 * s:.2f} ms")

    best = max(out["prefill"].values(), key=lambda v: v["of_peak"])
    best_name = next(k for k, v in out["prefill"].items() if v is best)
    dec, fixed = out["decode"]["tiled"], out["decode"]["tiled, static trip count"]
    ratio = dec["0.25"]["step_ms"] / dec["1.0"]["step_ms"]
    out["summary"] = {"prefill_best": best_name, "prefill_of_peak": best["of_peak"],
                      "decode_quarter_over_full": ratio,
                      "prefill_ok": best["of_peak"] >= PREFILL_TARGET,
                      "decode_ok": ratio <= DECODE_TARGET}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    demo_shape = (f"packed [{budget_rows}, {chunk}]" if budget_rows
                  else f"{rows} segments [1, {chunk}]")
    first = out["prefill"][demo_shape]
    print(f"model: prefill {best['tflops']:.3g} TFLOP/s = {100 * best['of_peak']:.1f} % of the "
          f"measured peak {out['peak_tflops']:.3g} ({best_name}; the demo's {demo_shape}: "
          f"{100 * first['of_peak']:.1f} %; target >= {100 * PREFILL_TARGET:.0f} %: "
          f"{'MET' if out['summary']['prefill_ok'] else 'NOT MET'}); decode "
          f"{dec['0.25']['step_ms']:.2f} ms at a quarter width / {dec['1.0']['step_ms']:.2f} ms "
          f"full = {100 * ratio:.0f} % (target <= {100 * DECODE_TARGET:.0f} %: "
          f"{'MET' if out['summary']['decode_ok'] else 'NOT MET'}); the trip count fixed: "
          f"{fixed['1.0']['step_ms']:.2f} ms full, {fixed['0.125']['step_ms']:.2f} ms at an "
          f"eighth (data-dependent: {dec['0.125']['step_ms']:.2f} ms)"
          + ("" if args.no_baseline else
             f"; full-width attention (before): decode "
             f"{out['decode']['full width']['1.0']['step_ms']:.2f} ms, prefill "
             f"{100 * out['prefill'][f'{rows} segments [1, {chunk}], full width (before)']['of_peak']:.1f} %"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
