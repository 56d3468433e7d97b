"""The demo's runs: each run served in turn (--repeat N: all of them N times), the replicas'
runs in their own processes, the disk runs over a FileStore, the load sweep's runs at each
rate, and --events-overhead's; with the devices and the memory checked and the observers
started before the first. What they found goes to report.py."""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import tempfile
import time

import jax

from ..cache import PoolExhaustedError
from ..stores import FileStore
from ..transfer.limits import HOST_LIMIT_ENV
from . import observe, serving, store_servers, workloads
from . import replicas as replica_runs
from .model import ModelConfig, kv_block_nbytes
from .report import (
    SWEEP_RUNS,
    plot_runs,
    plot_sweep,
    print_runs,
    print_sweep,
    repeat_figures,
    sweep_point,
    wrap,
)
from .sizes import (
    DISK,
    JOINED,
    JOINED_ALONE,
    PREFIX_ROUTED,
    REPLICA_RUNS,
    RESTARTED,
    RUNS,
    STORE_RUNS,
    cap_pinned_host,
    host_peak,
    memory_shortfall,
    run_pools,
    size_text,
    store_namespace,
    workload,
)


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
        line = (f"{self.label:<{max(map(len, RUNS))}} [{bar}] {done}/{total} turns "
                f"{time.perf_counter() - self.t0:5.1f} s")
        if self.tty:
            sys.stderr.write("\r" + line + ("\n" if done == total else ""))
        elif int(frac * 4) != self.last_quarter:
            self.last_quarter = int(frac * 4)
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


class DiskError(RuntimeError):
    """--disk's directory did not take the disk tier."""


def serve(args: argparse.Namespace, cfg: dict, model: ModelConfig,
          convs: list[workloads.Conversation], rates: list[float], real=None) -> int:
    """Serves the runs the options ask for (`rates`: more than one, a load sweep of
    conversations arriving at each rate) and prints the report; returns the exit status: 0
    when the runs that must be exact are, 1 when not, 2 when a run cannot fit (said in one
    line)."""
    every = cfg["low_priority_every"]
    priorities = [serving.LOW_PRIORITY if every and i % every == every - 1 else 35
                  for i in range(len(convs))]
    sweep = None
    if len(rates) > 1:
        sweep = [(rate, workload(args.workload, {**cfg, "arrival_rate": rate}, model.vocab_size,
                                 args.seed)) for rate in rates]
    started = _start(args, cfg, model, convs, priorities, real)
    if isinstance(started, int):
        return started
    common, pools = started
    if args.events_overhead:  # the offload run with events and metrics off, then on
        return observe.overhead(args, model, convs, pools["offload"], common, real)
    if sweep is not None:
        return _sweep(args, cfg, model, sweep, priorities, common, pools)
    served = _serve_runs(args, cfg, model, convs, priorities, real, common, pools)
    if isinstance(served, int):
        return served
    first, later = served
    results = {name: first[name] for name in RUNS if name in first}  # as reported
    exact = print_runs(args, cfg, model, results, real, later=later)
    if args.plot:
        plot_runs(args.plot, results)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if exact else 1


def _start(args: argparse.Namespace, cfg: dict, model: ModelConfig,
           convs: list[workloads.Conversation], priorities: list[int], real
           ) -> tuple[dict, dict] | int:
    """Checks the devices and the memory, starts the observers; the options every run shares
    and each run's pools, or 2 (said in one line)."""
    import numpy as np

    from .model import TP_AXIS

    capped = cap_pinned_host(model, cfg, convs)  # before JAX starts its GPU client
    devices = jax.devices()
    if args.devices > len(devices):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N)"
                if devices[0].platform == "cpu" else "")
        print(f"jax-kvxfer demo: error: --devices {args.devices}, but JAX sees {len(devices)} "
              f"device(s){hint}", file=sys.stderr)
        return 2
    # Before anything is allocated: a run that cannot fit is one line now, not minutes of runs
    # and then the allocator's error (or, on CPU, the OOM killer).
    shortfall = memory_shortfall(model, cfg, convs, devices[:args.devices], preset=args.preset,
                                 trace=args.trace is not None)
    if shortfall is not None:
        print(f"jax-kvxfer demo: error: {shortfall}", file=sys.stderr)
        return 2
    mesh = (jax.sharding.Mesh(np.array(devices[:args.devices]), (TP_AXIS,))
            if args.devices > 1 else None)
    common = {"batch": cfg["batch"], "chunk": cfg["chunk"], "prefill_rows": cfg["prefill_rows"],
              "prefill_budget": cfg["prefill_budget"],
              "tokens_per_block": cfg["tokens_per_block"], "mesh": mesh,
              "priorities": priorities,
              "stop_token": None if real is None else real[1].eos_id,
              "fixed_step_s": None if args.fixed_step_ms is None else args.fixed_step_ms / 1e3,
              "dma": {"auto": "auto", "true": True, "false": False}[args.dma],
              "admission": args.admission, "layer_groups": args.layer_groups}
    pools = run_pools(cfg, convs)
    try:  # --kv-events, --metrics-port: every block manager from now on reports
        observe.start(args)
    except Exception as e:  # noqa: BLE001 - a bad option or a missing package: one line
        print(f"jax-kvxfer demo: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if "prefill_why" in cfg:  # (once every option is checked: a bad one stays one line)
        print(cfg["prefill_why"], file=sys.stderr)
    peak, each = host_peak(model, cfg, convs)
    cap = (f"; XLA's pinned-host limit set to {capped} GiB ({HOST_LIMIT_ENV}) so that its "
           "allocator takes no more" if capped is not None and devices[0].platform == "gpu"
           else "")
    print("\n".join(wrap(f"host memory: peak {size_text(peak)} (" + ", ".join(
        f"{name} {size_text(nbytes)}" for name, nbytes in each.items()) + "; a run's host pool and "
        f"the replies' token records so far){cap}")), file=sys.stderr)
    return common, pools


def _serve_runs(args: argparse.Namespace, cfg: dict, model: ModelConfig,
                convs: list[workloads.Conversation], priorities: list[int], real,
                common: dict, pools: dict) -> tuple[dict, list] | int:
    """Each run in turn (--repeat N: all of them N times): the first repeat's results and the
    later repeats' figures, or 2 when a run cannot fit (said in one line)."""
    from .model import init_params

    params = None  # made after the replica runs (their processes take the GPU's memory first)
    first: dict = {}  # the first repeat's runs: the table's
    results = first  # the runs of the repeat under way
    later: list[tuple[dict, dict]] = []  # --repeat: each later repeat's summaries and exactness
    # The disk runs' files: a fresh subdirectory of --disk (the first pass starts cold; the
    # restart finds what it left), removed at the end.
    workdir = None
    order = [r for r in REPLICA_RUNS if r in pools] + [r for r in pools if r not in REPLICA_RUNS]
    # --repeat N: all the runs in turn, then again, so that a drift of the machine's speed
    # touches each run alike
    schedule = [(repeat, name) for repeat in range(args.repeat) for name in order]
    try:
        for repeat, name in schedule:
            if repeat and name == order[0]:  # a later repeat: runs of its own
                results = {}
            label = name if args.repeat == 1 else f"{name} {repeat + 1}/{args.repeat}"
            primary, secondary = pools[name]
            store = None
            try:
                if name in REPLICA_RUNS:
                    results[name] = _replica_run(name, args, cfg, model, convs, priorities,
                                                 real, primary, secondary, common, results)
                    continue
                if params is None:
                    params = init_params(model, args.seed) if real is None else \
                        {k: jax.numpy.asarray(v) for k, v in real[0].items()}
                if name in (DISK, RESTARTED):
                    if workdir is None:
                        workdir = tempfile.mkdtemp(prefix="jax-kvxfer-demo-", dir=args.disk)
                    store = _file_store(workdir, args, cfg, model, real)
                results[name] = serving.run(
                    model, params, convs, primary_blocks=primary, secondary_blocks=secondary,
                    progress=_Progress(label, not args.no_progress), name=name,
                    **common, **({"stores": (store,)} if store is not None else {}))
                if repeat and name == order[-1]:  # a later repeat: its figures, not its records
                    later.append(repeat_figures(cfg, model, results))
            except BaseException as e:  # Ctrl-C too
                failed = f"run {label} failed: " + f"{type(e).__name__}: {e}".splitlines()[0]
                if first:  # the runs that finished took minutes: they are printed first
                    print_runs(args, cfg, model, first, real, failed=failed, later=later)
                # out of memory (RESOURCE_EXHAUSTED: XLA's allocator), or a --disk that takes
                # no file: one line, as for bad options
                if isinstance(e, (PoolExhaustedError, MemoryError, DiskError,
                                  store_servers.StoreUnavailable)) or \
                        "RESOURCE_EXHAUSTED" in str(e) or "MemoryError" in str(e):
                    print(f"jax-kvxfer demo: error: {failed}", file=sys.stderr)
                    return 2
                raise
            finally:
                if store is not None:
                    store.close()
                # The run's server holds its pools in reference cycles: released now, not at
                # the next full collection, so that the next run's pools are not allocated
                # beside them (on the H200, a 32 GiB pinned host pool).
                gc.collect()
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    return first, later


def _replica_run(name: str, args: argparse.Namespace, cfg: dict, model: ModelConfig,
                 convs: list[workloads.Conversation], priorities: list[int], real,
                 primary: int, secondary: int, common: dict, done: dict) -> serving.RunResult:
    """A replicas run: cfg["replicas"] processes of `primary` / `secondary` blocks each,
    sharing the store --store names (started here, stopped at the end) when `name` is one of
    STORE_RUNS, routed by prefix when it is one of PREFIX_ROUTED; or with --scale-out
    (replicas.py), replica A then B: JOINED runs A with the store and B reading it,
    JOINED_ALONE B alone after the A of JOINED (in `done`)."""
    n = cfg["replicas"]
    server = {"max_blocks": serving.max_request_blocks(convs, cfg["tokens_per_block"]),
              "batch": cfg["batch"], "chunk": cfg["chunk"], "prefill_rows": cfg["prefill_rows"],
              "prefill_budget": cfg["prefill_budget"],
              "tokens_per_block": cfg["tokens_per_block"], "primary_blocks": primary,
              "secondary_blocks": secondary, "dma": common["dma"],
              "stop_token": common["stop_token"], "layer_groups": common["layer_groups"]}
    on_gpu = jax.devices()[0].platform == "gpu"
    # a local mooncake master's pool: every block of the chats, and a quarter more
    capacity = int(1.25 * serving.blocks_to_never_evict(convs, cfg["batch"],
                                                        cfg["tokens_per_block"])
                   * (kv_block_nbytes(model, cfg["tokens_per_block"]) + 4096))
    started = (store_servers.start_store(cfg["store"], capacity_bytes=capacity)
               if name in STORE_RUNS else None)
    try:
        if started is not None:
            cfg["store_described"] = started.describe
        spec = None if started is None else started.spec
        common_args = {
            "server": server, "priorities": priorities, "seed": args.seed,
            "smollm2": real is not None, "fixed_step_s": common["fixed_step_s"],
            "namespace": store_namespace(model, cfg, preset=args.preset, seed=args.seed,
                                         real=real is not None),
            "mem_fraction": replica_runs.GPU_SHARE / n if on_gpu else None}
        if name not in (JOINED, JOINED_ALONE):
            return replica_runs.run_replicas(
                model, convs, replicas=n, store=spec,
                router="prefix" if name in PREFIX_ROUTED else "round-robin",
                progress=_Progress(name, not args.no_progress), **common_args)
        by_document = args.workload == "docqa"
        if name == JOINED:  # replica A, writing to the store
            first = replica_runs.run_part(
                model, replica_runs.first_part(convs, by_document=by_document), replicas=n - 1,
                store=spec, progress=_Progress("replica A", not args.no_progress),
                **common_args)
        else:
            first = done[JOINED].replicas[0]
        follow = replica_runs.follow_ups(convs, by_document=by_document, replies=first.turns,
                                         priorities=priorities,
                                         tokens_per_block=cfg["tokens_per_block"])
        return replica_runs.joined(first, replica_runs.run_part(
            model, follow, replicas=1, store=spec,
            progress=_Progress(name, not args.no_progress), **common_args))
    finally:
        if started is not None:
            started.stop()


def _file_store(path: str, args: argparse.Namespace, cfg: dict, model: ModelConfig,
                real) -> FileStore:
    """A disk run's FileStore over `path`. Raises DiskError where it takes no file."""
    try:
        return FileStore(path, namespace=store_namespace(model, cfg, preset=args.preset,
                                                         seed=args.seed, real=real is not None),
                         capacity_bytes=int(cfg["disk_gb"] * 2**30))
    except ValueError as e:
        raise DiskError(f"--disk {args.disk}: {e}") from None


def _sweep(args: argparse.Namespace, cfg: dict, model: ModelConfig, sweep: list,
           priorities: list[int], common: dict, pools: dict) -> int:
    """--arrival-rate with several rates: offload, drop and never_evict at each rate (the same
    conversations, arriving at that rate), each against never_evict; a table of TTFT p50 / p90
    and output tokens/s per rate, a closing line per rate, and with --plot TTFT against load.
    Exits 0 when offload is exact at every rate."""
    from .model import init_params

    params = init_params(model, args.seed)
    points = []
    for rate, convs in sweep:
        results = {}
        for name in SWEEP_RUNS:
            primary, secondary = pools[name]
            results[name] = serving.run(
                model, params, convs, primary_blocks=primary, secondary_blocks=secondary,
                progress=_Progress(f"{name} @{rate:g}/s", not args.no_progress),
                name=f"{name}@{rate:g}", **common)
        points.append(sweep_point(model, rate, results))
    exact = print_sweep(args, cfg, model, points)
    if args.plot:
        plot_sweep(args.plot, points)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if exact else 1
