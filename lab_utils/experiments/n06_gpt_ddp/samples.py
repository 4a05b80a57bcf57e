"""Notebook 06's model summary and text samples: the GPT's shape and parameters (:func:`model_summary`), its
FLOPs per token (:func:`flops_table`), and the untrained model against the trained checkpoint of
:data:`lab_utils.experiments.n06_gpt_ddp.experiment.TRAIN_EXPERIMENT` continuing the same prompt
(:func:`samples_before_after`,
table ``gpt_samples``).
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from lab_utils.engine.session import session_for
from lab_utils.engine.store import Record, ResultStore
from lab_utils.experiments.n06_gpt_ddp.experiment import Settings, checkpoint_path
from lab_utils.experiments.n06_gpt_ddp.worker import evaluate
from lab_utils.experiments.shared.gpt_checkpoint import load_checkpoint
from lab_utils.experiments.shared.text_data import TextSplits, TokenWindows, load_splits
from lab_utils.learn.errors import LabError
from lab_utils.learn.models.gpt import GPT, count_parameters
from lab_utils.learn.models.gpt_sizes import (
    gpt_config,
    measure_train_flops_per_token,
    parameter_count,
    train_flops_per_token,
)

__all__ = ["flops_table", "model_summary", "print_samples", "sample_text", "samples_before_after",
           "save_samples", "validation_loss"]


def _splits(s: Settings) -> TextSplits:
    return load_splits(s.corpus, max_chars=s.max_chars)


def sample_text(model: GPT, splits: TextSplits, n_chars: int, prompt_chars: int = 40, seed: int = 0,
                temperature: float = 0.8) -> tuple[str, str]:
    """``(prompt, continuation)``: the model continues the start of the validation text."""
    prompt = splits.val[:prompt_chars].unsqueeze(0)
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    out = model.generate(prompt.to(dev), n_chars, temperature=temperature, top_k=None, generator=g)
    return splits.vocab.decode(prompt[0]), splits.vocab.decode(out[0, prompt_chars:].cpu())


def validation_loss(model: GPT, splits: TextSplits, batches: int | None, batch_size: int = 32) -> float:
    """Mean next-character loss (nats/char) over the first ``batches`` validation batches."""
    from torch.utils.data import DataLoader

    dev = next(model.parameters()).device
    ds = TokenWindows(splits.val, model.config.block_size, model.config.block_size)
    total, tokens = evaluate(model, DataLoader(ds, batch_size=batch_size), dev, batches)
    return total / max(tokens, 1)


def samples_before_after(lab: Any, settings: Settings):
    """A table: the untrained model and the trained checkpoint (``lab``'s profile) continuing the same
    prompt."""
    profile = session_for(lab).profile.name
    s = settings.validate()
    splits = _splits(s)
    torch.manual_seed(0)
    untrained = GPT(gpt_config(s.size, vocab_size=splits.vocab.size)).eval()
    trained, payload = load_checkpoint(checkpoint_path(profile))
    if payload["vocab"] != splits.vocab.chars:
        raise LabError("The checkpoint was trained on another corpus than this notebook now uses; "
                       "re-run the final training with FORCE = True.")
    rows = []
    for stage, model in (("before training", untrained), ("after training", trained)):
        prompt, text = sample_text(model, splits, s.sample_chars)
        rows.append({"model": stage, "val_loss_nats_per_char": validation_loss(model, splits, s.val_batches),
                     "prompt": prompt, "generated": text})
    df = pd.DataFrame(rows)
    df.attrs["vocab_size"] = splits.vocab.size
    df.attrs["corpus"] = splits.corpus_name
    return df


def print_samples(df) -> None:
    """The samples as plain text (newlines kept), prompt and continuation marked."""
    for _, row in df.iterrows():
        print(f"--- {row['model']} (validation loss {row['val_loss_nats_per_char']:.3f} nats/char) ---")
        print(f"[prompt] {row['prompt']}[model] {row['generated']}\n")


def save_samples(store: ResultStore, df, record: Record | None = None):
    """Save the samples table as ``gpt_samples``, each text one line for its Markdown cell (newlines
    shown as ⏎, pipes escaped)."""
    vocab_size = df.attrs["vocab_size"]
    table = df.copy()
    for c in ("prompt", "generated"):
        table[c] = table[c].map(lambda text: text.replace("|", "\\|").replace("\n", " ⏎ "))
    store.save_table(table, "gpt_samples", [record] if record else None, title="GPT text samples",
                     notes=["Same prompt (the start of the validation text), temperature 0.8, seed 0.",
                            "Loss: mean next-character cross-entropy on validation batches (nats/char); "
                            f"guessing uniformly among the {vocab_size} characters gives "
                            f"ln({vocab_size}) = {math.log(vocab_size):.2f}."])
    return table


def model_summary(settings: Settings):
    """A small table: the model's shape and parameters (formula and counted)."""
    s = settings.validate()
    splits = _splits(s)
    cfg = gpt_config(s.size, vocab_size=splits.vocab.size)
    return pd.DataFrame([{
        "size": s.size, "layers": cfg.n_layer, "heads": cfg.n_head, "width": cfg.n_embd,
        "context (tokens)": cfg.block_size, "vocabulary": cfg.vocab_size,
        "parameters (formula)": parameter_count(cfg), "parameters (counted)": count_parameters(GPT(cfg)),
        "corpus": splits.corpus_name, "train tokens": splits.train_tokens, "val tokens": splits.val_tokens,
    }])


def flops_table(settings: Settings):
    """The training FLOPs per token of the profile's model by the formula 6N + 12LCT
    (:func:`lab_utils.learn.models.gpt_sizes.train_flops_per_token`) and counted by ``FlopCounterMode`` on the
    model (Exercise 06-a's answer for it: notebook 06 shows it after the exercise)."""
    s = settings.validate()
    cfg = gpt_config(s.size, vocab_size=_splits(s).vocab.size)
    return pd.DataFrame([{"size": s.size, "train FLOPs/token (6N+12LCT)": train_flops_per_token(cfg),
                          "train FLOPs/token (FlopCounterMode)": measure_train_flops_per_token(GPT(cfg))}])
