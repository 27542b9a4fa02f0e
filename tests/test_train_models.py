"""Every zoo model learns every shipped dataset with its default learning rate (a few epochs on
one process, well above the 10% of chance). ResNet-8, the slow one, gets fewer synthetic samples
in smaller batches (as many steps in less time)."""

from __future__ import annotations

import io

import pytest

from mpdl.threadworld import ThreadWorld
from mpdl.training.loop import TrainConfig, Trainer
from mpdl.training.models import IMAGE_MODELS

DATASETS = {"digits": dict(dataset="digits"),
            "synthetic-mnist": dict(dataset="synthetic", synthetic_shape="mnist"),
            "synthetic-cifar": dict(dataset="synthetic", synthetic_shape="cifar")}
SIZES = {("mlp", "digits"): dict(epochs=6),
         ("mlp", "synthetic"): dict(synthetic_samples=2048, epochs=3),
         ("lenet", "digits"): dict(epochs=6),
         ("lenet", "synthetic"): dict(synthetic_samples=4096, epochs=4),
         ("resnet8", "digits"): dict(epochs=6),
         ("resnet8", "synthetic"): dict(synthetic_samples=768, global_batch_size=32, epochs=3)}


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_each_model_learns_each_dataset_with_the_defaults(model, dataset):
    sizes = SIZES[model, DATASETS[dataset]["dataset"]]
    config = TrainConfig(model=model, progress=False, **DATASETS[dataset], **sizes)
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    summary = trainer.run()[-1]
    assert summary["test_acc"] >= 0.6, f"{model} on {dataset}: test accuracy {summary['test_acc']}"
