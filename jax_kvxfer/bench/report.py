"""Results: the JSON document, the copy targets, the stdout table and summary, and the plot."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .config import DIRECTIONS, KiB, fmt_size, geometry_for
from .helpers import cpu_model, gpu_name
from .stores import stores_summary


class ReportMixin:
    """`Bench`'s JSON writing, targets, table, summary and plot (uses `BenchCore`'s state)."""

    # --- JSON ---------------------------------------------------------------------------------

    def meta(self) -> dict[str, Any]:
        import jaxlib

        from .. import HAS_CUDA_HANDLERS
        from .. import __version__ as kvx_version
        return {
            "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "gpu": gpu_name(self.dev),
            "backend": self.backend,
            "jax": jax.__version__,
            "jaxlib": getattr(jaxlib, "__version__", None),
            "python": platform.python_version(),
            "numpy": np.__version__,
            "cupy": self.cupy.version if self.cupy else None,
            "jax_kvxfer": kvx_version,
            "cuda_handlers": HAS_CUDA_HANDLERS,
            "host": platform.node(),
            # The manager's host time (target 6) follows the host's speed: name the CPU.
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "argv": sys.argv,
            "config": {k: (sorted(v) if isinstance(v, set) else v)
                       for k, v in vars(self.cfg).items()},
            "dtype": "bfloat16",
            "notes": self.notes,
        }

    def save(self) -> None:
        self._assign_ratios()
        doc = {"meta": self.meta(), "elapsed_s": round(self.elapsed(), 2),
               "ceilings": [{"direction": d, "block_bytes": b, **v}
                            for (d, b), v in sorted(self.ceilings.items())],
               "results": self.results, **self.sections,
               "targets": self.targets()}
        tmp = self.json_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, indent=1, default=_json_default)
        os.replace(tmp, self.json_path)

    def _assign_ratios(self) -> None:
        for rec in self.results:
            ceil = self.ceilings.get((rec.get("direction"), rec.get("block_bytes")))
            if rec.get("kind") == "ceiling" or not ceil or not rec.get("gbps"):
                continue
            rec["ceiling_gbps"] = ceil["gbps"]
            rec["ceiling_path"] = ceil["path"]
            rec["ratio"] = rec["gbps"] / ceil["gbps"]
            if rec.get("gpu_gbps"):
                rec["gpu_ratio"] = rec["gpu_gbps"] / ceil["gbps"]
            if rec.get("span_gbps"):
                rec["span_ratio"] = rec["span_gbps"] / ceil["gbps"]
            same = self.same_bytes.get((rec["direction"], rec["block_bytes"], rec.get("n_label")),
                                       ceil["gbps"] if rec.get("n_label") == "T" else None)
            if same and rec.get("direction") == "d2d":
                rec["same_bytes_ceiling_gbps"] = same
                rec["same_bytes_ratio"] = rec["gbps"] / same
                if rec.get("gpu_gbps"):
                    rec["same_bytes_gpu_ratio"] = rec["gpu_gbps"] / same

    # --- targets, table, plot -----------------------------------------------------------------

    def _find(self, path: str, d: str, n_label: str, size: int | None = None
              ) -> list[dict[str, Any]]:
        return [r for r in self.results if r.get("path") == path and r.get("direction") == d
                and r.get("n_label") == n_label and r.get("gbps")
                and (size is None or r.get("block_bytes") == size)]

    def targets(self) -> dict[str, Any]:
        """The copy targets as measured (information, not assertions)."""
        t: dict[str, Any] = {}

        def min_ratio(recs: list[dict[str, Any]], key: str = "ratio") -> float | None:
            rs = [r[key] for r in recs if r.get(key)]
            return min(rs) if rs else None

        # each as wall time per call and as the kernels' GPU time (profiler), both against the
        # same ceiling
        whole = [r for d in ("d2h", "h2d") for r in self._find("ours", d, "T")]
        big, small = ([r for r in whole if r["block_bytes"] >= 64 * KiB],
                      [r for r in whole if r["block_bytes"] < 64 * KiB])
        big_dma = [r for d in ("d2h", "h2d") for r in self._find("ours_dma", d, "T")
                   if r["block_bytes"] >= 64 * KiB]
        t["1_whole_host"] = {"min_ratio_ge_64K": min_ratio(big), "goal_ge_64K": 0.90,
                             "min_ratio_lt_64K": min_ratio(small), "goal_lt_64K": 0.75,
                             "min_gpu_ratio_ge_64K": min_ratio(big, "gpu_ratio"),
                             "min_gpu_ratio_lt_64K": min_ratio(small, "gpu_ratio"),
                             "min_span_ratio_ge_64K": min_ratio(big, "span_ratio"),
                             # the same copies with dma=True (the copy engines)
                             "min_dma_ratio_ge_64K": min_ratio(big_dma)}
        part = [r for d in ("d2h", "h2d") for lab in ("T/2", "T-1") for r in self._find("ours", d, lab)]
        one = [r for d in ("d2h", "h2d") for r in self._find("ours", d, "1")]
        t["2_partial_host"] = {"min_ratio_half_and_T-1": min_ratio(part), "goal": 0.80,
                               "min_ratio_n1": min_ratio(one), "aim_n1": 0.50,
                               "min_gpu_ratio_half_and_T-1": min_ratio(part, "gpu_ratio"),
                               "min_span_ratio_half_and_T-1": min_ratio(part, "span_ratio"),
                               "min_gpu_ratio_n1": min_ratio(one, "gpu_ratio")}
        d2d = [r for lab in ("T", "T-1", "T/2") for r in self._find("ours", "d2d", lab)]
        t["3_d2d_n_ge_half"] = {"min_ratio": min_ratio(d2d), "goal": 0.80,
                                "min_gpu_ratio": min_ratio(d2d, "gpu_ratio"),
                                # against a memcpy of the bytes each case moves
                                "min_same_bytes_ratio": min_ratio(d2d, "same_bytes_ratio"),
                                "min_same_bytes_gpu_ratio": min_ratio(d2d,
                                                                      "same_bytes_gpu_ratio")}
        vs: dict[str, Any] = {}
        for d in ("d2h", "h2d"):
            o, nv = self._find("ours", d, "T", 64 * KiB), self._find("naive", d, "T", 64 * KiB)
            if o and nv:
                vs[f"ours_over_naive_64K_{d}"] = o[0]["gbps"] / nv[0]["gbps"]
        for trt in ("trt_gpu", "trt_loop"):
            # ours: the copy kernel; best: the faster of it and dma=True where both ran
            for name, paths in (("ours", ("ours",)), ("best", ("ours", "ours_dma"))):
                worst = None
                for r in self.results:
                    if r.get("path") != "ours" or not r.get("gbps"):
                        continue
                    other = self._find(trt, r["direction"], r["n_label"], r["block_bytes"])
                    if other:
                        gbps = max(x["gbps"] for p in paths for x in self._find(
                            p, r["direction"], r["n_label"], r["block_bytes"]))
                        q = gbps / other[0]["gbps"]
                        if worst is None or q < worst[0]:
                            at = f"{r['direction']} {fmt_size(r['block_bytes'])} n={r['n_label']}"
                            worst = (q, at)
                if worst:
                    vs[f"min_{name}_over_{trt}"] = worst[0]
                    vs[f"min_{name}_over_{trt}_at"] = worst[1]
        vs["goal_over_naive"] = 50.0
        vs["goal_over_trt"] = 1.0
        t["4_vs_baselines"] = vs
        ov = self.sections.get("overlap", {}).get("paths", {})
        t["5_overlap_added_to_step"] = {k: v.get("added_to_step") for k, v in ov.items()}
        t["5_overlap_added_to_step"]["goal"] = 0.10
        ho = self.sections.get("host_overhead", {}).get("cases", [])
        t["6_host_overhead_us"] = {f"{c['direction']} [{c['variant']}]": c.get("median_us")
                                   for c in ho}
        t["6_host_overhead_us"]["recompiled_any"] = any(c.get("recompiled") for c in ho)
        t["6_host_overhead_us"]["goal_us"] = 200.0
        bd = self.sections.get("bidirectional", {}).get("paths", {})
        t["7_bidir_factor"] = {k: v.get("factor") for k, v in bd.items()}
        t["7_bidir_factor"]["goal"] = 1.6
        return t

    def table(self) -> str:
        cols = [("ours", "T"), ("ours", "T-1"), ("ours", "T/2"), ("ours", "1"),
                ("ours_unique", "T"), ("ours_unique", "T/2"), ("ours_dma", "T"),
                ("ours_dma", "T/2"), ("manager", "T"), ("manager_dma", "T"), ("eager", "T"),
                ("eager_kernel", "T"), ("xla", "T"),
                ("naive", "T"), ("trt_gpu", "T"), ("trt_gpu", "T/2"), ("trt_loop", "T")]
        cols = [c for c in cols if any(r.get("path") == c[0] and r.get("n_label") == c[1]
                                       for r in self.results)]
        head = f"{'dir':4} {'block':>6} {'ceiling':>13} " + " ".join(
            f"{p + ':' + n:>13}" for p, n in cols)
        lines = ["GB/s and % of the same-run ceiling (bytes moved / ceiling)", head,
                 "-" * len(head)]
        for d in DIRECTIONS:
            for size in self.cfg.sizes:
                ceil = self.ceilings.get((d, geometry_for(size).block_bytes))
                if ceil is None and not any(r.get("direction") == d and r.get("block_bytes") == size
                                            for r in self.results):
                    continue
                cells = [f"{_fmt_gbps(ceil['gbps'])} {'mcpy' if ceil['path'] == 'memcpy' else 'jax':>5}"
                         if ceil else f"{'-':>13}"]
                for p, n in cols:
                    rs = self._find(p, d, n, size)
                    if not rs:
                        cells.append(f"{'-':>13}")
                        continue
                    r = rs[0]
                    ratio = f"{r['ratio']:4.0%}" if r.get("ratio") else "  - "
                    cells.append(f"{_fmt_gbps(r['gbps'])} {ratio:>5}")
                lines.append(f"{d:4} {fmt_size(size):>6} " + " ".join(cells))
        lines += self._gpu_time_table()
        lines += self._span_table()
        lines += self._same_bytes_table()
        errs = [r for r in self.results if r.get("error")]
        if errs:
            lines.append(f"{len(errs)} case(s) failed: " + "; ".join(
                f"{r.get('direction', '')} {fmt_size(r.get('block_bytes', 0))} {r['path']} "
                f"n={r.get('n_label', '')}" for r in errs[:8]))
        return "\n".join(lines)

    def _ours_table(self, title: str, directions: tuple[str, ...], width: int,
                    cell: Callable[[dict[str, Any]], str | None]) -> list[str]:
        """One row per direction and size, one column per n of `ours`: cell(record), or "-"
        where it gives None or the case did not run. No rows: no table."""
        labels = ("T", "T-1", "T/2", "1")
        rows = []
        for d in directions:
            for size in self.cfg.sizes:
                cells = [next((c for r in self._find("ours", d, n, size)
                               if (c := cell(r)) is not None), f"{'-':>{width}}")
                         for n in labels]
                if any(c.strip() != "-" for c in cells):
                    rows.append(f"{d:4} {fmt_size(size):>6} " + " ".join(cells))
        if not rows:
            return []
        head = f"{'dir':4} {'block':>6} " + " ".join(f"{'ours:' + n:>{width}}" for n in labels)
        return ["", title, head, "-" * len(head), *rows]

    def _gpu_time_table(self) -> list[str]:
        """`ours` again, timed by its kernels' GPU time (profiler) instead of the wall clock."""
        return self._ours_table(
            "ours by its kernels' GPU time (profiler trace), % of the same ceiling", DIRECTIONS,
            12, lambda r: f"{_fmt_gbps(r['gpu_gbps'])} {r.get('gpu_ratio', 0):4.0%}"
            if r.get("gpu_gbps") else None)

    def _span_table(self) -> list[str]:
        """`ours` again, timed by the GPU timeline's span over calls in flight (profiler)."""
        return self._ours_table(
            "ours by the GPU timeline from its first kernel's start to its last's end (gaps and "
            "XLA's own work between them included), % of the same ceiling", DIRECTIONS,
            12, lambda r: f"{_fmt_gbps(r['span_gbps'])} {r.get('span_ratio', 0):4.0%}"
            if r.get("span_gbps") else None)

    def _same_bytes_table(self) -> list[str]:
        """Device to device `ours` against a memcpy of the bytes each case moves: wall / GPU."""
        def cell(r: dict[str, Any]) -> str | None:
            if not r.get("same_bytes_ratio"):
                return None
            gpu = r.get("same_bytes_gpu_ratio")
            return f"{r['same_bytes_ratio']:4.0%} / " + (f"{gpu:4.0%}" if gpu else "  - ")
        return self._ours_table("d2d ours against a memcpy of the bytes it moves (wall / GPU time)",
                                ("d2d",), 11, cell)

    def summary(self) -> str:
        out = []
        ho = self.sections.get("host_overhead", {}).get("cases", [])
        for c in ho:
            if "median_us" in c:
                out.append(f"host overhead {c['direction']:8} [{c['variant']}]: median "
                           f"{c['median_us']:.1f} us (p90 {c['p90_us']:.1f}), "
                           f"recompiled={c['recompiled']}")
        ov = self.sections.get("overlap", {})
        for name, r in ov.get("paths", {}).items():
            if "both_s" in r:
                out.append(f"overlap {name:18}: step {r['step_s'] * 1e3:.1f} ms, transfer "
                           f"{r['transfer_s'] * 1e3:.1f} ms, both {r['both_s'] * 1e3:.1f} ms, sum "
                           f"{r['no_overlap_sum_s'] * 1e3:.1f} ms: +{r['added_to_step']:.0%} on "
                           "the step")
        for name, r in self.sections.get("bidirectional", {}).get("paths", {}).items():
            if "factor" in r:
                out.append(f"bidirectional {name:18}: {r['aggregate_gbps']:.1f} GB/s aggregate ="
                           f" {r['factor']:.2f}x one direction "
                           f"(off {r['offload_gbps']:.1f}, on {r['onboard_gbps']:.1f})")
        for r in self.sections.get("sharded", {}).get("cases", []):
            if "offload_gbps" in r:
                scale = (f" = {r['offload_scaling']:.2f} / {r['onboard_scaling']:.2f} of "
                         f"{r['devices']} x one device" if "offload_scaling" in r else "")
                ceil = (f"; concurrent memcpy {r['memcpy_offload_gbps']:.1f} / "
                        f"{r['memcpy_onboard_gbps']:.1f} GB/s, ours "
                        f"{r['offload_of_memcpy']:.0%} / {r['onboard_of_memcpy']:.0%} of it"
                        if "memcpy_offload_gbps" in r else "")
                out.append(f"sharded x{r['devices']}: offload {r['offload_gbps']:.1f} / onboard "
                           f"{r['onboard_gbps']:.1f} GB/s aggregate{scale}{ceil}, "
                           f"verified={r['verified']}")
        out += stores_summary(self.sections.get("stores", {}))
        out += target_lines(self.targets(), host=f"{cpu_model()}, {os.cpu_count()} CPUs")
        return "\n".join(out)

    def plot(self) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception:  # noqa: BLE001
            return None
        dirs = [d for d in DIRECTIONS if any(r.get("direction") == d and r.get("gbps")
                                             for r in self.results)]
        if not dirs:
            return None
        fig, axes = plt.subplots(1, len(dirs), figsize=(6 * len(dirs), 7.5), squeeze=False)
        titles = {"d2h": "offload device -> pinned host", "h2d": "onboard pinned host -> device",
                  "d2d": "device -> device"}
        colors = {"ours": "C0", "trt_gpu": "C1", "xla": "C2", "naive": "C3", "trt_loop": "C4"}
        markers = {"ours": "o", "trt_gpu": "s", "xla": "^", "naive": "v", "trt_loop": "x"}
        styles = {"T": "-", "T-1": "-.", "T/2": "--", "1": ":"}
        sizes = sorted({r["block_bytes"] for r in self.results if r.get("gbps")})
        for ax, d in zip(axes[0], dirs):
            series: dict[tuple[str, str], list[tuple[int, float]]] = {}
            for r in self.results:
                if r.get("direction") != d or not r.get("gbps") or r.get("kind") == "ceiling":
                    continue
                series.setdefault((r["path"], r["n_label"]), []).append(
                    (r["block_bytes"], r["gbps"]))
            ceil_pts = sorted((b, v["gbps"]) for (dd, b), v in self.ceilings.items() if dd == d)
            if ceil_pts:
                ax.plot(*zip(*ceil_pts), color="k", lw=2.5, alpha=0.6,
                        label="ceiling: contiguous copy, same run")
            order = list(colors)
            for (path, n), pts in sorted(series.items(), key=lambda kv: (
                    order.index(kv[0][0]) if kv[0][0] in order else 99, list(styles).index(
                        kv[0][1]) if kv[0][1] in styles else 9)):
                pts.sort()
                ax.plot(*zip(*pts), linestyle=styles.get(n, "-"),
                        marker=markers.get(path, "."), color=colors.get(path, "C7"), ms=4,
                        lw=1.8 if path == "ours" else 1.1, label=f"{path} n={n}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [fmt_size(b) for b in sizes])
            ax.set_xlabel("block size")
            ax.set_ylabel("GB/s (bytes moved)")
            ax.set_title(titles[d])
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6.5, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
        fig.suptitle(f"jax_kvxfer, {gpu_name(self.dev)}, jax {jax.__version__}, "
                     f"{self.cfg.blocks} blocks per batch")
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=110)
        plt.close(fig)
        return self.png_path


def target_lines(t: dict[str, Any], host: str = "") -> list[str]:
    """One line per copy target measured in this run (from `targets()`), the figure that
    decides it first: for copies to and from the host the GPU timeline's span, which like the
    memcpy ceiling's CUDA events leaves out the host's dispatch before the GPU starts and its
    wake-up after; the wall clock, which counts both once per sample, beside it. `host`: the
    run's host CPU, named on target 6's line (the manager's host time follows its speed)."""
    def pct(x: Any) -> str:
        return "-" if x is None else f"{x:.1%}"

    def our_paths(figures: dict[str, Any]) -> dict[str, float]:
        """A section's figures of our paths (the memcpy references and the goal left out)."""
        return {k: v for k, v in figures.items()
                if k != "goal" and v is not None and not k.startswith("memcpy")}

    lines = []
    t1 = t.get("1_whole_host", {})
    if t1.get("min_ratio_ge_64K") is not None or t1.get("min_ratio_lt_64K") is not None:
        lines.append(
            f"target 1 (whole blocks, host; >= 64K goal 90 %, 16K 75 %): >= 64K span "
            f"{pct(t1.get('min_span_ratio_ge_64K'))}, wall {pct(t1.get('min_ratio_ge_64K'))}, "
            f"dma=True wall {pct(t1.get('min_dma_ratio_ge_64K'))}; < 64K wall "
            f"{pct(t1.get('min_ratio_lt_64K'))}")
    t2 = t.get("2_partial_host", {})
    if t2.get("min_ratio_half_and_T-1") is not None:
        lines.append(
            f"target 2 (partial, host; T/2 and T-1 goal 80 %, n=1 aim 50 %): span "
            f"{pct(t2.get('min_span_ratio_half_and_T-1'))}, wall "
            f"{pct(t2['min_ratio_half_and_T-1'])}; n=1 wall {pct(t2.get('min_ratio_n1'))}")
    t3 = t.get("3_d2d_n_ge_half", {})
    if t3.get("min_ratio") is not None:
        lines.append(
            f"target 3 (device to device, n >= T/2; goal 80 %): wall {pct(t3['min_ratio'])}, "
            f"kernels' GPU time {pct(t3.get('min_gpu_ratio'))}; against a memcpy of the same "
            f"bytes {pct(t3.get('min_same_bytes_ratio'))} / "
            f"{pct(t3.get('min_same_bytes_gpu_ratio'))}")
    t4 = t.get("4_vs_baselines", {})
    naive = [v for k, v in sorted(t4.items()) if k.startswith("ours_over_naive_64K")]
    if naive or "min_best_over_trt_loop" in t4:
        lines.append(
            "target 4 (goal 50x naive at 64K, ahead of the TensorRT-LLM-style loop): naive "
            + " / ".join(f"{v:.0f}x" for v in naive)
            + "".join(f"; {trt} kernel {t4[f'min_ours_over_{trt}']:.2f}x, best path "
                      f"{t4[f'min_best_over_{trt}']:.2f}x (least at "
                      f"{t4[f'min_best_over_{trt}_at']})"
                      for trt in ("trt_loop", "trt_gpu") if f"min_best_over_{trt}" in t4))
    t5 = our_paths(t.get("5_overlap_added_to_step", {}))
    if t5:
        best = min(t5, key=t5.get)
        lines.append(f"target 5 (goal <= 10 % added to the step): least {t5[best]:+.1%} ({best})")
    t6 = t.get("6_host_overhead_us", {})
    verbs = [t6.get(f"{d} [manager {d}_blocks]") for d in ("offload", "onboard")]
    if all(v is not None for v in verbs):
        lines.append(f"target 6 (goal <= 200 us, no recompiles): manager {verbs[0]:.0f} / "
                     f"{verbs[1]:.0f} us, recompiled={t6.get('recompiled_any')}"
                     + (f" (host: {host})" if host else ""))
    t7 = our_paths(t.get("7_bidir_factor", {}))
    if t7:
        best = max(t7, key=t7.get)
        lines.append(f"target 7 (goal >= 1.6x one direction): best {t7[best]:.2f}x ({best})")
    return lines


def _fmt_gbps(x: float) -> str:
    return f"{x:7.1f}" if x >= 10 else f"{x:7.2f}"


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)
