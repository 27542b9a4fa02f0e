"""`mpdl serve` under clients that leave: pages in use and the server's memory after each wave.

    python benchmarks/bench_serve_leave.py [--clients 200] [--waves 4] [--json PATH]

`bench_serve.py`'s GPT (random weights, 4 blocks, width 128, block 128) is served by `mpdl serve`
on one rank (--max-batch 64). Each wave, `--clients` clients send one request each at once: three
in four a completion of 16-64 greedy tokens, read to its end; one in four a request for 2,000
tokens (every other one streamed) that it leaves 0.1-1 s after sending, by closing its socket.
After the wave the server is idle again: reported per wave are the requests it finished and
cancelled, the KV pages still in use (0 when every leaver's pages were freed), and the server
process's resident memory (Linux /proc; flat from wave to wave when nothing leaks). Exits 1
when pages stay in use or a request still runs 30 s after a wave.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from bench_serve import VOCAB, checkpoint, get

LEAVE_TOKENS = 2000


def rss_mib(pid: int) -> float:
    """The resident memory of process pid, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def complete(base: str, prompt: str, max_tokens: int) -> int:
    """One completion read to its end; its number of characters."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return len(json.loads(r.read())["choices"][0]["text"])


def leave(port: int, prompt: str, stream: bool, after: float) -> None:
    """Ask for LEAVE_TOKENS tokens, then close the connection `after` seconds later."""
    body = json.dumps({"prompt": prompt, "max_tokens": LEAVE_TOKENS, "temperature": 0,
                       "stream": stream})
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
                  f"application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        time.sleep(after)


def idle(base: str, timeout: float = 30) -> dict:
    """The server's metrics once nothing runs or waits (or after timeout seconds)."""
    deadline = time.monotonic() + timeout
    while True:
        m = get(base + "/metrics")
        if (m["running"] == 0 and m["waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=200)
    p.add_argument("--waves", type=int, default=4)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    rng = np.random.default_rng(3)
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(Path(tmp) / "ckpt")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        server = subprocess.Popen([str(Path(sys.executable).parent / "mpdl"), "serve",
                                   "--checkpoint", str(Path(tmp) / "ckpt"), "--port", str(port),
                                   "--max-batch", "64"], stdout=subprocess.DEVNULL)
        base = f"http://127.0.0.1:{port}"
        rows = []
        try:
            while True:
                try:
                    get(base + "/health")
                    break
                except OSError:
                    time.sleep(0.2)
            complete(base, "warm up", 4)
            before = rss_mib(server.pid)
            print(f"# {args.clients} clients a wave, one in four leaving mid-request; server RSS "
                  f"after warm-up {before:.1f} MiB")
            print(f"{'wave':>4} {'finished':>8} {'cancelled':>9} {'pages in use':>12} "
                  f"{'running':>7} {'RSS MiB':>8} {'wall s':>7}")
            for wave in range(1, args.waves + 1):
                jobs = []
                for i in range(args.clients):
                    prompt = "".join(rng.choice(list(VOCAB[1:]), int(rng.integers(4, 33))))
                    if i % 4 == 3:
                        jobs.append((leave, port, prompt, i % 8 == 7,
                                     float(rng.uniform(0.1, 1.0))))
                    else:
                        jobs.append((complete, base, prompt, int(rng.integers(16, 65))))
                start = time.perf_counter()
                with ThreadPoolExecutor(args.clients) as pool:
                    for future in [pool.submit(fn, *rest) for fn, *rest in jobs]:
                        future.result()
                m = idle(base)
                row = {"wave": wave, "finished": m["finished"], "cancelled": m["cancelled"],
                       "kv_pages_in_use": m["kv_pages_in_use"], "running": m["running"],
                       "rss_mib": rss_mib(server.pid), "wall_s": time.perf_counter() - start}
                rows.append(row)
                print(f"{wave:>4} {row['finished']:>8} {row['cancelled']:>9} "
                      f"{row['kv_pages_in_use']:>12} {row['running']:>7} {row['rss_mib']:>8.1f} "
                      f"{row['wall_s']:>7.1f}")
        finally:
            server.terminate()
            server.wait(30)
    growth = rows[-1]["rss_mib"] - rows[0]["rss_mib"]
    print(f"# RSS from wave 1 to wave {args.waves}: {growth:+.1f} MiB "
          f"({rows[-1]['rss_mib'] / rows[0]['rss_mib']:.3f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "rss_after_warmup_mib": before})
                                   + "\n")
    return 1 if any(r["kv_pages_in_use"] or r["running"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
