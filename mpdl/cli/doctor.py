"""`mpdl doctor FLIGHT`: what went wrong, from the flight records every rank wrote.

    mpdl doctor CHECKPOINT_DIR/flight      (or $MPDL_FLIGHT_DIR, or ./mpdl-flight)

Says which ranks wrote records and why, where each stopped, the first collective whose signature
differs between ranks, the ranks that never arrived, and which ranks to look at first.
A checkpoint folder stands for its flight folder. Exit status 0 when the records show no
problem, or when a checkpoint has no flight folder (ranks write records only when a run fails,
stalls or is sent SIGUSR1: a run that went well leaves none), 1 when they show one, 2 when FLIGHT
is not a flight folder (missing, a file, or a folder without rank-R.json records).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mpdl.cli import UsageError
from mpdl.tools.doctor import FlightError, diagnose
from mpdl.training.checkpoint import has_checkpoint


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("flight", nargs="?", default="mpdl-flight", metavar="FLIGHT",
                   help="folder of rank-R.json flight records (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="the diagnosis as one JSON object")


def run(args: argparse.Namespace) -> int:
    folder = Path(args.flight)
    if has_checkpoint(folder) or (folder / "flight").is_dir():
        folder = folder / "flight"
    expected = ("expected the flight folder of a run: CHECKPOINT/flight, $MPDL_FLIGHT_DIR or "
                "./mpdl-flight")
    if not folder.is_dir() and folder.name == "flight" and has_checkpoint(folder.parent):
        print(f"{folder}: no flight records: nothing went wrong (ranks write them only when a "
              f"run fails, stalls or is sent SIGUSR1)")
        return 0
    if not folder.exists():
        raise UsageError(f"FLIGHT: {args.flight}: no such folder ({expected})")
    if not folder.is_dir():
        raise UsageError(f"FLIGHT: {args.flight}: a file, not a flight folder ({expected})")
    if not any(folder.glob("rank-*.json")):
        raise UsageError(f"FLIGHT: {args.flight}: no flight records (rank-R.json) in this folder "
                         f"({expected})")
    try:
        found = diagnose(folder)
    except FlightError as exc:
        raise UsageError(f"FLIGHT: {exc}") from None
    if args.json:
        print(json.dumps({"folder": found.folder, "size": found.size,
                          "ranks": sorted(found.ranks), "missing": found.missing,
                          "mismatches": [{"group": list(g), "seq": s,
                                          "signatures": [{"ranks": r, "signature": list(k)}
                                                         for k, r in sig.items()]}
                                         for g, s, sig in found.mismatches],
                          "never_arrived": [{"rank": r, "group": list(g), "seq": s,
                                             "collective": c, "last_seq": last}
                                            for r, g, s, c, last in found.absent],
                          "departed": [{"rank": r, "seq": s, "expected": list(k), "skipped": skip}
                                       for r, s, k, skip in found.departed],
                          "waits": {str(k): v for k, v in found.waits.items()},
                          "culprits": found.culprits()}))
    else:
        print("\n".join(found.lines()))
    return 1 if found.culprits() or found.missing else 0
