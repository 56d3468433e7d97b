"""Matching a prompt against the GPU and host pools and the stores, and taking what matched."""

from __future__ import annotations

import dataclasses

from ..connector.tiers import READ_PROBE_EVERY, longest_stored, read_rate
from .block_cache import ROOT_KEY, CachedBlock, block_key


@dataclasses.dataclass(eq=False)
class StoreRun:
    """Full blocks of a prompt that only a store holds: per block its key, parent key and
    tokens; and the store that holds them (its index)."""

    chain: list[tuple[bytes, bytes, tuple[int, ...]]]
    store: int = 0


@dataclasses.dataclass(eq=False)
class Match:
    """What a prompt reuses: its full blocks in order, as runs that the GPU and host pools hold
    (lists of blocks) and runs that only a store holds (`StoreRun`); then a partially matched
    block of the pools and its matching tokens; and the tokens reused in all, should every
    store block arrive intact."""

    runs: list[list[CachedBlock] | StoreRun]
    partial: tuple[CachedBlock, int] | None
    tokens: int
    # else a partly filled block only a store holds (an earlier turn's reply tail, say), all
    # of whose tokens the prompt repeats: its key, parent key and tokens
    store_partial: StoreRun | None = None
    # blocks a store holds past the match, left to recompute: reading them would take longer
    skipped: int = 0

    def pool_blocks(self) -> list[CachedBlock]:
        return [b for run in self.runs if isinstance(run, list) for b in run]

    def store_blocks(self) -> int:
        return sum(len(run.chain) for run in self.runs if isinstance(run, StoreRun))


def _each_stored(stores, keys: list[bytes]) -> list[list[bool]]:
    """Per store, per key, whether it holds it (`Store.lookup_each`)."""
    return [store.lookup_each(keys) for store in stores]


class PrefixMatching:
    """`BlockManager`'s prefix matching (`_match`) and reuse of a match (`_reuse`); the state
    is the block manager's, set in its `__init__`."""

    def _match(self, tokens: tuple[int, ...], reading: bool = True) -> Match:
        """The prompt's full blocks in order, from the GPU and host pools or a store, then an
        optional (block, n) partial match of the pools (a prompt's last, partly filled block
        of an earlier turn, say: its reply's tail); cut before the store reads that would
        take longer than recomputing their blocks (`_worth_reading`). `reading`: the match
        is read (False: only asked about, and never a probe read)."""
        t, limit = self.tokens_per_block, len(tokens) - 1  # the last token is always computed
        self._offer_evicted()  # evicted blocks are matched where the host pool put them
        chains = self._key_chains
        keys = chains.keys(tokens, 0)  # block i's key: keys[i], once computed that far
        if self._prefetching:  # the prompt's blocks being prefetched join the index first
            for key in chains.keys(tokens, limit // t)[:limit // t]:
                self._finish_prefetch(key)
        runs: list[list[CachedBlock] | StoreRun] = []
        parent, n = ROOT_KEY, 0
        while n + t <= limit:
            run = []  # blocks the pools hold
            while n + t <= limit:
                if n // t >= len(keys):  # hashed as far as the match goes (a miss: once)
                    keys = chains.keys(tokens, n // t + 1)
                block = self._index.block_of(keys[n // t], tokens[n:n + t])
                if block is None:
                    break
                run.append(block)
                parent, n = block.key, n + t
            if run:
                runs.append(run)
            if not self._has_stores or n + t > limit:
                break
            chain, key = [], parent  # blocks only a store may hold: up to one the pools hold
            keys = chains.keys(tokens, limit // t)
            for start in range(n, limit - t + 1, t):
                chunk = tokens[start:start + t]
                child = keys[start // t]
                if child in self._index.by_key:
                    break
                chain.append((child, key, chunk))
                key = child
            store, found = self._asked_stores(longest_stored, [c[0] for c in chain])
            if not found:
                break
            runs.append(StoreRun(chain[:found], store))
            parent, n = chain[found - 1][0], n + found * t
            if found < len(chain):
                break
        partial = store_partial = None
        if self.enable_partial_reuse and n < limit:
            block, common = self._index.longest_partial(parent, tokens[n:min(n + t, limit)])
            if block is not None:
                partial, n = (block, common), n + common
            elif self._has_stores:  # a partly filled block of the prompt's tokens, the
                # longest a store holds (a store matches keys only: one key per length, asked
                # of each store at once)
                lengths = range(min(t - 1, limit - n), 0, -1)
                keys = [block_key(parent, tokens[n:n + m]) for m in lengths]
                held = self._asked_stores(_each_stored, keys)
                for i, m in enumerate(lengths):
                    where = next((j for j, h in enumerate(held) if h[i]), None)
                    if where is not None:
                        store_partial = StoreRun([(keys[i], parent, tokens[n:n + m])], where)
                        n += m
                        break
        return self._worth_reading(Match(runs, partial, n, store_partial), reading)

    def _asked_stores(self, question, keys: list[bytes]):
        """`question(stores, keys)`, answered once a step: the Server matches a prompt, then
        adds it (matching it again), and a server store answers each question in a round trip
        (~0.1-1 ms). The answers are forgotten at the step boundary (`sync_transfers`), so a
        block another replica writes is found at the next step. `keys` is a chain or one
        parent's candidates: its first and last key name it."""
        if not keys:  # (a key the index holds for other tokens: a hash collision)
            return question(self._host.stores, keys)
        memo = self._store_answers
        name = (question, keys[0], keys[-1], len(keys))
        if name not in memo:
            memo[name] = question(self._host.stores, keys)
        return memo[name]

    def _worth_reading(self, match: Match, reading: bool) -> Match:
        """The match, cut before its store reads that do not pay, with a recompute cost set
        (`set_recompute_cost`). It keeps the prefix of its runs that saves the most time: a
        pool run saves its tokens' recompute, a store run that less its expected read
        (`_read_seconds`); so a read that loses is made only where the pool blocks after it
        make up for it, and a read at the end only where it wins. Ties recompute. Every
        `READ_PROBE_EVERY`th match read that would skip a read is read in full (a probe)."""
        c, t = self.recompute_s_per_token, self.tokens_per_block
        if c is None or not (match.store_blocks() or match.store_partial):
            return match
        gain, cuts = 0.0, []  # cuts: (time saved, runs kept) at each place the match may end
        for i, run in enumerate(match.runs):
            if isinstance(run, StoreRun):
                cuts.append((gain, i))
                gain -= self._read_seconds(run.store, len(run.chain))
                gain += len(run.chain) * t * c
            else:
                gain += len(run) * t * c
        cuts.append((gain, len(match.runs)))  # the pools' partial block saves time too
        sp = match.store_partial
        if sp is not None:  # its read: a whole block, for the tokens the prompt repeats
            cuts.append((gain + len(sp.chain[0][2]) * c - self._read_seconds(sp.store, 1),
                         len(match.runs) + 1))
        best = cuts[0]
        for cut in cuts[1:]:
            if cut[0] > best[0]:
                best = cut
        if reading and best is not cuts[-1]:
            self._reads_skipped += 1
            if self._reads_skipped % READ_PROBE_EVERY == 0:
                return match
        return self._cut(match, best[1])

    def _cut(self, match: Match, kept: int) -> Match:
        """The match up to its first `kept` runs (one more: its store's partial block too)."""
        runs, sp = match.runs, match.store_partial
        if kept > len(runs) or (kept == len(runs) and sp is None):
            return match
        if kept == len(runs):  # all but the store's partial block
            return Match(runs, match.partial, match.tokens - len(sp.chain[0][2]), None, 1)
        skipped = sum(len(r.chain) for r in runs[kept:] if isinstance(r, StoreRun))
        blocks = sum(len(r.chain) if isinstance(r, StoreRun) else len(r) for r in runs[:kept])
        return Match(runs[:kept], None, blocks * self.tokens_per_block, None,
                     skipped + (sp is not None))

    def _store_writes_pay(self) -> bool:
        """Whether a block written to the stores now could be read back faster than the model
        recomputes it (`set_recompute_cost`): some store's measured reads move a block's bytes
        in less time, however long the read. Yes without a recompute cost, or while a store's
        reads are not yet measured at more than one size. Of the blocks that do not pay, every
        `READ_PROBE_EVERY`th is written all the same (a probe: reading it keeps the estimate
        current); the others are counted in `store_declined_blocks`."""
        c = self.recompute_s_per_token
        if c is None:
            return True
        for store in self._host.stores:
            seconds = read_rate(store).marginal_seconds(self._row_nbytes)
            if seconds is None or seconds < c * self.tokens_per_block:
                return True
        self._writes_declined += 1
        if self._writes_declined % READ_PROBE_EVERY == 0:
            return True
        self._stats.store_declined_blocks += 1
        return False

    def _read_seconds(self, store: int, blocks: int) -> float:
        """How long a read of `blocks` blocks from store `store` is expected to take: by its
        measured reads (`connector.tiers.read_rate`), by the prior until enough are
        measured; 0 with neither (it is read, and so measured)."""
        nbytes = blocks * self._row_nbytes
        seconds = read_rate(self._host.stores[store]).seconds(nbytes)
        if seconds is not None:
            return seconds
        if self.store_read_prior is None:
            return 0.0
        throughput, latency = self.store_read_prior
        return latency + nbytes / throughput

    def _reuse(self, match: Match, priority: int
               ) -> tuple[list[CachedBlock], tuple[CachedBlock, int] | None, int]:
        """Takes a match's blocks for a new sequence (its GPU blocks are referenced already):
        onboards its host blocks, reads and onboards its store blocks, up to the first that
        does not arrive. Returns the blocks, the partial match still to copy (its source
        pinned) and the tokens reused."""
        partial, reused = match.partial, match.tokens
        on_host = [b for b in match.pool_blocks() if not b.is_primary]
        # Protected in the host pool before anything is evicted; a partially matched block is
        # counted as reused only once copied (a short store read may drop it).
        if on_host:
            self._pin_on_host(on_host)
        if partial and not partial[0].is_primary:
            self._pin_on_host([partial[0]], count_reuse=False)
        s = self._stats
        # Host hits are onboarded first, so that issuing gives their rows back for the store
        # reads should the host pool run short of rows to stage them in.
        for block in match.pool_blocks():
            if block.is_primary:
                s.reused_blocks += 1
            else:
                self._onboard(block)
        blocks, whole = [], True
        for run in match.runs:
            if isinstance(run, StoreRun):
                if not whole:
                    continue
                # read into host rows, then onboarded like host hits
                found = self._read_store_blocks(run.chain, priority=priority)
                s.store_hit_blocks += len(found)
                whole = len(found) == len(run.chain)
                if found:
                    self._pin_on_host(found)
                for block in found:
                    self._onboard(block)
                blocks += found
            elif whole:
                blocks += run
            else:  # after a block that did not arrive: not a prefix any more
                for block in run:
                    self._unref(block)
        if whole and match.store_partial is not None:
            found = self._read_store_blocks(match.store_partial.chain, priority=priority)
            if found:  # its pin is released once its copy is issued
                self._pin_on_host(found, count_reuse=False)
                partial = (found[0], len(found[0].tokens))
            else:
                reused -= len(match.store_partial.chain[0][2])
        if not whole:
            if partial:
                (self._unref if partial[0].is_primary else self._unpin)(partial[0])
                partial = None
            reused = len(blocks) * self.tokens_per_block
        return blocks, partial, reused
