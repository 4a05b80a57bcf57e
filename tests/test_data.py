import numpy as np
import pytest
import torch

from lab_utils.experiments.shared import data
from lab_utils.learn.errors import LabError


def test_spec_transform_order():
    names = [type(t).__name__ for t in data.train_transform().transforms]
    assert names == ["RandomCrop", "RandomHorizontalFlip", "ToTensor", "Normalize"]
    crop, flip, _, norm = data.train_transform().transforms
    assert crop.size == (32, 32) and crop.padding == 4 and flip.p == 0.5
    assert tuple(norm.mean) == (0.4914, 0.4822, 0.4465) and tuple(norm.std) == (0.2023, 0.1994, 0.2010)
    assert [type(t).__name__ for t in data.test_transform().transforms] == ["ToTensor", "Normalize"]


def test_synthetic_is_cifar_shaped_and_deterministic():
    a = data.SyntheticCIFAR10(train=True, size=1500)
    b = data.SyntheticCIFAR10(train=True, size=3000)
    assert a.data.shape == (1500, 32, 32, 3) and a.data.dtype == np.uint8
    assert np.array_equal(a.data, b.data[:1500]) and a.targets == b.targets[:1500]  # prefixes
    assert set(a.targets) == set(range(10))
    test = data.SyntheticCIFAR10(train=False, size=100)
    assert not np.array_equal(test.data, a.data[:100])  # train and test differ
    x, y = data.SyntheticCIFAR10(train=True, size=10, transform=data.train_transform())[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and isinstance(y, int)


def _nearest_mean_accuracy(train_x, train_y, test_x, test_y):
    means = np.stack([train_x[train_y == c].mean(0) for c in range(10)])
    pred = ((test_x[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)
    return (pred == test_y).mean()


def test_synthetic_is_learnable_from_texture_not_pixels():
    tr = data.SyntheticCIFAR10(train=True, size=2000)
    te = data.SyntheticCIFAR10(train=False, size=500)
    y, yt = np.array(tr.targets), np.array(te.targets)

    def gray(d):
        return d.astype(np.float32).mean(-1)

    # fixed pixel templates do not work (random phase and tint)...
    raw = _nearest_mean_accuracy(gray(tr.data).reshape(2000, -1), y, gray(te.data).reshape(500, -1), yt)
    # ...but the texture (amplitude spectrum) carries the class, as for a convolution
    def spectrum(d):
        g = gray(d) - gray(d).mean((1, 2), keepdims=True)
        return np.log1p(np.abs(np.fft.rfft2(g))).reshape(len(d), -1)

    spec = _nearest_mean_accuracy(spectrum(tr.data), y, spectrum(te.data), yt)
    assert raw < 0.4 < 0.7 < spec < 0.999


def test_auto_falls_back_to_synthetic_offline(tmp_path):
    assert data.resolve_dataset("auto", tmp_path) == "synthetic"
    with pytest.raises(LabError, match="make prepare"):
        data.resolve_dataset("cifar10", tmp_path)
    with pytest.raises(LabError, match="use one of"):
        data.resolve_dataset("imagenet", tmp_path)


def test_env_selects_dataset(monkeypatch, tmp_path):
    monkeypatch.setenv("LAB_DATASET", "cifar10")
    with pytest.raises(LabError, match="CIFAR-10 is not in"):
        data.make_loaders(batch_size=8, num_workers=0, train_images=16, test_images=16)


def test_loaders_subset_and_labels():
    with pytest.warns(UserWarning, match="synthetic"):
        data._warned_synthetic = False
        loaders = data.make_loaders(batch_size=32, num_workers=0, train_images=100, test_images=50)
    assert loaders.synthetic and loaders.train_images == 100 and loaders.test_images == 50
    x, y = next(iter(loaders.train))
    assert x.shape == (32, 3, 32, 32) and y.shape == (32,)
    assert len(loaders.train) == 4  # 100 / 32, last partial batch kept
    assert "synthetic" in loaders.dataset_name


@pytest.mark.parametrize("bs", [0, -4])
def test_bad_batch_size(bs):
    with pytest.raises(LabError, match="at least 1"):
        data.make_loaders(batch_size=bs, num_workers=0)


def test_prepare_offline_gives_one_sentence(tmp_path, monkeypatch):
    import torchvision.datasets

    def no_network(*a, **k):
        raise OSError("Network is unreachable")

    monkeypatch.setattr(torchvision.datasets.CIFAR10, "download", no_network)
    with pytest.raises(LabError, match="machine with internet"):
        data.prepare_cifar10(tmp_path)
