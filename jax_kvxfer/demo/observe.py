"""The demo's KV events and metrics: `--kv-events ENDPOINT`, `--metrics-port PORT`, and
`--events-overhead`, which serves the offload run twice in one process, with events and
metrics off then on, and reports the change in step time."""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import threading
import urllib.request

from ..observe import events as kv_events
from ..observe import metrics as kv_metrics
from . import serving


def add_options(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish every run's KV events in vLLM's format on this ZMQ endpoint "
                        "(tcp://*:5557 binds; pip install \"jax_kvxfer[events]\")")
    p.add_argument("--kv-events-replay", default=None, metavar="URL",
                   help="with --kv-events: the replay (ROUTER) endpoint, e.g. tcp://*:5558")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics on 127.0.0.1:PORT/metrics "
                        "(pip install \"jax_kvxfer[metrics]\")")
    p.add_argument("--events-overhead", action="store_true",
                   help="serve the offload run twice, KV events and metrics off then on (a "
                        "subscriber and a scrape a second), and report the change in step time")


def start(args: argparse.Namespace) -> None:
    """--kv-events and --metrics-port: every block manager made from now on reports.
    Checks the options first (ValueError)."""
    if args.events_overhead and (args.kv_events is not None or args.metrics_port is not None):
        raise ValueError("--events-overhead makes its own publisher and metrics server; "
                         "drop --kv-events and --metrics-port")
    if args.kv_events_replay is not None and args.kv_events is None:
        raise ValueError("--kv-events-replay needs --kv-events")
    if args.kv_events is not None:
        pub = kv_events.KVEventPublisher(args.kv_events, replay_endpoint=args.kv_events_replay)
        kv_events.publish_by_default(pub)
        atexit.register(pub.close)
        print(f"kv events: {pub.endpoint} (replay: {pub.replay_endpoint})", file=sys.stderr)
    if args.metrics_port is not None:
        server = kv_metrics.start_metrics_server(args.metrics_port)
        atexit.register(server.close)
        print(f"metrics: {server.url}", file=sys.stderr)


class _Consumers:
    """What a router and Prometheus would do: a SUB socket reading every batch, a scrape a
    second."""

    def __init__(self, endpoint: str, url: str) -> None:
        import zmq

        self.batches = self.scrapes = 0
        self._stop = threading.Event()
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, "")
        self._sub.connect(endpoint)
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._scrape, args=(url,), daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(100):
                self._sub.recv_multipart()
                self.batches += 1

    def _scrape(self, url: str) -> None:
        while not self._stop.wait(1.0):
            with urllib.request.urlopen(url, timeout=10) as r:
                r.read()
            self.scrapes += 1

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()
        self._sub.close()


def overhead(args: argparse.Namespace, model, convs, pool_sizes: tuple[int, int],
             common: dict, real) -> int:
    """--events-overhead: the offload run off, then on; one line with the change (and --json's
    object). Returns 0."""
    import jax

    from .model import init_params

    params = init_params(model, args.seed) if real is None else \
        {k: jax.numpy.asarray(v) for k, v in real[0].items()}
    primary, secondary = pool_sizes
    results, extra = {}, {}
    for name in ("offload", "offload+events"):
        consumers = pub = server = None
        if name == "offload+events":
            pub = kv_events.KVEventPublisher("tcp://127.0.0.1:*")
            kv_events.publish_by_default(pub)
            server = kv_metrics.start_metrics_server(0)
            consumers = _Consumers(pub.endpoint, server.url)
        try:
            results[name] = serving.run(model, params, convs, primary_blocks=primary,
                                        secondary_blocks=secondary, name=name, **common)
        finally:
            if pub is not None:
                kv_events.publish_by_default(None)
                consumers.stop()
                pub.close()
                server.close()
                extra = {"batches_published": pub.sent_batches,
                         "batches_dropped": pub.dropped_batches,
                         "batches_received": consumers.batches, "scrapes": consumers.scrapes}
    step = {n: r.seconds / max(r.steps, 1) for n, r in results.items()}
    ratio = step["offload+events"] / step["offload"]
    out = {"step_ms": {n: s * 1e3 for n, s in step.items()},
           "steps": {n: r.steps for n, r in results.items()},
           "seconds": {n: r.seconds for n, r in results.items()}, "ratio": ratio, **extra}
    if args.json:
        print(json.dumps({"events_overhead": out}))
    else:
        for n in results:
            print(f"{n:16s} steps {out['steps'][n]:6d}  {out['seconds'][n]:8.2f} s  "
                  f"step {out['step_ms'][n]:8.3f} ms")
        print(f"kv events: {extra['batches_published']} batches published, "
              f"{extra['batches_dropped']} dropped, {extra['batches_received']} received; "
              f"{extra['scrapes']} scrapes")
    print(f"events+metrics overhead: step time {out['step_ms']['offload']:.3f} ms -> "
          f"{out['step_ms']['offload+events']:.3f} ms, {(ratio - 1) * 100:+.2f} %",
          file=sys.stderr if args.json else sys.stdout)
    return 0
