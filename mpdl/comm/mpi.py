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
from mpdl.comm.base import (
    CollectiveMismatch,
    Communicator,
    PersistentRequest,
    Request,
    background_is_awaited,
)
from mpdl.comm.calls import (
    ANNOUNCE_TAG,
    NODES_TAG,
    NOTICE_ACK_TAG,
    NOTICE_TAG,
    OBJECT_TAG,
    P2P_TAG,
    SHM_SETUP_TAG,
    CallName,
    call_state,
)
from mpdl.comm.cuda import cuda_aware_mpi
from mpdl.comm.staging import DeviceStaging, StagingPool

#: polls of the lean first loop of `MPIComm._wait_all` where ranks outnumber cores
LEAN_POLLS = 256
_MAIN_THREAD = threading.main_thread().ident
#: the longest wait after which a rank tells the others which call it waits in (sooner under a
#: short MPDL_TIMEOUT: a third of it), and the bytes of a failing rank's word to the others
ANNOUNCE_AFTER_S = 10.0
NOTICE_BYTES = 1024
#: the longest a failing rank waits for the others to have said their line
NOTICE_WAIT_S = 5.0
#: the other ranks' announced calls kept, by (group, sequence number)
HEARD_KEPT = 256


class MPIComm(Communicator, DeviceStaging):
    """The mpi4py transport. Device arrays are staged through host buffers unless MPI is CUDA-aware."""

    _TAG = P2P_TAG
    #: the tag of the word a failing rank sends the others (say why, dump your flight records)
    _NOTICE_TAG = NOTICE_TAG

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
        if mpi_comm is None:  # a program using the library directly: one rank's failure ends all
            mpi_runtime.abort_on_uncaught_exception()
        self._notice: Any = None
        #: the calls other ranks said they wait in: {(group, seq, phase): {rank: (key, words)}}
        self._heard: dict[tuple, dict[int, tuple[Any, str]]] = {}
        #: announcements of this rank's waits still being sent (request, buffer)
        self._announcing: list[tuple[Any, Any]] = []
        if self.flight is not None and mpi_comm is None and self.size > 1:
            self._notice_buf = np.zeros(NOTICE_BYTES, np.uint8)
            self._notice_status = MPI.Status()
            self._notice = self.mpi.Irecv([self._notice_buf, MPI.BYTE], MPI.ANY_SOURCE,
                                          self._NOTICE_TAG)
            self._stop = threading.Event()
            self._watcher = threading.Thread(target=self._watch_notice, daemon=True,
                                             name="mpdl-flight")
            self._watcher.start()
            flight.notify_peers.append(self._tell_peers)
            atexit.register(self._cancel_notice)

    # -- failure notices -----------------------------------------------------------------------
    def _tell_peers(self, reason: str = "") -> None:
        """Tell every other rank that this one fails and why (each says so in one line and dumps
        its flight records), and wait until each has (at most NOTICE_WAIT_S) before the job is
        taken down."""
        word = np.frombuffer(reason.encode()[:NOTICE_BYTES], np.uint8).copy()
        peers = [peer for peer in range(self.size) if peer != self.rank]
        acks = np.zeros(len(peers), np.uint8)
        requests = [self.mpi.Irecv([acks[i:i + 1], self.MPI.BYTE], peer, NOTICE_ACK_TAG)
                    for i, peer in enumerate(peers)]
        requests += [self.mpi.Isend([word, self.MPI.BYTE], peer, self._NOTICE_TAG)
                     for peer in peers]
        deadline = time.monotonic() + NOTICE_WAIT_S
        while not self.MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(0.01)

    def _watch_notice(self) -> None:
        """A thread that looks for a failing peer's word 20 times a second (whatever the rank is
        doing: waiting, computing, or inside a blocking MPI call): then this rank says in one
        line which rank failed, why, and where this one is, and dumps its flight records. It
        also takes in the other ranks' announced waits, so that none pile up unread."""
        while not self._stop.wait(0.05):
            if self._notice.Test(self._notice_status):
                source = self._notice_status.Get_source()
                size = self._notice_status.Get_count(self.MPI.BYTE)
                reason = bytes(self._notice_buf[:size]).decode(errors="replace")
                mpi_runtime.say(f"mpdl: rank {self.rank}: ending because rank {source} failed"
                                f"{': ' + reason if reason else ''} ({self._where()})")
                flight.dump(f"peer failed: rank {source}", once=True)
                self.mpi.Send([np.ones(1, np.uint8), self.MPI.BYTE], source, NOTICE_ACK_TAG)
                return
            with contextlib.suppress(Exception):
                self._hear()

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
        return self.mpi.Isend([backend.as_bytes(host), self.MPI.BYTE], dest, call_state.tag)

    def _post_recv(self, host: np.ndarray, source: int) -> Any:
        return self.mpi.Irecv([backend.as_bytes(host), self.MPI.BYTE], source, call_state.tag)

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
        deadline = warn = announce = None
        hearing = False
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
                    announce = now + self.announce_after()
                    continue
                if announce is not None and now > announce:
                    announce, hearing = None, self._announce()
                if hearing:
                    self._hear(check=True)
                if now > deadline or (warn is not None and now > warn):
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
                                                   request.peer, call_state.tag)
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
        """Every rank's obj, in rank order: exchanged point to point under a tag of its own
        (never matched by a collective's messages or MPI's own collectives) and waited for under
        the wait policy, so that a rank that died or called something else ends the wait after
        MPDL_TIMEOUT instead of leaving it blocked in MPI."""
        return self._exchange_objects(obj, OBJECT_TAG)

    # -- what a stalled wait tells the others ---------------------------------------------------
    def announce_after(self) -> float:
        """Seconds a wait lasts before this rank tells the others which call it waits in."""
        return min(ANNOUNCE_AFTER_S, self.timeout / 3)

    def _current_call(self) -> tuple[tuple, int, str, Any, str] | None:
        """(group, sequence number, phase, key, words) of the call this rank waits in: phase
        "in" inside the call (key: its flight record's collective, algorithm, bytes, dtype and
        op), "before" in the exchange that checks it (key: its tag); None where it cannot say
        (no flight recorder, or a wait outside a collective)."""
        name = self.collective
        if name.__class__ is CallName and name.group is not None:
            return None if name.position is None else (name.group, name.position, "before",
                                                       name.tag, name.describe())
        entry = self.flight.last if self.flight is not None else None
        if name == "p2p" or entry is None or entry.state != "started" or entry.info[1] == "p2p":
            return None
        # all from the one record, which another thread's call cannot have half changed
        collective, algorithm, nbytes, dtype, op, group = entry.info
        if name.__class__ is CallName and name.signature[:2] == (collective, algorithm):
            words = name.describe()
        else:
            words = f"{collective}/{algorithm}({'op ' + op + ', ' if op else ''}{nbytes} B of {dtype})"
        return group, entry.seq, "in", (collective, algorithm, nbytes, str(dtype), op), words

    def _where(self) -> str:
        """Where this rank is, in words (for a line on its way out)."""
        now = self._current_call()
        if now is not None:
            return f"this rank was in {now[4]} #{now[1]}"
        if self.collective == "p2p":
            return "this rank was in no collective"
        return f"this rank was in {self.collective}"

    def _announce(self) -> bool:
        """Tell every other rank which call this rank waits in; whether it could say."""
        now = self._current_call()
        if now is None or self._notice is None:
            return False
        self._announcing = [(r, b) for r, b in self._announcing if not r.Test()]
        payload = np.frombuffer(pickle.dumps((self.rank, *now)), np.uint8).copy()
        for peer in range(self.size):
            if peer != self.rank:
                self._announcing.append((self.mpi.Isend([payload, self.MPI.BYTE], peer,
                                                        ANNOUNCE_TAG), payload))
        return True

    def _hear(self, check: bool = False) -> None:
        """Take in the calls other ranks announced; with `check`, raise CollectiveMismatch when
        one waits in another call at this rank's place in the same group."""
        status = self.MPI.Status()
        while True:
            message = self.mpi.Improbe(self.MPI.ANY_SOURCE, ANNOUNCE_TAG, status)
            if message is None:
                break
            buf = bytearray(status.Get_count(self.MPI.BYTE))
            message.Recv([buf, self.MPI.BYTE])
            rank, group, seq, phase, key, words = pickle.loads(buf)
            if len(self._heard) >= HEARD_KEPT:
                with contextlib.suppress(RuntimeError, KeyError, StopIteration):
                    self._heard.pop(next(iter(self._heard)))  # the oldest
            self._heard.setdefault((group, seq, phase), {})[rank] = (key, words)
        if not check:
            return
        now = self._current_call()
        if now is None:
            return
        group, seq, phase, key, words = now
        others = {r: w for r, (k, w) in self._heard.get((group, seq, phase), {}).items()
                  if k != key}
        if others:
            lines = "; ".join([f"rank {self.rank}: {words}",
                               *(f"rank {r}: {w}" for r, w in sorted(others.items()))])
            raise CollectiveMismatch(f"{self.collective} #{seq}: the ranks called different "
                                     f"collectives: {lines}")

    def heard_text(self) -> str:
        """What the other ranks said they wait in, for a timeout's message ("" if nothing)."""
        latest: dict[int, tuple[int, str]] = {}
        for (_, seq, _), ranks in self._heard.items():
            for rank, (_, words) in ranks.items():
                latest[rank] = (seq, words)
        return "; ".join(f"rank {r} waits in {w} #{s}" for r, (s, w) in sorted(latest.items()))

    # -- nodes ---------------------------------------------------------------------------------
    def node_of_rank(self) -> list[int]:
        if self._nodes is None:
            self._nodes = nodes.node_of_rank(self.size, self.settings.ranks_per_node,
                                             self._exchange_leaders)
        return self._nodes

    def _exchange_leaders(self) -> list[int]:
        """Every rank's lowest peer in MPI's shared-memory split (the node lookup): the split
        runs once every rank has shown, under the wait policy, that it is here."""
        previous, self.collective = self.collective, "the node lookup"
        try:
            self._exchange_objects(None, NODES_TAG)
            shared = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED, key=self.rank)
            peers = shared.Get_group().Translate_ranks(list(range(shared.Get_size())),
                                                       self.mpi.Get_group())
            shared.Free()
            return self._exchange_objects(min(peers), NODES_TAG)
        finally:
            self.collective = previous

    def shared_segments(self, nbytes: int, own: bool = False) -> tuple[list[np.ndarray],
                                                                        Callable[[], None]]:
        if self._shared is None:
            # a real MPI communicator over this rank's node (real shared memory, emulated split),
            # after a barrier under the deadline: the splits below block in MPI
            node = self.node_of_rank()[self.rank]
            previous, self.collective = (self.collective, "the shared-memory setup (before "
                                         "MPI_Comm_split_type)")
            try:
                self._exchange_objects(None, SHM_SETUP_TAG)
            finally:
                self.collective = previous
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
