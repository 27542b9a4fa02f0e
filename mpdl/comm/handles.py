"""Asynchronous collectives: one communication thread per communicator runs them in issue order.

mpi4py releases the GIL inside MPI calls and NumPy releases it in ufuncs and BLAS, so the thread
makes real progress while the caller computes (for example, the rest of a backward pass). While a
caller is blocked in `Handle.wait`, the thread's waits poll without pausing (nobody else needs the
GIL then).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from mpdl import memory
from mpdl.comm.base import blocked_on_background


class Handle:
    """A collective in flight: `.test()` says whether it finished, `.wait()` returns its result."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None

    def test(self) -> bool:
        """True once the collective has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self) -> Any:
        """Block until the collective finishes; return its result or raise its error."""
        if not self._done.is_set():
            with blocked_on_background():
                self._done.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done.set()


class CommThread:
    """A daemon thread that runs submitted work items one at a time, in submission order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="mpdl-comm", daemon=True)
        self.thread.start()

    def submit(self, work: Callable[[], Any]) -> Handle:
        """Queue `work`; it counts its arrays into the submitting thread's memory ledger."""
        handle = Handle()
        with self._lock:
            self._pending += 1
        ledger = memory.current()
        if ledger is not None:
            work = _counting(work, ledger)
        self._queue.put((work, handle))
        return handle

    def busy(self) -> bool:
        """True while submitted work has not finished."""
        return self._pending > 0

    def _loop(self) -> None:
        while True:
            work, handle = self._queue.get()
            try:
                result, error = work(), None
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                result, error = None, exc
            with self._lock:
                self._pending -= 1
            handle._finish(result, error)
            work = handle = result = None  # hold nothing of finished work while idle


def _counting(work: Callable[[], Any], ledger: memory.Ledger) -> Callable[[], Any]:
    def run() -> Any:
        with ledger.installed():
            return work()
    return run


def comm_thread_for(comm: Any) -> CommThread:
    """The communication thread of comm (started on first use)."""
    comm_thread = getattr(comm, "_comm_thread", None)
    if comm_thread is None:
        comm_thread = comm._comm_thread = CommThread()
    return comm_thread


def run_in_order(comm: Any, work: Callable[[], Any]) -> Any:
    """Run work now, unless asynchronous collectives are still in flight on comm: then queue it
    behind them, so that every rank issues its messages in the same order."""
    comm_thread = getattr(comm, "_comm_thread", None)
    if (comm_thread is None or threading.current_thread() is comm_thread.thread
            or not comm_thread.busy()):
        return work()
    return comm_thread.submit(work).wait()

