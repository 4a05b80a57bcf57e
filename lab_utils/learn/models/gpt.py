"""A small decoder-only GPT for character-level text (part 2 of the lab), written for it in GPT-2's layout:

- token embedding ``wte`` + learned position embedding ``wpe`` (block_size positions), dropout;
- ``n_layer`` pre-norm blocks, ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``: causal multi-head attention
  through ``F.scaled_dot_product_attention(is_causal=True)``, an MLP Linear(C, 4C) -> GELU -> Linear(4C, C);
- a final LayerNorm and an output head whose weight *is* the token embedding (tied: no parameters).

The loss is computed by the caller (:func:`lm_loss`) so that timers can separate forward, loss and backward.
Sizes, parameter and FLOP counts: :mod:`lab_utils.learn.models.gpt_sizes`; the checkpoint format notebook 06
writes and notebook 07 reads: :mod:`lab_utils.experiments.shared.gpt_checkpoint`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.models.resnet import count_parameters as count_parameters  # one count for both models


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT. ``block_size`` is the context length in tokens."""

    vocab_size: int = 65
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check_positive_int(getattr(self, name), f"GPTConfig.{name}")
        if self.n_embd % self.n_head:
            raise LabError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head "
                           f"({self.n_head}); pick n_head among its divisors.")
        if not 0.0 <= self.dropout < 1.0:
            raise LabError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}.")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GPTConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer over token ids; ``forward(idx) -> logits``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one tensor, two uses
        self.apply(self._init_weights)
        # Residual projections scaled down with depth (GPT-2's habit) so the residual
        # stream's variance does not grow with the number of blocks.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids ``idx`` (B, T) with T <= block_size."""
        b, t = idx.shape
        if t > self.config.block_size:
            raise LabError(f"Sequence length {t} exceeds the model's block_size "
                           f"{self.config.block_size}; crop the input to the last block_size tokens.")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T0); returns (B, T0 + new). Each step
        feeds the last ``block_size`` tokens, takes the final position's logits / ``temperature``
        (0: greedy, argmax), optionally keeps the ``top_k`` largest, and samples. Runs in eval mode and
        restores the mode."""
        if temperature < 0:
            raise LabError(f"temperature must be >= 0, got {temperature!r}.")
        was_training = self.training
        self.eval()
        try:
            for _ in range(max_new_tokens):
                ctx = idx[:, -self.config.block_size:]
                logits = self(ctx)[:, -1, :].float()
                if temperature == 0:
                    nxt = logits.argmax(dim=-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k is not None:
                        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                        logits = logits.masked_fill(logits < kth, float("-inf"))
                    probs = torch.softmax(logits, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=generator)
                idx = torch.cat([idx, nxt.to(idx.device)], dim=1)
        finally:
            self.train(was_training)
        return idx


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats per token) over all positions, in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def unwrap(model: nn.Module) -> nn.Module:
    """The plain :class:`GPT` inside DDP / DataParallel / torch.compile wrappers."""
    while isinstance(inner := getattr(model, "module", getattr(model, "_orig_mod", None)), nn.Module):
        model = inner
    return model
