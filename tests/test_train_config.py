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
    ({"staleness": 2}, "--staleness needs --mode ps"),
    ({"servers": 2}, "--servers needs --mode ps"),
    ({"mode": "ps"}, "at least 2 ranks"),
    ({"compression": "zip"}, "--compression: expected one of"),
    ({"compression": "topk", "ratio": 2.0}, "ratio"),
    ({"sync_every": 0}, "--sync-every"),
    ({"post_local_warmup": 5}, "--post-local-warmup needs --sync-every"),
    ({"sync_every": 4, "compression": "fp16"}, "cannot be combined"),
])
def test_train_rejects_bad_communication_flags(changes, message):
    with pytest.raises(UsageError, match=message):
        check(TrainConfig(**changes), 1)


@pytest.mark.parametrize("changes,library,flags", [
    ({"global_batch_size": 0}, "global_batch_size: expected a positive number, got 0",
     "--global-batch-size: expected a positive number, got 0"),
    ({"ps_async": True}, "ps_async needs mode ps", "--async needs --mode ps"),
    ({"mode": "ps", "ps_async": True, "staleness": 1},
     "ps_async and staleness exclude each other (staleness s bounds",
     "--async and --staleness exclude each other (--staleness s bounds"),
    ({"model": "{vgg}"}, "model: expected one of mlp, lenet, resnet8, gpt, got '{vgg}'",
     "--model: expected one of mlp, lenet, resnet8, gpt, got '{vgg}'"),
])
def test_checks_name_fields_and_the_cli_names_flags(changes, library, flags):
    with pytest.raises(ConfigError) as caught:
        validate(TrainConfig(**changes), 3)
    assert str(caught.value).startswith(library)
    assert caught.value.message(flag).startswith(flags)
    assert flag("powersgd_rank") == "--rank" and flag("lr_schedule") == "--lr-schedule"


def test_default_learning_rates():
    assert TrainConfig().base_lr() == 0.2
    assert TrainConfig(model="lenet").base_lr() == 0.03
    assert TrainConfig(model="lenet", optimizer="adam").base_lr() == 3e-3
    assert TrainConfig(compression="signsgd").base_lr() == pytest.approx(0.05)
    assert TrainConfig(lr=0.3, compression="signsgd").base_lr() == 0.3
    assert default_lr("resnet8", "lamb") == 1e-2


def _trainer(**changes) -> Trainer:
    config = TrainConfig(progress=False, global_batch_size=256, **changes)
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    return trainer


def test_resume_under_cosine_with_other_epochs_says_why_and_what_to_do(tmp_path):
    _trainer(epochs=2, checkpoint=str(tmp_path)).run()
    with pytest.raises(ConfigError) as caught:
        _trainer(epochs=3, checkpoint=str(tmp_path), resume=True)
    text = usage_error(caught.value).args[0]
    assert "written with epochs=2, this run has 3" in text
    assert "cosine schedule's length is the number of epochs" in text
    assert "--epochs 2" in text and "--lr-schedule constant" in text
    rows = _trainer(epochs=3, checkpoint=str(tmp_path), resume=True,
                    lr_schedule="constant").run()
    assert [r["epoch"] for r in rows[:-1]] == [1, 2, 3]


def test_emulation_is_this_process_setting_for_the_run_only(monkeypatch):
    monkeypatch.delenv("MPDL_EMULATE", raising=False)
    settings.use(None)
    before = settings.current()
    trainer = _trainer(epochs=1, emulate="inter=10Gbit/s,20us")
    assert settings.current().emulation.describe() == "inter=10Gbit/s,20us"
    rows = trainer.run()
    assert rows[0]["emulated"] == rows[-1]["emulated"] == "inter=10Gbit/s,20us"
    assert settings.current() == before and "MPDL_EMULATE" not in os.environ
    assert emulation.describe_active(trainer.comm) == ""
