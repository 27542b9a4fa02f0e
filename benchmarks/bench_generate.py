"""Generation speed: the KV cache against the uncached path, tensor and pipeline parallel against one
rank, and mpdl's per-token latency against PyTorch eager with its own KV cache on the same weights.

    python benchmarks/bench_generate.py cache   [--reps 3] [--json PATH]
    python benchmarks/bench_generate.py torch   [--reps 5] [--json PATH]
    mpiexec -n 2 python benchmarks/bench_generate.py parallel [--reps 5] [--json PATH]

cache: a GPT of block size 1024 (4 blocks, 4 heads, width 128, 65 characters), batch 1; for each
total length T = prompt + generation in 64 … 1024, a prompt of T − 32 tokens and 32 new tokens
(greedy), tokens/s of `GPT.generate` (each new token runs the whole prefix again) and of the KV
cache (`mpdl.inference.serving.generate_replica`: one prefill, then one token a step), taking
turns, median over reps. The uncached cost per token grows with T, the cached one barely. Also
the model FLOP/s (a forward's: 2N + 4·n_layer·n_embd·T per token) of the cached run's prefill
(the prompt in one forward, as training runs) and of its decode steps (one token each).

torch: the same shape with block size 256, a prompt of 64 tokens and 64 new tokens at batch 1
and 32; the time per new token after the first (decode steps only, argmax included) of mpdl's
decoder and of a nanoGPT-shaped PyTorch eager model with a KV cache of its own (preallocated,
`torch.inference_mode`), both on one thread, loaded with the same weights; ratio mpdl / PyTorch.

parallel (2 ranks): 8 prompts of 32 tokens, 32 new tokens each, on one rank (the other waits),
tp = 2 and pp = 2 (2 micro-batches); total tokens/s and per-token latency p50, taking turns.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from mpdl.inference.inference import Decoder
from mpdl.inference.serving import generate_replica, serve, summary
from mpdl.models.gpt import GPT

VOCAB, LAYERS, HEADS, WIDTH = 65, 4, 4, 128


def make_gpt(block_size: int) -> GPT:
    gpt = GPT(VOCAB, block_size, LAYERS, HEADS, WIDTH, seed=0)
    gpt.eval()
    return gpt


def prompts_of(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, length).tolist() for _ in range(batch)]


# -- the KV cache against the uncached path ---------------------------------------------------------
def bench_cache(reps: int) -> list[dict]:
    gpt = make_gpt(1024)
    decoder = Decoder(gpt)
    new = 32
    rows = []
    for total in (64, 128, 256, 512, 1024):
        prompt = prompts_of(1, total - new)
        times: dict[str, list[float]] = {"uncached": [], "cached": []}
        prefill, step = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            gpt.generate(np.array(prompt), new, top_k=1)
            times["uncached"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            seq = generate_replica(decoder, prompt, [0], new, top_k=1)[0]
            times["cached"].append(time.perf_counter() - t0)
            prefill.append(seq.ttft_s)
            step.append(statistics.median(seq.latencies_s))
        row = {"T": total, "prompt": total - new, "new": new,
               **{f"{k}_tokens_per_s": new / statistics.median(v) for k, v in times.items()}}
        row["speedup"] = row["cached_tokens_per_s"] / row["uncached_tokens_per_s"]
        # model FLOPs of a forward (a third of the training formula's), per token
        row["prefill_gflops"] = (total - new) * gpt.flops_per_token(total - new) / 3 / (
            statistics.median(prefill) * 1e9)
        row["decode_gflops"] = gpt.flops_per_token(total) / 3 / (statistics.median(step) * 1e9)
        rows.append(row)
        print(f"T {total:5d}: uncached {row['uncached_tokens_per_s']:8.1f} tokens/s, cached "
              f"{row['cached_tokens_per_s']:8.1f} tokens/s, cache x{row['speedup']:.1f}; "
              f"prefill {row['prefill_gflops']:.2f} GFLOP/s, decode {row['decode_gflops']:.2f} "
              f"GFLOP/s", flush=True)
    return rows


# -- against PyTorch eager with a KV cache ----------------------------------------------------------
def torch_model(gpt: GPT, batch: int):
    """A nanoGPT-shaped PyTorch GPT with gpt's weights and a preallocated KV cache for `batch`
    sequences: `prefill(idx)` and `step(idx, pos)` return the last logits."""
    import torch  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a.data))

    c, h = gpt.n_embd, gpt.n_head
    hd = c // h
    blocks = [{k: t(v) for k, v in (
        ("ln1_w", b.ln1.weight), ("ln1_b", b.ln1.bias), ("qkv_w", b.attn.qkv.weight),
        ("qkv_b", b.attn.qkv.bias), ("proj_w", b.attn.proj.weight), ("proj_b", b.attn.proj.bias),
        ("ln2_w", b.ln2.weight), ("ln2_b", b.ln2.bias), ("fc_w", b.mlp.fc.weight),
        ("fc_b", b.mlp.fc.bias), ("mproj_w", b.mlp.proj.weight),
        ("mproj_b", b.mlp.proj.bias))} for b in gpt.blocks]
    wte, wpe = t(gpt.token_embedding.weight), t(gpt.position_embedding.weight)
    lnf_w, lnf_b = t(gpt.ln_f.weight), t(gpt.ln_f.bias)
    k_cache = torch.zeros(len(blocks), batch, h, gpt.block_size, hd)
    v_cache = torch.zeros_like(k_cache)

    def run(idx, start: int):
        b, n = idx.shape
        x = wte[idx] + wpe[start:start + n]
        for i, w in enumerate(blocks):
            y = F.layer_norm(x, (c,), w["ln1_w"], w["ln1_b"])
            q, k, v = (z.view(b, n, h, hd).transpose(1, 2)
                       for z in F.linear(y, w["qkv_w"], w["qkv_b"]).split(c, dim=2))
            k_cache[i, :, :, start:start + n] = k
            v_cache[i, :, :, start:start + n] = v
            keys, values = k_cache[i, :, :, :start + n], v_cache[i, :, :, :start + n]
            y = F.scaled_dot_product_attention(q, keys, values, is_causal=n > 1)
            x = x + F.linear(y.transpose(1, 2).reshape(b, n, c), w["proj_w"], w["proj_b"])
            y = F.gelu(F.linear(F.layer_norm(x, (c,), w["ln2_w"], w["ln2_b"]), w["fc_w"],
                                w["fc_b"]))
            x = x + F.linear(y, w["mproj_w"], w["mproj_b"])
        return F.linear(F.layer_norm(x[:, -1], (c,), lnf_w, lnf_b), wte)

    return run


def decode_seconds_torch(run, prompts: list[list[int]], new: int) -> list[float]:
    """Seconds of each decode step (the tokens after the first), argmax included."""
    import torch  # noqa: PLC0415

    with torch.inference_mode():
        idx = torch.tensor(prompts)
        nxt = run(idx, 0).argmax(-1, keepdim=True)
        gaps, pos = [], idx.shape[1]
        for _ in range(new - 1):
            t0 = time.perf_counter()
            nxt = run(nxt, pos).argmax(-1, keepdim=True)
            gaps.append(time.perf_counter() - t0)
            pos += 1
    return gaps


def bench_torch(reps: int) -> list[dict]:
    import torch  # noqa: PLC0415

    torch.set_num_threads(1)
    gpt = make_gpt(256)
    decoder = Decoder(gpt)
    rows = []
    for batch in (1, 32):
        prompts = prompts_of(batch, 64)
        run = torch_model(gpt, batch)
        mpdl_s, torch_s = [], []
        for _ in range(reps):
            s = generate_replica(decoder, prompts, list(range(batch)), 64, top_k=1)
            mpdl_s.append(statistics.median(g for seq in s[:1] for g in seq.latencies_s))
            torch_s.append(statistics.median(decode_seconds_torch(run, prompts, 64)))
        row = {"batch": batch, "mpdl_ms": 1e3 * statistics.median(mpdl_s),
               "torch_ms": 1e3 * statistics.median(torch_s)}
        row["ratio"] = row["mpdl_ms"] / row["torch_ms"]
        rows.append(row)
        print(f"batch {batch:3d}: per-token latency mpdl {row['mpdl_ms']:.3f} ms, PyTorch eager "
              f"{row['torch_ms']:.3f} ms, ratio {row['ratio']:.2f}", flush=True)
    return rows


# -- tensor and pipeline parallel against one rank --------------------------------------------------
def bench_parallel(reps: int) -> list[dict]:
    from mpdl.comm import as_communicator  # noqa: PLC0415

    comm = as_communicator(None)
    if comm.size != 2:
        raise SystemExit("parallel: run under mpiexec -n 2")
    gpt = make_gpt(256)
    prompts = prompts_of(8, 32)
    alone = comm.sub([0]) if comm.rank == 0 else None
    layouts = {"one rank": None, "tp 2": (1, 1, 2), "pp 2": (1, 2, 1)}
    figures: dict[str, list[dict]] = {k: [] for k in layouts}
    for _ in range(reps):
        for name, layout in layouts.items():
            comm.barrier()
            if layout is None:
                if comm.rank == 0:
                    figures[name].append(summary(*serve(alone, gpt, prompts, 32, 1, 1, 1,
                                                        top_k=1)))
            else:
                figures[name].append(summary(*serve(comm, gpt, prompts, 32, *layout, top_k=1)))
    rows = []
    if comm.rank == 0:
        for name, runs in figures.items():
            row = {"layout": name,
                   "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                   "latency_p50_ms": 1e3 * statistics.median(r["latency_p50_s"] for r in runs)}
            rows.append(row)
            print(f"{name:>8}: {row['tokens_per_s']:8.1f} tokens/s, per-token latency p50 "
                  f"{row['latency_p50_ms']:.2f} ms", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("cache", "torch", "parallel"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = {"cache": bench_cache, "torch": bench_torch, "parallel": bench_parallel}[args.what](
        args.reps)
    if args.json and rows:
        with open(args.json, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
