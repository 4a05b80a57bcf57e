"""The first call of every notebook: which profile, where results go, which device.

``lab = start(PROFILE)`` resolves the profile (explicit value, ``$LAB_PROFILE``, or
automatic), prints one line saying which and why, and returns a :class:`LabSession`
holding the profile, the result store and the device the notebook should use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lab_utils.core import config
from lab_utils.core.environment import check_gpu_node
from lab_utils.store import ResultStore


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


def start(profile: str | None = None, seed: int = 0, verbose: bool = True) -> LabSession:
    """Resolve the profile, seed torch, and return the notebook's :class:`LabSession`.

    On a GPU node whose GPUs this torch cannot use, raises :class:`LabError` saying why and
    how to fix it, instead of running on the CPU (an explicit quick profile only warns).
    """
    name, why = config.resolve_profile_name(profile)
    check_gpu_node(name, why)
    torch.manual_seed(seed)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = torch.device("cuda" if gpus else "cpu")
    session = LabSession(profile=config.PROFILES[name], why=why, store=ResultStore(name),
                         device=device, gpu_count=gpus)
    if verbose:
        print(f"profile: {name} ({why}); device: {device}"
              f"{f' x{gpus}' if gpus else ''}; results: {session.store.root}")
    return session
