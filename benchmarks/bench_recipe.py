"""nanoGPT's "baby GPT on a CPU" recipe (examples/shakespeare.toml) in mpdl on 1 and 2 ranks,
and in a PyTorch model of the same recipe written here, side by side.

All three start from the same initial weights (mpdl's, seeded by the recipe's seed), train on
the same batches (the recipe's random windows: `mpdl.parallel.sampler.random_batch`) and are
scored on the same validation batches (`mpdl.training.tasks.validation_indices`) of the same
corpus (`--dataset shakespeare`). mpdl runs as a user runs it: `mpiexec -n R mpdl train --config
RECIPE` with `--log-interval 10`; PyTorch runs in this process on one thread, with AdamW
(decoupled weight decay on the ≥ 2-D weights, as the recipe's optimizer), nanoGPT's learning
rate schedule (linear warmup, cosine to min_lr, constant after) and clip_grad_norm_. Printed: the
validation loss at each evaluation step, the median ms/step of the 10-step means, tokens/s, the
judged differences, a sample from each model, and the machine's load average.

    python benchmarks/bench_recipe.py [--config examples/shakespeare.toml] [--data DIR]
                                      [--ranks 1 2] [--max-steps N] [--eval-steps K] [--out DIR]
                                      [--together] [--timing-rounds R] [--timing-steps S]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from mpdl import datasets  # noqa: E402
from mpdl.models.zoo import build_model  # noqa: E402
from mpdl.parallel.sampler import random_batch  # noqa: E402
from mpdl.training.config import TrainConfig, resolve  # noqa: E402
from mpdl.training.config_file import read_config_file  # noqa: E402
from mpdl.training.tasks import offsets, validation_indices  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpt import torch_gpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
#: steps per line of mpdl's log, and per mean of PyTorch's step times
LOG_INTERVAL = 10
#: the characters of each model's sample, after a newline
SAMPLE_CHARS = 300


def start_mpdl(ranks: int, flags: list[str], out: Path, name: str) -> tuple:
    """Start `mpiexec -n ranks mpdl train FLAGS` with a log line every LOG_INTERVAL steps, its
    JSON lines and checkpoint under out/name."""
    ckpt, jsonl = out / f"ckpt-{name}", out / f"{name}.jsonl"
    command = [str(BIN / "mpiexec"), "-n", str(ranks), str(BIN / "mpdl"), "train", *flags,
               "--json", str(jsonl), "--log-interval", str(LOG_INTERVAL), "--no-progress",
               "--checkpoint", str(ckpt)]
    job = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return job, ckpt, jsonl, time.perf_counter()


def finish_mpdl(started: tuple, sample: bool = True) -> dict:
    """The evaluations, step times (the log lines' means), learning rates, seconds and, with
    `sample`, the checkpoint's sample of a run `start_mpdl` started."""
    job, ckpt, jsonl, start = started
    _, err = job.communicate()
    seconds = time.perf_counter() - start
    if job.returncode:
        sys.exit(f"mpdl train failed ({job.returncode}): {err}")
    lines = [json.loads(line) for line in jsonl.read_text().splitlines()]
    text = subprocess.run([str(BIN / "mpdl"), "generate", "--checkpoint", str(ckpt),
                           "--max-new-tokens", str(SAMPLE_CHARS), "--seed", "0"],
                          capture_output=True, text=True, check=True).stdout if sample else ""
    return {"evals": {e["step"]: e["val_loss"] for e in lines if "val_loss" in e and "step" in e},
            "step_ms": [e["step_ms"] for e in lines if "step_ms" in e],
            "lr": {e["step"]: e["lr"] for e in lines if "lr" in e and "step" in e},
            "seconds": seconds, "sample": text}


def nanogpt_lr(step: int, o) -> float:
    """nanoGPT's get_lr: linear warmup, cosine from lr to min_lr over the decay steps, then
    min_lr."""
    if step < o.warmup_steps:
        return o.lr * (step + 1) / (o.warmup_steps + 1)
    if step > o.lr_decay_steps:
        return o.min_lr
    ratio = (step - o.warmup_steps) / (o.lr_decay_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (o.lr - o.min_lr)


def run_torch(config: TrainConfig, data: datasets.TextData, steps: int,
              evaluations: bool = True) -> dict:
    """The recipe in PyTorch on one thread from mpdl's initial weights: evaluations (with
    `evaluations`), step times and a sample."""
    import torch

    torch.set_num_threads(1)
    m, o, out = config.model, config.optim, config.output
    T, B = m.block_size, o.global_batch_size
    model = torch_gpt(torch, build_model("gpt", (T,), len(data.vocab), seed=o.seed,
                                         n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_embd))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    train_x, train_y = offsets(data.train, T)
    val_x, val_y = offsets(data.val, T)
    val = validation_indices(len(val_x), out.eval_steps, B, o.seed, random=True)

    def evaluate() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad():
            for start in range(0, len(val), 512):
                part = val[start:start + 512]
                logits = model(torch.from_numpy(val_x[part]))
                total += float(torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]),
                    torch.from_numpy(val_y[part]).reshape(-1), reduction="sum"))
        model.train()
        return total / (len(val) * T)

    evals, times = {0: evaluate()} if evaluations else {}, []
    for step in range(steps):
        idx = random_batch(o.seed, step, len(train_x), B)
        start = time.perf_counter()
        lr = nanogpt_lr(step, o)
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(torch.from_numpy(train_x[idx]))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(train_y[idx]).reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
        opt.step()
        times.append(time.perf_counter() - start)
        if evaluations and ((step + 1) % out.eval_interval == 0 or step + 1 == steps):
            evals[step + 1] = evaluate()
    means = [1e3 * sum(times[i:i + LOG_INTERVAL]) / LOG_INTERVAL
             for i in range(0, len(times) - LOG_INTERVAL + 1, LOG_INTERVAL)]
    generator = torch.Generator().manual_seed(0)
    ids = torch.tensor([[data.vocab.index("\n")]])
    model.eval()
    with torch.no_grad():
        for _ in range(SAMPLE_CHARS):
            probs = torch.softmax(model(ids[:, -T:])[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return {"evals": evals, "step_ms": means, "seconds": sum(times),
            "sample": data.decode(ids[0].tolist()),
            "lr": {s: nanogpt_lr(s - 1, o) for s in range(1, steps + 1)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "shakespeare.toml")
    parser.add_argument("--data", help="the folder of the Shakespeare corpus (default: mpdl's "
                        "data cache, fetched at first use)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--max-steps", type=int, help="fewer steps than the recipe's (a trial)")
    parser.add_argument("--eval-steps", type=int, help="fewer validation batches (a trial)")
    parser.add_argument("--out", type=Path, default=Path("bench-out/recipe"))
    parser.add_argument("--together", action="store_true", help="run mpdl's and PyTorch's "
                        "trainings at once (for the losses on a busy machine; the timing rounds "
                        "still alternate)")
    parser.add_argument("--timing-rounds", type=int, default=3, help="rounds of mpdl on 1 rank, "
                        "then PyTorch, --timing-steps steps each without evaluations")
    parser.add_argument("--timing-steps", type=int, default=100)
    args = parser.parse_args()
    if importlib.util.find_spec("torch") is None:
        raise SystemExit("bench_recipe.py: needs PyTorch, from the bench extra: "
                         "pip install -e '.[bench]'")
    values = read_config_file(args.config)
    if args.data:
        values["data.path"] = args.data
    if args.max_steps:
        values["optim.max_steps"] = args.max_steps
    if args.eval_steps:
        values["output.eval_steps"] = args.eval_steps
    config = resolve(values)
    o, B, T = config.optim, config.optim.global_batch_size, config.model.block_size
    data = datasets.text(datasets.shakespeare(config.data.path), T)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"# recipe {args.config}: {config.model.n_layer} layers, {config.model.n_head} heads, "
          f"width {config.model.n_embd}, block {T}, batch {B}, {o.max_steps} steps; corpus "
          f"{len(data.train) + len(data.val):,} characters; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    flags = ["--config", str(args.config), *(["--data", args.data] if args.data else []),
             *(["--eval-steps", str(args.eval_steps)] if args.eval_steps else [])]
    runs, started = {}, {}
    for ranks in args.ranks:
        name = f"mpdl {ranks} rank{'s' if ranks > 1 else ''}"
        started[name] = start_mpdl(ranks, flags + ["--max-steps", str(o.max_steps)], args.out,
                                   f"mpdl-{ranks}")
        if not args.together:
            runs[name] = finish_mpdl(started.pop(name))
    runs["pytorch"] = run_torch(config, data, o.max_steps)
    runs = {**{name: finish_mpdl(job) for name, job in started.items()}, **runs}
    print(f"# load {os.getloadavg()[0]:.1f} after the runs")
    timing = {"mpdl": [], "pytorch": []}
    for round_ in range(args.timing_rounds):
        job = start_mpdl(1, flags + ["--max-steps", str(args.timing_steps), "--eval-interval",
                                     "0"], args.out, f"timing-{round_}")
        timing["mpdl"] += finish_mpdl(job, sample=False)["step_ms"]
        timing["pytorch"] += run_torch(config, data, args.timing_steps, False)["step_ms"]
    names = list(runs)
    print(f"{'step':>6}" + "".join(f" {name:>14}" for name in names))
    for step in sorted(runs["pytorch"]["evals"]):
        print(f"{step:>6}" + "".join(f" {runs[n]['evals'].get(step, float('nan')):>14.4f}"
                                     for n in names))
    for label, pick in (("ms/step", lambda r: statistics.median(r["step_ms"])),
                        ("tokens/s", lambda r: B * T * 1e3 / statistics.median(r["step_ms"]))):
        print(f"{label:>6}" + "".join(f" {pick(runs[n]):>14.1f}" for n in names))
    last = o.max_steps
    torch_run, first = runs["pytorch"], runs[names[0]]
    for name in names[:-1]:
        lrs = runs[name]["lr"]
        lr_gap = max(abs(lrs[s] - torch_run["lr"][s]) for s in lrs)
        print(f"# {name}: val loss {runs[name]['evals'][last]:.4f} vs PyTorch "
              f"{torch_run['evals'][last]:.4f} (diff "
              f"{runs[name]['evals'][last] - torch_run['evals'][last]:+.4f}), vs "
              f"{names[0]} {runs[name]['evals'][last] - first['evals'][last]:+.2e}; ms/step "
              f"{statistics.median(runs[name]['step_ms']) / statistics.median(torch_run['step_ms']):.2f}"
              f"x PyTorch's; lr at most {lr_gap:.1e} from nanoGPT's; {runs[name]['seconds']:.0f} s")
    if args.timing_rounds:
        ours, theirs = (statistics.median(timing[k]) for k in ("mpdl", "pytorch"))
        print(f"# alternating rounds ({args.timing_rounds} x {args.timing_steps} steps, 1 rank, "
              f"median of the {LOG_INTERVAL}-step means): mpdl {ours:.1f} ms/step, PyTorch "
              f"{theirs:.1f} ms/step, {ours / theirs:.2f}x; load {os.getloadavg()[0]:.1f}")
    for name in names:
        print(f"\n# sample, {name}:\n{runs[name]['sample'].strip()}")
    (args.out / "results.json").write_text(json.dumps({"runs": runs, "timing": timing}, indent=1))


if __name__ == "__main__":
    main()
