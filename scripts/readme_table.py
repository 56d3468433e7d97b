"""The README's performance table from one bench run's JSON (`python -m jax_kvxfer bench`).

    python scripts/readme_table.py benchmarks/results/bench-YYYYMMDD-HHMMSS-nvidia-h200.json

Prints the table's Markdown rows: each figure is bytes moved / the same run's ceiling, wall clock
first and, in brackets, our kernels' GPU time in the same case; the last two rows are speedups
in GB/s against the naive `device_put` loop and the TensorRT-LLM-style per-block loop.
"""

from __future__ import annotations

import argparse
import json
import sys

SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
OFFLOAD, ONBOARD, D2D = "d2h", "h2d", "d2d"


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"


class Results:
    def __init__(self, doc: dict):
        self._by_case = {
            (r["path"], r["direction"], r["block_bytes"], r["n_label"]): r
            for r in doc["results"]
            if r.get("error") is None
        }

    def get(self, path: str, direction: str, size: int, n: str = "T") -> dict | None:
        return self._by_case.get((path, direction, size, n))

    def pct(self, path, direction, size, n="T", key="ratio", gpu_key="gpu_ratio") -> str:
        """`wall (GPU) %` where the case has both, `wall %` where it has only the wall clock."""
        r = self.get(path, direction, size, n)
        if r is None or r.get(key) is None:
            return "–"
        if gpu_key and r.get(gpu_key) is not None:
            return f"{100 * r[key]:.0f} ({100 * r[gpu_key]:.0f})"
        return f"{100 * r[key]:.0f}"

    def speedup(self, path, base, direction, size) -> str:
        ours, theirs = self.get(path, direction, size), self.get(base, direction, size)
        if ours is None or theirs is None or not theirs.get("gbps"):
            return "–"
        x = ours["gbps"] / theirs["gbps"]
        return f"{x:.0f}" if x >= 10 else f"{x:.2f}"


def each_way(cell) -> str:
    """`offload / onboard`: cell(direction) for each."""
    return f"{cell(OFFLOAD)} / {cell(ONBOARD)}"


def rows(res: Results) -> list[str]:
    def row(name, cell):  # cell(size) -> text
        return f"| {name} | " + " | ".join(cell(s) for s in SIZES) + " |"

    def d2d(s):  # whole / T-1 / T/2, wall clock then GPU time
        ns = ("T", "T-1", "T/2")
        wall = " / ".join(res.pct("ours", D2D, s, n, "ratio", None) for n in ns)
        gpu = " / ".join(res.pct("ours", D2D, s, n, "gpu_ratio", None) for n in ns)
        return f"{wall} % ({gpu} %)"

    def manager(s):
        kernel = each_way(lambda d: res.pct("manager", d, s, gpu_key=None))
        engines = each_way(lambda d: res.pct("manager_dma", d, s, gpu_key=None))
        return f"{kernel} %; {engines} %"

    def eager(s):
        return "; ".join(f"{res.pct('eager', d, s, gpu_key=None)} / "
                         f"{res.pct('eager_kernel', d, s, gpu_key=None)} %"
                         for d in (OFFLOAD, ONBOARD))

    def trt(s):
        cell = each_way(lambda d: res.speedup("ours", "trt_loop", d, s)) + "×"
        if s == SIZES[-1]:
            dma = each_way(lambda d: res.speedup("ours_dma", "trt_loop", d, s))
            cell += f" (`dma=True`: {dma}×)"
        return cell

    def partial(n):
        return lambda s: each_way(lambda d: res.pct("ours", d, s, n)) + " %"

    return [
        "| | " + " | ".join(_label(s) for s in SIZES) + " |",
        "| --- " * (len(SIZES) + 1) + "|",
        row("offload, whole blocks", lambda s: res.pct("ours", OFFLOAD, s) + " %"),
        row("onboard, whole blocks", lambda s: res.pct("ours", ONBOARD, s) + " %"),
        row("offload / onboard, n = T/2", partial("T/2")),
        row("offload / onboard, n = T−1", partial("T-1")),
        row("offload / onboard, n = 1", partial("1")),
        row("device→device, whole / n = T−1 / n = T/2", d2d),
        row("the same against a memcpy of the bytes moved, n = T/2",
            lambda s: res.pct("ours", D2D, s, "T/2", "same_bytes_ratio",
                              "same_bytes_gpu_ratio") + " %"),
        row("whole blocks with `dma=True`, offload / onboard",
            lambda s: each_way(lambda d: res.pct("ours_dma", d, s, gpu_key=None)) + " %"),
        row('the manager (`dma="auto"` picks the second), offload / onboard: kernel; copy engines',
            manager),
        row('eager `copy_blocks` (`dma="auto"`, the default) / with the kernel, offload; onboard',
            eager),
        row("vs naive `device_put` loop (offload / onboard)",
            lambda s: each_way(lambda d: res.speedup("ours", "naive", d, s)) + "×"),
        row("vs per-block TRT-style loop (offload / onboard)", trt),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a bench run's JSON (benchmarks/results/bench-*.json)")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        doc = json.load(f)
    print("\n".join(rows(Results(doc))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
