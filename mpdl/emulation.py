"""Link emulation: make messages between emulated nodes as slow as a real network would.

One machine has no slow network, yet hierarchical and torus all-reduces exist because inter-node
links are slower than intra-node ones. With `MPDL_EMULATE="inter=10Gbit/s,20us"` (or `--emulate` on
`mpdl bench`), every message that crosses a node boundary waits latency + bytes/bandwidth before it
is handed to MPI; `intra=` slows messages inside a node the same way. Nodes are those of
`MPDL_RANKS_PER_NODE=k` (k consecutive ranks) or, without it, the real shared-memory nodes.

The spec (`Link`, `Emulation`, `parse`) is a setting's value and is parsed in `mpdl.settings`;
this module installs it on a communicator.

The delay is paid by the sender before it posts the message (its network card is busy), so the
model a link follows is exactly the α + n·β of the cost model. The MPI library's own collectives
(the `mpi` baseline) do not go through mpdl's sends and are not slowed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from mpdl import settings
from mpdl.settings import EMULATE_ENV as ENV
from mpdl.settings import Emulation, Link, parse

__all__ = ["ENV", "Emulation", "Link", "LinkDelay", "OFF", "active", "apply", "describe_active",
           "install", "parse", "resolve"]


class LinkDelay:
    """The delay hook of one rank: `delay(dest, nbytes)` sleeps for the modelled transfer time."""

    def __init__(self, emulation: Emulation, node_of_rank: Sequence[int], rank: int):
        self.emulation = emulation
        mine = node_of_rank[rank]
        self.links = [emulation.intra if node == mine else emulation.inter for node in node_of_rank]

    def __call__(self, dest: int, nbytes: int) -> None:
        link = self.links[dest]
        if link is not None:
            time.sleep(link.delay(nbytes))


def install(comm: Any, emulation: Emulation | None) -> None:
    """Make comm (an MPIComm) slow down its messages as `emulation` says; None turns it off.

    Collective over comm when MPDL_RANKS_PER_NODE is unset (the node layout is looked up)."""
    if emulation is None:
        comm.link_delay = None
        return
    comm.link_delay = LinkDelay(emulation, comm.node_of_rank(), comm.rank)


def describe_active(comm: Any) -> str:
    """The links emulated on comm, e.g. 'inter=10Gbit/s,20us' ('' when none)."""
    links = active(comm)
    return links.describe() if links is not None else ""


def active(comm: Any) -> Emulation | None:
    """The emulation installed on comm, if any."""
    hook = getattr(comm, "link_delay", None)
    return hook.emulation if hook is not None else None


#: the specs that turn emulation off (also as MPDL_EMULATE)
OFF = ("off", "none", "0")


def resolve(spec: str | None) -> Emulation | None:
    """The links a run's `--emulate SPEC` asks for: None (no spec) keeps the settings'
    (MPDL_EMULATE), 'off' turns emulation off, anything else is parsed (ValueError naming what is
    wrong)."""
    if spec is None:
        return settings.current().emulation
    if spec.strip().lower() in OFF:
        return None
    return parse(spec)


def apply(comm: Any, emulation: Emulation | None) -> Callable[[], None]:
    """For a run: slow comm's messages down as `emulation` says (None: not at all) and make it
    this process's emulation setting (so `auto` and communicators built later see it). Returns the
    function that puts the previous setting and delays back. Collective over comm when the node
    layout has to be looked up."""
    previous_delay = getattr(comm, "link_delay", None)
    previous = settings.update(emulation=emulation)
    install(comm, emulation)

    def restore() -> None:
        comm.link_delay = previous_delay
        settings.use(previous)

    return restore
