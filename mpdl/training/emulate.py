"""`--emulate SPEC` for a run (`mpdl train`, `mpdl bench`): which links to emulate, and applying
them to a communicator and to this process's settings for the run's duration.

    emulated = resolve_emulation(spec)      # ValueError for a bad spec
    restore = emulate(comm, emulated)
    try:
        ...                                 # comm's messages, and settings.current(), emulate
    finally:
        restore()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mpdl import emulation, settings
from mpdl.emulation import Emulation

#: the specs that turn emulation off (also over MPDL_EMULATE)
OFF = ("off", "none", "0")


def resolve_emulation(spec: str | None) -> Emulation | None:
    """The links `spec` asks for: None (no spec) keeps the settings' (MPDL_EMULATE), 'off' turns
    emulation off, anything else is parsed (ValueError naming what is wrong)."""
    if spec is None:
        return settings.current().emulation
    if spec.strip().lower() in OFF:
        return None
    return emulation.parse(spec)


def emulate(comm: Any, emulated: Emulation | None) -> Callable[[], None]:
    """Slow comm's messages down as `emulated` says (None: not at all) and make it this process's
    emulation setting; returns the function that puts back the previous setting and delays.
    Collective over comm when the node layout has to be looked up."""
    previous_delay = getattr(comm, "link_delay", None)
    previous = settings.update(emulation=emulated)
    emulation.install(comm, emulated)

    def restore() -> None:
        comm.link_delay = previous_delay
        settings.use(previous)

    return restore
