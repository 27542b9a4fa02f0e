"""Every zoo model learns every shipped dataset with its default learning rate (a few epochs on
one process, well above the 10% of chance). ResNet-8 is the slow one: on the synthetic images it
gets fewer samples, in smaller batches (as many steps in a quarter of the time)."""

from __future__ import annotations

import io

import pytest

from mpdl.threadworld import ThreadWorld
from mpdl.training.loop import TrainConfig, Trainer
from mpdl.training.models import MODELS

DATASETS = {"digits": dict(dataset="digits", epochs=6),
            "synthetic-mnist": dict(dataset="synthetic", synthetic_shape="mnist", epochs=3),
            "synthetic-cifar": dict(dataset="synthetic", synthetic_shape="cifar", epochs=3)}
SYNTHETIC = {"mlp": dict(synthetic_samples=2048), "lenet": dict(synthetic_samples=2048),
             "resnet8": dict(synthetic_samples=768, global_batch_size=32)}


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("model", MODELS)
def test_each_model_learns_each_dataset_with_the_defaults(model, dataset):
    sizes = SYNTHETIC[model] if dataset.startswith("synthetic") else {}
    config = TrainConfig(model=model, progress=False, **DATASETS[dataset], **sizes)
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    summary = trainer.run()[-1]
    assert summary["test_acc"] >= 0.6, f"{model} on {dataset}: test accuracy {summary['test_acc']}"
