"""`python -m jax_kvxfer demo`: serving multi-turn chats over an offloading KV cache.

Runs one workload three times on one model: `offload` (a small GPU pool and a host tier:
evicted blocks are offloaded and onboarded back on a prefix hit), `drop` (the same GPU pool and
no host tier: evicted blocks are recomputed) and `never_evict` (a GPU pool that holds
everything: the exactness oracle). `offload` must produce the same tokens as the oracle, and
the same logits (every logit's bits by fingerprint, the largest within float tolerance), for
every turn; `drop`'s agreement is reported (in bfloat16,
recomputed K/V round differently). Reports TTFT, TPOT, throughput, cache hits and the transfer
time compute did not hide.

With `--disk PATH`, a run `offload+disk` too: the same GPU pool, a host pool smaller than the
working set, and a disk tier (a FileStore) below it: blocks offloaded to the host are written
through to the disk, and prefixes found only there are read back and onboarded. With
`--restart`, the same workload is then served again by a new block manager over the same
directory (`offload+disk (restarted)`): what the disk brings after a restart. Both must be
exact against never_evict, as offload must.

With `--replicas N`, two runs of N serving processes (replicas.py), each with its own model,
pools and block manager, turn t of chat c on replica (c + t) % N: `replicas+store`, sharing a
store (`--store`: a local Valkey server by default), which every replica writes a finished
turn's blocks to and reads the prefixes another replica computed from; and `replicas`, the
same without a store (each replica recomputes them). replicas+store must be exact too.

The program in parts: options.py (the parser and the checks before a run), sizes.py (the
presets, each run's pools and memory), runs.py (serving the runs) and report.py (the table,
the closing lines, --json); this module's `main` joins them.
"""

from __future__ import annotations

from . import options, runs


def main(argv: list[str] | None = None) -> int:
    """Runs the demo; returns 0 when offload is exact, 1 when not, 2 for bad options."""
    parser = options.build_parser(__doc__.split("\n\n")[0])
    args = parser.parse_args(argv)
    cfg, rates = options.config(parser, args)
    loaded = options.load_model(parser, args, cfg)
    if loaded is None:
        return 2
    model, real = loaded
    convs = options.load_conversations(parser, args, cfg, model, real)
    options.choose_prefill(parser, args, cfg, convs)
    options.check_run(parser, args, cfg, model, convs, rates)
    return runs.serve(args, cfg, model, convs, rates, real)
