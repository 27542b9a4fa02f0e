"""`mpdl doctor`'s reading of flight records: what went wrong, from every rank's FLIGHT/rank-R.json.

Operations are compared per group of ranks by sequence number (mpdl.comm.flight numbers them so
that the same number is the same call on every rank of a group). The diagnosis, in one screen:
which ranks wrote records and why, where each rank stopped, the first collective whose signature
(collective, algorithm, bytes, dtype, op) differs between ranks, the ranks that never arrived at
an operation the others started, and whom the waiting ranks waited for. Where the calls before a
difference repeat (a training step's), the call the pattern expected there tells the rank that
left it from the ranks that followed it (an error raised by the others comes after), and a rank
whose call is the one after the expected one skipped it. A rank killed under `mpdl launch` gets
its record from its watcher (`mpdl.tools.rankwatch`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class FlightError(ValueError):
    """A folder without flight records, or a record that cannot be read."""


@dataclass
class Diagnosis:
    """What `diagnose` found; `lines()` says it."""

    folder: str
    size: int
    ranks: dict[int, dict[str, Any]]
    #: ranks of the job that wrote no record
    missing: list[int] = field(default_factory=list)
    #: (group, seq, {signature: [ranks]}) of the first differing collective of each group
    mismatches: list[tuple[tuple[int, ...], int, dict[tuple, list[int]]]] = field(
        default_factory=list)
    #: (rank, group, seq it never reached, the collective the others started there, its last seq)
    absent: list[tuple[int, tuple[int, ...], int, str, int | None]] = field(default_factory=list)
    #: waiting rank -> the ranks it still waited for
    waits: dict[int, list[int]] = field(default_factory=dict)
    #: (rank, seq, the call the repeated pattern expected there, whether the rank's call was the
    #: one after it: a skip) for the ranks that left the pattern at a first difference
    departed: list[tuple[int, int, tuple, bool]] = field(default_factory=list)

    def culprits(self) -> list[int]:
        """The ranks the evidence points at, most likely first."""
        found = [r for r, *_ in self.departed] + self.failed()
        for _, _, signatures in self.mismatches:
            groups = sorted(signatures.values(), key=len)
            if len(groups) > 1:
                found += [r for ranks in groups[:-1] for r in ranks]
        found += [r for r, *_ in self.absent]
        waited = [p for peers in self.waits.values() for p in peers if p not in self.waits]
        found += sorted(set(waited), key=waited.count, reverse=True)
        found += self.missing
        return list(dict.fromkeys(found))

    def failed(self) -> list[int]:
        """Ranks ended by an error of their own (not a timeout waiting for another rank)."""
        return [r for r, d in sorted(self.ranks.items(), key=lambda kv: kv[1].get("time", 0.0))
                if d.get("reason", "").startswith("fatal:")
                and "CollectiveTimeout" not in d["reason"]]

    def lines(self) -> list[str]:
        out = [f"mpdl doctor: {self.folder}: records of {len(self.ranks)} of {self.size} ranks"]
        if self.missing:
            out.append(f"  no records from {_ranks(self.missing)} (killed before writing, or not "
                       f"reached by the word of the failing rank)")
        end = max((_last_time(r) for r in self.ranks.values()), default=0.0)
        for rank in sorted(self.ranks):
            data = self.ranks[rank]
            last = _last(data["records"])
            where = "no operations recorded"
            if last is not None:
                where = (f"stopped at #{last['seq']} {_describe(last)} ({last['state']}"
                         f"{_ago(last, end)}")
                if last.get("waiting_for"):
                    where += f", waiting for {_ranks(last['waiting_for'])}"
                where += ")"
            out.append(f"  rank {rank}: {where}")
            out.append(f"          why written: {_short(data.get('reason', '?'))}")
        for group, seq, signatures in self.mismatches:
            calls = sorted(signatures.items(), key=lambda kv: (-len(kv[1]), kv[1]))
            out.append(f"first difference among {_ranks(group)}: #{seq}: " + "; ".join(
                f"{_ranks(ranks)}: {_signature(signature)}" for signature, ranks in calls))
        for rank, seq, expected, skipped in self.departed:
            what = "skipped" if skipped else "did not make"
            out.append(f"rank {rank} {what} #{seq} {_signature(expected)}, the call the steps "
                       f"before repeat" + (" (it made the next one instead)" if skipped else ""))
        for rank, group, seq, collective, last in self.absent:
            had = f"its last was #{last}" if last is not None else "it recorded none"
            out.append(f"never arrived: rank {rank} at #{seq} {collective} of {_ranks(group)} "
                       f"({had})")
        culprits = self.culprits()
        if culprits:
            out.append("look first at: " + ", then ".join(f"rank {r}" for r in culprits))
        elif not self.missing:
            out.append("every rank agrees and nobody waits: the records show no hang")
        return out


def read(folder: str | Path) -> dict[int, dict[str, Any]]:
    """Every rank's record in folder, by rank."""
    folder = Path(folder)
    paths = sorted(folder.glob("rank-*.json"))
    if not paths:
        raise FlightError(f"{folder}: no flight records (rank-R.json) here")
    ranks = {}
    for path in paths:
        try:
            data = json.loads(path.read_text())
            ranks[int(data["rank"])] = data
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise FlightError(f"{path}: not a flight record ({exc})") from None
    return ranks


def diagnose(folder: str | Path) -> Diagnosis:
    ranks = read(folder)
    size = max([int(d.get("size", 1)) for d in ranks.values()] + [max(ranks) + 1])
    found = Diagnosis(str(folder), size, ranks,
                      missing=[r for r in range(size) if r not in ranks])
    by_group: dict[tuple[int, ...], dict[int, dict[int, dict]]] = {}
    for rank, data in ranks.items():
        for rec in data["records"]:
            peers = tuple(rec["peers"])
            if rec["algorithm"] == "p2p":
                continue
            by_group.setdefault(peers, {}).setdefault(rank, {})[rec["seq"]] = rec
        last = _last(data["records"])
        if last is not None and last["state"] != "done" and last.get("waiting_for"):
            found.waits[rank] = list(last["waiting_for"])
    for group, per_rank in sorted(by_group.items()):
        present = [r for r in group if r in per_rank]
        first = max(min(per_rank[r]) for r in present)
        top = max(max(per_rank[r]) for r in present)
        for seq in range(first, top + 1):
            signatures: dict[tuple, list[int]] = {}
            for r in present:
                if seq in per_rank[r]:
                    signatures.setdefault(_key(per_rank[r][seq]), []).append(r)
            if len(signatures) > 1:
                found.mismatches.append((group, seq, signatures))
                found.departed += _departed(per_rank, present, first, seq, signatures)
                break
        started = next(per_rank[r][top] for r in present if top in per_rank[r])
        for r in group:
            if r in ranks and r not in present:
                found.absent.append((r, group, top, started["collective"], None))
            elif r in present and max(per_rank[r]) < top:
                found.absent.append((r, group, top, started["collective"], max(per_rank[r])))
    return found


def _departed(per_rank: dict[int, dict[int, dict]], present: list[int], first: int, seq: int,
              signatures: dict[tuple, list[int]]) -> list[tuple[int, int, tuple, bool]]:
    """The ranks whose call at seq (the group's first difference) is not the one the calls before
    it repeat, when some rank's is: (rank, seq, the expected call, whether the rank's call is the
    one after it)."""
    history = [_key(per_rank[present[0]][t]) for t in range(first, seq)
               if t in per_rank[present[0]]]
    period = next((n for n in range(1, len(history) // 2 + 1)
                   if history[-n:] == history[-2 * n:-n]), None)
    if period is None:
        return []
    expected = history[-period]
    following = history[-period + 1] if period > 1 else None
    if expected not in signatures:
        return []
    return [(r, seq, expected, key == following)
            for key, ranks in signatures.items() if key != expected for r in ranks]


def _key(rec: dict) -> tuple:
    return rec["collective"], rec["algorithm"], rec["bytes"], rec["dtype"], rec["op"]


def _signature(key: tuple) -> str:
    collective, algorithm, nbytes, dtype, op = key
    return " ".join(str(x) for x in (f"{collective}/{algorithm}", nbytes and f"{nbytes} B", dtype, op)
                    if x)


def _describe(rec: dict) -> str:
    what = f"{rec['collective']}/{rec['algorithm']}"
    return what + (f" {rec['bytes']} B" if rec.get("bytes") else "") + \
        (f" of {_ranks(rec['peers'])}" if rec["algorithm"] != "p2p" else
         f" with rank {rec['peers'][0]}")


def _last(records: list[dict]) -> dict | None:
    return max(records, key=lambda r: r["start"]) if records else None


def _last_time(data: dict) -> float:
    return max([r["end"] or r["start"] for r in data["records"]] + [data.get("time", 0.0)])


def _ago(rec: dict, end: float) -> str:
    if rec["state"] == "done":
        return ""
    return f", began {end - rec['start']:.1f} s before the last record"


def _ranks(ranks: Any) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _short(text: str, width: int = 100) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."
