"""CIFAR-10 with the assignment's transforms, and a synthetic stand-in for offline use.

Train transforms, in this order (the order matters: ``Normalize`` needs a tensor, so
putting it before ``ToTensor`` crashes): RandomCrop(32, padding=4),
RandomHorizontalFlip(0.5), ToTensor, Normalize(mean, std). Test: ToTensor, Normalize.

Where the data come from (``dataset=``, or ``$LAB_DATASET``):

- ``"auto"`` (default): CIFAR-10 from ``data/`` when it was prepared there, otherwise
  the synthetic stand-in, with a warning that says how to prepare the real one;
- ``"cifar10"``: the real data set, or a :class:`LabError` naming ``make prepare``;
- ``"synthetic"``: always the stand-in.

No download is attempted at training time (compute nodes are often offline);
``python -m lab_utils prepare`` downloads on a machine that has internet.

The synthetic stand-in has CIFAR's shapes and types (32x32 RGB uint8 images as PIL,
10 classes, 50,000 / 10,000 images) and is deterministic. Each class is a stripe texture
(2 orientations x 5 frequencies) under random phase, contrast, tint and noise: a
convolutional network learns it well above chance within an epoch or two, but not
trivially. Every record built from it says ``synthetic``.

The fast path (notebook 08) reads a split as arrays (:func:`load_split`) and trains from the
spec loader (:func:`spec_loader`) or from :class:`DeviceLoader` (the same augmentation,
batched on the device).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from lab_utils.engine import config
from lab_utils.engine.config import (
    CIFAR10_TEST_SIZE,
    CIFAR10_TRAIN_SIZE,
    check_batch_size,
    cifar10_present,
    resolve_dataset,
)
from lab_utils.learn.errors import LabError, check_positive_int

CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2023, 0.1994, 0.2010)


def train_transform():
    """The spec's training transforms, in the spec's order."""
    from torchvision import transforms as T

    return T.Compose([
        T.RandomCrop(32, padding=4),
        T.RandomHorizontalFlip(p=0.5),
        T.ToTensor(),
        T.Normalize(CIFAR10_MEAN, CIFAR10_STD),
    ])


def test_transform():
    """The spec's test transforms: ToTensor, then the same Normalize."""
    from torchvision import transforms as T

    return T.Compose([T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)])


# --------------------------------------------------------------------------- synthetic


def synthetic_arrays(n: int, train: bool, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` deterministic CIFAR-shaped images (N, 32, 32, 3 uint8) and labels (N,); image ``i`` of
    a split is the same whatever ``n`` is, so subsets are prefixes."""
    # Class c: stripes, horizontal or vertical (both unchanged by a horizontal flip), at one of 5
    # frequencies; random phase, contrast, tint and noise make the class a texture, as a
    # convolution reads it, not fixed pixel values.
    freqs = np.array([1.5, 2.5, 3.5, 4.5, 5.5]) * 2 * np.pi / 32  # radians per pixel
    grid = np.arange(32, dtype=np.float32)
    chunk = 1000  # image i depends only on (split, i): subsets are prefixes
    split_seed = seed * 1000 + (1 if train else 2)
    images = np.empty((n, 32, 32, 3), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    for start in range(0, n, chunk):
        k = min(chunk, n - start)
        r = np.random.default_rng([split_seed, start // chunk])
        lab = r.integers(0, 10, size=chunk)[:k]
        phase = r.uniform(0, 2 * np.pi, size=chunk)[:k, None]
        contrast = r.uniform(25, 70, size=chunk)[:k, None, None, None]
        tint = r.uniform(60, 200, size=(chunk, 3))[:k, None, None, :]
        noise = r.normal(0, 40, size=(chunk, 32, 32, 3))[:k]
        wave = np.sin(freqs[lab % 5][:, None] * grid[None, :] + phase)  # (k, 32)
        vertical = (lab // 5 == 1)[:, None, None]
        stripes = np.where(vertical, wave[:, None, :], wave[:, :, None])  # (k, 32, 32)
        img = tint + contrast * stripes[..., None] + noise
        images[start:start + k] = np.clip(img, 0, 255).astype(np.uint8)
        labels[start:start + k] = lab
    return images, labels


class ArrayDataset(Dataset):
    """Images held as a uint8 (N, 32, 32, 3) array, served as ``torchvision``'s CIFAR10 does (one PIL
    image per item, then the transform): the spec pipeline's per-image work."""

    def __init__(self, images: np.ndarray, labels, transform=None):
        self.data = images
        self.targets = [int(t) for t in labels]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        from PIL import Image

        img = Image.fromarray(self.data[i])
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[i]


class SyntheticCIFAR10(ArrayDataset):
    """A deterministic, learnable stand-in with CIFAR-10's interface (PIL images, int labels)."""

    classes = [f"class_{i}" for i in range(10)]

    def __init__(self, train: bool = True, transform=None, size: int | None = None, seed: int = 0):
        full = CIFAR10_TRAIN_SIZE if train else CIFAR10_TEST_SIZE
        n = full if size is None else min(size, full)
        images, labels = synthetic_arrays(n, train, seed)
        super().__init__(images, labels, transform)
        self.train = train


# --------------------------------------------------------------------------- real data


def cifar10_dataset(train: bool, dataset: str | None = None, transform=None,
                    root: Path | None = None, size: int | None = None) -> tuple[Dataset, bool]:
    """A CIFAR-10 split (real or synthetic) and whether it is synthetic; ``size`` limits only how
    many synthetic images are generated (a prefix), the real split is read whole."""
    kind = resolve_dataset(dataset, root)
    if kind == "synthetic":
        return SyntheticCIFAR10(train=train, transform=transform, size=size), True
    from torchvision.datasets import CIFAR10

    return CIFAR10(str(root or config.data_dir()), train=train, transform=transform, download=False), False


_warned_synthetic = False


@dataclass
class CifarLoaders:
    """Train/test loaders and what they hold."""

    train: DataLoader
    test: DataLoader
    synthetic: bool
    train_images: int
    test_images: int

    @property
    def dataset_name(self) -> str:
        return "synthetic CIFAR-10 stand-in" if self.synthetic else "CIFAR-10"


def _subset(ds: Dataset, n: int | None) -> Dataset:
    if n is None or n >= len(ds):  # type: ignore[arg-type]
        return ds
    return Subset(ds, range(n))


def make_loaders(batch_size: int = 128, test_batch_size: int = 100, num_workers: int = 2,
                 train_images: int | None = None, test_images: int | None = None,
                 dataset: str | None = None, sampler=None, seed: int = 0,
                 pin_memory: bool | None = None, drop_last: bool = False) -> CifarLoaders:
    """CIFAR-10 loaders with the spec's transforms.

    ``train_images`` / ``test_images`` take the first N images (None: the whole split).
    ``sampler`` replaces shuffling (for ``DistributedSampler``). The shuffle order is
    seeded, so two runs see the same batches.
    """
    check_batch_size(batch_size, "train batch size")
    check_batch_size(test_batch_size, "test batch size")
    check_num_workers(num_workers)
    global _warned_synthetic
    train_ds, synthetic = cifar10_dataset(True, dataset, train_transform(), size=train_images)
    test_ds, _ = cifar10_dataset(False, dataset, test_transform(), size=test_images)
    if synthetic and not _warned_synthetic and config.dataset_choice(dataset) == "auto":
        warnings.warn("CIFAR-10 is not in data/: using the synthetic stand-in "
                      "(run `make prepare` on a machine with internet for the real data).",
                      stacklevel=2)
        _warned_synthetic = True
    train_ds, test_ds = _subset(train_ds, train_images), _subset(test_ds, test_images)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    g = torch.Generator()
    g.manual_seed(seed)
    common = config.loader_worker_options(num_workers, pin_memory)
    train = DataLoader(train_ds, batch_size=batch_size, shuffle=sampler is None, sampler=sampler,
                       generator=g if sampler is None else None, drop_last=drop_last, **common)
    test = DataLoader(test_ds, batch_size=test_batch_size, shuffle=False, **common)
    return CifarLoaders(train=train, test=test, synthetic=synthetic,
                        train_images=len(train_ds), test_images=len(test_ds))  # type: ignore[arg-type]


def dataset_status(root: Path | None = None) -> dict:
    """For notebook 00: is real CIFAR-10 here, and what to run if not."""
    present = cifar10_present(root)
    return {
        "cifar10_present": present,
        "data_dir": str(root or config.data_dir()),
        "used": "CIFAR-10" if present else "synthetic stand-in",
        "to_prepare": None if present else "make prepare   (on a machine with internet)",
    }


# --------------------------------------------------------------------------- prepare


def prepare_cifar10(root: Path | None = None) -> Path:
    """Download CIFAR-10 (both splits) into ``root`` (default ``data/``); verifies its MD5."""
    from torchvision.datasets import CIFAR10

    root = Path(root) if root else config.data_dir()
    root.mkdir(parents=True, exist_ok=True)
    try:
        CIFAR10(str(root), train=True, download=True)
        CIFAR10(str(root), train=False, download=True)
    except Exception as e:  # URLError, socket errors, ...: one sentence with the fix
        raise LabError(f"Could not download CIFAR-10 into {root} ({e.__class__.__name__}: {e}); "
                       "run this on a machine with internet (e.g. a cluster login node), "
                       "or copy cifar-10-batches-py/ into data/ by hand.") from None
    return root / "cifar-10-batches-py"


# ---------------------------------------------------- arrays and the device-resident loader


@dataclass
class ArraySplit:
    """One CIFAR-10 split as arrays: images (N, 32, 32, 3) uint8 HWC, labels (N,) int64."""

    images: np.ndarray
    labels: np.ndarray
    synthetic: bool

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def dataset_name(self) -> str:
        return "synthetic CIFAR-10 stand-in" if self.synthetic else "CIFAR-10"


def load_split(train: bool, images: int | None = None, dataset: str | None = None,
               root: Path | None = None) -> ArraySplit:
    """The first ``images`` images of a split (None: all), from :func:`cifar10_dataset`'s sources
    (the synthetic arrays are ``SyntheticCIFAR10.data``)."""
    if images is not None:
        check_positive_int(images, "number of images")
    size = CIFAR10_TRAIN_SIZE if train else CIFAR10_TEST_SIZE
    n = size if images is None else min(images, size)
    ds, synthetic = cifar10_dataset(train, dataset, root=root, size=n)
    global _warned_synthetic
    if synthetic and not _warned_synthetic and config.dataset_choice(dataset) == "auto":
        warnings.warn("CIFAR-10 is not in data/: using the synthetic stand-in "
                      "(run `make prepare` on a machine with internet for the real data).", stacklevel=2)
        _warned_synthetic = True
    return ArraySplit(images=np.ascontiguousarray(ds.data[:n]),
                      labels=np.asarray(ds.targets[:n], dtype=np.int64), synthetic=synthetic)


def check_num_workers(num_workers: object) -> int:
    """``num_workers`` for a DataLoader: a whole number >= 0, or a LabError naming it."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise LabError(f"num_workers must be a whole number >= 0, got {num_workers!r}.")
    return num_workers


def spec_loader(split: ArraySplit, batch_size: int = 128, num_workers: int = 2, seed: int = 0,
                pin_memory: bool | None = None) -> torch.utils.data.DataLoader:
    """The assignment's training loader: PIL transforms in ``num_workers`` processes, shuffled."""
    check_batch_size(batch_size)
    check_num_workers(num_workers)
    g = torch.Generator()
    g.manual_seed(seed)
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    return DataLoader(
        ArrayDataset(split.images, split.labels, train_transform()), batch_size=batch_size,
        shuffle=True, generator=g, **config.loader_worker_options(num_workers, pin_memory))


class DeviceLoader:
    """CIFAR-10 resident on ``device``: shuffling, crop, flip and normalization batched there.

    The uint8 images are moved to the device once, zero-padded by 4 pixels (RandomCrop's
    ``padding=4``) and kept as one int32 per pixel (the 3 channel bytes packed; 50,000 padded
    CIFAR images: 320 MB). Each epoch draws a device permutation and, for every image, a crop
    offset (rows and columns uniform over 0..8) and a flip (probability 1/2). Each batch is then
    one ``index_select`` of pixels (crop and flip together), a conversion to float32 and a
    per-channel multiply-add: ``(x/255 - mean) / std`` (``ToTensor`` + ``Normalize`` up to float
    rounding).

    Iterating yields ``(x, y)`` on the device: x float32 (B, C, H, W), channels_last layout when
    ``channels_last``; y int64 (B,). ``augment=False``: the test pipeline (no padding).
    """

    def __init__(self, images: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor | Sequence[int],
                 batch_size: int = 128, device: torch.device | str = "cpu", augment: bool = True,
                 shuffle: bool = True, drop_last: bool = False, seed: int = 0, channels_last: bool = False):
        check_batch_size(batch_size)
        x = torch.as_tensor(images)
        if x.dtype != torch.uint8 or x.dim() != 4:
            raise LabError(f"DeviceLoader needs uint8 images shaped (N, H, W, C) like CIFAR10.data, "
                           f"got {x.dtype} {tuple(x.shape)}.")
        y = (labels.long() if isinstance(labels, torch.Tensor)
             else torch.as_tensor(np.asarray(labels), dtype=torch.long))
        if y.shape != (x.shape[0],):
            raise LabError(f"Need one label per image: {x.shape[0]} images but labels of shape "
                           f"{tuple(y.shape)}.")
        if x.shape[0] == 0:
            raise LabError("DeviceLoader got no images; give at least one.")
        n, h, w, c = x.shape
        if c != 3:
            raise LabError(f"DeviceLoader needs RGB images (3 channels, CIFAR's mean and std), got {c}.")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.augment = augment
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.channels_last = channels_last
        self.num_images, self.height, self.width, self.channels = int(n), int(h), int(w), int(c)
        p = 4 if augment else 0
        hp, wp = h + 2 * p, w + 2 * p
        self._plane = hp * wp  # pixels per padded image
        # Moved once; padded on the device (zeros, as RandomCrop's default fill). Each pixel's
        # channels are packed into one int32 (4 bytes, unused ones zero), so that cropping is one
        # 1-D index_select of whole pixels: far faster than gathering rows of 3 bytes.
        x = x.to(self.device)
        packed = torch.zeros((n, hp, wp, 4), dtype=torch.uint8, device=self.device)
        packed[:, p:p + h, p:p + w, :c] = x
        self._pixels = packed.view(torch.int32).reshape(n * self._plane)
        del packed, x
        self.labels = y.to(self.device)
        # Pixel index tables: for offset (dy, dx) and flip f, output pixel (i, j) reads padded
        # pixel (dy + i, dx + j) unflipped, (dy + i, dx + W-1 - j) flipped (crop, then flip).
        k = 2 * p + 1
        rows = torch.arange(k)[:, None] + torch.arange(h)[None, :]                 # (k, H)
        cols = torch.arange(k)[:, None] + torch.arange(w)[None, :]                 # (k, W)
        cols = torch.stack([cols, cols.flip(1)], dim=1)                           # (k, 2, W)
        table = rows[:, None, None, :, None] * wp + cols[None, :, :, None, :]     # (k, k, 2, H, W)
        self._table = table.reshape(k * k * 2, h * w).to(self.device)
        self._offsets = k
        mean, std = torch.tensor(CIFAR10_MEAN), torch.tensor(CIFAR10_STD)
        self._scale = (1.0 / (255.0 * std)).view(1, c, 1, 1).to(self.device)
        self._shift = (-mean / std).view(1, c, 1, 1).to(self.device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def __len__(self) -> int:
        return (self.num_images // self.batch_size if self.drop_last
                else math.ceil(self.num_images / self.batch_size))

    def draw_epoch(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One epoch's random choices: (order, dy, dx, flip), each of length N, on the device."""
        n, g, dev = self.num_images, self.generator, self.device
        order = (torch.randperm(n, generator=g, device=dev) if self.shuffle
                 else torch.arange(n, device=dev))
        if not self.augment:
            zeros = torch.zeros(n, dtype=torch.long, device=dev)
            return order, zeros, zeros, zeros
        dy = torch.randint(0, self._offsets, (n,), generator=g, device=dev)
        dx = torch.randint(0, self._offsets, (n,), generator=g, device=dev)
        flip = torch.randint(0, 2, (n,), generator=g, device=dev)
        return order, dy, dx, flip

    def batch(self, idx: torch.Tensor, dy: torch.Tensor, dx: torch.Tensor,
              flip: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) of images ``idx`` cropped at (``dy``, ``dx``) of the padded image, flipped where ``flip``,
        normalized; all int64 tensors of shape (B,) on the device."""
        table_row = (dy * self._offsets + dx) * 2 + flip
        pix = self._table.index_select(0, table_row) + (idx * self._plane)[:, None]   # (B, H*W)
        b = idx.shape[0]
        packed = self._pixels.index_select(0, pix.reshape(-1))                     # (B*H*W,) int32
        u8 = packed.view(torch.uint8).view(b, self.height, self.width, 4)
        u8 = u8.permute(0, 3, 1, 2)[:, :self.channels]  # NCHW view of the bytes, channels_last strides
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        x = u8.to(torch.float32, memory_format=fmt)
        x.mul_(self._scale).add_(self._shift)
        return x, self.labels.index_select(0, idx)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order, dy, dx, flip = self.draw_epoch()
        n, bs = self.num_images, self.batch_size
        stop = (n // bs) * bs if self.drop_last else n
        for start in range(0, stop, bs):
            sl = slice(start, min(start + bs, n))
            yield self.batch(order[sl], dy[sl], dx[sl], flip[sl])


def device_loader(split: ArraySplit, device: torch.device | str, batch_size: int = 128,
                  augment: bool = True, shuffle: bool = True, seed: int = 0,
                  channels_last: bool = False) -> DeviceLoader:
    """A :class:`DeviceLoader` over an :class:`ArraySplit`."""
    return DeviceLoader(split.images, split.labels, batch_size=batch_size, device=device, augment=augment,
                        shuffle=shuffle, seed=seed, channels_last=channels_last)
