"""Writing a file so that a reader sees the old version or the new one, never half of either."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from typing import IO, Any


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", sync: bool = False,
                **open_args: Any) -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; when the block ends without an
    exception, rename it over ``path`` (after an fsync when ``sync``), otherwise delete it."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_open: mode must be a write mode ('w', 'wb'), not {mode!r}")
    path = os.fspath(path)
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp{os.getpid()}")
    try:
        with open(tmp, mode, **open_args) as f:
            yield f
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_atomic(path: str | os.PathLike, data: bytes | str, durable: bool = False) -> None:
    """Write data (bytes, or text as UTF-8) to path atomically; ``durable``: fsync before the
    rename, so the file survives a crash of the machine too."""
    with atomic_open(path, "wb", sync=durable) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def describe_write_error(exc: OSError, what: str, nbytes: int, path: str | os.PathLike) -> str:
    """One line on a failed write of `what` (nbytes in all) while at `path` (the error's own path
    first): the error's name, the path and the bytes it needed, e.g. "... ENOSPC (No space left on
    device) at PATH; it needs 40,960 bytes"."""
    name = errno.errorcode.get(exc.errno or 0, "error")
    path = exc.filename or os.fspath(path)
    return (f"cannot write {what}: {name} ({exc.strerror or exc}) at {path}; it needs "
            f"{nbytes:,} bytes")
