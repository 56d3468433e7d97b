"""Token-budgeted prefill in the serving loop (`prefill_budget`): several requests' prompt
chunks packed into one segment `[budget / chunk, chunk]` a step, each row one chunk-aligned
piece of one request. A turn's logits are bit for bit those of a run that prefills one chunk a
step, and within float tolerance of the per-request segments (budget 0); offload against
never_evict stays exact when the two runs pack differently; bad values are one line."""

from __future__ import annotations

import numpy as np
import pytest

from jax_kvxfer.demo import cli as demo
from jax_kvxfer.demo import serving, workloads
from jax_kvxfer.demo.model import ModelConfig, budget_chunks, init_params, pack_prefill

MODEL = ModelConfig(vocab_size=64, num_layers=1, d_model=32, num_heads=2, num_kv_heads=1,
                    head_dim=16, d_ff=64)
T = CHUNK = 4
BATCH = 3


@pytest.fixture(scope="module")
def chats():
    return workloads.chat_workload(conversations=6, turns=3, system_tokens=6, user_tokens=10,
                                   assistant_tokens=4, think_s=0.01, arrival_rate=200.0,
                                   vocab_size=MODEL.vocab_size, seed=1)


def _run(model, params, convs, *, budget, primary=None, secondary=0, prefill_rows=1,
         step_s=0.01):
    never = serving.blocks_to_never_evict(convs, BATCH, T)
    return serving.run(model, params, convs, batch=BATCH, chunk=CHUNK, tokens_per_block=T,
                       primary_blocks=primary or never, secondary_blocks=secondary,
                       prefill_rows=prefill_rows, prefill_budget=budget, fixed_step_s=step_s)


def _schedule(run):
    """Each turn's arrival and first token, in steps of the run's clock."""
    return sorted((k, round(r.arrival_s, 6), round(r.first_token_s, 6))
                  for k, r in run.turns.items())


def _assert_bit_equal(run, ref):
    assert set(run.turns) == set(ref.turns)
    for key, want in ref.turns.items():
        got = run.turns[key]
        assert got.tokens == want.tokens, key
        np.testing.assert_array_equal(got.logits, want.logits, err_msg=str(key))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_packed_budget_is_exact_whatever_the_schedule(chats, dtype):
    """One budget (one segment shape) under two clocks: other steps, other requests beside
    each chunk, the same bits. Against one chunk a step and the per-request segments (budget
    0, chunks from the cache hit on, not aligned), other shapes: equal within the demo's
    tolerance."""
    model = ModelConfig(**{**MODEL.__dict__, "dtype": dtype})
    params = init_params(model, seed=2)
    packed = _run(model, params, chats, budget=4 * CHUNK)
    rescheduled = _run(model, params, chats, budget=4 * CHUNK, step_s=0.0037)
    assert _schedule(rescheduled) != _schedule(packed)
    _assert_bit_equal(rescheduled, packed)
    one_row = _run(model, params, chats, budget=CHUNK)
    assert packed.steps < one_row.steps  # it packed: several rows a step
    segments = _run(model, params, chats, budget=0, prefill_rows=2)
    tol = demo.TOLERANCE[dtype]
    for other in (one_row, segments):
        exact, max_diff, first_bad = serving.compare(other, packed, atol=tol, rtol=tol)
        assert exact, (max_diff, first_bad)


@pytest.mark.slow
def test_offload_is_bit_exact_against_never_evict(chats):
    """offload (a GPU pool of one request and a bit, a host pool for everything) against
    never_evict, with the same budget: other steps and company for each chunk (offload admits
    fewer requests at once), blocks evicted and onboarded, the same bits."""
    params = init_params(MODEL, seed=2)
    need = serving.max_request_blocks(chats, T)
    offload = _run(MODEL, params, chats, budget=4 * CHUNK, primary=need + 2, secondary=200)
    oracle = _run(MODEL, params, chats, budget=4 * CHUNK)
    assert offload.block_stats.offloaded_blocks > 0 and offload.block_stats.onboarded_blocks > 0
    assert oracle.block_stats.offloaded_blocks == 0
    assert _schedule(offload) != _schedule(oracle)
    _assert_bit_equal(offload, oracle)


def test_budget_chunks_and_pack_prefill_align_rows_to_positions():
    # next positions 6, 0, 9 with 4-token rows: the first takes 2 then whole rows
    assert budget_chunks([10, 3, 9], rows=4, row_tokens=4, starts=[6, 0, 9]) == [10, 3, 0]
    assert budget_chunks([10, 9], rows=4, row_tokens=4, starts=[6, 9]) == [10, 3]
    assert budget_chunks([9], rows=2, row_tokens=4, starts=[5]) == [7]
    seg, last = pack_prefill([(list(range(10, 20)), 6, [0, 1, 2, 3, 4]),
                              ([7, 8, 9], 9, [5, 6, 7])], rows=5, row_tokens=4, max_blocks=5,
                             aligned=True)
    pos = np.asarray(seg.positions)
    valid = pos >= 0
    assert (pos[valid] % 4 == np.nonzero(valid)[1]).all()  # position p in column p % 4
    assert pos.tolist() == [[-1, -1, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15],
                            [-1, 9, 10, 11], [-1, -1, -1, -1]]
    assert last == [2, 3] and np.asarray(seg.logit_index)[[2, 3]].tolist() == [3, 3]
    with pytest.raises(ValueError, match="more than the segment's 2 rows"):
        pack_prefill([([1] * 7, 2, [0, 1, 2])], rows=2, row_tokens=4, max_blocks=3, aligned=True)


TINY = ["--vocab", "64", "--layers", "1", "--d-model", "32", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--d-ff", "64", "--conversations", "4", "--turns", "2",
        "--tokens-per-block", "4", "--chunk", "4", "--no-progress", "--fixed-step-ms", "10"]


@pytest.mark.parametrize("argv, message", [
    (["--prefill-budget", "6"], "--prefill-budget 6 must be a multiple of --chunk 4"),
    (["--prefill-budget", "-4"], "--prefill-budget: must be >= 0"),
    (["--chunk", "5"], "--prefill-budget 32 (--preset cpu's) must be a multiple of --chunk 5"),
    (["--prefill-rows", "2"], "--prefill-rows needs --prefill-budget 0"),
])
def test_bad_budgets_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(TINY + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.slow
def test_the_demo_passes_the_budget_to_every_run(monkeypatch, capsys):
    budgets = []
    real_run = serving.run

    def run(*args, **kwargs):
        budgets.append((kwargs["prefill_budget"], kwargs["prefill_rows"],
                        kwargs["prefill_shapes"]))
        return real_run(*args, **kwargs)

    monkeypatch.setattr(serving, "run", run)
    assert demo.main(TINY + ["--prefill-budget", "8"]) == 0
    assert budgets == [(8, 2, "fixed")] * 3  # the offload, drop and never_evict runs
    assert "exactness offload vs never_evict: PASS" in capsys.readouterr().out


@pytest.mark.parametrize("budget_rows", range(20))
def test_auto_shapes_are_powers_of_two_then_the_budget_and_the_fewest_that_hold(budget_rows):
    choices = serving.segment_row_choices(budget_rows)
    # brute force: every power of two below the budget's rows, then the budget's own
    want = sorted({2 ** k for k in range(8) if 2 ** k < budget_rows} | {budget_rows} - {0})
    assert list(choices) == want
    for needed in range(budget_rows + 3):
        got = serving.fewest_rows(choices, needed)
        holding = [c for c in want if c >= needed]
        assert got == (min(holding) if holding else max(want, default=0))


@pytest.mark.slow
def test_auto_shapes_keep_tokens_and_logits_within_the_demos_tolerance(chats):
    """Each step's segment the fewest rows that hold its prompts: smaller steps when little
    waits. A chunk may then run in another shape in another run, whose matrix products round
    differently: offload and never_evict (both auto) and a fixed budget agree on every token,
    their logits within the demo's tolerance, and auto runs fewer padded rows."""
    params = init_params(MODEL, seed=2)
    need = serving.max_request_blocks(chats, T)
    never = serving.blocks_to_never_evict(chats, BATCH, T)
    runs = {}
    for name, shapes, primary, secondary in (("offload", "auto", need + 2, 200),
                                             ("never_evict", "auto", never, 0),
                                             ("fixed", "fixed", never, 0)):
        runs[name] = serving.run(MODEL, params, chats, batch=BATCH, chunk=CHUNK,
                                 tokens_per_block=T, primary_blocks=primary,
                                 secondary_blocks=secondary, prefill_budget=8 * CHUNK,
                                 prefill_shapes=shapes, fixed_step_s=0.01)
    assert runs["offload"].block_stats.onboarded_blocks > 0
    tol = demo.TOLERANCE["float32"]
    for name in ("offload", "fixed"):
        exact, max_diff, first_bad = serving.compare(runs[name], runs["never_evict"],
                                                     atol=tol, rtol=tol)
        assert exact, (name, max_diff, first_bad)
    assert runs["never_evict"].prefill_rows_run < runs["fixed"].prefill_rows_run
