"""The connector section: the host time of the scheduler side's calls for one serving step.

A step as the h200 chats preset makes one (16-token blocks, a host pool of 16,384 blocks kept
full): one turn admitted whose prompt of 396 blocks (6,336 tokens, a fifth turn) the host pool
holds but for its last block (`lookup`, `prepare_load`, `touch`, `complete_load`), and the 128
blocks that the step's 2,048-token prefill budget computes stored (`prepare_store`, each
evicting one stored the step before, and `complete_store`), then `take_events`. The engine's hashes are ints. No
device is involved: this is the Python the engine's scheduler runs each step. Reported: the
median and 90th percentile of a step over many, and each call's median. Then the host case
(host_step.py): the block manager's calls of a whole demo step.
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

from ..connector import OffloadingManager
from .helpers import median
from .host_step import host_line, run_host

TARGET_S = 0.3e-3  # a step's scheduler-side calls, at most
DECODED_PRIORITY = 20  # the step's new blocks: below the prompts' default 35


class ConnectorMixin:
    def run_connector(self, sec: dict[str, Any]) -> None:
        host, prompt, stored, steps = ((1024, 64, 16, 50) if self.cfg.quick
                                       else (16384, 396, 128, 400))
        mgr = OffloadingManager(host, block_size=16, offload_min_priority=0)
        fresh = itertools.count(1)
        chains = []  # prompts the host pool holds, each a chain of `prompt` hashes
        while mgr.num_free_host_blocks >= prompt + stored:  # and rows for a step's blocks
            chain = [next(fresh) for _ in range(prompt)]
            mgr.complete_store(mgr.prepare_store(chain).block_hashes_to_store)
            chains.append(chain)
        filler = [next(fresh) for _ in range(mgr.num_free_host_blocks)]  # a full pool
        mgr.complete_store(mgr.prepare_store(filler, priority=DECODED_PRIORITY)
                           .block_hashes_to_store)
        mgr.take_events()
        pick = random.Random(0)
        calls: dict[str, list[float]] = {}
        totals = []
        for step in range(steps):
            chain = pick.choice(chains) + [next(fresh)]
            new = [next(fresh) for _ in range(stored)]
            t0 = time.perf_counter()
            marks = [t0]
            n = mgr.lookup(chain)
            marks.append(time.perf_counter())
            mgr.prepare_load(chain[:n])
            marks.append(time.perf_counter())
            mgr.touch(chain)
            marks.append(time.perf_counter())
            mgr.complete_load(chain[:n])
            marks.append(time.perf_counter())
            # of a lower priority than the prompts: each evicts the last step's blocks, and
            # the prompts stay held
            out = mgr.prepare_store(new, priority=DECODED_PRIORITY)
            marks.append(time.perf_counter())
            mgr.complete_store(out.block_hashes_to_store)
            marks.append(time.perf_counter())
            mgr.take_events()
            marks.append(time.perf_counter())
            totals.append(marks[-1] - t0)
            for name, a, b in zip(("lookup", "prepare_load", "touch", "complete_load",
                                   "prepare_store", "complete_store", "take_events"),
                                  marks, marks[1:]):
                calls.setdefault(name, []).append(b - a)
            if n != prompt or len(out.block_hashes_evicted) != stored:
                raise RuntimeError(f"connector bench: step {step} found {n} of {prompt} "
                                   f"blocks and evicted {len(out.block_hashes_evicted)}")
        totals.sort()
        sec.update({"host_blocks": host, "prompt_blocks": prompt, "stored_blocks": stored,
                    "steps": steps, "step_s": median(totals),
                    "step_p90_s": totals[int(0.9 * (len(totals) - 1))],
                    "calls_s": {k: median(v) for k, v in calls.items()}, "target_s": TARGET_S})
        self.log("connector: " + connector_line(sec))
        sec["host"] = run_host(self.cfg.quick)  # the block manager's calls a demo step makes
        self.log("connector: " + host_line(sec["host"]))
        self.save()


def connector_line(sec: dict[str, Any]) -> str:
    calls = ", ".join(f"{k} {v * 1e6:.0f}" for k, v in sec["calls_s"].items())
    verdict = "within" if sec["step_s"] <= sec["target_s"] else "OVER"
    return (f"a step's scheduler-side calls ({sec['prompt_blocks']}-block prompt, "
            f"{sec['stored_blocks']} blocks stored, {sec['host_blocks']:,} host blocks): "
            f"median {sec['step_s'] * 1e3:.3f} ms, p90 {sec['step_p90_s'] * 1e3:.3f} ms, "
            f"{verdict} the {sec['target_s'] * 1e3:.1f} ms budget; per call (µs): {calls}")


def connector_summary(sec: dict[str, Any]) -> list[str]:
    lines = [connector_line(sec)] if "step_s" in sec else []
    if "host" in sec:
        lines.append(host_line(sec["host"]))
    return [f"connector: {line}" for line in lines]
