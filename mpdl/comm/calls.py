"""What a collective call's messages carry so that ranks making different calls never match:
each call's tag, made from its signature (`CallName`), and the fixed tags of the exchanges mpdl
makes for itself. `call_state.tag` is the tag this thread's messages travel with now.
"""

from __future__ import annotations

import contextlib
import math
import threading
import zlib
from collections.abc import Iterator

#: the tag of messages outside a collective (and of every message where calls carry no tag)
P2P_TAG = 7331
#: the tags of the exchanges mpdl makes for itself, one per kind, so that an exchange of one
#: kind on one rank never matches another kind's (or a collective's messages) on another
(NOTICE_TAG, ANNOUNCE_TAG, PRECHECK_TAG, OBJECT_TAG, NODES_TAG, SHM_SETUP_TAG,
 NOTICE_ACK_TAG) = range(7332, 7339)


def is_check_tag(tag: int) -> bool:
    """Whether tag is one of mpdl's own exchanges (a check, a notice), not an algorithm's."""
    return NOTICE_TAG <= tag <= NOTICE_ACK_TAG


#: the tags of collective calls: a hash of the call's signature into [FIRST_CALL_TAG, 32767]
#: (32767: the least MPI_TAG_UB the standard allows)
FIRST_CALL_TAG = 8192
_CALL_TAGS = 32768 - FIRST_CALL_TAG


class CallName(str):
    """The name of a collective call (what timeouts print, "allreduce/ring"), carrying its
    signature (collective, algorithm, shape, dtype, op, root) and the tag its messages travel
    with: ranks that make different calls send under different tags, so their messages never
    match."""

    signature: tuple
    tag: int
    #: the signature's CRC-32 (the tag is made from it)
    digest: int
    #: for the exchange that checks a call before it runs: its group's ranks and the sequence
    #: number the call will take (None: the call itself)
    group: tuple[int, ...] | None = None
    position: int | None = None

    def before(self, group: tuple[int, ...], position: int | None) -> CallName:
        """This call's name for the exchange that checks it before it runs, over `group`, as
        the group's call number `position` (None: unknown)."""
        name = CallName(self)
        name.signature, name.tag, name.digest = self.signature, self.tag, self.digest
        name.group, name.position = group, position
        return name

    def describe(self) -> str:
        """The call in words: collective/algorithm(op, dtype, shape, root)."""
        _, _, shape, dtype, op, root = self.signature
        parts = [f"op {op}"] if op is not None else []
        parts.append(f"{dtype} {tuple(shape) if isinstance(shape, tuple) else shape}")
        if root is not None:
            parts.append(f"root {root}")
        return f"{self}({', '.join(parts)})"


_call_names: dict[tuple, CallName] = {}


def call_name(signature: tuple) -> CallName:
    """The `CallName` of a call's signature (collective, algorithm, shape, dtype, op, root):
    the same name and tag on every rank for the same call (cached); the shape counts by its
    number of elements."""
    name = _call_names.get(signature)
    if name is None:
        name = CallName(f"{signature[0]}/{signature[1]}")
        name.signature = signature
        collective, algorithm, shape, dtype, op, root = signature
        # the count, not the shape: arrays of one size in different shapes make the same call
        count = math.prod(shape) if isinstance(shape, tuple) else shape
        text = repr((collective, algorithm, count, str(dtype), op, root))
        name.digest = zlib.crc32(text.encode())
        name.tag = FIRST_CALL_TAG + name.digest % _CALL_TAGS
        if len(_call_names) > 4096:
            _call_names.clear()
        _call_names[signature] = name
    return name


class _CallState(threading.local):
    """This thread's message tag (a collective call's, or an exchange's own)."""

    tag = P2P_TAG


#: the tag this thread's messages travel with now
call_state = _CallState()


@contextlib.contextmanager
def tagged(tag: int) -> Iterator[None]:
    """Send and receive this thread's messages under `tag` inside the block."""
    previous, call_state.tag = call_state.tag, tag
    try:
        yield
    finally:
        call_state.tag = previous
