"""The GPT's named sizes and its formulas: parameters and training FLOPs per token."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab_utils.learn.errors import LabError
from lab_utils.learn.flops import count_flops
from lab_utils.learn.models.gpt import GPTConfig, unwrap

#: Named sizes (everything but the vocabulary, which comes from the corpus): ``tiny`` for the quick profile
#: and tests; ``small``, the default (about 10.7 M parameters with a 65-character vocabulary), trains
#: usefully in minutes on one GPU.
GPT_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64},
    "small": {"block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384},
}


def gpt_config(size: str = "small", vocab_size: int = 65, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a named size, with ``vocab_size`` and any overrides."""
    if size not in GPT_SIZES:
        raise LabError(f"Unknown GPT size {size!r}; use one of: {', '.join(GPT_SIZES)}.")
    return GPTConfig(vocab_size=vocab_size, **{**GPT_SIZES[size], **overrides})


def parameter_count(cfg: GPTConfig) -> int:
    """Trainable parameters of :class:`~lab_utils.learn.models.gpt.GPT` for ``cfg``, exact (tied head
    counted once): embeddings V*C + T*C; per block two LayerNorms (2C each with bias, C without),
    qkv C*3C (+3C), attention projection C*C (+C), MLP C*4C (+4C) and 4C*C (+C), i.e. 12C^2 + 13C
    with biases, 12C^2 + 2C without; final LayerNorm 2C (or C)."""
    c, ln = cfg.n_embd, (2 if cfg.bias else 1) * cfg.n_embd
    linear_bias = (3 * c + c + 4 * c + c) if cfg.bias else 0
    block = 12 * c * c + linear_bias + 2 * ln
    return cfg.vocab_size * c + cfg.block_size * c + cfg.n_layer * block + ln


def matmul_parameter_count(cfg: GPTConfig) -> int:
    """Weights that take part in a matrix multiply per token: L*12C^2 + V*C (the head); embedding
    look-ups, biases and LayerNorms are excluded (no matmul)."""
    return cfg.n_layer * 12 * cfg.n_embd ** 2 + cfg.vocab_size * cfg.n_embd


def train_flops_per_token(cfg: GPTConfig) -> int:
    """Matmul FLOPs of one training step per token: 6 N_matmul + 12 L C T, nanoGPT's 6N + 12LHQT estimate with
    N the matmul weights. 6 = 2 FLOPs per multiply-accumulate x (1 forward + 2 backward); the second term is
    attention (QK^T and AV over the full T x T square, as the kernels compute it; T = block_size)."""
    return 6 * matmul_parameter_count(cfg) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def measure_train_flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token (forward + backward) counted by ``FlopCounterMode`` on one sequence of
    ``block_size`` random tokens, with the *math* attention backend: the counter has no formula for the
    fused CPU attention kernel (it would count attention as zero), and the math backend's matmuls are
    counted like the fused GPU ones. Gradients are cleared afterwards."""
    gpt = unwrap(model)
    cfg = gpt.config
    example = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), device=next(gpt.parameters()).device)
    with sdpa_kernel(SDPBackend.MATH):
        fc = count_flops(gpt, example)
    return fc.train_flops / cfg.block_size
