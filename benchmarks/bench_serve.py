"""`mpdl serve` under load on loopback: continuous against static batching, paged against
contiguous KV memory.

    python benchmarks/bench_serve.py [--requests 64] [--clients 16] [--rounds 1] [--json PATH]

A GPT with random weights (4 blocks, 4 heads, width 128, block size 128, 28 characters) is saved
as a checkpoint and served by `mpdl serve` on one rank in four modes, taking turns each round:
continuous against static batching (a batch is admitted only when the last one has finished),
both over paged memory with pages enough for 16 whole blocks (memory does not bind); then, with
pages for 4 blocks only, paged memory against a whole block of pages per sequence (a contiguous
cache's memory), both continuous. A batch holds at most 16 sequences. N clients send the same
mixed requests (prompts of 4-48 characters, 8-96 new tokens, greedy, not streamed: a stream's
per-token events would cost the one-rank server more than a step of this small model), each
client one request at a time. Reported per mode: new tokens/s over the run, the server's time
to first token and between tokens p50/p99 (its /metrics, from a request's arrival), mean KV
pages per running sequence (sampled from /metrics) against the formula: a contiguous cache
holds ceil(block/page) pages per sequence, a paged one ceil(length/page) for the sequence's
current length. Also the cost of reading pages: one layer's q·kᵀ over keys gathered as whole
pages against keys sliced from a contiguous cache.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from mpdl.models.gpt import GPT
from mpdl.training.checkpoint import save_checkpoint

VOCAB = " abcdefghijklmnopqrstuvwxyz."
BLOCK, PAGE, BATCH = 128, 16, 16
BIG, SMALL = 16 * BLOCK // PAGE, 4 * BLOCK // PAGE  # pages: 16 blocks, 4 blocks
MODES = {"continuous, paged": ([], BIG), "static, paged": (["--batching", "static"], BIG),
         "continuous, paged, 4 blocks": ([], SMALL),
         "continuous, contiguous, 4 blocks": (["--kv", "contiguous"], SMALL)}


def checkpoint(directory: Path) -> None:
    gpt = GPT(len(VOCAB), BLOCK, 4, 4, 128, seed=0)
    rng = np.random.default_rng(0)
    for name, p in gpt.named_parameters():
        p.data[...] = rng.normal(0, 1.0 if "embedding" in name else 0.1, p.shape)
    info = {"name": "gpt", "vocab": VOCAB, "block_size": BLOCK, "n_layer": 4, "n_head": 4,
            "n_embd": 128, "dtype": "float32"}
    save_checkpoint(directory, gpt.state_dict(), {"state": {}, "param_groups": []},
                    {"epoch": 1, "step": 1, "model_info": info, "config": {"model": "gpt"}})


def workload(n: int) -> list[tuple[str, int]]:
    rng = np.random.default_rng(1)
    return [("".join(rng.choice(list(VOCAB[1:]), int(rng.integers(4, 49)))),
             int(rng.integers(8, 97))) for _ in range(n)]


def request(base: str, prompt: str, max_tokens: int) -> str:
    """One completion's text."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["text"]


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def run_mode(ckpt: Path, flags: list[str], pages: int, work: list[tuple[str, int]],
             clients: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "mpdl"), "serve", "--checkpoint",
                               str(ckpt), "--port", str(port), "--page-size", str(PAGE),
                               "--kv-pages", str(pages), "--max-batch", str(BATCH), *flags],
                              stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                get(base + "/health")
                break
            except OSError:
                time.sleep(0.2)
        request(base, "warm up", 4)
        per_seq, done = [], threading.Event()

        def sample() -> None:
            while not done.is_set():
                m = get(base + "/metrics")
                if m["running"]:
                    per_seq.append(m["kv_pages_in_use"] / m["running"])
                time.sleep(0.05)

        sampler = threading.Thread(target=sample)
        sampler.start()
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            results = list(pool.map(lambda w: request(base, *w), work))
        wall = time.perf_counter() - start
        done.set()
        sampler.join()
        served = get(base + "/metrics")
    finally:
        server.terminate()
        server.wait(30)
    assert [len(r) for r in results] == [n for _, n in work]
    return {"tokens_per_s": sum(n for _, n in work) / wall, "wall_s": wall,
            "ttft_p50_s": served["ttft_p50_s"], "ttft_p99_s": served["ttft_p99_s"],
            "gap_p50_s": served["latency_p50_s"], "gap_p99_s": served["latency_p99_s"],
            "pages_per_seq": statistics.mean(per_seq) if per_seq else None}


def gather_cost(reps: int = 200) -> tuple[float, float]:
    """Seconds of one layer's q·kᵀ for a decode step of 16 sequences of 96 positions: keys read
    as whole pages (in random order) from a pool (`mpdl.inference.paged.forward`'s gather), and
    sliced from a contiguous (batch, heads, block, head_dim) cache (`Decoder.step`'s)."""
    rng = np.random.default_rng(0)
    pool = rng.normal(size=(4, BIG, PAGE, 16)).astype(np.float32)
    tables = rng.permutation(BIG)[:16 * 96 // PAGE].reshape(16, 96 // PAGE)
    contiguous = rng.normal(size=(16, 4, BLOCK, 16)).astype(np.float32)
    q = rng.normal(size=(16, 4, 1, 16)).astype(np.float32)
    times: dict[str, list[float]] = {"paged": [], "contiguous": []}
    for _ in range(reps):
        t = time.perf_counter()
        q.transpose(1, 0, 2, 3) @ pool[:, tables].reshape(4, 16, 96, 16).swapaxes(-1, -2)
        times["paged"].append(time.perf_counter() - t)
        t = time.perf_counter()
        q @ contiguous[:, :, :96].swapaxes(-1, -2)
        times["contiguous"].append(time.perf_counter() - t)
    return statistics.median(times["paged"]), statistics.median(times["contiguous"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    work = workload(args.requests)
    # the formula: a sequence of prompt p and n new tokens holds ceil((p + j) / PAGE) pages
    # after its j-th token; a contiguous cache ceil(BLOCK / PAGE) throughout
    held = [math.ceil((len(pr) + j) / PAGE) for pr, n in work for j in range(1, n + 1)]
    rows = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint(Path(tmp) / "ckpt")
        for _ in range(args.rounds):
            for mode, (flags, pages) in MODES.items():
                rows[mode].append(run_mode(Path(tmp) / "ckpt", flags, pages, work, args.clients))
    base = statistics.median(r["tokens_per_s"] for r in rows["continuous, paged"])
    print(f"# {args.requests} requests, {args.clients} clients, pages of {PAGE}, batch <= "
          f"{BATCH}; median of {args.rounds} rounds; tokens/s also as a ratio to the first row")
    print(f"{'mode':<33} {'tokens/s':>9} {'ratio':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'gap p50':>8} {'gap p99':>8} {'pages/seq':>9}  tokens/s of each round")
    out = []
    for mode, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
        print(f"{mode:<33} {med['tokens_per_s']:>9.1f} {med['tokens_per_s'] / base:>6.2f} "
              f"{med['ttft_p50_s'] * 1e3:>7.0f}ms {med['ttft_p99_s'] * 1e3:>7.0f}ms "
              f"{med['gap_p50_s'] * 1e3:>6.1f}ms {med['gap_p99_s'] * 1e3:>6.1f}ms "
              f"{med.get('pages_per_seq', float('nan')):>9.2f}  "
              + " ".join(f"{r['tokens_per_s']:.0f}" for r in rs))
        out.append({"mode": mode, **med})
    print(f"# formula: pages per sequence, paged {statistics.mean(held):.2f} (token-weighted "
          f"ceil(length/{PAGE})), contiguous {math.ceil(BLOCK / PAGE)}")
    paged_s, contiguous_s = gather_cost()
    print(f"# one layer's key read, 16 sequences x 96 positions: gathered from pages "
          f"{paged_s * 1e6:.1f} us, sliced from a contiguous cache {contiguous_s * 1e6:.1f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": out, "formula_pages_paged":
                                               statistics.mean(held),
                                               "gather_s": [paged_s, contiguous_s]}) + "\n")


if __name__ == "__main__":
    main()
