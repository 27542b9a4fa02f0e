"""A per-rank memory ledger: the live bytes of the arrays the runtime holds, by category, and their
peaks.

Arrays are counted where they are made or kept, not from formulas: a strategy, optimizer or
collective calls `hold(array, category)` on the buffers it keeps (a weak-reference finalizer takes
the bytes off when the buffer dies), and the autograd engine calls `save(arrays)` for what a graph
node keeps for backward (the bytes go when the node is released). An array is counted by its
*root*, the array that owns the memory (`a.base` followed down), so views cost nothing and a
buffer kept by several nodes is counted once. A buffer held under one category is not counted
again as an activation: the weights a linear layer saves for backward are parameters.

    ledger = Ledger()
    with ledger.installed():       # this thread's arrays go to `ledger` (process-wide: install())
        ...                        # a training step
    ledger.peak["activations"]     # bytes, the most held at one time since reset_peaks()

The categories: parameters, master_weights (float32 copies of low-precision parameters),
gradients, optimizer_state, activations (saved for backward), communication (collective
workspaces, pipeline send and receive buffers), other.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

CATEGORIES = ("parameters", "master_weights", "gradients", "optimizer_state", "activations",
              "communication", "other")
#: the categories that make up the model state (ZeRO's accounting)
MODEL_STATE = ("parameters", "master_weights", "gradients", "optimizer_state")
#: the most counter samples a ledger keeps for the timeline
MAX_SAMPLES = 200_000

_local = threading.local()
_process: Ledger | None = None


def root_of(array: Any) -> Any:
    """The array that owns `array`'s memory (itself unless it is a view)."""
    while True:
        base = getattr(array, "base", None)
        if base is None or not hasattr(base, "nbytes") or not hasattr(base, "dtype"):
            return array
        array = base


def _array_types() -> tuple[type, ...]:
    cupy = sys.modules.get("cupy")
    return (np.ndarray, cupy.ndarray) if cupy is not None else (np.ndarray,)


class _Saved:
    """What one graph node keeps for backward; its bytes leave the ledger when it is dropped."""

    __slots__ = ("ledger", "roots")

    def __init__(self, ledger: Ledger, roots: list[Any]) -> None:
        self.ledger, self.roots = ledger, roots

    def __del__(self) -> None:
        self.ledger._unsave(self.roots)


class Ledger:
    """Live and peak bytes per category of one rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        #: the most bytes held at one time: of all categories, and of the model state
        self.peak_total = 0
        self.peak_state = 0
        #: the live bytes per category when the total was at its peak
        self.at_peak = dict(self.live)
        self._total = 0
        self._state = 0
        self._held: dict[int, tuple[str, int]] = {}    # id(root) -> (category, bytes)
        self._saved: dict[int, list[int]] = {}          # id(root) -> [references, bytes]
        #: with `trace()`: (time.perf_counter, live bytes per category) at every change
        self.samples: list[tuple[float, tuple[int, ...]]] | None = None

    # -- counting ---------------------------------------------------------------------------------
    def _add(self, category: str, nbytes: int) -> None:
        live = self.live[category] + nbytes
        self.live[category] = live
        if live > self.peak[category]:
            self.peak[category] = live
        self._total += nbytes
        if self._total > self.peak_total:
            self.peak_total = self._total
            self.at_peak = dict(self.live)
        if category in MODEL_STATE:
            self._state += nbytes
            if self._state > self.peak_state:
                self.peak_state = self._state
        if self.samples is not None and len(self.samples) < MAX_SAMPLES:
            self.samples.append((time.perf_counter(), tuple(self.live.values())))

    def hold(self, array: Any, category: str) -> None:
        """Count `array`'s root under `category` until the root is garbage (nothing if the root
        is already held)."""
        if category not in self.live:
            raise ValueError(f"category: expected one of {', '.join(CATEGORIES)}, got "
                             f"{category!r}")
        root = root_of(array)
        if root.ndim == 0:  # a scalar, or a freed parameter's placeholder: no buffer
            return
        key = id(root)
        with self._lock:
            if key in self._held:
                return
            nbytes = int(root.nbytes)
            self._held[key] = (category, nbytes)
            saved = self._saved.get(key)
            if saved is not None and saved[1]:  # was counted as an activation until now
                self._add("activations", -saved[1])
                saved[1] = 0
            self._add(category, nbytes)
        weakref.finalize(root, self._drop, key)

    def _drop(self, key: int) -> None:
        with self._lock:
            category, nbytes = self._held.pop(key)
            self._add(category, -nbytes)

    def category_of(self, array: Any) -> str | None:
        """The category `array`'s root is held under (None if it is not held)."""
        entry = self._held.get(id(root_of(array)))
        return None if entry is None else entry[0]

    def save(self, arrays: Iterable[Any]) -> _Saved:
        """Count the roots of `arrays` as activations until the returned record is dropped
        (roots held under another category are not counted)."""
        types = _array_types()
        roots, seen = [], set()
        with self._lock:
            for a in arrays:
                if not isinstance(a, types):
                    continue
                root = root_of(a)
                key = id(root)
                if key in seen or key in self._held:  # the record must not keep those alive
                    continue
                seen.add(key)
                roots.append(root)
                entry = self._saved.get(key)
                if entry is not None:
                    entry[0] += 1
                else:
                    self._saved[key] = [1, int(root.nbytes)]
                    self._add("activations", int(root.nbytes))
        return _Saved(self, roots)

    def _unsave(self, roots: list[Any]) -> None:
        with self._lock:
            for root in roots:
                key = id(root)
                entry = self._saved[key]
                entry[0] -= 1
                if entry[0] == 0:
                    del self._saved[key]
                    if entry[1]:
                        self._add("activations", -entry[1])

    # -- reading ----------------------------------------------------------------------------------
    def reset_peaks(self) -> None:
        """Start the peaks afresh from what is held now."""
        with self._lock:
            self.peak, self.at_peak = dict(self.live), dict(self.live)
            self.peak_total, self.peak_state = self._total, self._state

    def trace(self) -> None:
        """Record a sample of the live bytes at every change from now on (for a timeline)."""
        self.samples = [(time.perf_counter(), tuple(self.live.values()))]

    def held(self, category: str) -> int:
        """Live bytes of `category`."""
        return self.live[category]

    @contextlib.contextmanager
    def installed(self) -> Iterator[Ledger]:
        """Within the block, arrays counted on this thread go to this ledger."""
        previous = getattr(_local, "ledger", None)
        _local.ledger = self
        try:
            yield self
        finally:
            _local.ledger = previous


def current() -> Ledger | None:
    """The ledger this thread counts into: the one installed on the thread, else the process's
    (`install`), else None (nothing is counted)."""
    return getattr(_local, "ledger", None) or _process


def install(ledger: Ledger | None) -> None:
    """Make `ledger` the process's ledger (one rank per process, as under mpiexec); None: none."""
    global _process
    _process = ledger


def hold(array: Any, category: str) -> None:
    """`current().hold(array, category)` when a ledger is counting; nothing otherwise."""
    ledger = current()
    if ledger is not None and array is not None:
        ledger.hold(array, category)


def hold_all(arrays: Iterable[Any], category: str) -> None:
    """`hold` each of `arrays` that is an array."""
    ledger = current()
    if ledger is None:
        return
    types = _array_types()
    for a in arrays:
        if isinstance(a, types):
            ledger.hold(a, category)


@contextlib.contextmanager
def counting_into(ledger: Ledger | None) -> Iterator[None]:
    """Run the block with `ledger` installed on this thread (nothing changes for None)."""
    if ledger is None:
        yield
        return
    with ledger.installed():
        yield
