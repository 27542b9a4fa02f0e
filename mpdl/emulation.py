"""Link emulation: make messages between emulated nodes as slow as a real network would.

One machine has no slow network, yet hierarchical and torus all-reduces exist because inter-node
links are slower than intra-node ones. With `MPDL_EMULATE="inter=10Gbit/s,20us"` (or `--emulate` on
`mpdl bench`), every message that crosses a node boundary waits latency + bytes/bandwidth before it
is handed to MPI; `intra=` slows messages inside a node the same way. Nodes are those of
`MPDL_RANKS_PER_NODE=k` (k consecutive ranks) or, without it, the real shared-memory nodes.

The delay is paid by the sender before it posts the message (its network card is busy), so the
model a link follows is exactly the α + n·β of the cost model. The MPI library's own collectives
(the `mpi` baseline) do not go through mpdl's sends and are not slowed.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ENV = "MPDL_EMULATE"

_BANDWIDTH = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgt]?)(bit|b|byte)/s$", re.I)
_LATENCY = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ns|us|µs|ms|s)$", re.I)
_PREFIX = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class Link:
    """An emulated link: bytes per second and seconds of latency per message."""

    bandwidth: float
    latency: float

    def delay(self, nbytes: int) -> float:
        """Seconds a message of nbytes takes on this link: latency + nbytes / bandwidth."""
        return self.latency + nbytes / self.bandwidth

    def describe(self) -> str:
        parts = [] if self.bandwidth == float("inf") else [f"{self.bandwidth * 8 / 1e9:g}Gbit/s"]
        return ",".join([*parts, f"{round(self.latency * 1e9) / 1e3:g}us"])


@dataclass(frozen=True)
class Emulation:
    """The emulated links: `inter` between nodes, `intra` inside a node (either may be None)."""

    inter: Link | None = None
    intra: Link | None = None

    def describe(self) -> str:
        """The spec in canonical form, e.g. 'inter=10Gbit/s,20us'."""
        parts = [f"{name}={link.describe()}" for name, link in (("inter", self.inter),
                                                                 ("intra", self.intra)) if link]
        return ";".join(parts)


def _parse_bandwidth(text: str) -> float:
    m = _BANDWIDTH.match(text.strip())
    if not m:
        raise ValueError(f"bandwidth {text!r}: expected a number and a unit such as 10Gbit/s, "
                         f"100Mbit/s or 1.25GB/s")
    value = float(m.group(1)) * _PREFIX[m.group(2).lower()]
    if m.group(3).lower() == "bit":
        value /= 8  # bits to bytes
    if value <= 0:
        raise ValueError(f"bandwidth {text!r}: expected a positive rate")
    return value


def _parse_latency(text: str) -> float:
    m = _LATENCY.match(text.strip())
    if not m:
        raise ValueError(f"latency {text!r}: expected a number and a unit such as 20us, 0.5ms or 1s")
    return float(m.group(1)) * _SECONDS[m.group(2).lower()]


def parse(spec: str) -> Emulation:
    """Parse 'inter=10Gbit/s,20us' (optionally ';intra=100Gbit/s,1us'). A link may give its bandwidth,
    its latency or both, in either order; ValueError names what is wrong."""
    links: dict[str, dict[str, float]] = {}
    current: str | None = None
    for token in (t.strip() for t in re.split(r"[;,\s]+", spec.strip())):
        if not token:
            continue
        if "=" in token:
            current, _, token = token.partition("=")
            current = current.strip().lower()
            if current not in ("inter", "intra"):
                raise ValueError(f"{ENV}: unknown link {current!r}; expected inter= or intra=")
            if current in links:
                raise ValueError(f"{ENV}: link {current!r} given twice")
            links[current] = {}
        if current is None:
            raise ValueError(f"{ENV}: {spec!r} must start with inter= or intra=")
        try:
            if token.lower().endswith("/s"):
                key, value = "bandwidth", _parse_bandwidth(token)
            else:
                key, value = "latency", _parse_latency(token)
        except ValueError as exc:
            raise ValueError(f"{ENV}: {exc}") from None
        if key in links[current]:
            raise ValueError(f"{ENV}: {current} link has two {key} values in {spec!r}")
        links[current][key] = value
    if not links:
        raise ValueError(f"{ENV}: empty spec; expected e.g. inter=10Gbit/s,20us")
    made = {name: Link(v.get("bandwidth", float("inf")), v.get("latency", 0.0))
            for name, v in links.items()}
    return Emulation(inter=made.get("inter"), intra=made.get("intra"))


def from_environment() -> Emulation | None:
    """The emulation MPDL_EMULATE asks for, or None when it is unset, empty or 'off'."""
    raw = os.environ.get(ENV, "").strip()
    if not raw or raw.lower() in ("0", "off", "none"):
        return None
    return parse(raw)


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


def active(comm: Any) -> Emulation | None:
    """The emulation installed on comm, if any."""
    hook = getattr(comm, "link_delay", None)
    return hook.emulation if hook is not None else None
