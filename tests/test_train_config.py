"""The training configuration: its checks in the library's words and in the flags', the default
learning rates, and the message of a resume that cannot continue."""

from __future__ import annotations

import io
import os

import pytest

from mpdl import emulation, settings
from mpdl.cli import UsageError
from mpdl.cli.train import check, flag, usage_error
from mpdl.threadworld import ThreadWorld
from mpdl.training.config import ConfigError, TrainConfig, default_lr, validate
from mpdl.training.loop import Trainer


@pytest.mark.parametrize("changes,message", [
    ({"parallel.staleness": 2}, "--staleness needs --mode ps"),
    ({"parallel.servers": 2}, "--servers needs --mode ps"),
    ({"parallel.mode": "ps"}, "at least 2 ranks"),
    ({"communication.compression": "zip"}, "--compression: expected one of"),
    ({"communication.compression": "topk", "communication.ratio": 2.0}, "ratio"),
    ({"communication.sync_every": 0}, "--sync-every"),
    ({"communication.post_local_warmup": 5}, "--post-local-warmup needs --sync-every"),
    ({"communication.sync_every": 4, "communication.compression": "fp16"}, "cannot be combined"),
    ({"communication.outer_lr": 1.0}, "--outer-lr needs --diloco"),
    ({"communication.outer_compress": "int4"}, "--outer-compress needs --diloco"),
    ({"communication.diloco": True, "communication.outer_compress": "int2"},
     "--outer-compress: expected one of none, fp16, int8, int4"),
    ({"communication.diloco": True, "communication.outer_momentum": 1.0}, "--outer-momentum"),
    ({"communication.diloco": True, "parallel.zero": 1}, "--diloco cannot be combined with --zero"),
    ({"communication.diloco": True, "communication.compression": "fp16"},
     "--diloco cannot be combined with --compression"),
])
def test_train_rejects_bad_communication_flags(changes, message):
    with pytest.raises(UsageError, match=message):
        check(TrainConfig.from_keys(changes), 1)


@pytest.mark.parametrize("changes,library,flags", [
    ({"optim.global_batch_size": 0},
     "optim.global_batch_size: expected a positive number, got 0",
     "--global-batch-size: expected a positive number, got 0"),
    ({"parallel.ps_async": True}, "parallel.ps_async needs parallel.mode ps",
     "--async needs --mode ps"),
    ({"parallel.mode": "ps", "parallel.ps_async": True, "parallel.staleness": 1},
     "parallel.ps_async and parallel.staleness exclude each other (parallel.staleness s bounds",
     "--async and --staleness exclude each other (--staleness s bounds"),
    ({"model.name": "{vgg}"}, "model.name: expected one of mlp, lenet, resnet8, gpt, got '{vgg}'",
     "--model: expected one of mlp, lenet, resnet8, gpt, got '{vgg}'"),
])
def test_checks_name_fields_and_the_cli_names_flags(changes, library, flags):
    with pytest.raises(ConfigError) as caught:
        validate(TrainConfig.from_keys(changes), 3)
    assert str(caught.value).startswith(library)
    assert caught.value.message(flag).startswith(flags)
    assert flag("communication.powersgd_rank") == "--rank"
    assert flag("optim.lr_schedule") == "--lr-schedule"


def test_sequence_parallelism_names_the_digits_that_split_evenly():
    """3-digit addition has 11 positions: tp 2 cannot split them, 2 or 4 digits (8, 14) can."""
    keys = {"model.name": "gpt", "data.dataset": "addition", "parallel.tp": 2, "parallel.pp": 2,
            "parallel.sp": True}
    with pytest.raises(ConfigError) as caught:
        validate(TrainConfig.from_keys(keys), 4)
    assert caught.value.message(flag) == (
        "--sp: each rank's 11 positions of a sequence must be divisible by --tp 2 (addition has "
        "3 x --digits + 2 positions: try --digits 2 or 4)")
    validate(TrainConfig.from_keys({**keys, "data.digits": 2}), 4)


def test_default_learning_rates():
    assert TrainConfig().base_lr() == 0.2
    assert TrainConfig.from_keys({"model.name": "lenet"}).base_lr() == 0.03
    assert TrainConfig.from_keys({"model.name": "lenet", "optim.optimizer": "adam"}
                                 ).base_lr() == 3e-3
    signsgd = {"communication.compression": "signsgd"}
    assert TrainConfig.from_keys(signsgd).base_lr() == pytest.approx(0.05)
    assert TrainConfig.from_keys({**signsgd, "optim.lr": 0.3}).base_lr() == 0.3
    assert default_lr("resnet8", "lamb") == 1e-2
    assert default_lr("gpt", "adam", experts=True) == 2e-3
    assert default_lr("gpt", "sgd", experts=True) == default_lr("gpt", "sgd")
    moe = TrainConfig.from_keys({"model.name": "gpt", "model.moe_experts": 4,
                                 "optim.optimizer": "adam"})
    assert moe.base_lr() == 2e-3


def _trainer(changes: dict) -> Trainer:
    config = TrainConfig.from_keys({"output.progress": False, "optim.global_batch_size": 256,
                                    **changes})
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    return trainer


def test_resume_under_cosine_with_other_epochs_says_why_and_what_to_do(tmp_path):
    ckpt = {"checkpoint.dir": str(tmp_path)}
    _trainer({**ckpt, "optim.epochs": 2}).run()
    with pytest.raises(ConfigError) as caught:
        _trainer({**ckpt, "optim.epochs": 3, "checkpoint.resume": True})
    text = usage_error(caught.value).args[0]
    assert "written with --epochs=2, this run has 3" in text
    assert "cosine schedule's length is the number of epochs" in text
    assert "--epochs 2" in text and "--lr-schedule constant" in text
    rows = _trainer({**ckpt, "optim.epochs": 3, "checkpoint.resume": True,
                       "optim.lr_schedule": "constant"}).run()
    assert [r["epoch"] for r in rows[:-1]] == [1, 2, 3]


def test_emulation_is_this_process_setting_for_the_run_only(monkeypatch):
    monkeypatch.delenv("MPDL_EMULATE", raising=False)
    settings.use(None)
    before = settings.current()
    trainer = _trainer({"optim.epochs": 1, "communication.emulate": "inter=10Gbit/s,20us"})
    assert settings.current().emulation.describe() == "inter=10Gbit/s,20us"
    rows = trainer.run()
    assert rows[0]["emulated"] == rows[-1]["emulated"] == "inter=10Gbit/s,20us"
    assert settings.current() == before and "MPDL_EMULATE" not in os.environ
    assert emulation.describe_active(trainer.comm) == ""
