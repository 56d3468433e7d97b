"""Serving workloads: multi-turn conversations that arrive over time.

A workload is a list of `Conversation`s. Each starts at `start_s` with a fixed `prefix` (a
shared system prompt), then has turns: the user adds tokens, the model replies with
`output_len` tokens, and the next turn arrives `think_s` after the reply ends. Turn k's prompt
is the prefix, every earlier turn's user tokens and reply, then its own user tokens; so a
serving loop unfolds a conversation as it runs (the replies are the model's).

Three sources:
- `chat_workload`: synthetic chats whose shape follows published statistics (most
  conversations have several turns, every one shares the system prompt, reuse comes back after
  a think time): lengths log-normal around the given means, conversation starts a Poisson
  process, think times exponential.
- `docqa_workload`: long documents, each asked several short questions (LMCache's long-document
  case): every question is a one-turn conversation whose prefix is its document, and the
  questions of different documents are interleaved, so that between two questions of one
  document come those of many others.
- `read_mooncake_trace`: replay of a trace in the Mooncake format, one JSON object per line:
  `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, one id per 512-token block
  of the input, equal ids meaning equal content. Each request becomes a one-turn conversation
  whose tokens are derived from its hash ids, so equal prefixes are equal tokens.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence

import numpy as np

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake format


@dataclasses.dataclass(frozen=True)
class Turn:
    user: tuple[int, ...]  # the tokens the user adds
    output_len: int  # tokens the model generates
    think_s: float = 0.0  # after the previous turn's last token, before this turn arrives


@dataclasses.dataclass(frozen=True)
class Conversation:
    start_s: float  # arrival of the first turn
    prefix: tuple[int, ...]  # tokens every turn's prompt starts with (a system prompt)
    turns: tuple[Turn, ...]


def _lognormal_lengths(rng: np.random.Generator, mean: float, sigma: float, n: int,
                       low: int = 1) -> np.ndarray:
    """n integer lengths >= low whose distribution is log-normal with the given mean."""
    mu = math.log(max(mean, low)) - sigma * sigma / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
    return np.maximum(low, np.rint(rng.lognormal(mu, sigma, n))).astype(int)


def chat_workload(*, conversations: int, turns: int, system_tokens: int, user_tokens: float,
                  assistant_tokens: float, think_s: float, arrival_rate: float, vocab_size: int,
                  length_sigma: float = 0.5, burst: int = 1, seed: int = 0) -> list[Conversation]:
    """Synthetic multi-turn chats.

    Args:
      conversations: how many; their starts are a Poisson process of `arrival_rate` per
        second (the first at 0), in groups of `burst` that start at the same instant (the
        groups a Poisson process of `arrival_rate / burst` a second: the same mean rate).
      turns: turns per conversation.
      system_tokens: the shared system prompt every conversation starts with.
      user_tokens, assistant_tokens: mean tokens a user message adds and a reply generates
        (log-normal, `length_sigma`, at least 1).
      think_s: mean seconds between a reply and the next turn (exponential).
      vocab_size: tokens are drawn uniformly from [0, vocab_size).
      seed: everything is drawn from it.

    Raises:
      ValueError: a count below 1 (system_tokens below 0), a rate, mean or time not positive.
    """
    for name, value, low in (("conversations", conversations, 1), ("turns", turns, 1),
                             ("burst", burst, 1),
                             ("system_tokens", system_tokens, 0), ("vocab_size", vocab_size, 1)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    for name, value in (("user_tokens", user_tokens), ("assistant_tokens", assistant_tokens),
                        ("arrival_rate", arrival_rate), ("length_sigma", length_sigma)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not think_s >= 0:
        raise ValueError(f"think_s must be >= 0, got {think_s!r}")
    rng = np.random.default_rng(seed)
    system = tuple(int(t) for t in rng.integers(0, vocab_size, system_tokens))
    gaps = rng.exponential(burst / arrival_rate, conversations)
    gaps[np.arange(conversations) % burst != 0] = 0.0  # a burst's conversations start together
    starts = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    user_lens = _lognormal_lengths(rng, user_tokens, length_sigma, conversations * turns)
    out_lens = _lognormal_lengths(rng, assistant_tokens, length_sigma, conversations * turns)
    thinks = rng.exponential(think_s, conversations * turns) if think_s > 0 else \
        np.zeros(conversations * turns)
    result = []
    for c in range(conversations):
        conv_turns = []
        for t in range(turns):
            k = c * turns + t
            user = tuple(int(x) for x in rng.integers(0, vocab_size, user_lens[k]))
            conv_turns.append(Turn(user, int(out_lens[k]), 0.0 if t == 0 else float(thinks[k])))
        result.append(Conversation(float(starts[c]), system, tuple(conv_turns)))
    return result


def docqa_workload(*, documents: int, questions: int, doc_tokens: tuple[int, int],
                   question_tokens: float, answer_tokens: float, arrival_rate: float,
                   vocab_size: int, interleave: int | None = None, length_sigma: float = 0.5,
                   seed: int = 0) -> list[Conversation]:
    """Long documents asked short questions: `documents * questions` one-turn conversations.

    Args:
      documents: how many; each is `doc_tokens` = (low, high) tokens long, uniform in that
        range (inclusive), its tokens uniform in [0, vocab_size).
      questions: questions per document; each is its own request whose prompt is the document
        then the question (`question_tokens` on average, log-normal), answered in
        `answer_tokens` on average.
      arrival_rate: questions per second (a Poisson process; the first at 0).
      interleave: the order of the questions: question q of document d comes at place
        d + q * interleave (ties at random), so that between two questions of one document
        come the questions of at least `interleave` - 1 other documents (those at the places
        between), and each stretch of the stream holds first questions of new documents and
        later questions of earlier ones alike. Default: half the documents (at least 1).

    Raises:
      ValueError: a count below 1, a bad length range, a rate or mean not positive.
    """
    for name, value in (("documents", documents), ("questions", questions),
                        ("vocab_size", vocab_size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    low, high = doc_tokens
    if not 1 <= low <= high:
        raise ValueError(f"doc_tokens must be (low, high) with 1 <= low <= high, got {doc_tokens!r}")
    for name, value in (("question_tokens", question_tokens), ("answer_tokens", answer_tokens),
                        ("arrival_rate", arrival_rate), ("length_sigma", length_sigma)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if interleave is None:
        interleave = max(1, documents // 2)
    if isinstance(interleave, bool) or not isinstance(interleave, (int, np.integer)) \
            or interleave < 1:
        raise ValueError(f"interleave must be an integer >= 1, got {interleave!r}")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(low, high + 1, documents)
    docs = [tuple(int(t) for t in rng.integers(0, vocab_size, n)) for n in lengths]
    n = documents * questions
    q_lens = _lognormal_lengths(rng, question_tokens, length_sigma, n)
    a_lens = _lognormal_lengths(rng, answer_tokens, length_sigma, n)
    places = [(d + q * interleave, rng.random(), d, q) for d in range(documents)
              for q in range(questions)]
    places.sort()
    gaps = rng.exponential(1.0 / arrival_rate, n)
    starts = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    result = []
    for i, (_, _, d, q) in enumerate(places):
        k = d * questions + q
        question = tuple(int(x) for x in rng.integers(0, vocab_size, q_lens[k]))
        result.append(Conversation(float(starts[i]), docs[d],
                                   (Turn(question, int(a_lens[k])),)))
    return result


def trace_block_tokens(hash_id: int, block_tokens: int, vocab_size: int, seed: int = 0
                       ) -> tuple[int, ...]:
    """The tokens of one trace block: a function of its hash id alone (and the seed)."""
    rng = np.random.default_rng([seed, hash_id & (2**63 - 1)])
    return tuple(int(t) for t in rng.integers(0, vocab_size, block_tokens))


def read_mooncake_trace(path: str | os.PathLike, *, vocab_size: int, len_scale: float = 1.0,
                        time_scale: float = 1.0, max_requests: int | None = None,
                        seed: int = 0) -> list[Conversation]:
    """Requests of a Mooncake-format trace as one-turn conversations, in file order.

    Args:
      path: a JSON-lines file; blank lines are skipped.
      vocab_size: tokens are drawn from [0, vocab_size).
      len_scale: multiplies the lengths: a trace block becomes round(512 * len_scale) tokens
        (at least 1), a request's input round(input_length * len_scale) (at least 1, at most
        its blocks' tokens), its output max(1, round(output_length * len_scale)).
      time_scale: multiplies the gaps between requests (the first starts at 0).
      max_requests: read the first N requests only.
      seed: the tokens derived from the hash ids.

    Raises:
      ValueError: a bad line, naming the file and its line number, or a bad argument.
      OSError: the file cannot be read.
    """
    if not len_scale > 0 or not time_scale >= 0:
        raise ValueError(f"len_scale must be > 0 and time_scale >= 0, got {len_scale!r} and "
                         f"{time_scale!r}")
    if max_requests is not None and (isinstance(max_requests, bool) or max_requests < 1):
        raise ValueError(f"max_requests must be None or >= 1, got {max_requests!r}")
    block = max(1, round(TRACE_BLOCK_TOKENS * len_scale))
    blocks: dict[int, tuple[int, ...]] = {}
    requests = []
    t0 = None
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if max_requests is not None and len(requests) >= max_requests:
                break
            where = f"{os.fspath(path)}:{lineno}"
            timestamp, input_length, output_length, hash_ids = _parse_trace_line(line, where)
            if t0 is None:
                t0 = timestamp
            if timestamp < t0:
                raise ValueError(f"{where}: timestamp {timestamp} is earlier than the first "
                                 f"request's {t0}; the trace must be in time order")
            tokens: list[int] = []
            for h in hash_ids:
                if h not in blocks:
                    blocks[h] = trace_block_tokens(h, block, vocab_size, seed)
                tokens.extend(blocks[h])
            # the input never outruns its blocks (rounding the two scaled lengths may differ)
            n_in = min(max(1, round(input_length * len_scale)), len(tokens))
            turn = Turn(tuple(tokens[:n_in]), max(1, round(output_length * len_scale)))
            requests.append(Conversation((timestamp - t0) / 1000.0 * time_scale, (), (turn,)))
    return requests


def _parse_trace_line(line: str, where: str) -> tuple[float, int, int, Sequence[int]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(record, dict):  # a bad line is a ValueError, whatever is wrong with it
        raise ValueError(f"{where}: not a JSON object, got {type(record).__name__}")  # noqa: TRY004
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in record:
            raise ValueError(f"{where}: missing {key!r}")
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) \
            or not math.isfinite(timestamp) or timestamp < 0:
        raise ValueError(f"{where}: timestamp must be a number of ms >= 0, got {timestamp!r}")
    lengths = []
    for key in ("input_length", "output_length"):
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
        lengths.append(value)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not hash_ids or any(
            isinstance(h, bool) or not isinstance(h, int) for h in hash_ids):
        raise ValueError(f"{where}: hash_ids must be a non-empty list of integers")
    expected = math.ceil(lengths[0] / TRACE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise ValueError(f"{where}: input_length {lengths[0]} needs {expected} hash_ids (one "
                         f"per {TRACE_BLOCK_TOKENS} tokens), got {len(hash_ids)}")
    return float(timestamp), lengths[0], lengths[1], hash_ids
