"""Notebook 07's measuring worker: the GPT of a checkpoint and its int8 / bf16 variants on one device.

A job of the lab's worker protocol (:mod:`lab_utils.engine.harness`): ``job.options["checkpoint"]`` is the
model (not part of a key), each configuration one (variant, device) row of
:func:`lab_utils.experiments.n07_quantization.experiment.plan`. The variants of a job are measured together,
the first configuration's call doing all of them (:func:`measure_device`: their decoding repetitions
interleaved), so every speedup compares rows measured side by side; the others return their rows. On a GPU it
runs in a process of its own (the notebook's kernel opens no CUDA context: the variant checks,
``torch._int_mm``'s probe included, run here); on the CPU it may run in the caller's process.

What a row measures (the names of :mod:`lab_utils.learn.metrics`): ``size_bytes`` (``torch.save`` of the
state dict) and ``payload_bytes`` (its tensors alone), ``val_loss`` and ``perplexity`` on the
held-out tokens, and greedy decoding timed at batch 1 (``ms_per_token_b1``: latency) and at the
large batch (``tokens_per_s_large``: throughput), median, min and max over repetitions. A variant
that cannot run here is a ``skipped`` row with the reason; one that fails is ``error`` or ``oom``.
"""

from __future__ import annotations

import hashlib
import statistics
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab_utils.engine.dist import DistContext
from lab_utils.engine.hardware import hardware_summary
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.memory import free_device_memory, is_out_of_memory, oom_reason
from lab_utils.engine.records import Record
from lab_utils.experiments.n07_quantization.quant_model import (
    float_layers,
    float_layers_note,
    payload_bytes,
    quantize_model,
    serialized_size_bytes,
)
from lab_utils.experiments.n07_quantization.quant_timing import (
    evaluate_lm,
    make_prompts,
    mean_context_tokens,
    median_min_max,
    time_interleaved,
    weight_flops_per_byte,
)
from lab_utils.experiments.n07_quantization.quant_variants import VARIANT_INFO, check_variant
from lab_utils.experiments.shared.gpt_checkpoint import load_checkpoint
from lab_utils.experiments.shared.text_data import TRAIN_FRACTION, CharVocab, load_corpus
from lab_utils.learn.errors import LabError, error_line

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
METRICS_VERSION = 1

EXPERIMENT = "quantization"


@dataclass
class ModelUnderTest:
    """The fp32 model to quantize and the held-out text it is scored on."""

    model: nn.Module
    val_tokens: torch.Tensor          # 1-D int64
    block_size: int
    dataset: str | None = None
    synthetic: bool | None = None
    source: str = ""                  # where the weights came from, in words


def file_sha256(path: str | Path, prefix: int = 16) -> str:
    """The first ``prefix`` hex digits of a file's SHA-256 (identifies the weights measured)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:prefix]


def _held_out_tokens(payload: dict[str, Any]) -> tuple[torch.Tensor, str, bool, int]:
    """The validation text of the checkpoint's corpus, encoded with the checkpoint's vocabulary.

    The corpus is cut to ``metrics["max_chars"]`` when the checkpoint records it (the exact split it
    trained on), else taken whole: its last 10 % lies after any prefix's first 90 %, so it is held out
    either way. Characters absent from the vocabulary are dropped (counted). Returns ``(tokens,
    corpus name, synthetic, dropped characters)``.
    """
    name = payload["corpus"]
    kind = "shakespeare" if name == "tiny-shakespeare" else "stdlib" if name.startswith("python-stdlib") \
        else None
    if kind is None:
        raise LabError(f"Unknown corpus {name!r} in the checkpoint; re-run notebook 06 to write a fresh one.")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stand-in warning: the provenance label says it
        corpus = load_corpus(kind, max_chars=(payload.get("metrics") or {}).get("max_chars"))
    text = corpus.text[int(TRAIN_FRACTION * len(corpus.text)):]
    allowed = set(payload["vocab"])
    kept = "".join(ch for ch in text if ch in allowed)
    return CharVocab(payload["vocab"]).encode(kept), corpus.name, corpus.synthetic, len(text) - len(kept)


def load_model_under_test(path: str | Path, source: str = "") -> ModelUnderTest:
    """The checkpoint's GPT in fp32 on the CPU with its held-out tokens; ``source``: where it came from."""
    if not Path(path).exists():
        raise LabError(f"No checkpoint at {path}; run notebook 06 first (or give the path it printed).")
    model, payload = load_checkpoint(path, "cpu")
    tokens, corpus, synthetic, dropped = _held_out_tokens(payload)
    if dropped:
        source += f"; {dropped} held-out characters outside the model's vocabulary were dropped"
    return ModelUnderTest(model=model.float().eval(), val_tokens=tokens, block_size=model.config.block_size,
                          dataset=corpus, synthetic=synthetic, source=source or str(path))


def _failure(rec: Record, e: BaseException) -> None:
    """Mark ``rec`` as ``oom`` or ``error`` with the exception's first line (callers free memory after
    their ``except``)."""
    if is_out_of_memory(e):
        rec.status, rec.reason = "oom", oom_reason(e, limit=200)
    else:  # a kernel missing on this machine: the row says which error
        rec.status, rec.reason = "error", error_line(e)


def measure_device(mut: ModelUnderTest, variants: Sequence[str], device: str,
                   knobs: Mapping[str, Any]) -> list[Record]:
    """Measure ``variants`` on ``device`` in one session; one :class:`Record` each (config left empty).

    ``knobs``: :meth:`lab_utils.experiments.n07_quantization.experiment.Settings.measure_key`. For each
    available variant: quantize a copy, size it, score it on the held-out tokens; then time all of them
    together with :func:`time_interleaved`, at batch 1 and at the large batch.
    """
    dev = torch.device(device)
    big = knobs["cpu_large_batch"] if dev.type == "cpu" else knobs["large_batch"]
    ctx = mean_context_tokens(knobs["prompt_tokens"], knobs["new_tokens"], mut.block_size)
    records: dict[str, Record] = {}
    models: dict[str, nn.Module] = {}
    for variant in variants:
        avail, info = check_variant(variant, device), VARIANT_INFO[variant]
        rec = records[variant] = Record(EXPERIMENT, {}, {"label": info.label, "method": info.method,
                                                         "kernel": avail.kernel, "note": avail.note},
                                        dataset=mut.dataset, synthetic=mut.synthetic,
                                        hardware=hardware_summary(device, 1))
        if not avail.ok:
            rec.status, rec.reason = "skipped", avail.reason
            continue
        model = None
        kept = float_layers(mut.model, variant, dev)
        if kept:
            rec.metrics["kept_in_float"] = kept
            rec.metrics["note"] = "; ".join(x for x in (float_layers_note(kept), avail.note) if x)
        try:
            model = quantize_model(mut.model, variant, dev)
            rec.metrics.update(size_bytes=serialized_size_bytes(model), payload_bytes=payload_bytes(model))
            if knobs["compile"]:
                model = torch.compile(model)
            ev = evaluate_lm(model, mut.val_tokens, mut.block_size, knobs["eval_batch_size"], dev,
                             knobs["eval_tokens"])
        except Exception as e:  # out of memory or a missing kernel: the row says which
            _failure(rec, e)
        if rec.status != "ok":  # outside the except block, so the failed call's tensors can go
            model = None
            free_device_memory(dev)
            continue
        bpw = info.bytes_per_weight
        rec.metrics.update(val_loss=ev.loss, perplexity=ev.perplexity, eval_tokens=ev.tokens,
                           mean_context_tokens=ctx, large_batch=big,
                           weight_flops_per_byte_b1=weight_flops_per_byte(ctx, bpw),
                           weight_flops_per_byte_large=weight_flops_per_byte(big * ctx, bpw))
        models[variant] = model
    if models:
        k = knobs
        t1, tb = (time_interleaved(models, make_prompts(mut.val_tokens, batch, k["prompt_tokens"]),
                                   k["new_tokens"], mut.block_size, dev, k["warmup"], k["repeats"])
                  for batch in (1, big))
        for variant in models:
            rec, a, b = records[variant], t1[variant], tb[variant]
            if isinstance(a, Exception) or isinstance(b, Exception):  # freed in time_interleaved
                _failure(rec, a if isinstance(a, Exception) else b)
                continue
            rec.metrics.update(**median_min_max("ms_per_token_b1", a.ms_per_token),
                               **median_min_max("tokens_per_s_large", b.tokens_per_s),
                               tokens_per_s_b1=statistics.median(a.tokens_per_s), seconds_b1=a.seconds,
                               seconds_large=b.seconds)
    return [records[v] for v in variants]


def prepare(job: Job, ctx: DistContext) -> dict[str, Any]:
    return {"mut": load_model_under_test(job.options["checkpoint"]), "rows": {}}


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> list[Record]:
    """The row of one (variant, device); the first call measures every variant of the job together."""
    if not state["rows"]:
        variants = [c["variant"] for c in job.configs]
        state["rows"] = dict(zip(variants, measure_device(state["mut"], variants, config["device"],
                                                          config["settings"])))
    rec = state["rows"][config["variant"]]
    rec.config, rec.profile = dict(config), job.profile
    return [rec]


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
