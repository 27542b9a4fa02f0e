"""Check `mpdl info --json` (on stdin) against the node layout a launcher was asked for.

    mpdl info --json | python tools/check_layout.py 3,2

Prints the layout mpdl found and exits 1 unless it is exactly LAYOUT (ranks per node, in order)
on real, not emulated, nodes.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    expected = [int(n) for n in sys.argv[1].split(",")]
    info = json.loads(sys.stdin.read().strip().splitlines()[-1])
    by_node: dict[int, list[int]] = {}
    for r in info["ranks"]:
        by_node.setdefault(r["node"], []).append(r["rank"])
    hosts = {r["node"]: r["host"] for r in info["ranks"]}
    print(f"{info['nodes']} MPI nodes, ranks per node {info['ranks_per_node']}, ranks by node "
          f"{[by_node[n] for n in sorted(by_node)]}, emulated {info['nodes_emulated']}, "
          f"host names {[hosts[n] for n in sorted(hosts)]}; {info['mpi_library']}")
    if info["ranks_per_node"] != expected or info["nodes_emulated"]:
        print(f"check_layout: expected nodes of {expected} ranks")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
