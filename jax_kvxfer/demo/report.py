"""The demo's report: each run's summary and exactness against never_evict, the verdict, and
what is printed of them: the table of the runs side by side and the lines under it (the paths
exercised, the tiers, the replicas, exactness), the closing lines (offload against drop and
never_evict as ratios "N× lower/higher", or the statement that two runs did the same work and
their difference is noise), --json's object, the plots, and the load sweep's table and plot.
Its lines of prose and tables are within WIDTH characters."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import textwrap
import time
from collections.abc import Callable

import jax

from . import replicas as replica_runs
from . import serving, store_servers
from .model import RECORD_TOP_K, ModelConfig
from .sizes import (
    ALONE,
    CHAT_TEXT,
    DISK,
    JOINED,
    JOINED_ALONE,
    PREFIX_ROUTED,
    REPLICA_RUNS,
    RESTARTED,
    ROUTED_ALONE,
    ROUTED_SHARED,
    RUNS,
    SHARED,
    size_text,
    store_namespace,
)

WIDTH = 120  # the longest line the demo prints (but an error's one line, and --json)
SWEEP_RUNS = ("offload", "drop", "never_evict")  # the runs served at each rate of a sweep
# Logits of offload and drop against never_evict: |a - b| <= tol + tol * |b|, per dtype
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
# The runs whose exactness against never_evict the exit status requires (those that ran).
MUST_BE_EXACT = ("offload", DISK, RESTARTED, SHARED, ROUTED_SHARED, JOINED)


def wrap(text: str, indent: str = "  ") -> list[str]:
    """A line of prose as lines of at most WIDTH characters, the later ones indented."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) or [""]


def title_lines(title: str) -> list[str]:
    """A title of parts apart by "; " (what is served; the model, the device): on one line
    where it fits, else what is served first and the rest below it, indented."""
    if len(title) <= WIDTH or "; " not in title:
        return wrap(title)
    served, _, rest = title.partition("; ")
    return [*wrap(served), *wrap("  " + rest, "    ")]


def column_groups(first: int, widths: list[int], gap: int = 3) -> list[list[int]]:
    """The columns (their indices) in groups, each printed beside the first column (`first`
    wide) within WIDTH: as many in each group as fit, in order, at least one."""
    groups: list[list[int]] = []
    used = WIDTH + 1
    for i, w in enumerate(widths):
        if used + gap + w > WIDTH:
            groups.append([])
            used = first
        groups[-1].append(i)
        used += gap + w
    return groups


def grid(header: list[str], rows: list[list[str]], gap: int = 3) -> list[str]:
    """Rows of cells in columns as wide as their widest cell (header included), at least
    `gap` spaces apart: the first column left-aligned, the others right-aligned. Columns that
    do not fit WIDTH go to another block below, after a blank line, beside the first column
    again."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines: list[str] = []
    for group in column_groups(widths[0], widths[1:], gap):
        if lines:
            lines.append("")
        for cells in [header, *rows]:
            lines.append(f"{cells[0]:<{widths[0]}}" + "".join(
                f"{' ' * gap}{cells[1 + i]:>{widths[1 + i]}}" for i in group))
    return lines


def _transcript(tokenizer, res: serving.RunResult, conversations: int, shown: int = 2) -> str:
    """The first conversations' turns as text."""
    lines = []
    for c in range(min(shown, conversations)):
        lines.append(f"-- conversation {c}")
        texts = CHAT_TEXT[c % len(CHAT_TEXT)]
        for t in range(len([k for k in res.turns if k[0] == c])):
            lines += wrap(f"user: {texts[t % len(texts)]}")
            lines += wrap(f"assistant: {tokenizer.decode(res.turns[(c, t)].tokens).strip()}")
    return "\n".join(lines) + "\n"


def _ttft_p50(res: serving.RunResult, keys=None) -> float | None:
    """TTFT p50 over the turns `keys` of the run (all: None); None when it has none."""
    import numpy as np

    ttft = [r.first_token_s - r.arrival_s for k, r in res.turns.items()
            if keys is None or k in keys]
    return float(np.percentile(ttft, 50)) if ttft else None


def shown(name: str, res: serving.RunResult) -> serving.RunResult:
    """What the table shows of a run: of a scale-out run (replica A, then B), replica B's
    own requests (its exactness covers A's turns and B's)."""
    return res.replicas[-1] if name in (JOINED, JOINED_ALONE) else res


def _moved(cfg: dict, results: dict) -> set[tuple[int, int]]:
    """The turns that moved replica: with --scale-out, replica B's (their prefixes were A's),
    else `moved_turns`."""
    if cfg.get("scale_out"):
        return set(results[JOINED].moved) if JOINED in results else set()
    return moved_turns(cfg, next(iter(results.values())).turns) if results else set()


def moved_turns(cfg: dict, turns) -> set[tuple[int, int]]:
    """With --replicas, the turns (of `turns`) whose previous turn round robin sends to
    another replica (the same turns in every run but the prefix-routed ones, whoever serves
    them)."""
    n = cfg.get("replicas")
    if not n:
        return set()
    route = replica_runs.route
    return {(c, t) for c, t in turns if t > 0 and route(c, t, n) != route(c, t - 1, n)}


def _turn_figures(res: serving.RunResult, moved: set) -> dict:
    """TTFT p50 of the turns with host hits (the host tier's), and of those that moved
    replica (--replicas)."""
    host = {k for k, r in res.turns.items() if r.host_hit_tokens > 0}
    out = {"ttft_p50_host_hit_turns_s": _ttft_p50(res, host)}
    if moved:
        out["ttft_p50_moved_turns_s"] = _ttft_p50(res, moved)
        out["moved_turns_computed_prefill_tokens"] = sum(
            r.computed_prompt_tokens for k, r in res.turns.items() if k in moved)
    return out


def _declined(replica: dict) -> str:
    n = replica["store_declined_blocks"]
    return f", {n:,} not written: their reads would lose" if n else ""


def _replica_summary(i: int, res: serving.RunResult, moved: set) -> dict:
    m = res.metrics()
    return {"replica": i, "turns": len(res.turns),
            "moved_turns": sum(k in moved for k in res.turns),
            **{k: m[k] for k in ("computed_prefill_tokens", "gpu_hit_tokens", "host_hit_tokens",
                                 "store_hit_tokens")},
            "store_hit_blocks": res.block_stats.store_hit_blocks,
            "store_declined_blocks": res.block_stats.store_declined_blocks,
            "moved_turns_store_hit_tokens": sum(r.store_hit_tokens for k, r in res.turns.items()
                                                if k in moved),
            "store": m["store"], "ttft_p50_s": _ttft_p50(res), **_turn_figures(res, moved),
            # where its host time goes, per router tick (the tick itself is the router's)
            "step_ms": {k: v for k, v in m["step_ms"].items() if k != "step"}}


def summary(res: serving.RunResult, moved: set = frozenset()) -> dict:
    """A run as the report shows it (the table's values, --json's "runs"): its pools, metrics,
    block manager's and transfers' counts; `moved`: the turns that moved replica."""
    b = res.block_stats
    extra = {}
    if moved:
        extra = _turn_figures(res, moved)
    if res.replicas is not None:
        extra["replicas"] = [_replica_summary(i, r, moved) for i, r in enumerate(res.replicas)]
    metrics = res.metrics()
    if jax.devices()[0].platform == "cpu":  # what a CPU's prefill rate says: nothing
        metrics["full_prefill_tflop_per_s"] = None
    return {
        "primary_blocks": res.primary_blocks, "secondary_blocks": res.secondary_blocks,
        **metrics, "compile_seconds": round(res.compile_seconds, 4),
        "admission": res.admission, "offloads_declined": res.offloads_declined,
        "prefix_hit_rate": round(b.prefix_hit_rate, 4),
        "offloaded_blocks": b.offloaded_blocks, "onboarded_full_blocks": b.onboarded_blocks,
        "partial_copies_device": b.partial_copies, "partial_copies_host": b.partial_onboards,
        "dropped_device_blocks": b.dropped_primary_blocks,
        "dropped_host_blocks": b.dropped_secondary_blocks,
        "store_hit_blocks": b.store_hit_blocks, "store_skipped_blocks": b.store_skipped_blocks,
        "store_declined_blocks": b.store_declined_blocks,
        "transfers": dataclasses.asdict(res.transfer_stats), **extra,
    }


def _paths(offload: dict) -> dict:
    """The transfer paths the offload run exercised (from its summary): how often each."""
    return {"offload": offload["offloaded_blocks"],
            "full_onboard": offload["onboarded_full_blocks"],
            "partial_reuse": offload["partial_copies_device"] + offload["partial_copies_host"],
            "partial_from_host": offload["partial_copies_host"],
            "host_eviction": offload["dropped_host_blocks"]}


def exactness(model: ModelConfig, results: dict) -> dict:
    """Each run against never_evict (which must be in `results`), by `serving.compare`: exact
    within the dtype's tolerance, the largest difference of the top logits (of the tokens whose
    logits' bits differ; inf: another token among the largest), the first differing turn, and
    the reply tokens whose logits' bits differ."""
    ref = results["never_evict"]
    return {name: _compared(model, results[name], ref)
            for name in RUNS if name in results and name != "never_evict"}


def _compared(model: ModelConfig, run, ref) -> dict:
    """`serving.compare(run, ref)` at the dtype's tolerance, as the report's dict."""
    tol = TOLERANCE.get(model.dtype, TOLERANCE["float32"])
    c = serving.compare(run, ref, atol=tol, rtol=tol)
    return {"exact": c.exact, "max_abs_logit_diff": c.max_diff, "first_bad_turn": c.first_bad,
            "rows_bits_differ": c.rows_bits_differ,
            "recomputed_turns_differ": c.recomputed_turns_differ}


def repeat_figures(cfg: dict, model: ModelConfig, results: dict) -> tuple[dict, dict]:
    """A later repeat (--repeat) as what the report needs of it: its runs' summaries and their
    exactness; the replies' records are left behind."""
    moved = moved_turns(cfg, next(iter(results.values())).turns)
    return ({name: summary(res, res.moved if name in PREFIX_ROUTED else moved)
             for name, res in results.items()}, exactness(model, results))


def _merged(compared: dict, later: list[tuple[dict, dict]]) -> dict:
    """Exactness over every repeat: exact in all, the largest difference, the first repeat's
    first differing turn."""
    merged = {}
    for name, first in compared.items():
        each = [first, *(c[name] for _, c in later if name in c)]
        bad = [c["first_bad_turn"] for c in each if not c["exact"]]
        merged[name] = {"exact": not bad, "first_bad_turn": bad[0] if bad else None,
                        "max_abs_logit_diff": max(c["max_abs_logit_diff"] for c in each),
                        "rows_bits_differ": max(c.get("rows_bits_differ", 0) for c in each),
                        "recomputed_turns_differ": max(c.get("recomputed_turns_differ", 0)
                                                       for c in each)}
    return merged


def print_runs(args: argparse.Namespace, cfg: dict, model: ModelConfig, results: dict, real,
               failed: str | None = None, later: list[tuple[dict, dict]] = ()) -> bool | None:
    """Prints the runs in `results` (a table, or --json's object); returns whether offload and
    the disk runs are exact, None when never_evict (the reference) did not finish (`failed`
    says why). `later`: --repeat's later repeats (`repeat_figures`), whose exactness counts
    too and whose ratios the closing lines take."""
    moved = _moved(cfg, results)  # (a prefix-routed run's own: where its router sent them)
    runs = {name: summary(shown(name, res), res.moved if name in PREFIX_ROUTED else moved)
            for name, res in results.items()}
    verdict = {"exact": None, "device": str(jax.devices()[0].device_kind),
               "devices": args.devices,
               "paths": _paths(runs["offload"]) if "offload" in runs else {}}
    if cfg.get("replicas"):
        verdict["replicas"] = _replica_verdict(cfg, runs)
        if cfg.get("scale_out"):
            verdict["replicas"].update(_scale_out_verdict(cfg, results, args.workload))
    if failed is not None:
        verdict["failed"] = failed
    if args.disk is not None:
        verdict["disk"] = {"path": args.disk, "capacity_bytes": int(cfg["disk_gb"] * 2**30),
                           "host_blocks": cfg["disk_host_blocks"],
                           "namespace": store_namespace(model, cfg, preset=args.preset,
                                                        seed=args.seed, real=real is not None)}
    compared = {}
    if later:
        verdict["repeats"] = 1 + len(later)
    if "never_evict" in results:
        ref = results["never_evict"]
        tol = TOLERANCE.get(model.dtype, TOLERANCE["float32"])
        compared = _merged(exactness(model, results), later)
        verdict.update({
            # The library's claim: restored blocks are the very blocks, from the host or the
            # disk. Recomputation (drop) matches too in float32, but bfloat16 kernels round a
            # token's K/V differently in a prefill chunk than in the decode that first made
            # them: reported, not required.
            "exact": all(compared[r]["exact"] for r in MUST_BE_EXACT if r in compared),
            "runs": compared,
            "turns": len(ref.turns), "tokens": sum(len(r.tokens) for r in ref.turns.values()),
            "reference_evicted": ref.block_stats.offloaded_blocks
            + ref.block_stats.dropped_primary_blocks,
            "tolerance": tol, **_prefill_rate(model, results)})
    verdict["closing"] = closing(runs, compared, [runs, *(r for r, _ in later)])
    if args.json:
        config = {**cfg, "preset": args.preset, "seed": args.seed, "trace": args.trace,
                  "disk": args.disk, "workload": args.workload, "admission": args.admission,
                  "repeat": args.repeat}
        if "replicas" in verdict:  # a URL's password not shown
            config["store"] = verdict["replicas"]["store"]
        print(json.dumps({"config": config,
                          "runs": runs, **{k: v for k, v in verdict.items() if k != "runs"},
                          **({"exactness": compared} if compared else {})}, indent=1))
        return verdict["exact"]
    source = _source(args, cfg)
    title = (f"jax_kvxfer demo: {source}, {len(results['offload'].turns)} requests, "
             f"batch {cfg['batch']}; "
             f"model {model.num_layers} layers, d={model.d_model}, {model.num_heads}q/"
             f"{model.num_kv_heads}kv heads ({model.num_params / 1e6:.2f}M params); "
             f"{cfg['tokens_per_block']}-token blocks; {verdict['device']}")
    if real is not None:
        print(_transcript(real[1], results["offload"], cfg["conversations"]))
    print(table(title, runs, verdict))
    return verdict["exact"]


def _source(args: argparse.Namespace, cfg: dict) -> str:
    if args.trace:
        return f"trace {args.trace}"
    if args.workload == "docqa":
        low, high = cfg["doc_tokens"]
        return (f"docqa: {cfg['conversations']} documents of {low:,}-{high:,} tokens × "
                f"{cfg['turns']} questions")
    kind = {"lowreuse": "low reuse: ", "bursts": f"bursts of {cfg.get('burst', 1)}: "}
    return (f"{kind.get(args.workload, '')}{cfg['conversations']} chats × {cfg['turns']} turns")


def table(title: str, runs: dict, verdict: dict) -> str:
    """The runs in `runs` side by side, each column as wide as its widest value; the paths,
    the disk tier, the GPU's peak and exactness where known."""
    rows = _table_rows(runs, verdict)
    names = [r for r in RUNS if r in runs]
    lines = [*title_lines(title), ""]
    lines += grid(["", *names], [[label, *(fmt(runs[r]) for r in names)] for label, fmt in rows])
    prose = _table_prose(runs, verdict)
    lines += [""] + [line for text in prose for line in wrap(text, " " * (
        len(text) - len(text.lstrip()) + 2))]
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{1e3 * x:,.1f} ms"


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _opt_ms(x: float | None) -> str:
    return "-" if x is None else _ms(x)


def _store_rows(tier: str) -> list[tuple[str, Callable[[dict], str]]]:
    """The rows of the tier below the host (a disk or a shared store), for runs that have one."""
    def store(fmt):
        return lambda s: "-" if s["store"] is None else fmt(s["store"])

    def decisions(s: dict) -> str:  # the read-or-recompute rule's: reads that would lose
        if s["store"] is None:
            return "-"
        return f"{s['store_skipped_blocks']:,} / {s['store_declined_blocks']:,}"

    return [
        (f"{tier} read / written", store(lambda d: f"{_mib(d['read_bytes'])} / "
                                                   f"{_mib(d['written_bytes'])}")),
        (f"{tier} blocks hit / corrupt", store(lambda d: f"{d['hits']:,} / {d['corrupt']:,}")),
        (f"{tier} blocks recomputed / not written", decisions),
        (f"{tier} writes dropped / evicted", store(lambda d: f"{d['dropped_writes']:,} / "
                                                            f"{d['evicted']:,}")),
        (f"{tier} flush at the end", store(lambda d: f"{d['close_seconds']:.3f} s")),
    ]


def _table_rows(runs: dict, verdict: dict) -> list[tuple[str, Callable[[dict], str]]]:
    """The table's rows: a label and how to show it for a run's summary."""
    disk = any(s["store"] is not None for s in runs.values())
    # the tier below the host: a disk (--disk), a store the replicas share (--replicas), or both
    tier = ("disk / store" if "disk" in verdict and "replicas" in verdict
            else "store" if "replicas" in verdict else "disk")

    def hits(s: dict) -> str:
        tiers = f"{s['gpu_hit_tokens']:,} / {s['host_hit_tokens']:,}"
        if not disk:
            return tiers
        return tiers + (" / -" if s["store"] is None else f" / {s['store_hit_tokens']:,}")

    rows = [
        ("primary / secondary blocks",
         lambda s: f"{s['primary_blocks']} / {s['secondary_blocks']}"),
        ("TTFT p50 / p90", lambda s: f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p90'])}"),
        ("TTFT p99", lambda s: _ms(s["ttft_s"]["p99"])),
        ("queue wait p50 / p90", lambda s: f"{_ms(s['queue_wait_s']['p50'])} / "
                                           f"{_ms(s['queue_wait_s']['p90'])}"),
        ("TPOT p50", lambda s: _ms(s["tpot_s"]["p50"])),
        ("output tokens/s", lambda s: f"{s['output_tokens_per_s']:,.0f}"),
        ("prefill tokens computed", lambda s: f"{s['computed_prefill_tokens']:,}"),
        (f"tokens from GPU / host / {tier} hits" if disk else "tokens from GPU / host hits",
         hits),
        ("onboarded / offloaded", lambda s: f"{_mib(s['onboarded_bytes'])} / "
                                            f"{_mib(s['offloaded_bytes'])}"),
    ]
    if disk:
        rows += _store_rows(tier)
    if "replicas" in verdict:
        rows += [
            ("TTFT p50, turns with host hits",
             lambda s: _opt_ms(s.get("ttft_p50_host_hit_turns_s"))),
            ("TTFT p50, turns that moved replica",
             lambda s: _opt_ms(s.get("ttft_p50_moved_turns_s"))),
        ]
    def moved_any(s: dict) -> bool:
        return bool(s["onboarded_bytes"] or s["offloaded_bytes"] or s["store"])

    rows += [
        ("prefix hit rate", lambda s: f"{100 * s['prefix_hit_rate']:.1f}%"),
        ("exposed transfer time", lambda s: (
            f"{s['exposed_transfer_s']:.3f} s "
            f"({100 * s['exposed_transfer_s'] / max(s['seconds'], 1e-12):.1f}%)"
            if moved_any(s) else "-")),
    ]
    if all(s.get("step_ms") for s in runs.values()):  # where a step's time goes (STEP_PHASES)
        def phases(*names: str):
            return lambda s: " / ".join(f"{s['step_ms'][n]:.2f}" for n in names) + " ms"
        rows += [
            ("mean step", phases("step")),
            ("  block manager / transfers", phases("block manager", "transfers")),
            ("  model dispatch / wait", phases("model dispatch", "model wait")),
        ]
    if any(s["offloads_declined"] for s in runs.values()):
        rows.append(("offloads declined (admission)", lambda s: (
            f"{s['offloads_declined']:,} ({s['admission']})" if s["secondary_blocks"] else "-")))
    if any(s["full_prefill_tflop_per_s"] is not None for s in runs.values()):
        rows.append(("prefill rate (full-prefill steps)", lambda s: (
            "-" if s["full_prefill_tflop_per_s"] is None
            else f"{s['full_prefill_tflop_per_s']:,.1f} TFLOP/s")))
    rows += [
        ("run time (+ compile)", lambda s: f"{s['seconds']:.2f} s (+{s['compile_seconds']:.1f})"),
        ("compiles during the run", lambda s: (
            f"{s['compiles_during_run']} ({s['compile_seconds_during_run']:.2f} s)")),
    ]
    return rows


def _table_prose(runs: dict, verdict: dict) -> list[str]:
    """The lines under the table: paths, tiers, exactness, the closing lines."""
    paths = verdict["paths"] or {"offload": 0}  # (offload did not run)
    prose = ["paths exercised (offload run): " + ", ".join(
        f"{k.replace('_', ' ')} {'yes (' + str(v) + ')' if v else 'NO'}" for k, v in paths.items())]
    if not all(paths.values()):
        prose.append("  (smaller pools or more conversations/turns exercise every path)")
    if "disk" in verdict:
        d = verdict["disk"]
        prose.append(f"disk tier: a FileStore in a fresh subdirectory of {d['path']} (removed at "
                     f"the end), capacity {size_text(d['capacity_bytes'])}, below a host pool of "
                     f"{d['host_blocks']} blocks"
                     + ("; restarted: a new block manager and FileStore over the same files"
                        if RESTARTED in runs else ""))
    if "replicas" in verdict:
        prose += replica_lines(runs, verdict["replicas"])
    if verdict.get("prefill_fraction_of_matmul") is not None:
        prose.append(f"prefill reaches {100 * verdict['prefill_fraction_of_matmul']:.0f} % of a "
                     f"{verdict['matmul']['dtype']} matmul measured in this run "
                     f"({verdict['matmul']['tflop_per_s']:.3g} TFLOP/s; never_evict's "
                     "full-prefill steps)")
    if verdict.get("repeats"):
        prose.append(f"the table shows the first of {verdict['repeats']} repeats; exactness "
                     "and the ratios below are over all of them")
    if "failed" in verdict:
        prose.append(f"{verdict['failed']}; exactness not checked (never_evict is the reference)")
    if verdict.get("runs"):
        tol = verdict["tolerance"]
        prose.append(f"exactness: each run against never_evict's tokens, every logit's bits by "
                     f"fingerprint, and where the bits differ the {RECORD_TOP_K} largest logits "
                     f"(by token id) within {tol:g} + {tol:g} × |ref|")
    for name, v in verdict.get("runs", {}).items():
        differ, excused = v.get("rows_bits_differ", 0), v.get("recomputed_turns_differ", 0)
        prose.append(
            f"exactness {name} vs never_evict: {'PASS' if v['exact'] else 'FAIL'} - "
            f"{verdict['turns']} turns, {verdict['tokens']} tokens "
            f"{'identical' if v['exact'] and not excused else 'compared'}; "
            + (f"{excused} turns differ where they or an earlier turn of their chat recomputed "
               "what never_evict reused, as a recompute rounding apart does (top logits within "
               f"{serving.RECOMPUTE_TOLERANCE:g} + {serving.RECOMPUTE_TOLERANCE:g} × |ref|); "
               "the others: " if excused else "")
            + ("every logit's bits identical" if not differ else
               f"logits' bits differ in {differ} of them, "
               + (f"top-K differ (another token among the {RECORD_TOP_K} largest)"
                  if math.isinf(v["max_abs_logit_diff"])
                  else f"max |top-{RECORD_TOP_K} logit diff| {v['max_abs_logit_diff']:.3g}"))
            + ("" if v["exact"] else f"; first differing turn {v['first_bad_turn']}"))
    prose += verdict.get("closing", {}).get("lines", [])
    return prose


def _times(ratio: float | None, above: str, below: str) -> str:
    """A ratio as "N× above" (ratio >= 1) or "N× below" (N = 1 / ratio): N is never under 1.
    "the same" where it rounds to 1.00 either way."""
    if ratio is None:
        return "n/a"
    factor = ratio if ratio >= 1 else 1 / ratio
    if f"{factor:.2f}" == "1.00":
        return "the same"
    return f"{factor:.2f}× {above if ratio >= 1 else below}"


def _apart(ratio: float | None) -> str:
    """How far apart two figures whose ratio this is are, whichever is larger: "N×"."""
    return "n/a" if not ratio else f"{max(ratio, 1 / ratio):.2f}×"


def _spread(ratios: list, above: str, below: str) -> str:
    """One ratio as `_times` writes it; several (one per repeat) as their median, then their
    least and greatest (min–max): "1.54× lower (1.20–1.80× lower)", or "(1.06× higher to 1.80×
    lower)" where the repeats fall on both sides of 1."""
    if None in ratios:
        return "n/a"
    median = _times(statistics.median(ratios), above, below)
    if len(ratios) == 1:
        return median
    low, high = min(ratios), max(ratios)
    if low >= 1 or high < 1:  # all on one side of 1: the factors in increasing order
        a, b = sorted(r if r >= 1 else 1 / r for r in (low, high))
        if f"{a:.2f}" == f"{b:.2f}":
            return f"{median} (in every repeat)"
        return f"{median} ({a:.2f}–{b:.2f}× {above if low >= 1 else below})"
    return f"{median} ({_times(low, above, below)} to {_times(high, above, below)})"


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def same_work(a: dict, b: dict) -> bool:
    """Whether two runs (summaries) did the same work: the same prefill tokens computed, and
    neither read a block back from the host or a store. What then differs between their times
    is the machine's noise, not the cache."""
    return (a["computed_prefill_tokens"] == b["computed_prefill_tokens"]
            and not any(r["host_hit_tokens"] or r.get("store_hit_tokens") for r in (a, b)))


def _versus(ref: str, other: str, repeats: list[dict]) -> tuple[dict, str] | None:
    """Run `ref` against run `other` over the repeats (None where a repeat lacks one): TTFT
    p50 (other's over ref's: above 1, ref's is lower), output tokens/s (ref's over other's),
    prefill tokens computed (other's over ref's: the work saved, which unlike the times does
    not vary from run to run); figures and a line."""
    pairs = [(r[ref], r[other]) for r in repeats if ref in r and other in r]
    if not pairs or len(pairs) < len(repeats):
        return None
    ttft = [_ratio(o["ttft_s"]["p50"], a["ttft_s"]["p50"]) for a, o in pairs]
    rate = [_ratio(a["output_tokens_per_s"], o["output_tokens_per_s"]) for a, o in pairs]
    prefill = [_ratio(o["computed_prefill_tokens"], a["computed_prefill_tokens"])
               for a, o in pairs]
    same = all(same_work(a, o) for a, o in pairs)
    figures = {"same_work": same}
    for key, values in (("ttft_p50_ratio", ttft), ("output_tokens_per_s_ratio", rate),
                        ("computed_prefill_ratio", prefill)):
        known = None not in values
        figures[key] = statistics.median(values) if known else None
        if len(pairs) > 1:
            figures[f"{key}_min"] = min(values) if known else None
            figures[f"{key}_max"] = max(values) if known else None
            figures[f"{key}s"] = values
    head = f"{ref} vs {other}" + (f" (median of {len(pairs)} repeats, min–max)"
                                  if len(pairs) > 1 else "")
    if same:
        tokens = pairs[0][0]["computed_prefill_tokens"]
        return figures, (f"{head}: the same work ({tokens:,} prefill tokens computed by each, "
                         f"no host hits), so the difference in their times is noise (TTFT p50 "
                         f"{_apart(figures['ttft_p50_ratio'])} and output tokens/s "
                         f"{_apart(figures['output_tokens_per_s_ratio'])} apart)")
    return figures, (f"{head}: TTFT p50 {_spread(ttft, 'lower', 'higher')}, output tokens/s "
                     f"{_spread(rate, 'higher', 'lower')}, "
                     + ("the same prefill computed" if all(p == 1 for p in prefill) else
                        f"prefill computed {_spread(prefill, 'less', 'more')}"))


def closing(runs: dict, compared: dict, repeats: list[dict] | None = None) -> dict:
    """offload against drop and never_evict, in lines and in figures (`_versus`); with
    --replicas, the replica run to beat (prefix-routed+store, else replicas+store) against the
    other replica runs alike; and whether offload is exact (else its first differing turn).

    `repeats`: with --repeat N, each repeat's runs (the first is `runs`): each ratio is then
    their median, with its least and greatest. Two runs that did the same work (`same_work`)
    get no ratio but the statement that their difference is noise. A single run says how far
    apart identical runs are on this machine: drop and never_evict, where they did the same
    work, else that one run cannot tell (and how to find out)."""
    repeats = repeats or [runs]
    out: dict = {"repeats": len(repeats)}
    lines = []
    best = ROUTED_SHARED if ROUTED_SHARED in runs else SHARED
    pairs = [("offload", "drop"), ("offload", "never_evict"),
             *((best, other) for other in (SHARED, ALONE, ROUTED_ALONE)
               if best in runs and other != best)]
    for ref, other in pairs:
        versus = _versus(ref, other, repeats)
        if versus is not None:
            key = f"vs_{other}" if ref == "offload" else f"{ref} vs {other}"
            out[key], line = versus
            lines.append(line)
    if len(repeats) == 1 and "drop" in runs and "never_evict" in runs:
        drop, never = runs["drop"], runs["never_evict"]
        measured = same_work(drop, never)
        out["spread"] = {"measured": measured}
        if measured:
            ttft = _ratio(never["ttft_s"]["p50"], drop["ttft_s"]["p50"])
            rate = _ratio(drop["output_tokens_per_s"], never["output_tokens_per_s"])
            out["spread"].update(ttft_p50_ratio=ttft, output_tokens_per_s_ratio=rate)
            lines.append(f"spread between identical runs on this machine: drop and never_evict "
                         f"did the same work ({drop['computed_prefill_tokens']:,} prefill "
                         f"tokens computed by each, no host hits), yet their TTFT p50 are "
                         f"{_apart(ttft)} and their output tokens/s {_apart(rate)} apart: a "
                         "ratio within that is noise")
        else:
            lines.append("spread between identical runs on this machine: not measured (drop "
                         "and never_evict did different work), so one run cannot tell a "
                         "ratio from noise: --repeat 3 gives each ratio with its spread")
    c = compared.get("offload")
    if c is not None:
        out["exact"], out["first_bad_turn"] = c["exact"], c["first_bad_turn"]
        lines.append("offload is exact against never_evict" if c["exact"] else
                     f"offload is not exact against never_evict: first differing turn "
                     f"{c['first_bad_turn']}")
    if JOINED in runs and JOINED_ALONE in runs:
        out["scale_out"], line = _scale_out_closing(runs[JOINED], runs[JOINED_ALONE])
        lines.append(line)
    out["lines"] = lines
    return out


def _scale_out_closing(joined: dict, alone: dict) -> tuple[dict, str]:
    """--scale-out's closing figures and line: replica B with the store against B without
    (TTFT p50 and p90: without's over with's, above 1 lower with the store; output tokens/s:
    with's over without's; prefill computed: without's over with's)."""
    figures = {
        "ttft_p50_ratio": _ratio(alone["ttft_s"]["p50"], joined["ttft_s"]["p50"]),
        "ttft_p90_ratio": _ratio(alone["ttft_s"]["p90"], joined["ttft_s"]["p90"]),
        "output_tokens_per_s_ratio": _ratio(joined["output_tokens_per_s"],
                                            alone["output_tokens_per_s"]),
        "computed_prefill_ratio": _ratio(alone["computed_prefill_tokens"],
                                         joined["computed_prefill_tokens"])}
    p50 = _times(figures["ttft_p50_ratio"], "lower", "higher")
    return figures, (
        "replica B with the store: TTFT p50 "
        + ("the same as without" if p50 == "the same" else f"{p50} than without")
        + f" (p90 {_times(figures['ttft_p90_ratio'], 'lower', 'higher')}), output tokens/s "
        f"{_times(figures['output_tokens_per_s_ratio'], 'higher', 'lower')}, prefill computed "
        f"{_times(figures['computed_prefill_ratio'], 'less', 'more')}")


def _scale_out_verdict(cfg: dict, results: dict, workload: str) -> dict:
    """--scale-out: how the workload was split, and replica A's figures (B's are the table's)."""
    n = cfg["replicas"]
    if workload == "docqa":
        unit = ("every question on each document but the last",
                "the last question on each document")
    else:
        unit = ("every turn of each chat but its last", "the last turn of each chat")
    spread = f" over {n - 1} processes, as --replicas {n - 1} routes" if n > 2 else ""
    out = {"route": (f"replica A: {unit[0]}{spread}; then replica B, a new process: "
                     f"{unit[1]}"),
           "scale_out": {"replicas_a": n - 1, "a_serves": unit[0], "b_serves": unit[1]}}
    if JOINED in results:
        first, follow = results[JOINED].replicas
        a = summary(first)
        out["scale_out"].update(
            a_requests=len(first.turns), b_requests=len(follow.turns),
            a={k: a[k] for k in ("ttft_s", "computed_prefill_tokens", "store_hit_tokens",
                                 "store")})
    return out


def _scale_out_lines(runs: dict, v: dict) -> list[str]:
    """--scale-out under the table: the split, the store, replica A's figures."""
    s, k = v["scale_out"], v["scale_out"]["replicas_a"]
    who = f"{k} processes, routed as --replicas {k} routes" if k > 1 else "1 process"
    lines = [(f"scale-out: replica A ({who}) served "
              f"{s['a_serves']} ({s.get('a_requests', '-')} requests), writing to "
              f"{v['store_described'] or v['store']}; then replica B, a new process with "
              f"empty pools, served {s['b_serves']} ({s.get('b_requests', '-')} requests): "
              f"{JOINED} reading what A wrote, {JOINED_ALONE} without a store (recomputing)")]
    if "a" in s:
        a, store = s["a"], s["a"]["store"] or {}
        lines.append(f"  replica A: prefill computed {a['computed_prefill_tokens']:,}, "
                     f"{store.get('written', 0):,} blocks written to the store "
                     f"({_mib(store.get('written_bytes', 0))}), TTFT p50 "
                     f"{_ms(a['ttft_s']['p50'])}")
    computed = [runs.get(name, {}).get("moved_turns_computed_prefill_tokens")
                for name in (JOINED, "never_evict")]
    if None not in computed:  # the difference: what the cost rule recomputed rather than read
        lines.append(f"  prompt tokens computed for B's requests: {computed[0]:,} by {JOINED}, "
                     f"{computed[1]:,} by never_evict")
    lines.append(f"  the {JOINED} and {JOINED_ALONE} columns: B's requests alone; their "
                 "exactness lines: A's turns and B's")
    return lines


def replica_lines(runs: dict, v: dict) -> list[str]:
    """--replicas under the table: the routing and the store, each replica's figures, and the
    two comparisons (--scale-out: `_scale_out_lines`)."""
    if "scale_out" in v:
        return _scale_out_lines(runs, v)

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{1e3 * x:,.1f} ms"

    n = v["replicas"]
    lines = [(f"replicas: {n} serving process{'es' if n > 1 else ''}; {v['route']}; the "
              f"+store runs share {v['store_described'] or v['store']}, the others have no "
              "store")]
    width = max(len(name) for name in REPLICA_RUNS)
    for name in REPLICA_RUNS:
        for r in runs.get(name, {}).get("replicas", []):
            lines.append(
                f"  {name:<{width}}  replica {r['replica']}: {r['turns']} turns "
                f"({r['moved_turns']} moved), prefill computed {r['computed_prefill_tokens']:,}"
                f", tokens from store hits {r['store_hit_tokens']:,} "
                f"({r['store_hit_blocks']:,} blocks read{_declined(r)}), TTFT p50 "
                f"{ms(r['ttft_p50_s'])}, "
                f"moved turns {ms(r.get('ttft_p50_moved_turns_s'))}")
    with_store, without = (SHARED, ALONE) if SHARED in runs else (ROUTED_SHARED, ROUTED_ALONE)
    shared, off, alone = runs.get(with_store), runs.get("offload"), runs.get(without)
    if shared is not None and off is not None:
        ratio = v.get("moved_ttft_p50_over_host_hit_ttft_p50")
        lines.append(f"TTFT p50 of the turns that moved replica, prefix from the store: "
                     f"{ms(shared.get('ttft_p50_moved_turns_s'))}; of the offload run's turns "
                     f"with host hits: {ms(off.get('ttft_p50_host_hit_turns_s'))}"
                     + (f" (moved turns {_times(ratio, 'higher', 'lower')})"
                        if ratio is not None else " (it had none)"))
    if v.get("ttft_p50_without_over_with_store") is not None:
        lines.append(f"TTFT p50 {with_store} {ms(shared['ttft_s']['p50'])} vs {without} "
                     f"{ms(alone['ttft_s']['p50'])}: "
                     f"{_times(v['ttft_p50_without_over_with_store'], 'lower', 'higher')} "
                     "with the store "
                     f"(turns that moved: {ms(shared.get('ttft_p50_moved_turns_s'))} vs "
                     f"{ms(alone.get('ttft_p50_moved_turns_s'))})")
    if len(v.get("ttft_p50_s", {})) > 2:
        best = v["best_ttft_p50"]
        lines.append("TTFT p50 by routing: " + ", ".join(
            f"{name} {ms(t)}" for name, t in v["ttft_p50_s"].items()) + f"; the lowest: {best}"
            + "".join(f", {_times(t / v['ttft_p50_s'][best], 'lower', 'higher')} than {name}"
                      for name, t in v["ttft_p50_s"].items() if name != best))
    return lines


def _replica_verdict(cfg: dict, runs: dict) -> dict:
    """--replicas: how the turns were routed, the store, and the two comparisons: the turns
    that moved replica with the store against the offload run's turns with host hits, and
    replicas+store's TTFT p50 against replicas'."""
    router = cfg.get("router", "round-robin")
    route = {"round-robin": "turn t of chat c on replica (c + t) % N",
             "prefix": "a turn on the replica where its prefill costs least, by the replicas' "
                       "KV events (prefix-routed runs)"}
    out = {"replicas": cfg["replicas"],
           "route": " / ".join(text for name, text in route.items()
                               if router in (name, "both")),
           "store": cfg["store"] if "://" not in cfg["store"]
           else store_servers.shown_url(cfg["store"]),
           "store_described": cfg.get("store_described")}

    def ratio(a, b):
        return a / b if a is not None and b else None

    ttft = {name: runs[name]["ttft_s"]["p50"] for name in REPLICA_RUNS if name in runs}
    out["ttft_p50_s"] = ttft
    if ttft:
        out["best_ttft_p50"] = min(ttft, key=ttft.get)
    with_store, without = (SHARED, ALONE) if SHARED in runs else (ROUTED_SHARED, ROUTED_ALONE)
    shared, alone, off = runs.get(with_store), runs.get(without), runs.get("offload")
    if shared is not None and off is not None:
        out["moved_ttft_p50_over_host_hit_ttft_p50"] = ratio(
            shared.get("ttft_p50_moved_turns_s"), off.get("ttft_p50_host_hit_turns_s"))
    if shared is not None and alone is not None:
        out["ttft_p50_without_over_with_store"] = ratio(alone["ttft_s"]["p50"],
                                                        shared["ttft_s"]["p50"])
        out["moved_ttft_p50_without_over_with_store"] = ratio(
            alone.get("ttft_p50_moved_turns_s"), shared.get("ttft_p50_moved_turns_s"))
    return out


def _prefill_rate(model: ModelConfig, results: dict) -> dict:
    """never_evict's full-prefill rate as a share of a square matmul in the model's dtype
    measured now, on the same device (`matmul_rate`): the one way the demo, the docs and
    scripts/model_bench.py state the model's compute rate. Empty where no step was a
    full-prefill one."""
    rate = results["never_evict"].metrics()["full_prefill_tflop_per_s"]
    if rate is None:
        return {}
    matmul = matmul_rate(model.dtype)
    return {"prefill_fraction_of_matmul": rate / matmul, "prefill_tflop_per_s": rate,
            "matmul": {"dtype": model.dtype, "tflop_per_s": matmul}}


def matmul_rate(dtype: str, n: int | None = None, repeats: int = 7) -> float:
    """TFLOP/s of a square matmul of random `dtype` operands (`n`: 8192 on a GPU, 1024
    elsewhere), jitted, 8 products a timed call so that dispatch does not count, the median of
    `repeats` after a warm-up: the ceiling a step's rate is stated against."""
    n = n or (8192 if jax.default_backend() == "gpu" else 1024)
    a, b = (jax.random.normal(jax.random.PRNGKey(i), (n, n), "float32").astype(dtype)
            for i in range(2))
    product = jax.jit(lambda x, y: x @ y)
    times = []
    for _ in range(repeats + 1):  # the first: compiles, warms up
        t = time.perf_counter()
        jax.block_until_ready([product(a, b) for _ in range(8)])
        times.append(time.perf_counter() - t)
    return 2 * n ** 3 * 8 / statistics.median(times[1:]) / 1e12


def plot_runs(path: str, results: dict) -> None:
    """The TTFT CDF of each run, and each run's output tokens/s, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [name for name in RUNS if name in results]
    results = {name: shown(name, results[name]) for name in names}
    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(10 + 2 * (len(names) > 3), 4))
    for name in names:
        ttft = np.sort([r.first_token_s - r.arrival_s for r in results[name].turns.values()])
        cdf.plot(1e3 * ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name)
    cdf.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="time to first token")
    cdf.legend()
    rates = [results[name].metrics()["output_tokens_per_s"] for name in names]
    bars.bar([name.replace(" ", "\n") for name in names], rates,
             color=[f"C{i}" for i in range(len(names))])
    bars.set(ylabel="output tokens/s", title="throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def sweep_point(model: ModelConfig, rate: float, results: dict) -> dict:
    """One rate of the load sweep, its SWEEP_RUNS' `results`: their summaries, offload's and
    drop's exactness against never_evict, and the closing lines."""
    runs = {name: summary(res) for name, res in results.items()}
    compared = {name: _compared(model, results[name], results["never_evict"])
                for name in ("offload", "drop")}
    return {"arrival_rate": rate, "runs": runs, "exactness": compared,
            "exact": compared["offload"]["exact"], "closing": closing(runs, compared)}


def print_sweep(args: argparse.Namespace, cfg: dict, model: ModelConfig, points: list[dict]
                ) -> bool:
    """Prints the load sweep (a table, or --json's object); returns whether offload is exact
    at every rate."""
    exact = all(p["exact"] for p in points)
    if args.json:
        config = {**cfg, "arrival_rate": [p["arrival_rate"] for p in points],
                  "preset": args.preset, "seed": args.seed, "workload": args.workload}
        print(json.dumps({"config": config, "device": str(jax.devices()[0].device_kind),
                          "exact": exact, "sweep": points}, indent=1))
    else:
        title = (f"jax_kvxfer demo, load sweep: {_source(args, cfg)}, batch {cfg['batch']}; "
                 f"model {model.num_layers} layers, d={model.d_model} "
                 f"({model.num_params / 1e6:.2f}M params); {jax.devices()[0].device_kind}")
        print(sweep_table(title, points))
    return exact


def sweep_table(title: str, points: list[dict]) -> str:
    """The load sweep: per rate, each run's TTFT p50 / p90 and output tokens/s; then per rate
    the closing line."""
    def ms(x: float) -> str:
        return f"{1e3 * x:,.1f}"

    header = ["arrival rate (/s)"]
    for name in SWEEP_RUNS:
        header += [f"{name} TTFT p50 / p90 (ms)", f"{name} tokens/s"]
    rows = []
    for p in points:
        row = [f"{p['arrival_rate']:g}"]
        for name in SWEEP_RUNS:
            r = p["runs"][name]
            row += [f"{ms(r['ttft_s']['p50'])} / {ms(r['ttft_s']['p90'])}",
                    f"{r['output_tokens_per_s']:,.1f}"]
        rows.append(row)
    lines = [*title_lines(title), "", *grid(header, rows), ""]
    lines += [line for p in points for text in p["closing"]["lines"]
              for line in wrap(f"at {p['arrival_rate']:g}/s: {text}")]
    return "\n".join(lines)


def plot_sweep(path: str, points: list[dict]) -> None:
    """TTFT p50 (solid) and p90 (dashed) against the arrival rate, and output tokens/s."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [p["arrival_rate"] for p in points]
    fig, (ttft, rate) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(SWEEP_RUNS):
        for q, style in (("p50", "-"), ("p90", "--")):
            ttft.plot(rates, [1e3 * p["runs"][name]["ttft_s"][q] for p in points], style,
                      color=f"C{i}", marker="o", label=f"{name} {q}")
        rate.plot(rates, [p["runs"][name]["output_tokens_per_s"] for p in points],
                  color=f"C{i}", marker="o", label=name)
    ttft.set(xlabel="arrival rate (/s)", ylabel="TTFT (ms)", title="time to first token vs load",
             yscale="log")
    rate.set(xlabel="arrival rate (/s)", ylabel="output tokens/s", title="throughput vs load")
    ttft.legend(fontsize=8)
    rate.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
