"""The one configuration surface of `mpdl train`: flags made from the options, `--config run.toml`
with flags overriding it, `--print-config` read back into the same run, errors naming the flag or
the file's key, the configuration in checkpoints and the JSON lines, and old (flat) checkpoints."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mpdl.cli import UsageError
from mpdl.cli.train import add_arguments, check, config_from_args
from mpdl.threadworld import ThreadWorld
from mpdl.tools.supervisor import checkpoint_dir
from mpdl.training.config import OPTIONS, ConfigError, TrainConfig, resume_mismatch
from mpdl.training.config_file import config_toml, read_config_file
from mpdl.training.loop import Trainer

MPDL = str(Path(sys.executable).parent / "mpdl")


def parse(*argv: str) -> tuple[TrainConfig, frozenset[str]]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(parser.parse_args(argv))


def configured(*argv: str) -> TrainConfig:
    return parse(*argv)[0]


def test_no_flags_is_the_defaults_and_the_gpt_gets_its_own():
    assert configured() == TrainConfig()
    gpt = configured("--model", "gpt")
    assert (gpt.data.dataset, gpt.optim.optimizer, gpt.optim.epochs, gpt.optim.global_batch_size,
            gpt.optim.warmup_epochs) == ("addition", "adam", 8, 128, 0.25)
    assert configured("--model", "gpt", "--epochs", "2").optim.epochs == 2
    assert configured("--model", "lenet").optim.epochs == 15


def test_each_flag_sets_its_option():
    config = configured("--rank", "3", "--no-overlap", "--async", "--no-prefetch", "--data", "x",
                        "--checkpoint", "ck", "--checkpoint-every", "5", "--no-progress",
                        "--lr", "0.5", "--bucket-mb", "2", "--scale-lr", "--zero", "3")
    assert config.communication.powersgd_rank == 3 and config.communication.overlap is False
    assert config.parallel.ps_async is True and config.parallel.prefetch is False
    assert config.data.path == "x" and config.checkpoint.dir == "ck"
    assert config.checkpoint.every == 5 and config.output.progress is False
    assert config.optim.lr == 0.5 and config.communication.bucket_mb == 2.0
    assert config.optim.scale_lr is True and config.parallel.zero == 3
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dests = {a.dest for a in parser._actions}
    assert set(OPTIONS) <= dests  # every option has its flag


def test_print_config_reads_back_into_the_same_run(tmp_path):
    flags = ("--model", "gpt", "--digits", "2", "--n-embd", "32", "--lr", "0.01", "--zero", "1",
             "--algorithm", "ring", "--no-overlap", "--rank", "4", "--json", "out.jsonl")
    config = configured(*flags)
    path = tmp_path / "run.toml"
    path.write_text(config_toml(config))
    assert configured("--config", str(path)) == config
    assert read_config_file(path)["model.n_embd"] == 32
    assert 'name = "gpt"' in path.read_text() and "[optim]" in path.read_text()
    again = configured("--config", str(path), "--epochs", "3", "--model", "gpt")
    assert again.optim.epochs == 3 and again.model.n_embd == 32
    assert again == dataclasses.replace(config, optim=dataclasses.replace(config.optim, epochs=3))
    out = subprocess.run([MPDL, "train", *flags, "--print-config"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == path.read_text(), out.stderr


def test_print_config_gives_the_learning_rate_used_when_unset(tmp_path):
    for flags, lr in [((), "0.2"), (("--model", "gpt"), "0.003"),
                      (("--optimizer", "adam"), "0.001")]:
        text = config_toml(configured(*flags))
        optim = text.split("[optim]\n", 1)[1]
        assert optim.startswith(f"# lr = {lr}  # unset: "), text
        path = tmp_path / "run.toml"
        path.write_text(text)
        assert "optim.lr" not in read_config_file(path)
    assert "# lr" not in config_toml(configured("--lr", "0.01"))


def test_a_small_file_keeps_the_defaults_and_the_model_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\nname = "gpt"\n\n[optim]\nlr = 1\n')
    config, from_file = parse("--config", str(path))
    assert config.optim.lr == 1.0 and isinstance(config.optim.lr, float)
    assert config.optim.epochs == 8 and config.data.dataset == "addition"
    assert from_file == {"model.name", "optim.lr"}
    assert parse("--config", str(path), "--lr", "2")[1] == {"model.name"}


@pytest.mark.parametrize("text,message", [
    ("[optim]\nbatch = 3\n", "run.toml: optim.batch: no such option (the options of [optim]: "
                             "epochs, global_batch_size,"),
    ("[optimisation]\nepochs = 3\n", "run.toml: [optimisation]: no such section"),
    ('[optim]\nepochs = "3"\n', "run.toml: optim.epochs: expected a number, got '3'"),
    ('[optim]\nmax_steps = 2.5\n', "run.toml: optim.max_steps: expected an integer, got 2.5"),
    ("[optim]\nscale_lr = 1\n", "run.toml: optim.scale_lr: expected true or false, got 1"),
    ("epochs = 3\n", "run.toml: epochs: not in a section (the sections: model, data, optim,"),
    ("optim = 3\n", "run.toml: optim: expected a table [optim] of options, got 3"),
    ("[optim\n", "run.toml: not TOML"),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, text, message):
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(UsageError) as caught:
        parse("--config", str(tmp_path / "run.toml"))
    assert caught.value.args[0].startswith(str(tmp_path) + "/" + message), caught.value.args[0]
    assert "\n" not in caught.value.args[0]


def _check_message(tmp_path, text: str, *flags: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    config, from_file = parse("--config", str(path), *flags)
    with pytest.raises(UsageError) as caught:
        check(config, 3, str(path), from_file)
    return caught.value.args[0].replace(str(tmp_path) + "/", "")


def test_a_value_from_the_file_is_named_by_its_key_one_from_a_flag_by_the_flag(tmp_path):
    text = "[optim]\nglobal_batch_size = 0\n"
    assert _check_message(tmp_path, text) == ("run.toml: optim.global_batch_size: expected a "
                                              "positive number, got 0")
    assert _check_message(tmp_path, text, "--global-batch-size", "-1") == (
        "--global-batch-size: expected a positive number, got -1")
    assert _check_message(tmp_path, "[parallel]\nps_async = true\n") == (
        "run.toml: parallel.ps_async needs --mode ps (asynchronous parameter server)")
    assert _check_message(tmp_path, "[parallel]\nmode = 'ps'\nps_async = true\n",
                          "--staleness", "1").startswith(
        "run.toml: parallel.ps_async and --staleness exclude each other")


def test_bad_config_file_exits_2_with_one_line(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[communication]\nbucket_mb = -1.0\n")
    out = subprocess.run([MPDL, "train", "--config", str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert f"{path}: communication.bucket_mb: expected a positive number, got -1.0" in out.stderr


def _run(config: TrainConfig) -> list[dict]:
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    return trainer.run()


#: the configuration as checkpoints recorded it before the sections (the fields of a run's
#: dataclasses.asdict then)
OLD = {"model": "mlp", "dataset": "digits", "data": None, "epochs": 1, "global_batch_size": 256,
       "lr": None, "optimizer": "sgd", "momentum": 0.9, "weight_decay": 0.0,
       "warmup_epochs": 0.0, "scale_lr": False, "lr_schedule": "cosine", "algorithm": "auto",
       "bucket_mb": 25.0, "first_bucket_mb": 1.0, "overlap": True, "seed": 0,
       "checkpoint": "ckpt", "resume": False, "checkpoint_every": 0, "keep": 0, "json": None,
       "timeline": None, "device": "cpu", "dtype": "float32", "synthetic_shape": "mnist",
       "synthetic_samples": 4096, "drop_last": False, "progress": False, "compression": "none",
       "ratio": 0.01, "levels": 127, "powersgd_rank": 2, "sync_every": 1, "post_local_warmup": 0,
       "mode": "allreduce", "servers": 1, "staleness": None, "ps_async": False, "emulate": None,
       "n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": None, "digits": 3, "zero": 0,
       "prefetch": True, "zero_hybrid": False, "dp": None, "pp": 1, "tp": 1, "microbatches": 1,
       "schedule": "1f1b", "verbose_comm": False}


def test_checkpoints_and_json_record_the_sections_and_old_checkpoints_still_resume(tmp_path):
    ckpt, jsonl = tmp_path / "ckpt", tmp_path / "run.jsonl"
    keys = {"optim.epochs": 1, "optim.global_batch_size": 256, "output.progress": False,
            "checkpoint.dir": str(ckpt), "output.json": str(jsonl)}
    config = TrainConfig.from_keys(keys)
    _run(config)
    state = json.loads((ckpt / "state.json").read_text())
    assert state["config"] == dataclasses.asdict(config)
    assert state["config"]["optim"]["global_batch_size"] == 256
    first = json.loads(jsonl.read_text().splitlines()[0])
    assert first == {"config": state["config"]}
    # the same checkpoint as an older version wrote it: a flat configuration, no checksum
    state["config"] = {**OLD, "checkpoint": str(ckpt)}
    del state["checksum"]
    (ckpt / "state.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"state\.json: it has no checksum"):
        _run(TrainConfig.from_keys({**keys, "optim.epochs": 2, "checkpoint.resume": True}))
    keys["checkpoint.accept_unchecked"] = True  # once, for a checkpoint written before checksums
    with pytest.raises(ConfigError, match=r"written with optim\.epochs=1, this run has 2"):
        _run(TrainConfig.from_keys({**keys, "optim.epochs": 2, "checkpoint.resume": True}))
    out = io.StringIO()
    trainer = Trainer(TrainConfig.from_keys({**keys, "optim.epochs": 2, "checkpoint.resume": True,
                                             "optim.lr_schedule": "constant"}),
                      comm=ThreadWorld(1).comm(0), out=out)
    trainer.setup()
    assert trainer.start_epoch == 1
    assert [r["epoch"] for r in trainer.run()[:-1]] == [1, 2]
    assert f"# resumed from {ckpt} after epoch 1" in out.getvalue()
    lenet = TrainConfig.from_keys({"model.name": "lenet", "checkpoint.dir": "ckpt"})
    assert "written with model.name='mlp', this run has 'lenet'" in str(
        ConfigError(resume_mismatch(lenet, OLD)))
    assert resume_mismatch(TrainConfig.from_keys({"optim.epochs": 1,
                                                  "optim.global_batch_size": 256}), OLD) is None


def test_an_unknown_key_in_the_library_is_refused():
    with pytest.raises(ConfigError, match=r"optim\.epoch: no such option"):
        TrainConfig.from_keys({"optim.epoch": 3})


def test_the_launcher_finds_the_checkpoint_directory_in_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[checkpoint]\ndir = "from-file"\n')
    assert checkpoint_dir(["train", "--config", str(path)]) == "from-file"
    assert checkpoint_dir(["train", f"--config={path}", "--checkpoint", "flag"]) == "flag"
    assert checkpoint_dir(["train", "--config", str(tmp_path / "none.toml")]) is None
    path.write_text("[optim]\nepochs = 2\n")
    assert checkpoint_dir(["train", "--config", str(path)]) is None
