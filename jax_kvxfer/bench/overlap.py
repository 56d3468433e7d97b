"""The overlap section: an offload running alongside a compute-bound matmul chain."""

from __future__ import annotations

import functools
import gc
import math
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import on_stream
from ..ops import copy_blocks
from ..testing import dma_batches
from .config import DTYPE, MiB, fmt_size, geometry_for
from .helpers import block_on, clamp, err_text, median


class OverlapMixin:
    """`Bench`'s overlap section (uses `BenchCore`'s state and helpers)."""

    def run_overlap(self) -> None:
        cfg = self.cfg
        sec: dict[str, Any] = {}
        self.sections["overlap"] = sec
        if self.hsh is None:
            sec["skipped"] = "no pinned_host memory"
            return
        geom = geometry_for(cfg.overlap_block)
        nb = max(1, cfg.overlap_bytes // geom.block_bytes)
        total = nb * geom.block_bytes
        N = cfg.matmul_dim
        sec.update({"block_bytes": geom.block_bytes, "blocks": nb, "bytes": total,
                    "matmul_dim": N, "paths": {}})
        self.log(f"== overlap: offload {total / MiB:.0f} MiB ({nb} x {fmt_size(geom.block_bytes)})"
                 f" during a {N}x{N} bf16 matmul chain ==")
        try:
            src = self.random_pool(geom, nb, self.dsh)
            st = {"dst": self.zero_pool(geom, nb, self.hsh)}
            si, di = self.perms(1, nb, nb)[0], self.perms(1, nb, nb)[0]
            si_dev, di_dev = jnp.asarray(si), jnp.asarray(di)
            # the DMA variants read their indices on the host: jit arguments in pinned_host
            si_pin, di_pin = jax.device_put((si, di), self.hsh)
            block_on([si_pin, di_pin])
            x = self.matrix(N, 2.0)
            w = self.matrix(N, 2.0 * math.sqrt(3.0 / N))
            block_on([src, st["dst"], x, w])

            def matmuls(x: jax.Array, w: jax.Array, iters: int) -> jax.Array:
                for _ in range(iters):
                    x = jnp.dot(x, w, preferred_element_type=jnp.float32).astype(DTYPE)
                return x

            # ours: the custom call on XLA's compute stream; ours_stream*: on a GPU stream of its
            # own, with the default grid cap (HOST_COPY_CTAS) or another one; step_stream: the
            # matmuls on a GPU stream of their own too; dma: the copy engines, no SMs
            ours_options = {"ours": {}, "ours_stream": {"stream": 1},
                            "ours_stream_4ctas": {"stream": 1, "max_ctas": 4},
                            "ours_stream_32ctas": {"stream": 1, "max_ctas": 32},
                            "ours_stream_step_stream": {"stream": 1, "step_stream": 2},
                            "ours_stream_step_stream_1cta": {"stream": 1, "step_stream": 2,
                                                             "max_ctas": 1},
                            "ours_stream_step_stream_nocap": {"stream": 1, "step_stream": 2,
                                                              "max_ctas": 1 << 20},
                            "ours_dma_stream": {"stream": 1, "dma": True},
                            "ours_dma_stream_step_stream": {"stream": 1, "step_stream": 2,
                                                            "dma": True},
                            # as a decode step does, the step also writes one token row of
                            # every block of the pool being offloaded, in place: XLA must
                            # order the offload's read before that write (or copy the pool)
                            "ours_dma_stream_step_writes_src": {"stream": 1, "step_stream": 2,
                                                                "dma": True, "writes_src": True}}
            step_only = ("step_stream", "writes_src")  # options of the step, not of the copy

            def indices(name: str) -> tuple[jax.Array, jax.Array]:
                return (si_pin, di_pin) if "dma" in name else (si_dev, di_dev)

            def offload_fn(options: dict[str, int]) -> Callable[..., jax.Array]:
                kw = {k: v for k, v in options.items() if k not in step_only}
                return lambda dst, s, a, b: copy_blocks(dst, s, a, b, **kw)

            offloads = {name: offload_fn(o) for name, o in ours_options.items()}
            ours_fns = {name: jax.jit(f, donate_argnums=0, out_shardings=self.hsh)
                        for name, f in offloads.items()}
            xla_fn = jax.jit(lambda s, a: s[a], out_shardings=self.hsh)

            def ours_call(name: str) -> jax.Array:
                st["dst"] = ours_fns[name](st["dst"], src, *indices(name))
                return st["dst"]

            transfer: dict[str, float] = {}
            errors: dict[str, str] = {}
            transfer_calls: dict[str, Callable[[], Any]] = {
                name: functools.partial(ours_call, name) for name in ours_fns}
            transfer_calls["xla"] = lambda: xla_fn(src, si_dev)
            for name, call in transfer_calls.items():
                try:
                    transfer[name] = median(self.time_jax(call, pipe=1)[0])
                except Exception as e:  # noqa: BLE001
                    errors[name] = err_text(e)
            cu = self.cupy
            if cu is not None:
                try:
                    cu.ensure_arena(total)
                    dp, sp = cu.ptr("host_b"), cu.ptr("dev_a")
                    times, _ = cu.time_ops(lambda s: cu.memcpy(dp, sp, total, s), reps=1,
                                           samples=cfg.repeats, warmup=cfg.warmup, gpu_only=True)
                    transfer["memcpy_side_stream"] = median(times)
                except Exception as e:  # noqa: BLE001
                    errors["memcpy_side_stream"] = err_text(e)

            # calibrate the step to last about as long as the slowest transfer
            probe_iters = 4
            probe = jax.jit(lambda a, b: matmuls(a, b, probe_iters))
            t_probe = median(self.time_jax(lambda: probe(x, w), pipe=1)[0])
            per_iter = max(t_probe / probe_iters, 1e-7)
            # as long as our default offload (a slower variant would lengthen every step)
            goal = transfer.get("ours", max(transfer.values())) if transfer else t_probe
            iters = clamp(round(goal / per_iter), 1, 2000 if not cfg.quick else 64)
            step = jax.jit(lambda a, b: matmuls(a, b, iters))
            step_s = median(self.time_jax(lambda: step(x, w), pipe=1)[0])
            flops = 2.0 * N ** 3 * iters
            sec.update({"step_iters": iters, "step_s": step_s,
                        "step_tflops": flops / step_s / 1e12})
            self.log(f"overlap: step {iters} matmuls = {step_s * 1e3:.2f} ms "
                     f"({flops / step_s / 1e12:.0f} TFLOP/s)")

            def both_fn(name: str) -> Callable[..., Any]:
                def run(a: jax.Array, b: jax.Array) -> jax.Array:
                    return matmuls(a, b, iters)

                def run_and_write(a: jax.Array, b: jax.Array, s: jax.Array) -> Any:
                    y = matmuls(a, b, iters)  # the new token row comes from the step's output
                    row = y[:1, :1].astype(s.dtype).reshape((1,) * s.ndim)
                    return y, s.at[:, :, :, :, 0:1, :].set(jnp.broadcast_to(
                        row, s.shape[:4] + (1,) + s.shape[5:]))

                options, offload = ours_options[name], offloads[name]
                if options.get("writes_src"):
                    step_w = on_stream(run_and_write, options["step_stream"],
                                       jax.memory.Space.Device)

                    def both(a, b, dst, s, i, j):
                        dst = offload(dst, s, i, j)  # called first: it reads s before the write
                        y, s = step_w(a, b, s)
                        return y, dst, s
                    return both
                step_part = run if "step_stream" not in options else on_stream(
                    run, options["step_stream"], jax.memory.Space.Device)
                return lambda a, b, dst, s, i, j: (step_part(a, b), offload(dst, s, i, j))

            ours_both = {name: jax.jit(both_fn(name), donate_argnums=(2, 3),
                                       out_shardings=(self.dsh, self.hsh, self.dsh))
                         if ours_options[name].get("writes_src") else
                         jax.jit(both_fn(name), donate_argnums=2,
                                 out_shardings=(self.dsh, self.hsh))
                         for name in ours_options}
            # the pool that the writing step updates in place (a copy: `src` stays as it is)
            st["src_w"] = jnp.copy(src)
            xla_both = jax.jit(lambda a, b, s, i: (matmuls(a, b, iters), s[i]),
                               out_shardings=(self.dsh, self.hsh))

            def ours_both_call(name: str) -> Any:
                if ours_options[name].get("writes_src"):
                    y, st["dst"], st["src_w"] = ours_both[name](x, w, st["dst"], st["src_w"],
                                                                *indices(name))
                    return y, st["dst"], st["src_w"]
                y, st["dst"] = ours_both[name](x, w, st["dst"], src, *indices(name))
                return y, st["dst"]

            both_calls: dict[str, Callable[[], Any]] = {
                name: functools.partial(ours_both_call, name) for name in ours_both}
            both_calls["xla"] = lambda: xla_both(x, w, src, si_dev)
            if cu is not None and "memcpy_side_stream" in transfer:
                dp, sp = cu.ptr("host_b"), cu.ptr("dev_a")

                def memcpy_both() -> Any:
                    y = step(x, w)  # dispatched, runs on XLA's stream
                    cu.memcpy(dp, sp, total, cu.stream)  # meanwhile on a cupy stream
                    cu.stream.synchronize()
                    return y

                both_calls["memcpy_side_stream"] = memcpy_both

            for name, call in both_calls.items():
                res: dict[str, Any] = {}
                if name in errors:
                    res["error"] = errors[name]
                elif self.past_deadline():
                    res["skipped"] = "past the deadline"
                else:
                    try:
                        before = dma_batches()
                        both_s = median(self.time_jax(call, pipe=1)[0])
                        used = None if before is None else dma_batches() > before
                        t = transfer[name]
                        res = {"transfer_s": t, "transfer_gbps": total / t / 1e9, "step_s": step_s,
                               "both_s": both_s, "no_overlap_sum_s": t + step_s,
                               "added_to_step": both_s / step_s - 1,
                               "transfer_hidden": (t + step_s - both_s) / t}
                        if "dma" in name and used is not None:
                            res["dma_used"] = used
                        writes = ours_options.get(name, {}).get("writes_src", False)
                        source = st["src_w"] if writes else src
                        if name in ours_both:
                            res["schedule"] = schedule_summary(ours_both[name], x, w, st["dst"],
                                                               source, *indices(name))
                        if name.startswith("ours"):  # the pool it wrote holds the blocks
                            ends = [0, nb - 1]
                            # (token row 0 of the written pool: the step rewrites it after
                            # the offload has read it)
                            rows = slice(1, None) if writes else slice(None)
                            res["verified"] = bool(np.array_equal(
                                self.fetch(st["dst"], di[ends])[..., rows, :],
                                self.fetch(source, si[ends])[..., rows, :]))
                        self.log(f"overlap {name}: transfer {t * 1e3:.2f} ms "
                                 f"({total / t / 1e9:.1f} GB/s), step {step_s * 1e3:.2f} ms, "
                                 f"both {both_s * 1e3:.2f} ms, sum {(t + step_s) * 1e3:.2f} ms "
                                 f"-> +{res['added_to_step']:.1%} on the step")
                    except Exception as e:  # noqa: BLE001
                        res["error"] = err_text(e)
                        self.log(f"overlap {name}: ERROR {res['error'][:300]}")
                sec["paths"][name] = res
            if cu is None:
                sec["note"] = self.cupy_note
        except Exception as e:  # noqa: BLE001
            sec["error"] = err_text(e)
            sec["traceback"] = traceback.format_exc(limit=6)
            self.log(f"overlap: ERROR {sec['error'][:300]}")
        gc.collect()
        self.save()


def schedule_summary(fn: Any, *args: Any) -> str:
    """The order XLA gave the entry computation's work, compacted: G a GEMM, C our custom call,
    c another custom call, f a fusion, S/D an async start/done (a stream annotation), cs/cd a
    copy start/done."""
    try:
        text = fn.lower(*args).compile().as_text()
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"unavailable: {err_text(e)[:200]}"
    entry = text[text.find("ENTRY"):]
    entry = entry[:entry.find("\n}") if "\n}" in entry else len(entry)]
    kinds = []
    for line in entry.splitlines()[1:]:
        for key, tag in (("copy-start", "cs"), ("copy-done", "cd"), ("-start", "S"),
                         ("-done", "D"), ("jax_kvxfer", "C"), ("cublas", "G"),
                         ("custom-call", "c"), ("fusion(", "f"), ("call(", "call")):
            if key in line:
                kinds.append(tag)
                break
    out: list[str] = []
    for tag in kinds:  # run-length: "G x27"
        if out and out[-1].split(" x")[0] == tag:
            head, _, count = out[-1].partition(" x")
            out[-1] = f"{head} x{int(count or 1) + 1}"
        else:
            out.append(tag)
    return " ".join(out)
