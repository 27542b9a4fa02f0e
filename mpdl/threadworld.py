"""An in-process world of p ranks, one thread each, with queues instead of MPI.

The same collective code that runs over mpi4py runs here, so tests can check every algorithm for
p = 1..32 in seconds, notebooks can run and draw an algorithm without mpiexec, and the message
log holds each message (collective, step, source, destination, bytes) for the cost model.
It is a test and teaching double: every algorithm is also tested over real MPI.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mpdl import backend
from mpdl.comm import Communicator, Request


class ThreadWorld:
    """The shared state of p in-process ranks: one mailbox per (source, destination) pair."""

    def __init__(self, size: int, ranks_per_node: int | None = None, message_log: bool = False):
        if size < 1:
            raise ValueError(f"size: expected at least 1 rank, got {size}")
        self.size = size
        self.ranks_per_node = ranks_per_node or size
        self.mailboxes = {(s, d): queue.SimpleQueue() for s in range(size) for d in range(size)}
        self.message_log: list[tuple] | None = [] if message_log else None
        self._lock = threading.Lock()
        self._segments: dict[tuple, list[np.ndarray]] = {}
        self._barriers: dict[tuple, threading.Barrier] = {}
        self._gather: dict[int, list] = {}
        self._gather_barrier = threading.Barrier(size)

    def comm(self, rank: int) -> ThreadComm:
        return ThreadComm(self, rank)

    def run(self, fn: Callable[[ThreadComm], Any], timeout: float = 60.0) -> list[Any]:
        """Run fn(comm) on every rank in its own thread; return the results in rank order.

        The first exception raised by any rank is re-raised here, also when the other ranks are
        left waiting for it; ranks still running after `timeout` seconds raise TimeoutError
        naming where each one waits.
        """
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.comm(rank))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors[rank] = exc

        threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        failed = [exc for exc in errors if exc is not None]
        if stuck and failed:
            failed[0].add_note(f"in-process world: ranks {stuck} were left waiting")
        elif stuck:
            frames = sys._current_frames()
            where = "; ".join(f"rank {r} in {_where(frames.get(threads[r].ident))}" for r in stuck)
            raise TimeoutError(f"in-process world: ranks {stuck} did not finish within {timeout} s "
                               f"({where})")
        if failed:
            raise failed[0]
        return results


def _where(frame: Any) -> str:
    """The innermost calls of a thread's stack, as 'file:line function' from the outside in."""
    calls = traceback.extract_stack(frame)[-4:] if frame is not None else []
    return " > ".join(f"{Path(c.filename).name}:{c.lineno} {c.name}" for c in calls) or "?"


class ThreadComm(Communicator):
    """One rank of a ThreadWorld. Sends are buffered (they complete at once); receives block."""

    def __init__(self, world: ThreadWorld, rank: int):
        super().__init__()
        self.world = world
        self.rank = rank
        self.size = world.size
        self._own_calls = 0
        self.message_log = world.message_log

    def _isend(self, buf: Any, dest: int, step: Any) -> Request:
        if not 0 <= dest < self.size:
            raise ValueError(f"dest: expected a rank in [0, {self.size}), got {dest}")
        self.world.mailboxes[(self.rank, dest)].put(backend.to_host(buf).copy())
        return Request(None, dest, step, "send")

    def _irecv(self, buf: Any, source: int, step: Any) -> Request:
        if not 0 <= source < self.size:
            raise ValueError(f"source: expected a rank in [0, {self.size}), got {source}")
        return Request(buf, source, step, "recv")

    def _wait_all(self, requests: Sequence[Request]) -> None:
        for r in requests:
            if r.kind != "recv" or r.handle is None:
                continue
            try:
                data = self.world.mailboxes[(r.peer, self.rank)].get(timeout=self.timeout)
            except queue.Empty:
                raise self._timeout_error([r]) from None
            self._deliver(r, data)

    def _test(self, request: Request) -> bool:
        if request.kind != "recv" or request.handle is None:
            return True
        try:
            data = self.world.mailboxes[(request.peer, self.rank)].get_nowait()
        except queue.Empty:
            return False
        self._deliver(request, data)
        return True

    def _deliver(self, r: Request, data: np.ndarray) -> None:
        dst = r.handle
        if data.nbytes != dst.nbytes:
            raise RuntimeError(f"{self.collective}: rank {self.rank} expected {dst.nbytes} "
                               f"bytes from rank {r.peer} at step {r.step}, got {data.nbytes}")
        backend.upload(dst, data.view(dst.dtype).reshape(dst.shape))
        r.handle = None

    def node_of_rank(self) -> list[int]:
        return [r // self.world.ranks_per_node for r in range(self.size)]

    def shared_segments(self, nbytes: int, own: bool = False):
        size_class = nbytes if own else 1 << max(nbytes - 1, 0).bit_length()
        node = self.node_of_rank()[self.rank]
        members = tuple(r for r, n in enumerate(self.node_of_rank()) if n == node)
        with self.world._lock:
            key = (members, size_class)
            if own:  # the k-th such call of every member of the node gets the k-th segments
                self._own_calls += 1
                key = (members, "own", self._own_calls)
            if key not in self.world._segments:
                self.world._segments[key] = [np.zeros(size_class, np.uint8) for _ in members]
                self.world._barriers[key] = threading.Barrier(len(members))
            segments, barrier = self.world._segments[key], self.world._barriers[key]
        return segments, lambda: barrier.wait(self.timeout)

    def allgather_object(self, obj: Any) -> list[Any]:
        world = self.world
        with world._lock:
            world._gather[self.rank] = obj
        world._gather_barrier.wait(self.timeout)
        result = [world._gather[r] for r in range(self.size)]
        world._gather_barrier.wait(self.timeout)
        return result


def run_world(size: int, fn: Callable[[ThreadComm], Any], ranks_per_node: int | None = None,
              message_log: bool = False) -> list[Any] | tuple[list[Any], list[tuple]]:
    """Run fn(comm) on an in-process world of `size` ranks; with message_log=True also return the
    message log, the messages sent as (collective, step, src, dst, nbytes) tuples."""
    world = ThreadWorld(size, ranks_per_node, message_log)
    results = world.run(fn)
    return (results, world.message_log) if message_log else results
