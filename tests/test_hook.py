"""The collectives' one hook into the tuning layer (`mpdl.collectives.hook`): with the tuner
switched off, every call sends the same messages and gives the same bytes, and "auto" takes the
size rule."""

from __future__ import annotations

from collections import Counter

import numpy as np

from mpdl import collectives as C
from mpdl import tuning
from mpdl.collectives import hook
from mpdl.collectives.checks import pick
from mpdl.threadworld import run_world
from mpdl.tuning import plan as plans


def calls(c) -> list[bytes]:
    """Each collective three times on the same arrays (a plan is cached at the second call)."""
    rng = np.random.default_rng(c.rank)
    n = 13  # not divisible by p
    x, out = rng.standard_normal(n), np.empty(n)
    block = rng.standard_normal(3)
    gathered = np.empty(3 * c.size)
    blocks = rng.standard_normal((c.size, 2))
    exchanged = np.empty_like(blocks)
    results = []
    for _ in range(3):
        results.append(C.allreduce(x, algorithm="ring", comm=c, out=out).tobytes())
        results.append(C.reduce_scatter(x, algorithm="ring", comm=c).tobytes())
        results.append(C.allgather(block, algorithm="ring", comm=c, out=gathered).tobytes())
        results.append(C.alltoall(blocks, comm=c, algorithm="pairwise", out=exchanged).tobytes())
    return results


def run(p: int) -> tuple[list, Counter]:
    plans.clear_cache()
    results, schedule = run_world(p, calls, message_log=True)
    return results, Counter(schedule)


def test_the_tuner_is_installed_by_importing_mpdl():
    assert hook.tuner is tuning.TUNER


def test_the_same_messages_and_bytes_with_the_tuner_on_and_off():
    for p in (2, 3, 4):
        on, sent_on = run(p)
        assert plans.cache, "with the tuner on, the repeated calls run through cached plans"
        with hook.off():
            assert hook.tuner is None
            off, sent_off = run(p)
            assert not plans.cache, "with the tuner off, no plan is made"
        assert hook.tuner is tuning.TUNER
        assert on == off, f"p={p}"
        assert sent_on == sent_off, f"p={p}"
        assert sum(sent_on.values()) > 0


def test_auto_takes_the_size_rule_without_the_tuner():
    def body(c):
        return [pick("allreduce", "auto", c, n).name for n in (8, 1 << 20)] + \
            [pick("alltoall", "auto", c, 1 << 20).name]

    with hook.off():  # around the world: the hook is one per process, not per rank
        chosen = run_world(2, body)
    for names in chosen:  # the in-process world's ranks share memory: shm for large sums
        assert names == ["recursive_doubling", "shm", "pairwise"]
        assert names[1] == hook.simple_choice("allreduce", 1 << 20, 2, 1, True)
