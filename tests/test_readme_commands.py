"""Every command of the README's commands table runs, in the shell the README sets up (`source
.venv/bin/activate`: the venv's mpiexec, python and mpdl first on PATH), in a scratch folder.

Each command is run as written with small sizes (one epoch of a small text file instead of eight
of 3-digit addition, a few message sizes) or, where a row takes minutes or starts a long-lived
job, a smoke version declared here beside it, with the reason. A row added to the table without
a line in RUNS fails the test, as does a line in RUNS whose command left the table."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: the commands are the same under every MPI library's venv: the Open MPI run leaves them out
pytestmark = pytest.mark.same_under_every_mpi

ROOT = Path(__file__).parent.parent
BIN = Path(sys.executable).parent
PROGRAMS = ("make", "mpiexec", "mpdl", "python")
#: a GPT row as written trains 8 epochs of 3-digit addition (minutes): one epoch of a small text
SMALL_GPT = "--dataset text --data tiny.txt --block-size 16 --epochs 1 --no-progress"
#: a make target's commands, expanded and printed, not run: what they run is in other rows or CI
DRY = "make -n -C {root} "

#: the README's command -> how this test runs it (a shell line in the scratch folder, where
#: gpt-ckpt is a GPT checkpoint, tiny.txt a small text and prompts.txt two prompts)
RUNS = {
    "make train": DRY + "train",
    "make train-gpt": DRY + "train-gpt",
    "mpdl train --print-config > run.toml; mpiexec -n 2 mpdl train --config run.toml --epochs 5":
        "mpdl train --print-config > run.toml; mpiexec -n 2 mpdl train --config run.toml "
        "--epochs 1",
    # 8 epochs of 3-digit addition take minutes: one of 1-digit addition, a 1-digit problem
    "mpiexec -n 2 mpdl train --model gpt --dataset addition --checkpoint ckpt-gpt":
        "mpiexec -n 2 mpdl train --model gpt --dataset addition --checkpoint ckpt-gpt --digits 1 "
        "--epochs 1 --no-progress",
    'mpdl generate --checkpoint ckpt-gpt --prompt "123+456="':
        'mpdl generate --checkpoint ckpt-gpt --prompt "3+4="',
    # 2,000 steps as written: a few steps on the excerpt the scratch cache holds as the corpus
    "mpiexec -n 2 mpdl train --config examples/shakespeare.toml --checkpoint ckpt-shakespeare":
        "mpiexec -n 2 mpdl train --config examples/shakespeare.toml --checkpoint ckpt-shakespeare "
        "--max-steps 4 --eval-interval 2 --eval-steps 2 --no-progress",
    "mpdl generate --checkpoint ckpt-shakespeare": "mpdl generate --checkpoint ckpt-shakespeare",
    # its runs train 2,000 steps three times, for an hour: the options it takes
    "python benchmarks/bench_recipe.py --together": "python benchmarks/bench_recipe.py --help",
    "mpiexec -n 4 mpdl train --zero 3": "mpiexec -n 4 mpdl train --zero 3 --epochs 1",
    "mpiexec -n 2 mpdl train --model gpt --optimizer muon --zero 1":
        f"mpiexec -n 2 mpdl train --model gpt --optimizer muon --zero 1 {SMALL_GPT}",
    "mpiexec -n 2 mpdl train --model gpt --n-layer 4 --pp 2 --microbatches 8 --schedule zb-h1":
        f"mpiexec -n 2 mpdl train --model gpt --n-layer 4 --pp 2 --microbatches 8 --schedule zb-h1 "
        f"{SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model gpt --tp 2 --pp 2 --microbatches 2":
        f"mpiexec -n 4 mpdl train --model gpt --tp 2 --pp 2 --microbatches 2 {SMALL_GPT}",
    "make test": DRY + "test",
    "make notebooks": DRY + "notebooks",
    "make notebook N=01": DRY + "notebook N=01",
    # JupyterLab serves until it is stopped: the commands it would run
    "make lab": DRY + "lab",
    "make docs": DRY + "docs",
    "make lint": DRY + "lint",
    "mpiexec -n 3 mpdl info": "mpiexec -n 3 mpdl info",
    "mpiexec -n 4 mpdl bench allreduce -b 8 -e 64M":
        "mpiexec -n 4 mpdl bench allreduce -b 8 -e 64 -n 2 -w 1",
    "mpiexec -n 2 mpdl bench allreduce -b 1K -e 1M --mpi-variants":
        "mpiexec -n 2 mpdl bench allreduce -b 1K -e 4K -n 2 -w 1 --mpi-variants",
    "mpiexec -n 4 mpdl calibrate": "mpiexec -n 4 mpdl calibrate -n 1",
    "make bench": DRY + "bench",
    # with the bench extra's PyTorch; without it, the one line that names the extra
    "python benchmarks/bench_gpt.py --clock cpu":
        "python benchmarks/bench_gpt.py --clock cpu --reps 1 --steps 1 --batch 2 --block-size 8 "
        "--n-layer 1 --n-embd 32",
    "mpdl simulate --profile resnet50-v100 --nodes 544 --per-node 4":
        "mpdl simulate --profile resnet50-v100 --nodes 544 --per-node 4",
    # its checks train and time steps at several world sizes for minutes: the options it takes
    "python benchmarks/simulate_agreement.py --checks recompute moe cp --moe-ranks 2 4 --rounds 3":
        "python benchmarks/simulate_agreement.py --help",
    "mpdl launch -n 4 --max-restarts 3 -- train --checkpoint ckpt --checkpoint-every 50":
        "mpdl launch -n 4 --max-restarts 3 -- train --checkpoint ckpt --checkpoint-every 50 "
        "--epochs 1",
    # after the run above, which went well
    "mpdl doctor ckpt/flight": "mpdl doctor ckpt/flight",
    "make test MPI=openmpi": DRY + "test MPI=openmpi",
    "make test MPI=impi": DRY + "test MPI=impi",
    "make test-multinode": DRY + "test-multinode",
    "make bench-multinode": DRY + "bench-multinode",
    "mpiexec -n 4 mpdl bench alltoall --check":
        "mpiexec -n 4 mpdl bench alltoall --check -b 8 -e 64 -n 2 -w 1",
    "mpiexec -n 4 python benchmarks/bench_alltoall_overhead.py":
        "mpiexec -n 4 python benchmarks/bench_alltoall_overhead.py --sizes 8 --reps 3",
    "mpiexec -n 4 python benchmarks/bench_narrow_sum.py --counts 1K,256K,4M":
        "mpiexec -n 4 python benchmarks/bench_narrow_sum.py --counts 1K --reps 2",
    "mpdl simulate --model-shape llama3-405b --seq 131072 --tp 8 --cp 16 --pp 16 --dp 8 --sp "
    "--recompute selective --gpu h100-80gb --microbatches 16 --virtual-stages 8 --zero 1":
        "mpdl simulate --model-shape llama3-405b --seq 131072 --tp 8 --cp 16 --pp 16 --dp 8 --sp "
        "--recompute selective --gpu h100-80gb --microbatches 16 --virtual-stages 8 --zero 1",
    "mpiexec -n 4 mpdl generate --checkpoint DIR --prompts FILE --tp 2 --pp 2 --json out.jsonl":
        "mpiexec -n 4 mpdl generate --checkpoint gpt-ckpt --prompts prompts.txt --tp 2 --pp 2 "
        "--json out.jsonl",
    # a server runs until it is stopped: started, asked for /health, stopped (with the serve
    # extra; without it, the one line that names the extra)
    "mpiexec -n 2 mpdl serve --checkpoint DIR --tp 2 --port 8000":
        "mpiexec -n 2 mpdl serve --checkpoint gpt-ckpt --tp 2 --port 8000",
    "mpdl export --checkpoint DIR model.safetensors":
        "mpdl export --checkpoint gpt-ckpt model.safetensors",
    "mpdl train --model gpt --init-from model.safetensors":
        f"mpdl train --model gpt --init-from model.safetensors {SMALL_GPT}",
    "mpdl export --checkpoint DIR --format hf hf-model":
        "mpdl export --checkpoint gpt-ckpt --format hf hf-model",
    "mpdl train --model gpt --init-from hf-model":
        f"mpdl train --model gpt --init-from hf-model {SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model gpt --dataset text --data FILE --block-size 2048 --cp 4":
        f"mpiexec -n 4 mpdl train --model gpt --cp 4 {SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model gpt --moe-experts 4 --ep 4":
        f"mpiexec -n 4 mpdl train --model gpt --moe-experts 4 --ep 4 {SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model gpt --moe-experts 4 --ep 2 --pp 2 --zero 1":
        f"mpiexec -n 4 mpdl train --model gpt --moe-experts 4 --ep 2 --pp 2 --zero 1 {SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model gpt --moe-experts 4 --ep 4 --precision bf16 --grad-accum 2 "
    "--recompute full":
        "mpiexec -n 4 mpdl train --model gpt --moe-experts 4 --ep 4 --precision bf16 "
        f"--grad-accum 2 --recompute full {SMALL_GPT}",
    "python benchmarks/bench_auto.py --ranks 2 --no-calibration --no-emulated --loop 4 --iters 12 "
    "--max-bytes 64M":
        "python benchmarks/bench_auto.py --ranks 2 --no-calibration --no-emulated --loop 4 "
        "--iters 1 --min-bytes 1K --max-bytes 1K",
    "mpiexec -n 2 mpdl train --model gpt --optimizer adamw --lr 1e-3 --weight-decay 0.1 --beta2 "
    "0.99 --max-steps 2000 --warmup-steps 100 --min-lr 1e-4 --grad-clip 1.0 --zero 3":
        "mpiexec -n 2 mpdl train --model gpt --optimizer adamw --lr 1e-3 --weight-decay 0.1 "
        f"--beta2 0.99 --max-steps 4 --warmup-steps 2 --min-lr 1e-4 --grad-clip 1.0 --zero 3 "
        f"{SMALL_GPT}",
    "mpiexec -n 2 mpdl train --model gpt --precision bf16 --grad-accum 2":
        f"mpiexec -n 2 mpdl train --model gpt --precision bf16 --grad-accum 2 {SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model gpt --precision bf16 --pp 2 --tp 2 --sp --digits 2":
        f"mpiexec -n 4 mpdl train --model gpt --precision bf16 --pp 2 --tp 2 --sp {SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model gpt --zero 3 --recompute full --json run.jsonl":
        f"mpiexec -n 4 mpdl train --model gpt --zero 3 --recompute full --json run.jsonl "
        f"{SMALL_GPT}",
    "mpiexec -n 4 mpdl train --model mlp --epochs 2 --seed 4 --deterministic --zero 1 --json "
    "run.jsonl": "mpiexec -n 4 mpdl train --model mlp --epochs 1 --seed 4 --deterministic --zero 1 "
                 "--no-progress --json run.jsonl",
    "mpiexec -n 4 mpdl train --diloco --sync-every 10 --epochs 5 --json run.jsonl":
        "mpiexec -n 4 mpdl train --diloco --sync-every 10 --epochs 1 --json run.jsonl",
}
#: a row whose command needs an optional extra: the module it needs, and the extra that the
#: command's one-line error must name when that module is missing
EXTRAS = {"python benchmarks/bench_gpt.py --clock cpu": ("torch", "bench"),
          "mpiexec -n 2 mpdl serve --checkpoint DIR --tp 2 --port 8000": ("starlette", "serve")}


def table_commands() -> list[str]:
    """The commands of the README's table, in order: each backquoted span of a row's command
    cell that starts with a program the README's shell runs."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Commands\n", 1)[1].split("\n## ", 1)[0]
    commands = []
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| what | command", "|---")):
            continue
        cell = line.strip().strip("|").split(" | ")[-1]
        commands += [span for span in re.findall(r"`([^`]+)`", cell)
                     if span.split()[0] in PROGRAMS]
    return commands


def test_every_row_of_the_table_has_a_way_to_run():
    commands = table_commands()
    assert len(commands) >= 30, "the commands table was not found"
    missing = [c for c in commands if c not in RUNS]
    assert not missing, f"README rows with no line in this file's RUNS: {missing}"
    gone = [c for c in RUNS if c not in commands]
    assert not gone, f"RUNS lines for commands the README no longer has: {gone}"


def serve_and_ask(line: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    """Start the server of line, wait for its /health (60 s at most), stop it."""
    import urllib.request  # noqa: PLC0415

    port = line.split("--port ")[1].split()[0]
    server = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    answer, deadline = "", time.monotonic() + 60
    while not answer and time.monotonic() < deadline and server.poll() is None:
        try:
            answer = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
        except OSError:
            time.sleep(0.5)
    if server.poll() is None:
        os.killpg(server.pid, 15)
    out, err = server.communicate(timeout=30)
    return subprocess.CompletedProcess(line, 0 if answer else 1, out, err + f"\n/health: {answer}")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A folder to run the commands in, with what their placeholders name, and the shell's
    environment: the venv's bin first on PATH, a cache of its own (calibrate writes there; the
    Shakespeare excerpt stands in its corpus)."""
    folder = tmp_path_factory.mktemp("readme")
    words = "the quick brown fox jumps over the lazy dog and runs far away. ".split()
    (folder / "tiny.txt").write_text(" ".join(words[i % len(words)] for i in range(400)) + "\n")
    (folder / "prompts.txt").write_text("the \nfox\n")
    (folder / "benchmarks").symlink_to(ROOT / "benchmarks")
    (folder / "examples").symlink_to(ROOT / "examples")
    corpus = folder / ".cache" / "mpdl" / "datasets" / "shakespeare.txt"
    corpus.parent.mkdir(parents=True)
    corpus.write_bytes((ROOT / "tests" / "data" / "shakespeare_excerpt.txt").read_bytes())
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
           "VIRTUAL_ENV": str(BIN.parent), "XDG_CACHE_HOME": str(folder / ".cache"),
           "MPDL_COST_MODEL": str(folder / ".cache" / "costmodel.json"),
           "OMP_NUM_THREADS": "1", "MPDL_AUTO_CACHE": "off"}
    made = subprocess.run(["bash", "-c", f"mpdl train --model gpt --checkpoint gpt-ckpt "
                           f"{SMALL_GPT}"], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=120)
    assert made.returncode == 0, made.stderr[-2000:]
    return folder, env


def test_every_row_runs(scratch):
    folder, env = scratch
    failed, took = [], []
    for command in table_commands():
        line = RUNS[command].format(root=shlex.quote(str(ROOT)))
        module, extra = EXTRAS.get(command, (None, None))
        start = time.perf_counter()
        if module and importlib.util.find_spec(module) is None:
            out = subprocess.run(["bash", "-c", line], cwd=folder, env=env, capture_output=True,
                                 text=True, timeout=120)
            ok = out.returncode != 0 and out.stderr.count("\n") == 1 and extra in out.stderr
        elif " serve " in line:
            out = serve_and_ask(line, env, folder)
            ok = out.returncode == 0
        else:
            out = subprocess.run(["timeout", "-k", "5", "150", "bash", "-c", line], cwd=folder,
                                 env=env, capture_output=True, text=True, timeout=170)
            ok = out.returncode == 0 and "Traceback" not in out.stderr
        took.append(f"{time.perf_counter() - start:6.1f} s  {line}")
        if not ok:
            failed.append(f"$ {line}\n(exit {out.returncode})\n{out.stdout[-800:]}"
                          f"{out.stderr[-1500:]}")
    print("\n".join(took))
    assert not failed, "\n\n".join(failed)


def test_bench_auto_with_a_python_that_has_no_mpdl_beside_it_says_so(tmp_path):
    """The system python in place of the venv's (a README row run without activating it)."""
    (tmp_path / "python").symlink_to(sys.executable)
    out = subprocess.run([str(tmp_path / "python"), str(ROOT / "benchmarks" / "bench_auto.py"),
                          "--ranks", "2"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == (f"bench_auto.py: no mpdl and mpiexec beside {tmp_path / 'python'}: run "
                          f"it with the venv's python (source .venv/bin/activate after make "
                          f"install)\n")
