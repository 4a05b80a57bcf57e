import math

import torch

from lab_utils.core.data import make_loaders
from lab_utils.core.loop import evaluate, make_optimizer, train_epoch, wrap_data_parallel
from lab_utils.models import ResNet18


def test_spec_optimizer():
    opt = make_optimizer(ResNet18(width=8))
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["weight_decay"]) == (0.1, 0.9, 5e-4)


def test_two_epoch_quick_run_loss_falls():
    torch.manual_seed(0)
    loaders = make_loaders(batch_size=32, num_workers=0, train_images=512, test_images=200,
                           dataset="synthetic")
    model = ResNet18(width=8)
    opt = make_optimizer(model, lr=0.05)
    r1 = train_epoch(model, loaders.train, opt, "cpu", epoch=1)
    r2 = train_epoch(model, loaders.train, opt, "cpu", epoch=2)
    after = evaluate(model, loaders.test, "cpu")
    assert r1.images == r2.images == 512 and r1.steps == 16
    assert r2.loss < r1.loss
    assert after.accuracy > 0.3  # chance is 0.1
    # the reported time excludes waiting on the loader and is made of the phases
    assert math.isclose(r2.train_seconds, r2.data_movement_seconds + r2.compute_seconds
                        + r2.communication_seconds)
    assert r2.epoch_seconds >= r2.train_seconds + r2.data_loading_seconds * 0.99
    assert r2.images_per_s == r2.images / r2.train_seconds
    assert r2.peak_memory_bytes is None  # not tracked on CPU


def test_max_steps_and_data_parallel_wrapper_on_cpu():
    model = wrap_data_parallel(ResNet18(width=8))  # no GPUs: DataParallel just calls the module
    batches = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))) for _ in range(5)]
    r = train_epoch(model, batches, make_optimizer(model), "cpu", max_steps=2)
    assert r.steps == 2 and r.images == 8
