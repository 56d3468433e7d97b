"""`python -m jax_kvxfer demo`: multi-turn chat over an offloading KV cache, checked for exactness.

Runs the workload twice: with a small primary pool (blocks are evicted, offloaded to host,
onboarded back and partially reused) and with a primary pool that never evicts. The two runs
must produce the same tokens, and logits within float tolerance, at every step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from . import serving
from .block_manager import PoolExhaustedError
from .model import ModelConfig

PRESETS = {
    # A 2-core CPU finishes this in well under a minute, through every transfer path.
    "cpu": {"vocab": 1024, "layers": 4, "d_model": 256, "heads": 8, "kv_heads": 2,
            "head_dim": 32, "d_ff": 512, "conversations": 24, "turns": 4, "batch": 4,
            "system_tokens": 24, "user_tokens": 16, "gen_tokens": 12, "tokens_per_block": 8,
            "chunk": 8, "primary_blocks": 80, "secondary_blocks": 96},
    "h200": {"vocab": 8192, "layers": 8, "d_model": 1024, "heads": 16, "kv_heads": 4,
             "head_dim": 64, "d_ff": 2816, "conversations": 64, "turns": 4, "batch": 8,
             "system_tokens": 256, "user_tokens": 128, "gen_tokens": 32, "tokens_per_block": 16,
             "chunk": 64, "primary_blocks": 640, "secondary_blocks": 1024},
}
ATOL = RTOL = 1e-4


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit status 2, no usage dump, no traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int, maximum: int = 2**31 - 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}" if value < minimum
                                             else f"must be <= {maximum}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="jax-kvxfer demo", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="sizes to start from (h200: the GPU machine); options below override")
    sizes = [("vocab", 2, "vocabulary size"), ("layers", 1, "transformer layers"),
             ("d-model", 1, "model width"), ("heads", 1, "query heads"),
             ("kv-heads", 1, "KV heads (GQA)"), ("head-dim", 2, "head dimension (even)"),
             ("d-ff", 1, "MLP width"), ("conversations", 1, "conversations"),
             ("turns", 1, "turns per conversation"), ("batch", 1, "conversations per wave"),
             ("system-tokens", 0, "shared system prompt length"),
             ("user-tokens", 1, "longest user message (shortest: half)"),
             ("gen-tokens", 1, "tokens generated per turn"),
             ("tokens-per-block", 1, "tokens per KV block"),
             ("chunk", 1, "tokens per sequence per model step"),
             ("primary-blocks", 1, "device pool blocks of the offloading run"),
             ("secondary-blocks", 0, "pinned-host pool blocks of the offloading run")]
    for name, minimum, text in sizes:
        p.add_argument(f"--{name}", type=_int_at_least(minimum), default=None,
                       help=f"{text} (preset's value by default)")
    p.add_argument("--low-priority-every", type=_int_at_least(0), default=4,
                   help=f"every Nth conversation gets priority {serving.LOW_PRIORITY} (< 30: its "
                        "evicted blocks are dropped, not offloaded); 0: none")
    p.add_argument("--devices", type=_int_at_least(1), default=1,
                   help="tensor-parallel devices: the KV pools are split by KV heads over them")
    p.add_argument("--dma", choices=("auto", "true", "false"), default="auto",
                   help="how the transfer manager moves blocks: on the GPU's transfer lanes "
                        "with the copy engines, beside the model step (auto, true), or with the "
                        "copy kernel in line with it (false)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="weights and workload seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


class _Progress:
    """A plain-stderr progress bar (\\r-redrawn on a terminal, a few lines otherwise)."""

    def __init__(self, label: str, enabled: bool) -> None:
        self.label, self.enabled = label, enabled
        self.tty = sys.stderr.isatty()
        self.t0, self.last_quarter = time.perf_counter(), -1

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        frac = done / total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        line = (f"{self.label:<11} [{bar}] {done}/{total} waves "
                f"{time.perf_counter() - self.t0:5.1f} s")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
        elif int(frac * 4) != self.last_quarter:
            self.last_quarter = int(frac * 4)
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _summary(res: serving.RunResult, block_nbytes: int) -> dict:
    b, t = res.block_stats, res.transfer_stats
    return {
        "primary_blocks": res.primary_blocks, "secondary_blocks": res.secondary_blocks,
        "seconds": round(res.seconds, 4), "compile_seconds": round(res.compile_seconds, 4),
        "steps": res.steps, "computed_tokens": res.computed_tokens,
        "generated_tokens": res.generated_tokens,
        "tokens_per_second": round(res.computed_tokens / res.seconds, 1),
        "generated_tokens_per_second": round(res.generated_tokens / res.seconds, 1),
        "prefix_hit_rate": round(b.prefix_hit_rate, 4),
        "prompt_tokens": b.prompt_tokens, "reused_tokens": b.reused_tokens,
        "reused_blocks": b.reused_blocks, "onboarded_full_blocks": b.onboarded_blocks,
        "partial_copies_device": b.partial_copies, "partial_copies_host": b.partial_onboards,
        "offloaded_blocks": b.offloaded_blocks,
        "dropped_device_blocks": b.dropped_primary_blocks,
        "dropped_host_blocks": b.dropped_secondary_blocks,
        "transfer_seconds": round(b.transfer_seconds, 4),
        "exposed_transfer_seconds": round(res.exposed_transfer_seconds, 4),
        "transfers": dataclasses.asdict(t), "block_nbytes": block_nbytes,
    }


def _table(cfg: dict, model: ModelConfig, run: dict, ref: dict, verdict: dict) -> str:
    def mib(n: int) -> str:
        return f"{n / 2**20:.2f} MiB"

    def moved(s: dict, kind: str) -> str:
        return f"{s['transfers'][kind + '_blocks']} blk, {mib(s['transfers'][kind + '_bytes'])}"

    rows = [
        ("primary / secondary blocks", lambda s: f"{s['primary_blocks']} / {s['secondary_blocks']}"),
        ("tokens/s (computed tokens)", lambda s: f"{s['tokens_per_second']:,.0f}"),
        ("generated tokens/s", lambda s: f"{s['generated_tokens_per_second']:,.0f}"),
        ("computed / generated tokens", lambda s: f"{s['computed_tokens']} / {s['generated_tokens']}"),
        ("prefix-hit rate", lambda s: f"{100 * s['prefix_hit_rate']:.1f}%"),
        ("blocks reused in place", lambda s: str(s["reused_blocks"])),
        ("onboarded host->device", lambda s: moved(s, "onboarded")),
        ("  full blocks / partial", lambda s: f"{s['onboarded_full_blocks']} / "
                                             f"{s['partial_copies_host']}"),
        ("offloaded device->host", lambda s: moved(s, "offloaded")),
        ("copied on device (partial)", lambda s: moved(s, "copied")),
        ("dropped from host (LRU)", lambda s: str(s["dropped_host_blocks"])),
        ("dropped from device", lambda s: str(s["dropped_device_blocks"])),
        ("exposed transfer time", lambda s: f"{s['exposed_transfer_seconds']:.3f} s ("
                                            f"{100 * s['exposed_transfer_seconds'] / s['seconds']:.1f}%)"),
        ("run time (+ compile)", lambda s: f"{s['seconds']:.2f} s (+{s['compile_seconds']:.2f})"),
    ]
    title = (
        f"jax_kvxfer demo: {cfg['conversations']} conversations x {cfg['turns']} turns, batch "
        f"{cfg['batch']}; model {model.num_layers} layers, d={model.d_model}, "
        f"{model.num_heads}q/{model.num_kv_heads}kv heads ({model.num_params / 1e6:.2f}M params); "
        f"{cfg['tokens_per_block']}-token blocks of {run['block_nbytes'] / 1024:.0f} KiB; "
        f"{verdict['device']}")
    lines = [
        title,
        "",
        f"{'':<28}{'offloading run':>22}{'reference (no eviction)':>26}",
    ]
    lines += [f"{name:<28}{fmt(run):>22}{fmt(ref):>26}" for name, fmt in rows]
    paths = verdict["paths"]
    lines += ["", "paths exercised: " + ", ".join(
        f"{k.replace('_', ' ')} {'yes (' + str(v) + ')' if v else 'NO'}" for k, v in paths.items())]
    if not all(paths.values()):
        lines.append("  (smaller pools or more conversations/turns exercise every path)")
    lines.append(
        f"exactness: {'PASS' if verdict['exact'] else 'FAIL'} - {verdict['replies']} replies, "
        f"{verdict['tokens']} tokens {'identical' if verdict['exact'] else 'compared'}; "
        f"max |logit diff| {verdict['max_abs_logit_diff']:.3g} (tolerance {ATOL:g} + {RTOL:g}*|ref|)"
        + ("" if verdict["exact"] else f"; first differing reply #{verdict['first_bad_reply']}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0 when exact, 1 when not, 2 for bad options."""
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = dict(PRESETS[args.preset])
    for key in cfg:
        value = getattr(args, key)
        if value is not None:
            cfg[key] = value
    try:
        model = ModelConfig(vocab_size=cfg["vocab"], num_layers=cfg["layers"],
                            d_model=cfg["d_model"], num_heads=cfg["heads"],
                            num_kv_heads=cfg["kv_heads"], head_dim=cfg["head_dim"],
                            d_ff=cfg["d_ff"])
    except ValueError as e:
        parser.error(str(e).replace("num_kv_heads", "--kv-heads").replace("num_heads", "--heads")
                     .replace("head_dim", "--head-dim"))
    workload = serving.make_workload(
        vocab_size=model.vocab_size, conversations=cfg["conversations"], turns=cfg["turns"],
        system_tokens=cfg["system_tokens"], user_tokens=cfg["user_tokens"],
        gen_tokens=cfg["gen_tokens"], low_priority_every=args.low_priority_every, seed=args.seed)
    t = cfg["tokens_per_block"]
    wave_blocks = min(cfg["batch"], cfg["conversations"]) * math.ceil(workload.max_len / t)
    if cfg["primary_blocks"] < wave_blocks:
        parser.error(f"--primary-blocks {cfg['primary_blocks']} is too small: a wave of "
                     f"{min(cfg['batch'], cfg['conversations'])} conversations of up to "
                     f"{workload.max_len} tokens needs {wave_blocks} blocks")
    if args.dma == "true" and args.devices > 1:
        parser.error("--dma true takes one device (the copy engines' path does not take pools "
                     "split over devices); use --dma auto or false with --devices")
    if model.num_kv_heads % args.devices:
        parser.error(f"--devices {args.devices} must divide the {model.num_kv_heads} KV heads")
    return _run(args, cfg, model, workload)


def _run(args: argparse.Namespace, cfg: dict, model: ModelConfig,
         workload: serving.Workload) -> int:
    import jax
    import numpy as np

    from .model import TP_AXIS, init_params

    devices = jax.devices()
    if args.devices > len(devices):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
                if devices[0].platform == "cpu" else "")
        print(f"jax-kvxfer demo: error: --devices {args.devices}, but JAX sees {len(devices)} "
              f"device(s){hint}", file=sys.stderr)
        return 2
    mesh = (jax.sharding.Mesh(np.array(devices[:args.devices]), (TP_AXIS,))
            if args.devices > 1 else None)
    params = init_params(model, args.seed)
    common = {"batch": cfg["batch"], "chunk": cfg["chunk"],
              "tokens_per_block": cfg["tokens_per_block"], "mesh": mesh,
              "dma": {"auto": "auto", "true": True, "false": False}[args.dma]}
    try:
        res = serving.run(model, params, workload, primary_blocks=cfg["primary_blocks"],
                          secondary_blocks=cfg["secondary_blocks"],
                          progress=_Progress("offloading", not args.no_progress), **common)
        ref_blocks = max(cfg["primary_blocks"], serving.blocks_to_never_evict(
            workload, cfg["batch"], cfg["tokens_per_block"]))
        ref = serving.run(model, params, workload, primary_blocks=ref_blocks,
                          secondary_blocks=0, progress=_Progress("reference",
                                                                 not args.no_progress), **common)
    except (PoolExhaustedError, MemoryError) as e:
        print(f"jax-kvxfer demo: error: {e}", file=sys.stderr)
        return 2
    exact, max_diff, first_bad = serving.compare(res, ref, atol=ATOL, rtol=RTOL)
    block_nbytes = (model.num_layers * 2 * model.num_kv_heads * cfg["tokens_per_block"]
                    * model.head_dim * jax.numpy.dtype(model.dtype).itemsize)
    run_s, ref_s = _summary(res, block_nbytes), _summary(ref, block_nbytes)
    b = res.block_stats
    verdict = {
        "exact": exact, "max_abs_logit_diff": max_diff, "first_bad_reply": first_bad,
        "replies": len(ref.tokens), "tokens": ref.generated_tokens,
        "reference_evicted": ref.block_stats.offloaded_blocks
        + ref.block_stats.dropped_primary_blocks,
        "device": str(jax.devices()[0].device_kind), "devices": args.devices,
        "paths": {"offload": b.offloaded_blocks, "full_onboard": b.onboarded_blocks,
                  "partial_reuse": b.partial_copies + b.partial_onboards,
                  "partial_from_host": b.partial_onboards,
                  "host_eviction": b.dropped_secondary_blocks},
    }
    if args.json:
        print(json.dumps({"config": {**cfg, "preset": args.preset, "seed": args.seed,
                                     "low_priority_every": args.low_priority_every},
                          "run": run_s, "reference": ref_s, **verdict}, indent=1))
    else:
        print(_table(cfg, model, run_s, ref_s, verdict))
    return 0 if exact else 1
