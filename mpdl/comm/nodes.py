"""Which ranks share a node, and shared-memory windows among them (over an mpi4py communicator).

Nodes are MPI's shared-memory nodes (the launcher's hosts: MPI_Comm_split_type's
COMM_TYPE_SHARED), or, with the settings' ranks_per_node k (MPDL_RANKS_PER_NODE), emulated nodes
of k consecutive ranks. The blocking split runs only after every rank has shown, point to point
under the deadline, that it is in the node lookup: no rank ever blocks in it for a peer that is
in another call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import settings


def ranks_per_node_override() -> int | None:
    """Emulated nodes of k consecutive ranks (settings: MPDL_RANKS_PER_NODE), or None."""
    return settings.current().ranks_per_node


def node_of_rank(size: int, ranks_per_node: int | None,
                 exchange_leaders: Callable[[], list[int]]) -> list[int]:
    """The node index of each of `size` ranks (nodes numbered by their lowest rank's order): from
    `exchange_leaders()` (every rank's lowest node peer, exchanged point to point under a
    deadline), or emulated nodes of ranks_per_node consecutive ranks (no exchange)."""
    if ranks_per_node is not None:
        return [r // ranks_per_node for r in range(size)]
    order: dict[int, int] = {}
    return [order.setdefault(leader, len(order)) for leader in exchange_leaders()]


class SharedWindows:
    """Shared-memory windows of one node, one per size class, with a node barrier each.

    `node_comm` is a real MPI communicator over this rank's node (emulated nodes are real
    shared-memory subsets); `wait(request)` waits for an MPI request under the caller's wait policy.
    """

    def __init__(self, MPI: Any, node_comm: Any, wait: Callable[[Any], None]):
        self.MPI = MPI
        self.node = node_comm
        self._wait = wait
        self._windows: dict[int, tuple[Any, list[np.ndarray], Callable[[], None]]] = {}
        self._own: list[tuple[Any, list[np.ndarray], Callable[[], None]]] = []

    def segments(self, nbytes: int, own: bool = False) -> tuple[list[np.ndarray],
                                                                 Callable[[], None]]:
        """Byte arrays of every rank of the node (at least nbytes each) and a node barrier.
        Collective over the node the first time a size class is asked for; with `own`, a window
        of nbytes for the caller alone, collective every time."""
        if own:
            self._own.append(self._allocate(nbytes))
            _, segments, node_barrier = self._own[-1]
            return segments, node_barrier
        size_class = 1 << max(nbytes - 1, 0).bit_length()
        entry = self._windows.get(size_class)
        if entry is None:
            entry = self._windows[size_class] = self._allocate(size_class)
        _, segments, node_barrier = entry
        return segments, node_barrier

    def _allocate(self, nbytes: int) -> tuple[Any, list[np.ndarray], Callable[[], None]]:
        MPI, node = self.MPI, self.node
        win = MPI.Win.Allocate_shared(nbytes, 1, comm=node)
        win.Lock_all(MPI.MODE_NOCHECK)
        segments = []
        for r in range(node.Get_size()):
            mem, _ = win.Shared_query(r)
            segments.append(np.frombuffer(mem, dtype=np.uint8, count=nbytes))

        def node_barrier() -> None:
            win.Sync()
            self._wait(node.Ibarrier())
            win.Sync()

        return win, segments, node_barrier

    def free(self) -> None:
        """Release the windows and the node communicator (before MPI finalizes)."""
        for win, _, _ in [*self._windows.values(), *self._own]:
            win.Unlock_all()
            win.Free()
        self._windows.clear()
        self._own.clear()
        self.node.Free()
