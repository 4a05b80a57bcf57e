"""A small decoder-only GPT for character-level text (part 2 of the lab).

Architecture (written for this lab; the layout follows the common GPT-2 recipe):

- token embedding ``wte`` (vocab_size x n_embd) + learned position embedding ``wpe``
  (block_size x n_embd), dropout;
- ``n_layer`` pre-norm blocks: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``, where
  ``attn`` is causal multi-head self-attention through
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` and ``mlp`` is
  Linear(C, 4C) -> GELU -> Linear(4C, C);
- a final LayerNorm and an output head whose weight *is* the token embedding (tied), so
  it adds no parameters.

``forward(idx)`` returns logits of shape (batch, time, vocab); the loss is computed by
the caller (:func:`lm_loss`) so that timers can separate forward, loss and backward.

Sizes are named (:data:`GPT_SIZES`): ``tiny`` for the quick profile and tests, ``small``
(about 10.7 M parameters with a 65-character vocabulary) as the default that trains
usefully in minutes on one GPU. :func:`parameter_count` gives the exact count from the
config (tested against the model).

Checkpoint format (written by notebook 06, read by notebook 07)
---------------------------------------------------------------
``results/<profile>/checkpoints/gpt.pt`` (:func:`checkpoint_path`), a ``torch.save``
of a plain dict that ``torch.load(path, weights_only=True)`` accepts::

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

import math
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.flops import count_flops
from lab_utils.learn.models.resnet import count_parameters as count_parameters  # one count for both models

CHECKPOINT_FORMAT = "lab-gpt-v1"


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


#: Named sizes (everything but the vocabulary, which comes from the corpus).
GPT_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64},
    "small": {"block_size": 256, "n_layer": 6, "n_head": 6, "n_embd": 384},
}


def gpt_config(size: str = "small", vocab_size: int = 65, **overrides: Any) -> GPTConfig:
    """The :class:`GPTConfig` of a named size, with ``vocab_size`` and any overrides."""
    if size not in GPT_SIZES:
        raise LabError(f"Unknown GPT size {size!r}; use one of: {', '.join(GPT_SIZES)}.")
    return GPTConfig(vocab_size=vocab_size, **{**GPT_SIZES[size], **overrides})


# --------------------------------------------------------------------------- formulas


def parameter_count(cfg: GPTConfig) -> int:
    """Trainable parameters of :class:`GPT` for ``cfg`` (tied head counted once).

    embeddings V*C + T*C; per block: two LayerNorms (2C each with bias, C without),
    qkv C*3C (+3C), attention projection C*C (+C), MLP C*4C (+4C) and 4C*C (+C),
    i.e. 12C^2 + 13C with biases, 12C^2 + 2C without; final LayerNorm 2C (or C).
    """
    c, ln = cfg.n_embd, (2 if cfg.bias else 1) * cfg.n_embd
    linear_bias = (3 * c + c + 4 * c + c) if cfg.bias else 0
    block = 12 * c * c + linear_bias + 2 * ln
    return cfg.vocab_size * c + cfg.block_size * c + cfg.n_layer * block + ln


def matmul_parameter_count(cfg: GPTConfig) -> int:
    """Weights that take part in a matrix multiply per token: L*12C^2 + V*C (the head).

    Embedding look-ups, biases and LayerNorms are excluded (no matmul).
    """
    return cfg.n_layer * 12 * cfg.n_embd ** 2 + cfg.vocab_size * cfg.n_embd


def train_flops_per_token(cfg: GPTConfig) -> int:
    """Matmul FLOPs of one training step per token: 6 N_matmul + 12 L C T.

    6 = 2 FLOPs per multiply-accumulate x (1 forward + 2 backward); the second term is
    attention (QK^T and AV, counted over the full T x T square as the kernels compute
    it; T = block_size). This is nanoGPT's 6N + 12LHQT estimate with N the matmul weights. FLOPs.
    """
    return 6 * matmul_parameter_count(cfg) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


# --------------------------------------------------------------------------- model


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
        """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T0); returns (B, T0 + new).

        Each step feeds the last ``block_size`` tokens, takes the final position's
        logits / ``temperature``, optionally keeps the ``top_k`` largest, and samples.
        ``temperature`` 0 means greedy (argmax). Runs in eval mode and restores the mode.
        """
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


def measure_train_flops_per_token(model: nn.Module) -> float:
    """Training FLOPs per token counted by ``torch.utils.flop_counter.FlopCounterMode``.

    Runs forward + backward once on one sequence of ``block_size`` random tokens with the *math*
    attention backend, because the counter has no formula for the fused CPU attention kernel (it
    would count attention as zero); the math backend's matmuls are counted like the fused GPU ones.
    Gradients are cleared afterwards. FLOPs per token (forward + backward).
    """
    gpt = unwrap(model)
    cfg = gpt.config
    example = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), device=next(gpt.parameters()).device)
    with sdpa_kernel(SDPBackend.MATH):
        fc = count_flops(gpt, example)
    return fc.train_flops / cfg.block_size


# --------------------------------------------------------------------------- checkpoints


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
