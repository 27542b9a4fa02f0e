"""The least span of ranks that outnumber the cores they share, waiting ranks included.

Ranks with more work than cores can run at once take at least their total work over the cores
(Graham's bound). A rank that waits for a message is not idle there: it polls, yields and wakes
from short sleeps, and each of those takes a core from a rank that computes. `mpdl calibrate`
measures what a wait costs (`Params.wait_cpu`, the CPU seconds of one wait however short, and
`Params.wait_share`, the share of a core it takes for each second it lasts), and `span` charges
every rank's waits, over the whole span less its own work, to the same cores.
"""

from __future__ import annotations

from collections.abc import Sequence


def span(work: Sequence[float], waits: Sequence[int], cores: int, wait_cpu: float = 0.0,
         wait_share: float = 0.0) -> float:
    """Seconds until every rank is done: rank i computes work[i] seconds and waits waits[i]
    times in between, `cores` cores serve them all. The least T at which the cores can have
    served every rank's work and its waits' CPU (waits[i]·wait_cpu + wait_share·(T − work[i])),
    and never less than the longest rank's work. With no more ranks than cores, that longest
    work. Waiting ranks that alone would take every core (wait_share · ranks ≥ cores) leave each
    rank its fair share, cores/ranks of a core."""
    if len(work) != len(waits) or not work:
        raise ValueError(f"work and waits: expected one entry per rank, got {len(work)} and "
                         f"{len(waits)}")
    if cores < 1 or wait_cpu < 0 or not 0 <= wait_share <= 1:
        raise ValueError(f"expected cores >= 1, wait_cpu >= 0 and 0 <= wait_share <= 1, got "
                         f"{cores}, {wait_cpu}, {wait_share}")
    ranks, longest = len(work), max(work)
    if ranks <= cores:
        return float(longest)
    free = cores - wait_share * ranks
    if free <= 0:
        return float(longest * ranks / cores)
    demand = (1 - wait_share) * sum(work) + wait_cpu * sum(waits)
    return float(max(longest, demand / free))
