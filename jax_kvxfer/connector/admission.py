"""Admission policies for offloading: which blocks evicted from the GPU pool go to the host.

`OffloadingManager(admission=...)` (and so `BlockManager(admission=...)`, which stands on it)
asks its policy in `prepare_store`, for a block whose priority is offloaded at all
(TensorRT-LLM's rule stays: a block below the minimum priority is never offloaded, whatever the
policy says), whether to offload it or drop it.

- `ReuseGate` ("reuse[:rate]", the default): every such victim is offloaded while the
  offloads earn their copies, that is while the blocks onboarded from the host pool (or read
  back from a store, which an offload wrote) are at least `rate` (5 % by default) of the
  blocks offloaded, over a decaying window, and during a warm-up (reuse lags offloads by a
  request's think time); below that rate, one victim in `explore`, so that the rate keeps
  being measured and the gate opens again when reuse comes back. Workloads with long reuse
  (chats, documents asked several questions) keep every hit; one whose offloads are never
  read back stops paying for them.
- `AlwaysAdmit` ("always"): every such victim is offloaded (TensorRT-LLM's behaviour).
- `FrequencyGate` ("second-sighting[:k]"): a victim is offloaded only once its key has been
  seen at least `k` times (2 by default) in a bounded, decaying window: vLLM's
  `store_threshold`, Dynamo KVBM's frequency gate. The counts are TinyLFU's: after every
  `window` sightings, every count is halved (rounded down) and the keys at 0 forgotten, so that
  old reuse fades and at most 2 * `window` keys are held. A sighting is a released sequence
  that holds the block (computed or reused). It declines a chat turn's blocks at their first
  eviction, which is when the next turn needs them offloaded.

The manager tells a policy that counts sightings of each one (`seen`, from `touch`: the
block manager touches a released sequence's blocks), and one that counts reuse of every block
loaded from the host pool or a store (`reused`, from `prepare_load`).
"""

from __future__ import annotations


class AlwaysAdmit:
    """Offload every evicted block whose priority is offloaded."""

    name = "always"
    counts_sightings = False  # the block manager need not report them
    counts_reuse = False

    def __init__(self) -> None:
        self.admitted = self.declined = 0

    def seen(self, key: bytes) -> None:
        pass

    def admit(self, key: bytes) -> bool:
        self.admitted += 1
        return True

    def describe(self) -> str:
        return "always"


class FrequencyGate:
    """Offload an evicted block only once its key has been seen `k` times in the window.

    Args:
      k: sightings needed (>= 1; 1 admits every block seen once, which is every cached block).
      window: sightings between two halvings of every count (>= 1): the memory of the gate.
    """

    counts_sightings = True
    counts_reuse = False

    def __init__(self, k: int = 2, window: int = 65536) -> None:
        for name, value in (("k", k), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.k, self.window = k, window
        self.name = "second-sighting" if k == 2 else f"second-sighting:{k}"
        self._counts: dict[bytes, int] = {}
        self._since_halving = 0
        self.admitted = self.declined = 0

    def seen(self, key: bytes) -> None:
        counts = self._counts
        counts[key] = counts.get(key, 0) + 1
        self._since_halving += 1
        if self._since_halving >= self.window:
            self._since_halving = 0
            self._counts = {k: c >> 1 for k, c in counts.items() if c > 1}

    def count(self, key: bytes) -> int:
        """The key's count now."""
        return self._counts.get(key, 0)

    def admit(self, key: bytes) -> bool:
        ok = self._counts.get(key, 0) >= self.k
        if ok:
            self.admitted += 1
        else:
            self.declined += 1
        return ok

    @property
    def tracked_keys(self) -> int:
        return len(self._counts)

    def describe(self) -> str:
        return f"second-sighting (k={self.k}, window {self.window:,} sightings)"


class ReuseGate:
    """Offload every evicted block while the host pool's reuse rate (blocks onboarded from it
    over blocks offloaded to it, both halved every `window` offloads) is at least `rate`, or
    until `warmup` blocks were offloaded; below it, one block in `explore`.

    Args:
      rate: the reuse rate below which the gate closes (0 < rate <= 1).
      window: offloads between two halvings of the rate's counts (>= 1).
      warmup: offloads before the rate is trusted (>= 0): reuse lags offloads by a request's
        think time, so a fresh pool has offloads and no hits yet.
      explore: while closed, one in `explore` of the evicted blocks is offloaded all the same
        (>= 1; 1: never closes), so that the rate sees reuse come back and the gate opens.
    """

    counts_sightings = False
    counts_reuse = True

    def __init__(self, rate: float = 0.05, *, window: int = 8192, warmup: int = 4096,
                 explore: int = 16) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f"rate must be a number in (0, 1], got {rate!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an integer >= 0, got {warmup!r}")
        for name, value in (("window", window), ("explore", explore)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.rate, self.window, self.warmup, self.explore = float(rate), window, warmup, explore
        self.name = "reuse" if rate == 0.05 else f"reuse:{rate:g}"
        self._offloaded = self._onboarded = 0.0  # decaying counts
        self._total = 0  # offloads in all: the warm-up, and a halving every `window`
        self._passed_by = 0  # blocks the closed gate met, for exploring
        self.admitted = self.declined = 0

    def seen(self, key: bytes) -> None:
        pass

    def reused(self, key: bytes) -> None:
        """A block onboarded from the host pool."""
        self._onboarded += 1

    @property
    def reuse_rate(self) -> float:
        """Blocks onboarded over blocks offloaded, in the decaying window (0 before any)."""
        return self._onboarded / self._offloaded if self._offloaded else 0.0

    @property
    def is_open(self) -> bool:
        """Whether every block is offloaded now."""
        return self._total < self.warmup or self.reuse_rate >= self.rate

    def admit(self, key: bytes) -> bool:
        if not self.is_open:
            self._passed_by += 1
            if self._passed_by % self.explore:
                self.declined += 1
                return False
        self.admitted += 1
        self._total += 1
        self._offloaded += 1
        if self._total % self.window == 0:
            self._offloaded /= 2
            self._onboarded /= 2
        return True

    def describe(self) -> str:
        return (f"reuse (offload all while blocks onboarded are >= {self.rate:g} of those "
                f"offloaded, else 1 in {self.explore})")


AdmissionPolicy = AlwaysAdmit | FrequencyGate | ReuseGate


def admission_policy(spec: str | AdmissionPolicy | None) -> AdmissionPolicy:
    """A policy from its name: None or "reuse" (the default), "reuse:RATE" ("reuse:0.1");
    "always"; "second-sighting" or "second-sighting:K"
    (optionally ",W" for the window: "second-sighting:3,4096"); or a policy object as is.

    Raises:
      ValueError: an unknown name or a bad k or window. TypeError: neither a name nor a policy.
    """
    if spec is None:
        return ReuseGate()
    if isinstance(spec, (AlwaysAdmit, FrequencyGate, ReuseGate)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"admission must be 'always', 'second-sighting[:k]', 'reuse[:rate]' or "
                        f"a policy, got {type(spec).__name__}")
    name, _, arg = spec.partition(":")
    if name == "always" and not arg:
        return AlwaysAdmit()
    if name == "second-sighting":
        k, window = 2, 65536
        if arg:
            k_text, _, w_text = arg.partition(",")
            try:
                k = int(k_text)
                window = int(w_text) if w_text else window
            except ValueError:
                raise ValueError(f"admission {spec!r}: expected second-sighting:K or "
                                 f"second-sighting:K,WINDOW with integers") from None
        return FrequencyGate(k, window)
    if name == "reuse":
        try:
            return ReuseGate(float(arg)) if arg else ReuseGate()
        except ValueError:
            raise ValueError(f"admission {spec!r}: expected reuse:RATE with a rate in (0, 1]") \
                from None
    raise ValueError(f"admission {spec!r}: expected 'always', 'second-sighting[:k]' or "
                     "'reuse[:rate]'")

