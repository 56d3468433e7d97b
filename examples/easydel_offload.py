"""EasyDeL's eSurge engine under a small page budget on CPU, without and with jax_kvxfer's
host pool below its prefix cache (`jax_kvxfer.integrations.easydel.enable_offloading`).

Serves a tiny random-weight Llama (2 layers, 2 KV heads, head_dim 16, vocabulary 256) in
eSurge with ``enable_prefix_caching=True`` and a KV page pool too small to keep every prompt's
pages: prompts of three families share long prefixes, and the order revisits a family after
the other two have evicted its pages. Greedy decoding, fixed seeds, one request at a time, so
the run is deterministic. It serves the prompts twice, on fresh engines: without offloading,
then with it, and prints each prompt's generated token ids, the prefill tokens the engine
computed and the pages its prefix cache hit; the last line compares the two runs.

What works on this machine (CPU, Python 3.11; found by trying, December 2026):
  - jax and jaxlib 0.10.2; easydel 0.3.0 and ejkernel 0.0.78 installed with ``--no-deps``
    (ejkernel 0.0.78 pins jax~=0.9, which pip cannot resolve together with jax 0.10); their
    declared requirements otherwise, with the core ``ray`` wheel instead of ``ray[default]``
    (easydel imports ray at import time), pillow (imported by eSurge, not declared) and torch
    (CPU build 2.13.0+cpu here; any easydel model import reaches a transformers class that
    needs it). ``scripts/easydel-check.sh`` builds that virtualenv and runs this script in it.
  - ``EASYDEL_AUTO=0`` (set below before easydel is imported): easydel otherwise appends
    GPU-only ``XLA_FLAGS`` that abort jaxlib 0.10.2. ``ENABLE_DISTRIBUTED_INIT=0`` skips its
    jax.distributed probe, ``JAX_PLATFORMS=cpu`` its TPU probe.
  - ``PYTHONHASHSEED`` set (below, before the engine is built): eSurge's first page hash
    starts from ``hash(seed)``, or from ``os.urandom`` without it; with it the page hashes
    repeat from run to run.
  - Patch: the KV page budget comes from ``per_device_hbm_budget_bytes`` (CPU devices report no
    memory stats, so it returns 4 GiB); the script replaces it in
    ``easydel.caching.ragged_page.cache`` so that the pool gets exactly ``--num-pages`` pages.
  - No network: the tokenizer is a WordLevel ``tokenizers`` model ("t3" .. "t255" map to ids
    3 .. 255) wrapped in ``transformers.PreTrainedTokenizerFast``, saved to a temporary folder
    (eSurge's tokenizer workers load it by path; special tokens are named so that no word
    contains one: transformers matches added tokens inside words).
  - ``overlap_execution=False``: one model step at a time (schedule, run, update), the order a
    connector acting between steps needs.
  - The first run autotunes the attention kernel (about a minute; ejkernel keeps the result in
    ~/ejkernel-presistent-cache); later runs build an engine in about 25 s, and each engine's
    ``terminate()`` waits 5 s (eSurge joins its loop while holding the loop's lock).

Expected (deterministic): without offloading the engine computes all 1,392 prompt tokens (each
revisit finds its prefix evicted); with it, 528 (0.38x): every revisit loads its 6 prefix pages
from the host pool (54 pages, none of them a page eSurge still held) and computes its 20-token
tail, and the generated tokens are identical. ``--reference`` adds a run whose pool never
evicts (64 pages), the most prefix caching can save: the same 528.

``--disk --restart`` (with few ``--host-blocks``) serves the prompts once more on a new engine
over the same disk folder, its page hashes seeded otherwise (another process's), every prompt
submitted at once: its first visits find the first engine's pages on the disk, since the
connector keys pages by their tokens, not by eSurge's hashes, and the pages of the prompts
waiting their turn are read ahead.

Usage: scripts/easydel-check.sh [--num-pages N] [--max-tokens N] [--reference]
       [--host-blocks N] [--disk [--restart]]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("EASYDEL_AUTO", "0")
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ENABLE_DISTRIBUTED_INIT", "0")

VOCAB = 256
PAGE_SIZE = 16
SEED = 0
VISITS = 4


def make_tokenizer(folder: str):
    """A WordLevel tokenizer ("<pad>" 0, "</s>" 1, "<s>" 2, then "t3" .. "t255" for ids 3 ..
    255; no special tokens added), saved to folder and loaded back from it: eSurge's tokenizer
    and detokenizer workers load it by its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2} | {f"t{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<pad>", pad_token="<pad>",
                            eos_token="</s>", bos_token="<s>").save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def make_prompts(rng) -> list[tuple[str, list[int]]]:
    """(name, token ids): three families, each a 96-token prefix (6 pages) and a 20-token
    tail; the order A B C A B C ... visits each family VISITS times, each visit after the other
    two families have run (and, with a small pool, evicted its pages)."""
    prefixes = {f: rng.integers(3, VOCAB, size=96).tolist() for f in "ABC"}
    prompts = []
    for visit in range(VISITS):
        for fam in "ABC":
            tail = rng.integers(3, VOCAB, size=20).tolist()
            prompts.append((f"{fam}{visit + 1}", prefixes[fam] + tail))
    return prompts


def patch_page_budget(num_pages: int, page_bytes: int) -> None:
    """CPU devices report no memory stats: make eSurge's page-pool sizing give num_pages."""
    import easydel.caching.ragged_page.cache as ragged
    import easydel.caching.unified_attention.cache as unified

    def budget(util: float = 0.9, mode: str = "free", safety_margin: int = 0) -> int:
        return num_pages * page_bytes

    ragged.per_device_hbm_budget_bytes = budget
    unified.per_device_hbm_budget_bytes = budget


def build_engine(args, folder: str, num_pages: int):
    """A fresh eSurge over the same random-weight model (the same seed every time)."""
    import easydel as ed
    import jax.numpy as jnp
    from flax import nnx

    config = ed.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=args.max_model_len, eos_token_id=1, bos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False)
    model = ed.LlamaForCausalLM(config=config, dtype=jnp.float32, param_dtype=jnp.float32,
                                rngs=nnx.Rngs(SEED))
    # eSurge sizes the pool as budget // (2 * layers * page_size * kv_heads * head_dim * 2):
    # its KV cache is bfloat16 whatever the model's dtype
    page_bytes = 2 * config.num_hidden_layers * PAGE_SIZE * 2 * 16 * 2
    patch_page_budget(num_pages, page_bytes)
    engine = ed.eSurge(
        model=model, tokenizer=make_tokenizer(folder), dtype=jnp.float32,
        max_model_len=args.max_model_len, max_num_seqs=2, page_size=PAGE_SIZE,
        hbm_utilization=0.5, enable_prefix_caching=True, overlap_execution=False,
        async_scheduling=False, silent_mode=True, esurge_name="kvxfer-example")
    assert engine.scheduler.kv_cache_manager.page_pool.num_pages == num_pages
    return engine


class PrefillCounter:
    """Counts, per prompt, the tokens the prefix cache supplied and the tokens left to compute,
    by wrapping the scheduler's CacheManager.get_computed_pages (called once per admission:
    the scheduler's prefix lookup, core/manager.py)."""

    def __init__(self, engine):
        self.manager = engine.scheduler.kv_cache_manager
        self.calls: list[tuple[str, int, int]] = []  # (request id, tokens, cache-hit tokens)
        inner = self.manager.get_computed_pages

        def get_computed_pages(request, **kw):
            pages, hit = inner(request, **kw)
            self.calls.append((request.request_id, request.num_tokens, hit))
            return pages, hit

        self.manager.get_computed_pages = get_computed_pages

    def of(self, request_id: str, start: int) -> tuple[int, int]:
        """(prefill tokens computed, pages hit) of a request admitted after call index start:
        its last call is its admission's (the connector asks once more after loading)."""
        n, hit = [(n, hit) for rid, n, hit in self.calls[start:] if rid == request_id][-1]
        return n - hit, hit // PAGE_SIZE


def serve(engine, counter: PrefillCounter, prompts, max_tokens: int, label: str,
          together: bool = False) -> dict:
    """Each prompt in turn (one request at a time), or all of them submitted `together` (the
    engine runs two at a time, the others wait); greedy; what each computed and got."""
    from easydel.inference.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                            seed=SEED)
    out = {"generated": {}, "prefill": {}, "hits": {}}
    t0 = time.perf_counter()
    for batch in ([prompts] if together else [[p] for p in prompts]):
        mark = len(counter.calls)
        texts = [" ".join(f"t{i}" for i in ids) for _, ids in batch]
        ids_of = [f"{label}-{name}" for name, _ in batch]
        results = {res.request_id: res for res in
                   engine.generate(texts, params, request_id=ids_of, use_tqdm=False)}
        for (name, ids), rid in zip(batch, ids_of):
            res = results[rid]
            gen = list(res.outputs[0].token_ids)
            assert list(res.prompt_token_ids[0]) == ids, "the tokenizer changed the prompt"
            prefill, hits = counter.of(rid, mark)
            out["generated"][name] = gen
            out["prefill"][name] = prefill
            out["hits"][name] = hits
            print(f"[{label}] {name}: prompt {len(ids)} tokens, prefill computed {prefill}, "
                  f"pages hit {hits}, generated {gen}")
    out["seconds"] = time.perf_counter() - t0
    out["prefill_total"] = sum(out["prefill"].values())
    out["hits_total"] = sum(out["hits"].values())
    return out


def run(args, prompts, label: str, num_pages: int, offload=None, together: bool = False) -> dict:
    """Builds an engine, optionally lets offload(engine) hook it, serves the prompts (`serve`),
    stops it."""
    import jax

    folder = tempfile.mkdtemp(prefix="kvxfer-easydel-tok-")
    try:
        t0 = time.perf_counter()
        engine = build_engine(args, folder, num_pages)
        counter = PrefillCounter(engine)
        # after the counter: the connector wraps get_computed_pages in turn, so that the pages
        # it loads count as the prefix cache's hits
        attached = offload(engine) if offload is not None else None
        print(f"[{label}] eSurge on {jax.devices()[0].platform}: {num_pages} pages of "
              f"{PAGE_SIZE} tokens (page 0 is its null page), built in "
              f"{time.perf_counter() - t0:.1f} s")
        out = serve(engine, counter, prompts, args.max_tokens, label, together)
        if attached is not None:
            attached.disable()
            out["report"] = attached.report
            out["recompute_s"] = attached.manager.recompute_s_per_token
            out["store_skipped"] = attached.manager.get_and_reset_stats().store_skipped
        engine.terminate()  # eSurge 0.3.0 joins its loop holding the loop's lock: 5 s
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-pages", type=int, default=14,
                    help="KV pages in eSurge's pool (page 0 is its null page; default 14: the "
                         "revisits find 1 of their 4 prefix pages)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--reference", action="store_true",
                    help="also run with a pool that never evicts (64 pages): the most the "
                         "prefix cache can save; its tokens must equal the baseline's")
    ap.add_argument("--host-blocks", type=int, default=64,
                    help="host blocks of the offloading run")
    ap.add_argument("--disk", action="store_true",
                    help="a disk tier below the host pool (a FileStore in a temporary folder): "
                         "with few --host-blocks, revisits read their pages back from it")
    ap.add_argument("--restart", action="store_true",
                    help="--disk, then serve the prompts again, all at once, on a new engine "
                         "whose page hashes differ (another process's), over the same folder: "
                         "its first visits must find the pages the first engine wrote")
    args = ap.parse_args(argv)

    import numpy as np

    prompts = make_prompts(np.random.default_rng(SEED))
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    base = run(args, prompts, "baseline", args.num_pages)
    line = (f"easydel baseline: {len(prompts)} prompts, {prompt_tokens} prompt tokens, "
            f"prefill computed {base['prefill_total']}, prefix-cache pages hit "
            f"{base['hits_total']}, {args.num_pages} pages, {base['seconds']:.1f} s")
    ok = True

    if args.reference:
        ref = run(args, prompts, "reference", 64)
        same = ref["generated"] == base["generated"]
        ok &= same
        line += (f"; reference (64 pages): prefill computed {ref['prefill_total']}, pages hit "
                 f"{ref['hits_total']}, tokens {'equal' if same else 'DIFFER'}")

    from jax_kvxfer.integrations.easydel import enable_offloading
    from jax_kvxfer.stores import FileStore

    disk = tempfile.mkdtemp(prefix="kvxfer-easydel-disk-") if args.disk or args.restart else None

    def offload_run(label: str, together: bool = False) -> dict:
        """A fresh engine with the host pool, and a disk tier on `disk` (a new store on it:
        what it holds is what earlier runs wrote)."""
        stores = () if disk is None else (FileStore(disk, namespace="easydel-example"),)
        try:
            return run(args, prompts, label, args.num_pages, offload=lambda engine:
                       enable_offloading(engine, num_host_blocks=args.host_blocks, stores=stores),
                       together=together)
        finally:
            for store in stores:
                store.close()

    try:
        offl = offload_run("offload")
        if args.restart:
            # another process's page hashes: eSurge seeds its first page's hash from
            # PYTHONHASHSEED when it builds its cache manager (at random without it)
            os.environ["PYTHONHASHSEED"] = "1"
            again = offload_run("restarted", together=True)
    finally:
        if disk is not None:
            shutil.rmtree(disk, ignore_errors=True)
    report = offl["report"]
    same = offl["generated"] == base["generated"]
    ratio = offl["prefill_total"] / base["prefill_total"]
    # the default host pool holds every revisited prefix (0.38x expected); a small one with a
    # disk tier reads part of them back from the disk and must still save prefill
    ok &= same and ratio <= (0.5 if disk is None else 0.9) and report.loaded_pages_gpu_held == 0
    line = (f"easydel offloading: generated tokens {'identical' if same else 'DIFFER'} with and "
            f"without; prefill computed {offl['prefill_total']} with, {base['prefill_total']} "
            f"without ({ratio:.2f}x); pages loaded from the host {report.loaded_pages} (of "
            f"them held by the GPU: {report.loaded_pages_gpu_held}"
            + (f"; read from the disk first: {report.loaded_from_stores}, left to recompute "
               f"{offl['store_skipped']} (a prompt token measured at "
               f"{offl['recompute_s'] * 1e3:.3f} ms)" if disk else "")
            + f"), stored {report.stored_pages}; {args.num_pages} GPU pages, {args.host_blocks} "
            f"host blocks{', a disk tier' if disk else ''}. " + line)
    if args.restart:
        # the restarted engine finds the first engine's pages on the disk from its first
        # prompts on, though its page hashes differ: the connector keys pages by content;
        # given every prompt at once, it reads ahead for those waiting their turn
        first = [name for name, _ in prompts[:3]]
        found = sum(again["hits"][name] for name in first)
        same = again["generated"] == base["generated"]
        report = again["report"]
        ok &= same and found > 0 and report.prefetched_pages > 0
        line = (f"easydel restarted on the disk tier, every prompt at once: generated tokens "
                f"{'identical' if same else 'DIFFER'}; pages read from the disk ahead of their "
                f"request's turn {report.prefetched_pages}, at its admission "
                f"{report.loaded_from_stores}; first visits {'/'.join(first)} hit {found} "
                f"pages; prefill computed {again['prefill_total']}. " + line)

    print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
