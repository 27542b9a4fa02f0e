"""`mpdl launch`: run `mpdl train` under the MPI launcher and restart it when it fails.

    mpdl launch -n P [--hostfile F] [--max-restarts K] [--min-ranks M] -- train ARGS...

Runs the job under srun (in a Slurm allocation) or mpiexec; when it fails, says which rank failed
and how, and restarts it with --resume from the newest whole checkpoint (train's --checkpoint DIR),
up to K times; with a hostfile, on fewer ranks (down to M) when hosts stop answering. Exits 0
when the job finishes, non-zero when it gives up.
"""

from __future__ import annotations

import argparse

from mpdl.cli import UsageError
from mpdl.tools.launch import LaunchError, LaunchPlan, supervise


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("example: mpdl launch -n 4 --max-restarts 3 -- train --epochs 20 --checkpoint "
                "ckpt --checkpoint-every 50")
    p.add_argument("-n", dest="ranks", type=int, required=True, metavar="P",
                   help="number of ranks")
    p.add_argument("--hostfile", metavar="F",
                   help="hosts to run on (host:slots or host slots=N per line)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="restarts after failures before giving up (default: %(default)s)")
    p.add_argument("--min-ranks", type=int, metavar="M",
                   help="with --hostfile, go on with as few as M ranks when hosts stop answering "
                        "(default: -n)")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- train ARGS",
                   help="the mpdl train command line")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    plan = LaunchPlan(ranks=args.ranks, train_args=command, hostfile=args.hostfile,
                max_restarts=args.max_restarts, min_ranks=args.min_ranks)
    try:
        return supervise(plan)
    except LaunchError as exc:
        raise UsageError(str(exc)) from None
