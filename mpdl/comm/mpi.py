"""The mpi4py transport: `MPIComm` and its wait policy, and `as_communicator`.

Device arrays go to MPI directly when the library is CUDA-aware, otherwise through host staging
(`mpdl.comm.staging`). A wait polls the requests, yields the core as the node's load asks, and
raises `CollectiveTimeout` naming the peer and step after the settings' timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mpdl import backend, emulation, mpi_runtime
from mpdl.comm import flight, nodes
from mpdl.comm.base import Communicator, PersistentRequest, Request, background_is_awaited
from mpdl.comm.cuda import cuda_aware_mpi
from mpdl.comm.staging import DeviceStaging, StagingPool

#: polls of the lean first loop of `MPIComm._wait_all` where ranks outnumber cores
LEAN_POLLS = 256
_MAIN_THREAD = threading.main_thread().ident


class MPIComm(Communicator, DeviceStaging):
    """The mpi4py transport. Device arrays are staged through host buffers unless MPI is CUDA-aware."""

    _TAG = 7331
    #: the tag of the word a failing rank sends the others (dump your flight records)
    _NOTICE_TAG = 7332

    def __init__(self, mpi_comm: Any = None):
        super().__init__()
        MPI = mpi_runtime.load_mpi()
        self.MPI = MPI
        self.mpi = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        self._nodes: list[int] | None = None
        self._shared: nodes.SharedWindows | None = None
        self._pools: dict[str, StagingPool] = {}
        self._cuda_aware: bool | None = None
        #: staged messages above this many bytes travel in chunks of it, so the device-host copies
        #: of one chunk overlap the transfer of another (MPDL_STAGING_CHUNK_BYTES, default 4 MiB)
        self.staging_chunk = self.settings.staging_chunk_bytes
        #: a waiting rank yields its core every this many polls: at every poll when the node runs
        #: more ranks than cores (the peer it waits for may need the core), else every 64
        self.yield_every = 1 if mpi_runtime.oversubscribed() else 64
        #: mpdl.emulation's delay hook, called as link_delay(dest, nbytes) before each send; None = off
        self.link_delay: emulation.LinkDelay | None = None
        if self.settings.emulation is not None:
            emulation.install(self, self.settings.emulation)
        self.flight = flight.recorder(MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
        self._notice: Any = None
        if self.flight is not None and mpi_comm is None and self.size > 1:
            self._notice_buf = np.zeros(1, np.int64)
            self._notice = self.mpi.Irecv([self._notice_buf, MPI.INT64_T], MPI.ANY_SOURCE,
                                          self._NOTICE_TAG)
            self._stop = threading.Event()
            self._watcher = threading.Thread(target=self._watch_notice, daemon=True,
                                             name="mpdl-flight")
            self._watcher.start()
            flight.notify_peers.append(self._tell_peers)
            atexit.register(self._cancel_notice)

    # -- failure notices -----------------------------------------------------------------------
    def _tell_peers(self) -> None:
        """Tell every other rank that this one fails (they dump their flight records at their
        next long poll), and give them a moment to do it before the job is taken down."""
        word = np.array([self.rank], np.int64)
        for peer in range(self.size):
            if peer != self.rank:
                self.mpi.Isend([word, self.MPI.INT64_T], peer, self._NOTICE_TAG)
        time.sleep(1.0)

    def _watch_notice(self) -> None:
        """A thread that looks for a failing peer's word 20 times a second and dumps this rank's
        flight records when it comes (whatever the rank is doing: waiting, computing, or inside
        a blocking MPI call)."""
        while not self._stop.wait(0.05):
            if self._notice.Test():
                flight.dump(f"peer failed: rank {int(self._notice_buf[0])}", once=True)
                return

    def _cancel_notice(self) -> None:
        self._stop.set()
        self._watcher.join(1.0)
        if not self._watcher.is_alive() and not self.MPI.Is_finalized():
            with contextlib.suppress(Exception):
                self._notice.Cancel()
                self._notice.Wait()

    # -- device buffers ------------------------------------------------------------------------
    def cuda_aware(self) -> bool:
        if self._cuda_aware is None:
            self._cuda_aware = cuda_aware_mpi()[0] == "yes"
        return self._cuda_aware

    def _post_send(self, host: np.ndarray, dest: int) -> Any:
        return self.mpi.Isend([backend.as_bytes(host), self.MPI.BYTE], dest, self._TAG)

    def _post_recv(self, host: np.ndarray, source: int) -> Any:
        return self.mpi.Irecv([backend.as_bytes(host), self.MPI.BYTE], source, self._TAG)

    def _handle_done(self, handle: Any) -> bool:
        return handle.Test()

    def _handles_done(self, handles: list[Any]) -> bool:
        return self.MPI.Request.Testall(handles)

    # -- the transport -------------------------------------------------------------------------
    def _isend(self, buf: Any, dest: int, step: Any) -> Request:
        if self.link_delay is not None:
            self.link_delay(dest, buf.nbytes)
        xp = backend.get_array_module(buf)
        if xp is np:
            return Request(self._post_send(buf, dest), dest, step, "send")
        backend.synchronize(xp)
        if self.cuda_aware() and xp is not backend.standin:
            return Request(self._post_send(buf, dest), dest, step, "send")
        return self._staged_isend(buf, xp, dest, step)

    def _irecv(self, buf: Any, source: int, step: Any) -> Request:
        xp = backend.get_array_module(buf)
        if xp is np:
            return Request(self._post_recv(buf, source), source, step, "recv")
        backend.synchronize(xp)
        if self.cuda_aware() and xp is not backend.standin:
            return Request(self._post_recv(buf, source), source, step, "recv")
        return self._staged_irecv(buf, xp, source, step)

    def _wait_all(self, requests: Sequence[Request]) -> None:
        """The wait policy: poll; yield the core every `yield_every` polls (a background thread
        sleeps instead, leaving the GIL to the compute thread, unless that thread is blocked
        waiting for it); say once whom it waits for after `settings.stall_warn` seconds; time out
        after `self.timeout`."""
        handles = [h for r in requests for h in (r.handle if isinstance(r.handle, list)
                                                  else (r.handle,))]
        progressing = [r.progress for r in requests if r.progress is not None]
        testall = self.MPI.Request.Testall
        yield_every = self.yield_every
        if yield_every == 1 and not progressing and threading.get_ident() == _MAIN_THREAD:
            # ranks outnumber cores: first a loop with nothing but polls and yields (every
            # instruction between two polls is taken from the rank waited for)
            for _ in range(LEAN_POLLS):
                if testall(handles):
                    return
                os.sched_yield()
        spins = 0
        deadline = warn = None
        # On the communication thread, pause between polls so the GIL goes to the compute thread.
        background = threading.current_thread() is not threading.main_thread()
        while not testall(handles):
            for progress in progressing:
                progress()
            spins += 1
            if background and spins > 64 and not background_is_awaited():
                time.sleep(20e-6)
            elif spins % yield_every == 0:
                # Oversubscribed ranks (more ranks than cores) need the peer to run: let it; and
                # one that has waited long (a pipeline stage for its neighbour's compute) sleeps,
                # since a rank that only yields still takes its share of a core from the others
                if yield_every == 1 and spins > 256:
                    time.sleep(50e-6)
                else:
                    os.sched_yield()
            if spins & 1023 == 0:
                now = time.monotonic()
                if deadline is None:
                    deadline, warn = now + self.timeout, now + self.settings.stall_warn
                elif now > deadline or (warn is not None and now > warn):
                    pending = [r for r in requests if not all(
                        h.Get_status()
                        for h in (r.handle if isinstance(r.handle, list) else (r.handle,)))]
                    if now > deadline:
                        raise self._timeout_error(pending or list(requests))
                    self._stall_warning(pending or list(requests), now - deadline + self.timeout)
                    warn = None

    def _test(self, request: Request) -> bool:
        if request.progress is not None:
            request.progress()
        handle = request.handle
        return self._handles_done(handle if isinstance(handle, list) else [handle])

    def _persistent(self, request: PersistentRequest) -> None:
        """A persistent MPI request for host arrays (and device arrays under CUDA-aware MPI);
        a staged device array keeps posting ordinary staged messages."""
        xp = backend.get_array_module(request.buf)
        if xp is not np and not (self.cuda_aware() and xp is not backend.standin):
            return
        init = self.mpi.Send_init if request.kind == "send" else self.mpi.Recv_init
        request.persistent = request.handle = init([backend.as_bytes(request.buf), self.MPI.BYTE],
                                                   request.peer, self._TAG)
        free_before_finalize(request)

    def _start(self, request: PersistentRequest) -> None:
        handle = request.persistent
        if handle is None:
            super()._start(request)
            return
        if request.kind == "send" and self.link_delay is not None:
            self.link_delay(request.peer, request.buf.nbytes)
        xp = backend.get_array_module(request.buf)
        if xp is not np:
            backend.synchronize(xp)
        handle.Start()

    def _free_persistent(self, request: PersistentRequest) -> None:
        handle, request.persistent = request.persistent, None
        _live.discard(request)
        if handle is not None and not self.MPI.Is_finalized():
            handle.Free()
        request.handle = None

    def _wait_mpi(self, request: Any, step: str) -> None:
        """Wait for one MPI request (a barrier) under the wait policy."""
        self._wait_all([Request(request, -1, step, "barrier")])

    # -- collectives we borrow from MPI -------------------------------------------------------
    def barrier(self) -> None:
        with self.recording("barrier", "mpi"):
            self._wait_mpi(self.mpi.Ibarrier(), "barrier")

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's obj, in rank order: pickled, and the sizes and bytes gathered by
        nonblocking MPI calls waited for under the wait policy, so that a rank that died ends the
        wait after MPDL_TIMEOUT instead of leaving it blocked in MPI."""
        payload = np.frombuffer(pickle.dumps(obj), np.uint8)
        mine, sizes = np.array([payload.size], np.int64), np.empty(self.size, np.int64)
        self._wait_mpi(self.mpi.Iallgather([mine, self.MPI.INT64_T], [sizes, self.MPI.INT64_T]),
                       "object size")
        displs = np.zeros(self.size, np.int64)
        np.cumsum(sizes[:-1], out=displs[1:])
        data = np.empty(int(sizes.sum()), np.uint8)
        self._wait_mpi(self.mpi.Iallgatherv([payload, self.MPI.BYTE],
                                            [data, sizes, displs, self.MPI.BYTE]), "object")
        return [pickle.loads(data[d:d + n].tobytes())
                for d, n in zip(displs.tolist(), sizes.tolist(), strict=True)]

    # -- nodes ---------------------------------------------------------------------------------
    def node_of_rank(self) -> list[int]:
        if self._nodes is None:
            self._nodes = nodes.node_of_rank(self.mpi, self.MPI, self.settings.ranks_per_node,
                                             self._wait_mpi)
        return self._nodes

    def shared_segments(self, nbytes: int, own: bool = False) -> tuple[list[np.ndarray],
                                                                        Callable[[], None]]:
        if self._shared is None:
            # a real MPI communicator over this rank's node (real shared memory, emulated split),
            # after a barrier under the deadline: the splits below block in MPI
            node = self.node_of_rank()[self.rank]
            self._wait_mpi(self.mpi.Ibarrier(), "the shared-memory setup (before "
                           "MPI_Comm_split_type)")
            shared = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
            node_comm = shared.Split(node, key=self.rank)
            shared.Free()
            self._shared = nodes.SharedWindows(self.MPI, node_comm,
                                               lambda r: self._wait_mpi(r, "shm barrier"))
            # A window still open at MPI_Finalize fails it with some network modules
            # (MPICH over libfabric: "fabricclose failed"), so free them first.
            atexit.register(self.free)
        return self._shared.segments(nbytes, own)

    def free(self) -> None:
        """Release the shared-memory windows and node communicator (before MPI finalizes; called
        at exit when the program did not), unless an uncaught exception ends the process."""
        if self._shared is not None and not self.MPI.Is_finalized() and not _failing():
            self._shared.free()
            self._shared = None


#: objects holding persistent MPI requests (persistent sends and receives, collective plans),
#: whose `free()` runs before MPI finalizes
_live: weakref.WeakSet = weakref.WeakSet()


def free_before_finalize(holder: Any) -> None:
    """Call holder.free() at exit, before MPI finalizes, if holder is still alive then."""
    _live.add(holder)


def _failing() -> bool:
    """Whether an uncaught exception ends this process: then the collective frees (of windows,
    of persistent requests' communicators) would wait for peers that may never come, and the
    job's abort cleans up instead."""
    return getattr(sys, "last_value", None) is not None


@atexit.register
def _free_all() -> None:
    if _failing():
        return
    for holder in list(_live):
        holder.free()


_world: MPIComm | None = None
_wrapped: dict[int, MPIComm] = {}


def as_communicator(comm: Any = None) -> Communicator:
    """mpdl's communicator for comm: None means MPI.COMM_WORLD; an mpi4py communicator is wrapped
    (once, then cached); an mpdl Communicator is returned as is."""
    global _world
    if isinstance(comm, Communicator):
        return comm
    if comm is None:
        if _world is None:
            _world = MPIComm()
        return _world
    MPI = mpi_runtime.load_mpi()
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm: expected None, an mpi4py communicator or an mpdl Communicator, "
                        f"got {type(comm).__name__}")
    if comm == MPI.COMM_WORLD:
        return as_communicator(None)
    key = MPI._handleof(comm)
    if key not in _wrapped:
        _wrapped[key] = MPIComm(comm)
    return _wrapped[key]
