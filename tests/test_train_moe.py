"""`mpdl train --moe-experts` under mpiexec: the JSON figures of the experts, the timeline's
dispatch and combine, and bad input (one line naming the flag, exit 2 on every rank)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mpdl.cli import UsageError
from mpdl.cli.train import add_arguments, check, config_from_args

BIN = Path(sys.executable).parent
MPIEXEC, MPDL = str(BIN / "mpiexec"), str(BIN / "mpdl")
TINY = ["--model", "gpt", "--digits", "1", "--n-layer", "2", "--n-head", "2", "--n-embd", "8",
        "--global-batch-size", "12", "--lr-schedule", "constant", "--epochs", "1"]


def train(n: int, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = ["timeout", "-k", "5", str(timeout), MPIEXEC, "-n", str(n), MPDL, "train",
           "--no-progress", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 15,
                          env={**os.environ, "MPDL_NO_CUPY": "1"})


def test_json_carries_the_experts_figures_and_the_timeline_dispatch_and_combine(tmp_path):
    out = train(2, *TINY, "--moe-experts", "4", "--ep", "2", "--moe-every", "2",
                "--moe-capacity-factor", "1.0", "--grad-accum", "2", "--json", str(tmp_path / "r.jsonl"),
                "--timeline", str(tmp_path / "t.json"))
    assert out.returncode == 0, out.stderr
    assert "1 MoE layer(s) of 4 experts, top-2, capacity factor 1; expert parallel over 2" \
        in out.stdout.splitlines()[0]
    lines = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    (row,), (summary,) = [r for r in lines if "epoch" in r], [r for r in lines if "summary" in r]
    assert row["mode"] == "expert" and row["ep"] == 2 and row["moe_experts"] == 4
    tokens = row["tokens_per_expert"]
    # one MoE layer (blocks 0 of 2); 90 problems of 5 tokens a epoch, 2 routings each
    assert len(tokens) == 1 and sum(tokens[0]) == 90 * 5 * 2
    assert 0 < row["dropped_fraction"] < 1 and row["aux_loss"] > 0
    assert 0 < row["alltoall_s"] <= row["comm_s"]
    assert summary["mode"] == "expert"
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["name"] for e in trace if e["ph"] == "X" and e["pid"] == 1}
    assert {"dispatch", "combine", "combine backward", "dispatch backward",
            "dispatch counts"} <= names


def test_bad_input_exits_2_with_one_line_on_every_rank():
    """Every check below takes this way out (`check`, before any rank communicates)."""
    message = "--ep 4 must divide the 2 data-parallel ranks"
    out = train(2, *TINY, "--moe-experts", "4", "--ep", "4", timeout=60)
    assert out.returncode == 2, (out.stdout, out.stderr)
    errors = out.stderr.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("mpdl train: error: "), out.stderr
    assert message in errors[0]


@pytest.mark.parametrize("flags, ranks, message", [
    (["--moe-experts", "3", "--ep", "2"], 2, "--moe-experts 3 must be divisible by --ep 2"),
    (["--moe-experts", "1", "--moe-top-k", "2"], 1,
     "--moe-top-k 2 must not exceed --moe-experts 1"),
    (["--moe-experts", "4", "--moe-top-k", "3"], 1, "--moe-top-k: expected one of 1, 2, got 3"),
    (["--moe-experts", "6", "--ep", "4"], 4, "--moe-experts 6 must be divisible by --ep 4"),
    (["--moe-experts", "4", "--ep", "2"], 3, "--ep 2 must divide the 3 data-parallel ranks"),
    (["--ep", "2"], 2, "--ep > 1 needs --moe-experts E > 0"),
    (["--moe-experts", "4", "--moe-capacity-factor", "-1"], 1,
     "--moe-capacity-factor: expected a number >= 0, got -1.0"),
    (["--moe-experts", "-2"], 1, "--moe-experts: expected an integer >= 0, got -2"),
    (["--moe-experts", "4", "--ep", "4", "--pp", "2"], 4,
     "--ep 4 must divide the 2 data-parallel ranks"),
    (["--moe-experts", "4", "--ep", "2", "--tp", "2"], 2,
     "--ep 2 must divide the 1 data-parallel ranks"),
    (["--moe-experts", "4", "--zero", "2"], 2, "--moe-experts combines with plain data"),
    (["--moe-experts", "4", "--cp", "2", "--digits", "2"], 2,
     "--moe-experts cannot be combined with --cp > 1"),
    (["--moe-experts", "4", "--grad-accum", "2", "--pp", "2"], 2,
     "--grad-accum > 1 cannot be combined with --pp, --tp or --cp > 1 (use --microbatches)"),
    (["--moe-experts", "4", "--precision", "fp16", "--zero", "1"], 2,
     "--precision fp16 with --moe-experts cannot be combined with --zero 1 yet"),
    (["--recompute", "selective", "--cp", "2", "--digits", "2"], 2,
     "--recompute cannot be combined with --cp > 1 yet"),
    (["--moe-experts", "4", "--tp", "2", "--sp", "--digits", "2"], 2,
     "--moe-experts cannot be combined with --cp > 1 or --sp"),
])
def test_bad_combinations_name_the_flag(flags, ranks, message):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config, _ = config_from_args(parser.parse_args([*TINY, *flags]))
    with pytest.raises(UsageError) as error:
        check(config, ranks)
    assert message in str(error.value) and "\n" not in str(error.value)
