"""The connector section's host case: the block manager's host time a serving step, no model.

The demo's Server calls at the h200 chats preset's sizes (16-token blocks, 3,840 GPU and 16,384
host blocks, 16 rows, a 2,048-token prefill budget, 1,024-token system prompt and turns, 32
tokens generated a turn): each step admits what the rows and the GPU pool allow
(`match_prefix`, `add_sequence`), hands the transfers over (`sync_transfers(block=False)`),
reads the prefilling rows' block tables, appends each decoded token and releases the turns that
end. The pools are CPU ones of one float a token: the host time is what is measured.
Reported: the mean and median of a step (the demo sums the phase: the mean is what it shows)
over repeats of the whole run, their spread, and cProfile's top entries of one more run.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from typing import Any

import numpy as np

from ..cache import BlockManager
from ..transfer.pool import KVCacheBlockPool
from .helpers import by_own_time, median

H200 = {"tokens_per_block": 16, "primary": 3840, "secondary": 16384, "batch": 16,
        "budget": 2048, "turn_tokens": 1024, "gen": 32, "conversations": 48, "turns": 5,
        "steps": 400, "repeats": 3}
QUICK = {"tokens_per_block": 8, "primary": 160, "secondary": 480, "batch": 4, "budget": 64,
         "turn_tokens": 40, "gen": 6, "conversations": 8, "turns": 3, "steps": 60,
         "repeats": 2}


def drive(p: dict[str, int], seed: int = 0, prof: cProfile.Profile | None = None) -> list[float]:
    """Runs the chats workload's block-manager calls for p["steps"] steps; each step's seconds
    (`prof`: profiles the steps alone)."""
    t = p["tokens_per_block"]
    pool = KVCacheBlockPool.create(num_layers=1, num_kv_heads=1, size_per_head=1,
                                   tokens_per_block=t, dtype="float32",
                                   num_primary_blocks=p["primary"],
                                   num_secondary_blocks=p["secondary"])
    bm = BlockManager(pool)
    # drawn up front: the workload's own Python is no part of the time measured
    stream = np.random.default_rng(seed).integers(0, 128256, size=1 << 22).tolist()
    drawn = 0

    def fresh(n: int) -> list[int]:
        nonlocal drawn
        drawn = (drawn + n) % (len(stream) - n)
        return stream[drawn:drawn + n]

    history = {c: fresh(p["turn_tokens"]) for c in range(p["conversations"])}  # system prompt
    turn = dict.fromkeys(history, 0)
    waiting, running, reserved, times = list(history), [], 0, []
    for _ in range(p["steps"]):
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        while waiting and len(running) < p["batch"]:  # Server._admit
            c = waiting[0]
            if turn[c] == p["turns"]:  # a conversation ended: a new one, same system prompt
                history[c], turn[c] = history[c][:p["turn_tokens"]], 0
            prompt = history[c] + fresh(p["turn_tokens"])
            need = -(-(len(prompt) + p["gen"]) // t)
            if reserved + need > p["primary"]:
                break
            waiting.pop(0)
            bm.match_prefix(prompt)
            key = (c, turn[c])
            start = bm.add_sequence(key, prompt)
            reserved += need
            running.append({"key": key, "prompt": prompt, "next": start, "out": [],
                            "need": need, "n": 0})
        left = p["budget"]  # the prefill budget, in admission order
        for r in running:
            if r["next"] < len(r["prompt"]):
                r["n"] = min(left, len(r["prompt"]) - r["next"])
                left -= r["n"]
            else:
                bm.num_tokens(r["key"])
        bm.sync_transfers(block=False)
        for r in running:
            if r["n"]:
                bm.block_table(r["key"])
        for r in list(running):  # Server.collect
            r["next"] += r["n"]
            r["n"] = 0
            if r["next"] < len(r["prompt"]):  # still prefilling
                continue
            token = fresh(1)[0]
            r["out"].append(token)
            if len(r["out"]) < p["gen"]:
                bm.append_tokens(r["key"], [token])
                continue
            running.remove(r)
            reserved -= r["need"]
            bm.release_sequence(r["key"])
            c = r["key"][0]
            history[c] = r["prompt"] + r["out"]
            turn[c] += 1
            waiting.append(c)
        times.append(time.perf_counter() - t0)
        if prof is not None:
            prof.disable()
    stats = bm.stats
    if stats.reused_tokens == 0:
        raise RuntimeError(f"host step bench: no prefix reused in {p['steps']} steps")
    bm.close()
    return times


def run_host(quick: bool, top: int = 12) -> dict[str, Any]:
    """The host case's results: per-step mean and median over repeats, and a profile."""
    p = QUICK if quick else H200
    drive(p)  # warm-up: imports, first allocations
    means, medians = [], []
    for rep in range(p["repeats"]):
        times = drive(p, seed=rep)
        means.append(sum(times) / len(times))
        medians.append(median(times))
    prof = cProfile.Profile()
    drive(p, prof=prof)
    total = pstats.Stats(prof).total_tt or 1.0
    profile = [{"function": fn, "calls": nc, "own_share": tt / total}
               for fn, nc, tt in by_own_time(prof, top)]
    return {"steps": p["steps"], "repeats": p["repeats"], "sizes": dict(p),
            "step_mean_s": median(means), "step_mean_spread_s": [min(means), max(means)],
            "step_median_s": median(medians), "profile": profile}


def host_line(h: dict[str, Any]) -> str:
    lo, hi = h["step_mean_spread_s"]
    top = ", ".join(f"{e['function']} {e['own_share']:.0%}" for e in h["profile"][:4])
    return (f"block manager host time a step ({h['steps']} steps x {h['repeats']} runs): mean "
            f"{h['step_mean_s'] * 1e3:.3f} ms ({lo * 1e3:.3f}-{hi * 1e3:.3f}), median "
            f"{h['step_median_s'] * 1e3:.3f} ms; top own time: {top}")
