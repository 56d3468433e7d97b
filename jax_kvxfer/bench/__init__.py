"""Transfer benchmark: `python -m jax_kvxfer bench [options]` (`--help` lists them).

Each section times what a user calls against ceilings measured in the same run (helpers.py says
how: warm-up, a wait for the device, the median of repeats) and prints its figures in the
summary, last on stdout; progress goes to stderr; a JSON document (rewritten after every case)
and a PNG of the ops section go to `--out`. A failing case records its error; the run goes on.
  ops      `copy_blocks` over block sizes and token counts, beside its baselines (ops.py)
  manager  the transfer manager's verbs at real models' block geometries (manager.py)
  step     the manager's transfers beside a compute-bound model step (step.py)
  layers   a pool over 32 per-layer arrays, `KVCacheBlockPool.from_layers` (layers.py)
  sharded  pools sharded by KV heads over 1, 2 and all devices (sharded.py)
  connector the host time of the connector's scheduler-side calls for a step (connector.py)
  stores   the tiers below the host against the same disk's and server's raw speed; only with
           `--only stores` (stores.py)
  peers    our transfers beside JAX's, PyTorch's and cudaMemcpyBatchAsync's; GPU only, only with
           `--only peers` (peers.py)
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from .config import OPT_IN, SECTIONS, fmt_size, parse_args
from .connector import ConnectorMixin, connector_summary
from .helpers import BenchCore, count_compiles, device_name
from .layers import LayersMixin, layers_summary
from .manager import ManagerMixin, manager_summary
from .ops import OpsMixin, ops_summary
from .peers import PeersMixin, peers_summary
from .sharded import ShardedMixin, sharded_summary
from .step import StepMixin, step_summary
from .stores import StoresMixin, stores_summary

__all__ = ["Bench", "main"]
SUMMARIES = {"ops": ops_summary, "manager": manager_summary, "step": step_summary,
             "layers": layers_summary, "sharded": sharded_summary,
             "connector": connector_summary, "stores": stores_summary,
             "peers": peers_summary}


class Bench(OpsMixin, ManagerMixin, StepMixin, LayersMixin, ShardedMixin, ConnectorMixin,
            StoresMixin, PeersMixin, BenchCore):
    """The benchmark: `BenchCore`'s state and helpers, and one mixin per section."""

    def summary(self) -> list[str]:
        out = []
        for name, sec in self.sections.items():
            if "skipped" in sec or ("error" in sec and name != "stores"):
                out.append(f"{name}: {sec.get('skipped') or 'ERROR ' + sec['error'][:300]}")
            out += SUMMARIES[name](sec)
        return out

    def plot(self) -> str | None:
        """GB/s over block size of the ops section's paths, one panel per direction."""
        cases = [r for r in self.sections.get("ops", {}).get("cases", []) if r.get("gbps")]
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return None
        dirs = [d for d in ("d2h", "h2d", "d2d") if any(r["direction"] == d for r in cases)]
        if not dirs:
            return None
        fig, axes = plt.subplots(1, len(dirs), figsize=(6 * len(dirs), 5), squeeze=False)
        for ax, d in zip(axes[0], dirs):
            series: dict[str, list[tuple[int, float]]] = {}
            for r in cases:
                if r["direction"] == d:
                    label = r["path"] + ("" if r.get("n", "T") == "T" else f" n={r['n']}")
                    series.setdefault(label, []).append((r["block_bytes"], r["gbps"]))
            for label, pts in series.items():
                ax.plot(*zip(*sorted(pts)), marker=".", label=label,
                        **({"color": "k", "lw": 2.5} if label == "ceiling" else {}))
            sizes = sorted({b for pts in series.values() for b, _ in pts})
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(sizes, [fmt_size(b) for b in sizes])
            ax.set(xlabel="block size", ylabel="GB/s (bytes moved)", title=d)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
        fig.suptitle(f"jax_kvxfer ops, {device_name(self.dev)}, {self.cfg.blocks} blocks a batch")
        fig.tight_layout()
        png = self.json_path.removesuffix(".json") + ".png"
        fig.savefig(png, dpi=110)
        plt.close(fig)
        return png


def main(argv: list[str] | None = None, *, _cupy_module: Any = None) -> int:
    """Runs the benchmark; returns the exit status. _cupy_module: a stand-in for cupy (tests)."""
    cfg = parse_args(list(sys.argv[1:] if argv is None else argv))
    jax.monitoring.register_event_duration_secs_listener(count_compiles)
    try:
        bench = Bench(cfg, _cupy_module)
        bench.log(f"jax {jax.__version__} on {device_name(bench.dev)}, sections "
                  f"{', '.join(s for s in SECTIONS + OPT_IN if s in cfg.only)}, results -> "
                  f"{bench.json_path}")
        for note in bench.notes:
            bench.log("note: " + note)
        for name in SECTIONS:
            if name in cfg.only:
                bench.section(name, getattr(bench, f"run_{name}"))
        if "stores" in cfg.only:
            bench.run_stores()
        if "peers" in cfg.only:
            bench.section("peers", bench.run_peers)
        png = bench.plot() if cfg.plot else None
        print(f"results: {bench.json_path}" + (f", plot: {png}" if png else ""))
        print("\n".join(bench.summary()))
        bench.log(f"done in {bench.elapsed():.1f} s")
        return 0
    finally:
        jax.monitoring.unregister_event_duration_listener(count_compiles)
