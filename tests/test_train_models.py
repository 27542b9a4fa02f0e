"""Every zoo model learns every shipped dataset with its default learning rate (a few epochs on
one process, well above the 10% of chance). ResNet-8, the slow one, gets fewer synthetic samples
in smaller batches (as many steps in less time)."""

from __future__ import annotations

import io

import pytest

from mpdl.models.zoo import IMAGE_MODELS
from mpdl.threadworld import ThreadWorld
from mpdl.training.loop import TrainConfig, Trainer

DATASETS = {"digits": {"data.dataset": "digits"},
            "synthetic-mnist": {"data.dataset": "synthetic", "data.synthetic_shape": "mnist"},
            "synthetic-cifar": {"data.dataset": "synthetic", "data.synthetic_shape": "cifar"}}
SIZES = {("mlp", "digits"): {"optim.epochs": 6},
         ("mlp", "synthetic"): {"data.synthetic_samples": 2048, "optim.epochs": 3},
         ("lenet", "digits"): {"optim.epochs": 6},
         ("lenet", "synthetic"): {"data.synthetic_samples": 4096, "optim.epochs": 4},
         ("resnet8", "digits"): {"optim.epochs": 6},
         ("resnet8", "synthetic"): {"data.synthetic_samples": 768, "optim.global_batch_size": 32,
                                    "optim.epochs": 3}}


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("model", IMAGE_MODELS)
def test_each_model_learns_each_dataset_with_the_defaults(model, dataset):
    sizes = SIZES[model, DATASETS[dataset]["data.dataset"]]
    config = TrainConfig.from_keys({"model.name": model, "output.progress": False,
                                    **DATASETS[dataset], **sizes})
    trainer = Trainer(config, comm=ThreadWorld(1).comm(0), out=io.StringIO())
    trainer.setup()
    summary = trainer.run()[-1]
    assert summary["test_acc"] >= 0.6, f"{model} on {dataset}: test accuracy {summary['test_acc']}"
