"""The schedule generator (`mpdl.parallel.pipeline.schedule`): every kind at p = 2..8, m = 1..32,
v = 1..4 where it runs replays without a deadlock, each op once after what it needs, its peak of
held chunk activations as the closed form below (written here, apart from the generator); a
subset runs on the in-process world, one thread per rank; schedules by hand; a broken schedule
is caught."""

from __future__ import annotations

import pytest

from mpdl.parallel.pipeline.schedule import (
    KINDS,
    Op,
    Schedule,
    allowed,
    check,
    fill_drain,
    generate,
    run_on_threads,
    schedule_bubble,
)


def peak(kind: str, p: int, m: int, v: int, r: int) -> int:
    """The most chunk activations rank r holds: afab all m; 1f1b p−r; interleaved Megatron's
    warm-up plus one; zb-h1 1F1B's most (p); zb-v 2p chunks of half a stage; dualpipev 2p+1."""
    return {"afab": m, "1f1b": min(p - r, m),
            "interleaved": min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) if v > 1
            else min(p - r, m),
            "zb-h1": min(p, m), "zb-v": min(2 * p, 2 * m), "dualpipev": 2 * p + 1}[kind]


def runnable(kind: str, p: int, m: int, v: int) -> bool:
    """Where each kind runs: afab, 1f1b and zb-h1 one chunk; zb-v and dualpipev two (a V),
    dualpipev m ≥ 2p; interleaved any v, m a multiple of p when v > 1."""
    if kind in ("afab", "1f1b", "zb-h1"):
        return v == 1
    if kind in ("zb-v", "dualpipev"):
        return v == 2 and (kind == "zb-v" or m >= 2 * p)
    return v == 1 or m % p == 0


@pytest.mark.parametrize("kind", KINDS)
def test_every_schedule_replays_on_the_grid(kind):
    count = 0
    for p in range(2, 9):
        for m in range(1, 33):
            for v in range(1, 5):
                assert (allowed(kind, p, m, v) is None) == runnable(kind, p, m, v), (p, m, v)
                if not runnable(kind, p, m, v):
                    continue
                replay = check(generate(kind, p, m, v))
                assert replay.peaks == [peak(kind, p, m, v, r) for r in range(p)], (p, m, v)
                count += 1
    assert count >= 7 * 16


@pytest.mark.parametrize("kind", KINDS)
def test_a_subset_runs_on_threads(kind):
    for p in (2, 3, 4):
        for m in (1, 5, 8):
            for v in (1, 2, 3):
                if runnable(kind, p, m, v):
                    peaks = run_on_threads(generate(kind, p, m, v))
                    assert peaks == [peak(kind, p, m, v, r) for r in range(p)], (p, m, v)


def test_unit_clock_bubbles_follow_the_formulas():
    """On a clock where F, B and W take a unit each (a fused backward two): (p−1)/(m+p−1) for
    afab and 1f1b, (p−1)/(vm+p−1) interleaved, (p−1)/(3m+p−1) zb-h1 with m ≥ p; the V schedules
    below zb-h1."""
    for p in range(2, 7):
        for m in range(p, 17, p):
            cases = {("afab", 1): (p - 1) / (m + p - 1), ("1f1b", 1): (p - 1) / (m + p - 1),
                     ("interleaved", 2): (p - 1) / (2 * m + p - 1),
                     ("interleaved", 3): (p - 1) / (3 * m + p - 1),
                     ("zb-h1", 1): (p - 1) / (3 * m + p - 1)}
            for (kind, v), want in cases.items():
                assert check(generate(kind, p, m, v)).bubble == pytest.approx(want, abs=1e-12)
                assert schedule_bubble(kind, p, m, v) == pytest.approx(want, abs=1e-12)
            if m >= 2 * p:
                for kind in ("zb-v", "dualpipev"):
                    assert check(generate(kind, p, m)).bubble < (p - 1) / (3 * m + p - 1)


def ops(text: str) -> list[str]:
    return text.split()


def test_schedules_by_hand():
    one = generate("1f1b", 2, 3)
    assert [str(op) for op in one.ranks[0]] == ops("F0.0 F1.0 B0.0 F2.0 B1.0 B2.0")
    assert [str(op) for op in one.ranks[1]] == ops("F0.1 B0.1 F1.1 B1.1 F2.1 B2.1")
    zb = generate("zb-h1", 2, 3)  # rank 1 puts its W's off by one microbatch
    assert [str(op) for op in zb.ranks[0]] == ops("F0.0 F1.0 B0.0 W0.0 F2.0 B1.0 W1.0 B2.0 W2.0")
    assert [str(op) for op in zb.ranks[1]] == ops("F0.1 B0.1 F1.1 B1.1 W0.1 F2.1 B2.1 W1.1 W2.1")
    inter = generate("interleaved", 2, 2, 2)  # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert [str(op) for op in inter.ranks[0]] == ops("F0.0 F1.0 F0.2 F1.2 B0.2 B1.2 B0.0 B1.0")
    assert [str(op) for op in inter.ranks[1]] == ops("F0.1 F1.1 F0.3 B0.3 F1.3 B1.3 B0.1 B1.1")
    v = generate("zb-v", 2, 2)  # a V: stages 0 and 3 on rank 0
    assert v.stages_of(0) == [0, 3] and v.stages_of(1) == [1, 2]
    assert [str(op) for op in v.rank_ops(1)][:3] == ["recv act 0.0 <- 0", "F0.1", "F0.2"]


def test_a_broken_schedule_is_caught():
    good = generate("1f1b", 2, 2)

    def with_rank(r: int, new: list[Op]) -> Schedule:
        ranks = list(good.ranks)
        ranks[r] = tuple(new)
        return Schedule("1f1b", 2, 2, 1, tuple(ranks))

    r1 = list(good.ranks[1])  # F0.1 B0.1 F1.1 B1.1
    with pytest.raises(ValueError, match="before F0.1"):
        check(with_rank(1, [r1[1], r1[0], *r1[2:]]))
    with pytest.raises(ValueError, match="once"):
        check(with_rank(1, r1[:-1]))
    with pytest.raises(ValueError, match="deadlocks"):  # rank 1 waits for microbatch 1 first
        check(Schedule("1f1b", 2, 2, 1, (
            (Op("F", 0, 0), Op("B", 0, 0), Op("F", 1, 0), Op("B", 1, 0)),
            (Op("F", 1, 1), Op("B", 1, 1), Op("F", 0, 1), Op("B", 0, 1)))))


@pytest.mark.parametrize("kind, p, m, v, words", [
    ("interleaved", 4, 6, 2, "multiple of pp = 4"),
    ("dualpipev", 4, 6, 2, "at least 2·pp = 8"),
    ("zb-v", 2, 4, 3, "2 chunks per rank"),
    ("1f1b", 2, 4, 2, "use interleaved"),
    ("gpipe", 2, 4, 1, "expected one of afab, 1f1b, interleaved, zb-h1, zb-v, dualpipev"),
])
def test_bad_combinations_say_why_in_one_line(kind, p, m, v, words):
    why = allowed(kind, p, m, v)
    assert words in why and "\n" not in why
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        generate(kind, p, m, v)


def test_fill_drain_runs_any_count_on_each_placement():
    """What a short batch runs when its microbatch count is not the schedule's: every forward,
    then every backward, on the kind's stages; each rank holds all its chunks' activations."""
    for kind, v in (("interleaved", 2), ("interleaved", 3), ("zb-v", 2), ("dualpipev", 2)):
        for p in (2, 3, 4):
            for m in (1, 3, 5):
                schedule = fill_drain(kind, p, m, v)
                assert schedule.stages_of(0) == generate(kind, p, p * 2, v).stages_of(0)
                assert check(schedule).peaks == [m * v] * p


def test_dualpipev_overlapped_pairs_give_deepseeks_bubble():
    """DeepSeek-V3's Table 2 (and DualPipe's README): DualPipeV's bubble is
    (PP/2 − 1)(F&B + B − 3W) for PP stages on PP/2 ranks, B a full backward; on the unit clock
    F = W = 1, B = 2 and a pair run overlapped F&B = F + B = 3: 2(p − 1) on p ranks. Run one after
    the other (as mpdl's executor does), a rank need not wait for both inputs: p − 1."""
    for p, m in ((2, 4), (3, 7), (4, 10), (5, 12)):
        schedule = generate("dualpipev", p, m)
        apart, paired = check(schedule), check(schedule, overlap=True)
        assert max(paired.idle) == (p - 1) * (3 + 2 - 3)
        assert max(apart.idle) == p - 1
        # the pairs lengthen the step by their waits only: the work is the same 6m units
        assert paired.length - max(paired.idle) == apart.length - max(apart.idle) == 6 * m
        assert schedule_bubble("dualpipev", p, m, 2, overlap=True) == paired.bubble
        # the last rank runs its first forward and backward of the steady state (after its 2p
        # warm-up forwards) apart, the next two overlapped
        assert 2 * p not in schedule.pairs[p - 1] and 2 * p + 2 in schedule.pairs[p - 1]
        assert 2 * p + 3 in schedule.pairs[p - 2]  # 2 + 2(p − 1) + 3 ops before its steady state
    # a schedule without pairs replays the same either way
    zbv = generate("zb-v", 4, 8)
    assert check(zbv, overlap=True).length == check(zbv).length
