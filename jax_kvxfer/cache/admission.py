"""Admission policies for offloading: which blocks evicted from the GPU pool go to the host.

`BlockManager(admission=...)` asks its policy at the eviction point, for a victim whose
priority is offloaded at all (TensorRT-LLM's rule stays: a block below
`secondary_offload_min_priority` is never offloaded, whatever the policy says), whether to
offload it or drop it. The block manager tells the policy of every sighting of a block key: once
per released sequence that holds the block (computed or reused).

- `AlwaysAdmit` ("always"): every such victim is offloaded (the default).
- `FrequencyGate` ("second-sighting[:k]"): a victim is offloaded only once its key has been
  seen at least `k` times (2 by default) in a bounded, decaying window: vLLM's
  `store_threshold`, Dynamo KVBM's frequency gate. The counts are TinyLFU's: after every
  `window` sightings, every count is halved (rounded down) and the keys at 0 forgotten, so that
  old reuse fades and at most 2 * `window` keys are held.
"""

from __future__ import annotations


class AlwaysAdmit:
    """Offload every evicted block whose priority is offloaded."""

    name = "always"
    counts_sightings = False  # the block manager need not report them

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


AdmissionPolicy = AlwaysAdmit | FrequencyGate


def admission_policy(spec: str | AlwaysAdmit | FrequencyGate | None) -> AlwaysAdmit | FrequencyGate:
    """A policy from its name: None or "always"; "second-sighting" or "second-sighting:K"
    (optionally ",W" for the window: "second-sighting:3,4096"); or a policy object as is.

    Raises:
      ValueError: an unknown name or a bad k or window. TypeError: neither a name nor a policy.
    """
    if spec is None:
        return AlwaysAdmit()
    if isinstance(spec, (AlwaysAdmit, FrequencyGate)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"admission must be 'always', 'second-sighting[:k]' or a policy, got "
                        f"{type(spec).__name__}")
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
    raise ValueError(f"admission {spec!r}: expected 'always' or 'second-sighting[:k]'")

