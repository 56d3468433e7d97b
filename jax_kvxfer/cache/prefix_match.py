"""Matching a prompt against the GPU and host pools and the stores, and taking what matched."""

from __future__ import annotations

import dataclasses

from .block_cache import ROOT_KEY, CachedBlock, block_key


@dataclasses.dataclass(eq=False)
class StoreRun:
    """Full blocks of a prompt that only a store holds: per block its key, parent key and
    tokens."""

    chain: list[tuple[bytes, bytes, tuple[int, ...]]]


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

    def pool_blocks(self) -> list[CachedBlock]:
        return [b for run in self.runs if isinstance(run, list) for b in run]

    def store_blocks(self) -> int:
        return sum(len(run.chain) for run in self.runs if isinstance(run, StoreRun))


class PrefixMatching:
    """`BlockManager`'s prefix matching (`_match`) and reuse of a match (`_reuse`); the state
    is the block manager's, set in its `__init__`."""

    def _match(self, tokens: tuple[int, ...]) -> Match:
        """The prompt's full blocks in order, from the GPU and host pools or a store, then an
        optional (block, n) partial match of the pools (a prompt's last, partly filled block
        of an earlier turn, say: its reply's tail)."""
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
            found = self._host.lookup_stores([c[0] for c in chain]) if chain else 0
            if not found:
                break
            runs.append(StoreRun(chain[:found]))
            parent, n = chain[found - 1][0], n + found * t
            if found < len(chain):
                break
        partial = store_partial = None
        if self.enable_partial_reuse and n < limit:
            block, common = self._index.longest_partial(parent, tokens[n:min(n + t, limit)])
            if block is not None:
                partial, n = (block, common), n + common
            elif self._has_stores:  # a partly filled block of the prompt's tokens
                for m in range(min(t - 1, limit - n), 0, -1):  # (a store matches keys only)
                    chunk = tokens[n:n + m]
                    key = block_key(parent, chunk)
                    if self._host.lookup_stores([key]):
                        store_partial, n = StoreRun([(key, parent, chunk)]), n + m
                        break
        return Match(runs, partial, n, store_partial)

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
