"""The first call of every notebook: which profile, where results go, which device.

``lab = start(PROFILE)`` resolves the profile (explicit value, ``$LAB_PROFILE``, or automatic), prints
one line saying which and why, and returns a :class:`LabSession`: the profile, the result store and the
device. ``lab.settings(Settings, ...)`` is the one way to get a profile's settings with the parameters
cell's overrides, and :func:`session_for` the one way code that is not a notebook gets a session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from lab_utils.engine import config, profiles
from lab_utils.engine.environment import check_gpu_node
from lab_utils.engine.store import ResultStore

T = TypeVar("T")


@dataclass
class LabSession:
    profile: config.Profile
    why: str
    store: ResultStore
    device: torch.device
    gpu_count: int

    @property
    def quick(self) -> bool:
        return self.profile.name == "quick"

    def settings(self, cls: type[T], /, **overrides: Any) -> T:
        """This profile's ``cls`` settings (an experiment's ``Settings``) with the overrides that are
        not None applied, checked (:func:`lab_utils.engine.profiles.settings`)."""
        return profiles.settings(cls, self.profile.name, **overrides)


def start(profile: str | None = None, seed: int = 0, verbose: bool = True) -> LabSession:
    """Resolve the profile, seed torch, and return the notebook's :class:`LabSession`.

    On a GPU node whose GPUs this torch cannot use, raises :class:`~lab_utils.learn.errors.LabError`
    saying why and how to fix it, instead of running on the CPU (an explicit quick profile only warns).
    """
    name, why = config.resolve_profile_name(profile)
    check_gpu_node(name, why)
    torch.manual_seed(seed)
    session = session_for(name, why=why)
    if verbose:
        gpus = session.gpu_count
        print(f"profile: {name} ({why}); device: {session.device}"
              f"{f' x{gpus}' if gpus else ''}; results: {session.store.root}")
    return session


def session_for(lab: Any = None, *, why: str | None = None) -> Any:
    """THE session helper: ``lab`` itself when it is a session (anything with a profile and a store,
    e.g. a test's stand-in), else a quiet :class:`LabSession` for a profile name, a
    :class:`~lab_utils.engine.config.Profile` or None (``$LAB_PROFILE``, else automatic), with the
    profile's default store and this machine's device."""
    if hasattr(lab, "profile") and hasattr(lab, "store"):
        return lab
    if isinstance(lab, config.Profile):
        lab = lab.name
    name, chosen = config.resolve_profile_name(lab)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return LabSession(profile=config.PROFILES[name], why=why or chosen, store=ResultStore(name),
                      device=torch.device("cuda" if gpus else "cpu"), gpu_count=gpus)
