"""Saving and loading the trained GPT of :mod:`lab_utils.learn.models.gpt`.

Checkpoint format (written by notebook 06, read by notebook 07)
---------------------------------------------------------------
``results/<profile>/checkpoints/gpt.pt``
(:func:`lab_utils.experiments.n06_gpt_ddp.experiment.checkpoint_path`), a ``torch.save`` of a
plain dict that ``torch.load(path, weights_only=True)`` accepts::

    {
        "format": "lab-gpt-v1",
        "config": asdict(GPTConfig),          # ints, floats, bools
        "model": state_dict,                  # fp32 tensors on CPU, tied weights stored once each key
        "vocab": "\\n !&',-.3:;?AB...",       # str: character of each token id, in id order
        "corpus": "tiny-shakespeare",         # which text it was trained on
        "metrics": {"val_loss": 1.52, ...},   # floats/ints/strs measured at save time
    }

:func:`save_checkpoint` writes it atomically; :func:`load_checkpoint` returns the model
(eval mode) and the dict.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab_utils.learn.errors import LabError
from lab_utils.learn.models.gpt import GPT, GPTConfig, unwrap

CHECKPOINT_FORMAT = "lab-gpt-v1"


def save_checkpoint(path: str | Path, model: nn.Module, vocab: str, corpus: str,
                    metrics: dict[str, Any] | None = None) -> Path:
    """Write the checkpoint dict described in the module docstring (atomically).

    ``model`` may be wrapped (DDP, compile); tensors are saved on the CPU in their dtype.
    """
    gpt = unwrap(model)
    if not isinstance(gpt, GPT):
        raise LabError(f"save_checkpoint needs a GPT (possibly wrapped), got {type(gpt).__name__}.")
    if len(vocab) != gpt.config.vocab_size:
        raise LabError(f"vocab has {len(vocab)} characters but the model's vocab_size is "
                       f"{gpt.config.vocab_size}; pass the vocabulary the model was trained with.")
    payload = {
        "format": CHECKPOINT_FORMAT,
        "config": asdict(gpt.config),
        "model": {k: v.detach().cpu() for k, v in gpt.state_dict().items()},
        "vocab": vocab,
        "corpus": corpus,
        "metrics": dict(metrics or {}),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return path


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict[str, Any]]:
    """Load a checkpoint saved by :func:`save_checkpoint`: ``(model in eval mode, dict)``."""
    path = Path(path)
    if not path.exists():
        raise LabError(f"No GPT checkpoint at {path}; run notebook 06 (labs/06_gpt_ddp.ipynb) "
                       "with the same profile first, it saves the trained model there.")
    payload = torch.load(path, map_location=device, weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise LabError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint; re-run notebook 06 to rewrite it.")
    model = GPT(GPTConfig.from_dict(payload["config"])).to(device)
    model.load_state_dict(payload["model"])
    model.eval()
    return model, payload
