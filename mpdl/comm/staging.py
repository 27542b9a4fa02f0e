"""Host staging of device arrays for an MPI library that cannot read GPU memory.

A device array is copied into a reused host buffer (pinned for CuPy) and sent from there; a receive
lands in a host buffer and is uploaded on completion. Messages above the staging chunk travel in
chunks, so the device-host copies of one chunk overlap the transfer of another.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from mpdl import backend, settings
from mpdl.comm.base import Request


def staging_chunk_bytes() -> int:
    """The chunk size of staged device messages (settings: MPDL_STAGING_CHUNK_BYTES, 4 MiB)."""
    return settings.current().staging_chunk_bytes


class StagingPool:
    """Host buffers for device arrays that MPI cannot read, reused across calls.

    A buffer is lent out by `acquire` and stays out of circulation until `release`, so no buffer is
    reused while a message that uses it is in flight.
    """

    def __init__(self, allocate: Callable[[int], np.ndarray]):
        self._allocate = allocate
        self._free: dict[int, list[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.in_flight: set[int] = set()
        self.allocations = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        size_class = 1 << max(nbytes - 1, 0).bit_length()
        with self._lock:
            free = self._free.get(size_class)
            if free:
                buf = free.pop()
            else:
                buf = self._allocate(size_class)
                self.allocations += 1
            if id(buf) in self.in_flight:
                raise RuntimeError("staging buffer handed out twice while in flight")
            self.in_flight.add(id(buf))
        return buf

    def release(self, buf: np.ndarray) -> None:
        with self._lock:
            self.in_flight.discard(id(buf))
            self._free.setdefault(buf.nbytes, []).append(buf)


def _pinned_allocator(xp: Any) -> Callable[[int], np.ndarray]:
    if xp is backend.standin or xp is np:
        return lambda n: np.empty(n, np.uint8)
    import cupyx  # noqa: PLC0415 - CuPy is optional and slow to import

    return lambda n: cupyx.empty_pinned(n, np.uint8)


class DeviceStaging:
    """Staged sends and receives of device arrays, for a transport that moves host bytes.

    The transport class provides `staging_chunk` (bytes), `_pools` (a dict, empty at first),
    `_post_send(host, dest)` and
    `_post_recv(host, source)` (each starts one host-buffer transfer and returns its handle),
    `_handle_done(handle)` and `_handles_done(handles)`.
    """

    staging_chunk: int
    _pools: dict[str, StagingPool]

    def _post_send(self, host: np.ndarray, dest: int) -> Any:
        raise NotImplementedError

    def _post_recv(self, host: np.ndarray, source: int) -> Any:
        raise NotImplementedError

    def _handle_done(self, handle: Any) -> bool:
        raise NotImplementedError

    def _handles_done(self, handles: list[Any]) -> bool:
        raise NotImplementedError

    def staging_pool(self, xp: Any) -> StagingPool:
        """The pool of host buffers for device arrays of the array module xp."""
        pool = self._pools.get(xp.__name__)
        if pool is None:
            pool = self._pools[xp.__name__] = StagingPool(_pinned_allocator(xp))
        return pool

    def _staged_isend(self, buf: Any, xp: Any, dest: int, step: Any) -> Request:
        """Send the device array buf through a host buffer (in chunks above `staging_chunk`)."""
        pool = self.staging_pool(xp)
        host = pool.acquire(buf.nbytes)
        staged = host[: buf.nbytes].view(buf.dtype)
        if buf.nbytes <= self.staging_chunk:
            xp.asnumpy(buf, out=staged)
            handle = self._post_send(staged, dest)
        else:
            handle = self._send_in_chunks(buf.reshape(-1), staged, dest)
        return Request(handle, dest, step, "send", lambda: pool.release(host))

    def _staged_irecv(self, buf: Any, xp: Any, source: int, step: Any) -> Request:
        """Receive into the device array buf through a host buffer, uploaded on completion."""
        pool = self.staging_pool(xp)
        host = pool.acquire(buf.nbytes)
        staged = host[: buf.nbytes].view(buf.dtype)
        if buf.nbytes > self.staging_chunk:
            return self._recv_in_chunks(buf.reshape(-1), staged, source, step,
                                        lambda: pool.release(host))

        def upload() -> None:
            backend.upload(buf, staged)
            pool.release(host)

        return Request(self._post_recv(staged, source), source, step, "recv", upload)

    def _chunks(self, count: int, itemsize: int) -> list[tuple[int, int]]:
        """Element ranges of the chunks a staged message of count elements travels in."""
        per = max(1, self.staging_chunk // itemsize)
        return [(lo, min(lo + per, count)) for lo in range(0, count, per)]

    def _send_in_chunks(self, flat: Any, staged: np.ndarray, dest: int) -> list[Any]:
        """Queue every chunk's device-to-host copy at once and post each chunk's send as soon as
        its copy is done: chunk i+1 is copied while chunk i is on the wire."""
        bounds = self._chunks(flat.size, flat.itemsize)
        copies = [backend.download_async(flat[lo:hi], staged[lo:hi]) for lo, hi in bounds]
        handles: list[Any] = []
        for (lo, hi), copy in zip(bounds, copies, strict=True):
            while not backend.copy_done(copy):
                if handles:
                    self._handles_done(handles)  # keep the posted chunks moving
            handles.append(self._post_send(staged[lo:hi], dest))
        return handles

    def _recv_in_chunks(self, flat: Any, staged: np.ndarray, source: int, step: Any,
                        release: Callable[[], None]) -> Request:
        """Post every chunk's receive at once; while waiting, start the host-to-device copy of
        each chunk that has arrived (in order), so uploads overlap the chunks still on the wire."""
        bounds = self._chunks(flat.size, flat.itemsize)
        handles = [self._post_recv(staged[lo:hi], source) for lo, hi in bounds]
        uploads: list[Any] = []

        def progress() -> None:
            while len(uploads) < len(handles) and self._handle_done(handles[len(uploads)]):
                lo, hi = bounds[len(uploads)]
                uploads.append(backend.upload_async(flat[lo:hi], staged[lo:hi]))

        def complete() -> None:
            progress()
            for upload in uploads:
                backend.wait_copy(upload)
            release()

        return Request(handles, source, step, "recv", complete, progress)
