"""Profiles, paths and input checks.

The profile (``quick`` for CPU machines and CI, ``full`` the assignment as written on a GPU
node; every settings class carries its values as ``QUICK`` and ``FULL``, read through
:mod:`lab_utils.engine.profiles`) is chosen automatically (``full`` when CUDA is available, else
``quick``); ``LAB_PROFILE`` or an explicit argument overrides the choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lab_utils.engine import profiles
from lab_utils.learn.errors import LabError, check_choice, check_positive_int

PROFILE_ENV = "LAB_PROFILE"
RESULTS_ENV = "LAB_RESULTS_DIR"
DATA_ENV = "LAB_DATA_DIR"
DATASET_ENV = "LAB_DATASET"

# The data sets' sizes and the choices of data (torch-free here, so that settings can check and resolve
# them without importing torch).
CIFAR10_TRAIN_SIZE = 50_000
CIFAR10_TEST_SIZE = 10_000
DATASET_CHOICES = ("auto", "cifar10", "synthetic")
CORPUS_CHOICES = ("auto", "shakespeare", "stdlib")

# The longest the lab waits for one batch from DataLoader worker processes. A worker that
# hangs (a stuck file system, a deadlocked transform) then raises "DataLoader timed out
# after 300 seconds" instead of blocking the run forever.
LOADER_TIMEOUT_S = 300.0


def loader_worker_options(num_workers: int, pin_memory: bool) -> dict:
    """The ``DataLoader`` keyword arguments every loader of the lab shares: workers persist across
    epochs (no re-spawn in a timed epoch), each batch wait bounded by :data:`LOADER_TIMEOUT_S`."""
    return {"num_workers": num_workers, "pin_memory": pin_memory,
            "persistent_workers": num_workers > 0,
            "timeout": LOADER_TIMEOUT_S if num_workers > 0 else 0}


@dataclass(frozen=True)
class Profile:
    """Knobs shared by every experiment of one profile (``None`` images: the whole CIFAR-10 split)."""

    name: str
    description: str
    train_images: int | None
    test_images: int | None
    num_workers: int
    train_batch_size: int = 128
    test_batch_size: int = 100

    QUICK: ClassVar[dict[str, Any]] = dict(
        name="quick",
        description="CPU/CI profile: small data subsets and few steps, minutes on 2 cores",
        train_images=1024,
        test_images=500,
        num_workers=0,
    )
    FULL: ClassVar[dict[str, Any]] = dict(
        name="full",
        description="the assignment as written: all of CIFAR-10, spec batch sizes and epochs",
        train_images=None,
        test_images=None,
        num_workers=2,
    )


# Per-profile values: Profile.QUICK and Profile.FULL, registered (lab_utils.engine.profiles).
PROFILES: dict[str, Profile] = profiles.table(profiles.register(Profile, "profile"))


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device (imports torch lazily)."""
    import torch

    return torch.cuda.is_available()


def resolve_profile_name(name: str | None = None) -> tuple[str, str]:
    """``(profile name, why it was chosen)``: explicit ``name`` > ``$LAB_PROFILE`` > automatic
    (``full`` with CUDA, else ``quick``); ``"auto"`` anywhere means the automatic choice."""
    if name is not None and name != "auto":
        return _checked(name, "given explicitly"), "given explicitly"
    env = os.environ.get(PROFILE_ENV, "").strip()
    if env and env != "auto":
        return _checked(env, f"${PROFILE_ENV}"), f"set by ${PROFILE_ENV}={env}"
    if cuda_available():
        return "full", "automatic: CUDA is available"
    return "quick", "automatic: no CUDA device, so the CPU profile"


def _checked(name: str, source: str) -> str:
    if name not in PROFILES:
        raise LabError(f"Unknown profile {name!r} ({source}); use one of: {', '.join(sorted(PROFILES))} "
                       "(or 'auto').")
    return name


def get_profile(name: str | None = None) -> Profile:
    """The :class:`Profile` for ``name`` (or the automatic / ``$LAB_PROFILE`` choice)."""
    return PROFILES[resolve_profile_name(name)[0]]


# --------------------------------------------------------------------------- paths


def repo_root() -> Path:
    """The checkout this package lives in (the folder holding ``labs/``)."""
    return Path(__file__).resolve().parents[2]


NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"  # a lab notebook: labs/NN_name.ipynb, run and graded in NN order


def labs_dir() -> Path:
    return repo_root() / "labs"


def data_dir() -> Path:
    """Where datasets live: ``$LAB_DATA_DIR`` or ``<repo>/data``."""
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser().resolve() if env else repo_root() / "data"


def results_root() -> Path:
    """Where results live: ``$LAB_RESULTS_DIR`` or ``<repo>/results``."""
    env = os.environ.get(RESULTS_ENV)
    return Path(env).expanduser().resolve() if env else repo_root() / "results"


def results_dir(profile: str | Profile | None = None) -> Path:
    """``results/<profile>``: runs/, tables/, figures/, executed/ live below it."""
    name = profile.name if isinstance(profile, Profile) else resolve_profile_name(profile)[0]
    return results_root() / name


# --------------------------------------------------------------------------- checks


def check_batch_size(value: object, what: str = "batch size") -> int:
    """A batch size must be a positive whole number."""
    return check_positive_int(value, what)


def check_batch_sizes(values: object, what: str = "batch sizes") -> tuple[int, ...]:
    """A non-empty sequence of positive batch sizes."""
    if isinstance(values, int) or not hasattr(values, "__iter__"):
        raise LabError(f"{what} must be a list of whole numbers, got {values!r}.")
    out = tuple(check_batch_size(v, f"each of the {what}") for v in values)  # type: ignore[union-attr]
    if not out:
        raise LabError(f"{what} must not be empty; give at least one, e.g. [32, 128].")
    return out


# --------------------------------------------------------------------------- data choices


def cifar10_present(root: Path | None = None) -> bool:
    """True when ``python -m lab_utils prepare`` has put CIFAR-10 under ``root``."""
    root = Path(root) if root else data_dir()
    folder = root / "cifar-10-batches-py"
    return (folder / "data_batch_1").exists() and (folder / "test_batch").exists()


def dataset_choice(dataset: str | None = None) -> str:
    """What was asked for: ``dataset``, else ``$LAB_DATASET``, else ``"auto"`` (not yet resolved)."""
    return dataset or os.environ.get(DATASET_ENV) or "auto"


def resolved_images(count: int | None, whole: int) -> int:
    """An image count of the settings resolved: None or 0 or less means the whole split (``whole``),
    else at most the split."""
    return whole if not count or count <= 0 else min(count, whole)


def resolve_dataset(dataset: str | None = None, root: Path | None = None) -> str:
    """``"cifar10"`` or ``"synthetic"``: what ``dataset`` (or ``$LAB_DATASET``) means here."""
    choice = dataset_choice(dataset)
    check_choice(choice, DATASET_CHOICES, "dataset")
    present = cifar10_present(root)
    if choice == "cifar10" and not present:
        asked = "dataset='cifar10'" if dataset else f"{DATASET_ENV}=cifar10"
        raise LabError(
            f"CIFAR-10 is not in {root or data_dir()} ({asked}) and compute nodes cannot download it; "
            "run `make prepare` (or `python -m lab_utils prepare`) on a machine with internet first, "
            "or use the synthetic stand-in (dataset='synthetic', or LAB_DATASET=synthetic).")
    if choice == "auto":
        return "cifar10" if present else "synthetic"
    return choice
