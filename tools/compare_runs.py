"""Compare two `mpdl train` runs: per-epoch losses (--json) and final parameters (--checkpoint).

    python tools/compare_runs.py RUN_A RUN_B [--atol 1e-9]

RUN is a prefix: RUN.jsonl is the run's --json file and RUN/ its --checkpoint folder (whole or
sharded). Exits 1 when a loss or a parameter differs by more than atol, or when the runs have
different epochs or arrays.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from mpdl.training.checkpoint import load_checkpoint


def losses(prefix: str) -> list[float]:
    with open(f"{prefix}.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row["loss"] for row in rows if "epoch" in row and not row.get("summary")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a")
    parser.add_argument("b")
    parser.add_argument("--atol", type=float, default=1e-9)
    args = parser.parse_args()
    la, lb = losses(args.a), losses(args.b)
    if len(la) != len(lb) or not la:
        print(f"compare_runs: epochs differ: {len(la)} vs {len(lb)}")
        return 1
    fa, fb = load_checkpoint(args.a)[0], load_checkpoint(args.b)[0]
    if sorted(fa) != sorted(fb):
        print(f"compare_runs: different parameters: {sorted(fa)} vs {sorted(fb)}")
        return 1
    param_diff = max(float(np.max(np.abs(fa[k] - fb[k]), initial=0.0)) for k in fa)
    loss_diff = max(abs(x - y) for x, y in zip(la, lb, strict=True))
    ok = param_diff <= args.atol and loss_diff <= args.atol
    print(f"compare_runs: {len(la)} epochs, losses {la[-1]:.10f} vs {lb[-1]:.10f}, "
          f"max |loss difference| {loss_diff:.2e}, max |parameter difference| {param_diff:.2e} "
          f"(atol {args.atol:g}): {'same' if ok else 'DIFFERENT'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
