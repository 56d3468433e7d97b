"""Random workloads of EasyDeL's eSurge with jax_kvxfer's connector, against eSurge alone
(`scripts/easydel-check.sh --random [TRIALS] [--seed S]`).

Each trial draws prompts over a few shared prefixes (`random_prompts`), a GPU pool of 10-16
pages (two requests at a time may not fit: eSurge preempts), a host pool of 4-40 blocks, with
or without a disk tier, and whether the prompts come one at a time or all at once. It serves them on eSurge alone and then with the connector (`enable_offloading`): the
generated tokens must be identical, or, where eSurge's batching changed them, those of the
prompt served alone (`judge`). With the disk tier, a new engine whose page hashes differ
(another process's) serves them again over the same folder, judged alike. The last line
says what each trial drew and saved, and PASS or FAIL; the exit status is 1 on a failure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import easydel_offload as example  # sets eSurge's environment first

MAX_MODEL_LEN, MAX_TOKENS = 128, 8


def random_prompts(rng) -> list[tuple[str, list[int]]]:
    """8-14 prompts over 3-6 prefixes of 2-6 pages, each with a tail of 1-23 tokens (at most
    119 tokens: with MAX_TOKENS generated, within MAX_MODEL_LEN)."""
    families = int(rng.integers(3, 7))
    prefixes = [rng.integers(3, example.VOCAB, size=16 * int(rng.integers(2, 7))).tolist()
                for _ in range(families)]
    prompts = []
    for i in range(int(rng.integers(8, 15))):
        family = int(rng.integers(families))
        tail = rng.integers(3, example.VOCAB, size=int(rng.integers(1, 24))).tolist()
        prompts.append((f"p{i}f{family}", prefixes[family] + tail))
    return prompts


def trial(rng, index: int) -> tuple[bool, str]:
    from jax_kvxfer.integrations.easydel import enable_offloading
    from jax_kvxfer.stores import FileStore

    args = argparse.Namespace(max_model_len=MAX_MODEL_LEN, max_tokens=MAX_TOKENS)
    prompts = random_prompts(rng)
    pages, host = int(rng.integers(10, 17)), int(rng.integers(4, 41))
    disk = tempfile.mkdtemp(prefix="kvxfer-easydel-random-") if rng.random() < 0.5 else None
    together = bool(rng.random() < 0.5)
    drew = (f"trial {index}: {len(prompts)} prompts, {pages} GPU pages, {host} host blocks"
            f"{', a disk tier' if disk else ''}, {'all at once' if together else 'one by one'}")
    print(drew, flush=True)

    def offloaded(label: str) -> dict:
        stores = () if disk is None else (FileStore(disk, namespace="easydel-random"),)
        try:
            return example.run(args, prompts, label, pages, together=together,
                               offload=lambda engine: enable_offloading(
                                   engine, num_host_blocks=host, stores=stores))
        finally:
            for store in stores:
                store.close()

    try:
        os.environ["PYTHONHASHSEED"] = str(2 * index)
        base = example.run(args, prompts, "alone", pages, together=together)
        runs = [offloaded("offload")]
        if disk is not None:  # another process's page hashes, the same folder
            os.environ["PYTHONHASHSEED"] = str(2 * index + 1)
            runs.append(offloaded("restarted"))
    finally:
        if disk is not None:
            shutil.rmtree(disk, ignore_errors=True)
    saved = ", ".join(f"prefill {run['prefill_total']} of {base['prefill_total']}, "
                      f"{run['report'].loaded_pages} pages loaded" for run in runs)
    ok, verdict = judge(args, dict(prompts), base, runs)
    return ok, f"{drew}: {saved}; {verdict}"


def judge(args, prompts: dict, base: dict, runs: list[dict]) -> tuple[bool, str]:
    """Identical tokens pass. eSurge's own output for a prompt may change with the requests it
    is batched with (its CPU numerics, over a random-weight model whose top logits are often
    near ties): a prompt whose tokens differ is served alone on a fresh engine, the arbiter.
    A run that gives the lone prompt's tokens passes; one that differs from them fails, unless
    eSurge alone did too, where the difference is the engine's batching (counted)."""
    differ = sorted({name for run in runs for name in prompts
                     if run["generated"][name] != base["generated"][name]})
    if not differ:
        return True, "tokens identical"
    ok, batching = True, []
    for name in differ:
        alone = example.run(args, [(name, prompts[name])], "lone", 64)["generated"][name]
        for run in runs:
            if run["generated"][name] != alone:
                if base["generated"][name] == alone:
                    ok = False  # eSurge alone agrees with itself served alone: the connector
                else:
                    batching.append(name)
    if not ok:
        return False, f"tokens of {', '.join(differ)} differ: the CONNECTOR CHANGED them"
    return True, (f"tokens of {', '.join(differ)} differ from eSurge alone, the connector's "
                  "equal to the prompt's served alone"
                  + (f" but for {', '.join(sorted(set(batching)))}, which neither gave "
                     "(eSurge's batching)" if batching else ""))


def main(argv=None) -> int:
    import numpy as np

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trials", type=int, nargs="?", default=3)
    ap.add_argument("--seed", type=int, default=None, help="default: a fresh one, printed")
    args = ap.parse_args(argv)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    lines, ok = [], True
    for i in range(args.trials):
        same, line = trial(rng, i)
        ok &= same
        lines.append(line)
    print("\n".join(lines))
    print(f"easydel random (--seed {seed}): {args.trials} trials, {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
