"""Int8 quantization of a trained language model for inference, measured honestly.

Each *variant* is one way of storing and running the model's ``nn.Linear`` layers:

==========================  =====================================================================
``fp32``                    the trained model as it is (the baseline of every speedup)
``bf16``                    weights and activations in bfloat16 (2 bytes per weight)
``ao_dynamic_int8``         ``torch.ao.quantization.quantize_dynamic``: int8 weights (per tensor),
                            activations quantized to 8 bits on the fly per call, int8 GEMM from
                            the CPU quantized engine (fbgemm/x86 or qnnpack). CPU only, and
                            deprecated upstream: the warning torch emits is detected and shown.
``torchao_int8_weight_only``  torchao ``quantize_(model, Int8WeightOnlyConfig())``: int8 weights
                            with one fp32 scale per output row; activations stay in float.
``torchao_int8_dynamic``    torchao ``quantize_(model, Int8DynamicActivationInt8WeightConfig())``:
                            int8 weights per row and activations quantized per token on the fly.
==========================  =====================================================================

A variant that this stack cannot run (module missing, class missing, CPU-only kernel on a
GPU, disabled by configuration) becomes a row with status ``skipped`` and the reason;
one that fails while running becomes ``error`` (or ``oom``) with the first line of the
exception. No number is ever filled in for them.

What is measured per (variant, device), all on the same held-out tokens and prompts (the functions
named are in :mod:`~lab_utils.experiments.quant_model` and :mod:`~lab_utils.experiments.quant_timing`):

- ``size_bytes``: length of ``torch.save(model.state_dict())`` (``serialized_size_bytes``;
  ``save_state_dict`` writes the same bytes to a file), and ``payload_bytes``: the bytes of the
  tensor storages in it (:func:`payload_bytes`), so the container overhead is visible;
- ``val_loss`` (mean next-token cross-entropy, nats per token, computed in fp32 from the
  variant's logits) and ``perplexity = exp(val_loss)`` (``evaluate_lm``);
- decoding speed (``time_decode``): greedy generation of ``new_tokens`` tokens after a
  ``prompt_tokens`` prompt, ``warmup`` untimed repetitions then ``repeats`` timed ones,
  each bracketed by a device synchronize. ``ms_per_token`` = repetition seconds x 1000 /
  new tokens at batch 1 (latency); ``tokens_per_s`` = batch x new tokens / repetition
  seconds at the larger batch (throughput). Median, min and max over repetitions.
- speedups over fp32 *on the same device* (``quantize_tables.quantization_table``): fp32
  latency / variant latency, variant tokens/s / fp32 tokens/s.

The GPT of this lab has no KV cache: every generated token re-runs the model over the
whole context (cropped to ``block_size``), so a decoding step multiplies each weight
matrix by ``batch x context`` rows. ``weight_flops_per_byte`` turns that into the
arithmetic intensity against the weights (2 x rows / bytes per weight) that decides
whether a step is memory-bound (few rows: reading the weights dominates, fewer bytes per
weight helps) or compute-bound (many rows).

The experiment's shape: :class:`Settings`, :func:`measure` (lab, settings) -> one record per
(device, variant). Below it: which variants can run (:mod:`~lab_utils.experiments.quant_variants`),
how one is made and sized (:mod:`~lab_utils.experiments.quant_model`), its quality and decoding
speed (:mod:`~lab_utils.experiments.quant_timing`); above it, the table, the figure and the
findings (:mod:`~lab_utils.experiments.quantize_tables`).
"""

from __future__ import annotations

import hashlib
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab_utils.core import config, profiles
from lab_utils.core.config import check_positive_int
from lab_utils.core.errors import LabError
from lab_utils.core.hardware import hardware_summary
from lab_utils.core.memory import free_device_memory, is_out_of_memory, oom_reason
from lab_utils.core.progress import headless, progress
from lab_utils.core.text_data import TRAIN_FRACTION, CharVocab, load_corpus
from lab_utils.experiments.quant_model import (
    float_layers,
    float_layers_note,
    payload_bytes,
    quantize_model,
    serialized_size_bytes,
)
from lab_utils.experiments.quant_timing import (
    evaluate_lm,
    make_prompts,
    mean_context_tokens,
    time_interleaved,
    weight_flops_per_byte,
)
from lab_utils.experiments.quant_variants import (
    VARIANT_INFO,
    VARIANTS,
    check_variant,
    cpu_has_native_bf16,
    torchao_version,
)
from lab_utils.models.gpt import checkpoint_path, load_checkpoint
from lab_utils.session import session_for
from lab_utils.store import Record
from lab_utils.workers.args import TrainConfig
from lab_utils.workers.gpt_train import run_training

# VARIANTS, check_variant, quantize_model and payload_bytes are also this module's: notebook 07 and its
# exercise call them as quantize.<name>.
__all__ = ["EXPERIMENT", "VARIANTS", "ModelUnderTest", "Settings", "check_variant", "describe",
           "devices_to_run", "file_sha256", "load_model_under_test", "measure", "measure_device",
           "payload_bytes", "quantize_model"]

EXPERIMENT = "quantization"


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Per-profile knobs of notebook 07.

    ``eval_tokens``: held-out tokens scored per variant (``None``: the whole validation
    split). ``prompt_tokens`` / ``new_tokens``: prompt length and tokens generated per
    timed repetition. ``large_batch`` / ``cpu_large_batch``: sequences decoded together for
    the throughput measurement on a GPU / on the CPU. ``disabled``: variants treated as
    unavailable (to see, or test, what an unavailable path looks like). ``compile``: wrap
    every variant (the fp32 baseline too) in ``torch.compile`` before measuring.
    ``fallback_*``: the GPT trained here when notebook 06's checkpoint is absent.
    """

    eval_tokens: int | None
    eval_batch_size: int
    prompt_tokens: int
    new_tokens: int
    large_batch: int
    cpu_large_batch: int
    warmup: int
    repeats: int
    fallback_size: str
    fallback_steps: int
    fallback_batch_size: int
    fallback_max_chars: int | None
    variants: tuple[str, ...] = VARIANTS
    devices: tuple[str, ...] | None = None   # None: "cpu", plus "cuda" when one is visible
    disabled: tuple[str, ...] = ()
    compile: bool = False

    def validate(self) -> Settings:
        """Raise :class:`LabError` on a bad knob, before anything is measured."""
        for name in ("eval_batch_size", "prompt_tokens", "new_tokens", "large_batch", "cpu_large_batch",
                     "repeats", "fallback_steps", "fallback_batch_size"):
            check_positive_int(getattr(self, name), name)
        for name in ("eval_tokens", "fallback_max_chars"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name)
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise LabError(f"warmup must be a whole number of repetitions (0 or more), got {self.warmup!r}.")
        for group, values in (("variants", self.variants), ("disabled", self.disabled)):
            unknown = [v for v in values if v not in VARIANTS]
            if unknown:
                raise LabError(f"Unknown {group} {unknown}; use names from: {', '.join(VARIANTS)}.")
        if not self.variants:
            raise LabError("variants must not be empty; keep at least 'fp32' (the baseline).")
        if self.devices is not None:
            for d in self.devices:
                if d not in ("cpu", "cuda"):
                    raise LabError(f"Unknown device {d!r} in devices; use 'cpu' and/or 'cuda'.")
        return self

    def measure_key(self) -> dict[str, Any]:
        """The knobs a measured row depends on (part of its stored configuration)."""
        names = ("eval_tokens", "eval_batch_size", "prompt_tokens", "new_tokens", "large_batch",
                 "cpu_large_batch", "warmup", "repeats", "compile")
        return {k: getattr(self, k) for k in names}


profiles.register(Settings, profiles.QUANT, "quantization")


# --------------------------------------------------------------------------- one row


@dataclass
class ModelUnderTest:
    """The fp32 model to quantize and the held-out text it is scored on."""

    model: nn.Module
    val_tokens: torch.Tensor          # 1-D int64
    block_size: int
    model_id: str                     # identifies the weights (e.g. checkpoint SHA-256 prefix)
    dataset: str | None = None
    synthetic: bool | None = None
    source: str = ""                  # where the weights came from, in words


def devices_to_run(settings: Settings) -> list[str]:
    """``settings.devices``, or the CPU plus CUDA when a GPU is visible."""
    if settings.devices is not None:
        return list(settings.devices)
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _row_config(mut: ModelUnderTest, variant: str, device: str, settings: Settings) -> dict[str, Any]:
    """The stored configuration of one row: what it measured and with which stack."""
    cfg: dict[str, Any] = {"variant": variant, "device": device, "model_id": mut.model_id,
                           "settings": settings.measure_key(),
                           "stack": {"torch": torch.__version__, "torchao": torchao_version()}}
    if device == "cpu":
        cfg["cpu_threads"] = torch.get_num_threads()
    return cfg


def _failure(rec, e: BaseException):
    """Mark ``rec`` as ``oom`` (:func:`lab_utils.core.memory.is_out_of_memory`) or ``error``, with
    the exception's first line. Frees nothing: callers free memory after their ``except``."""
    if is_out_of_memory(e):
        rec.status, rec.reason = "oom", oom_reason(e, limit=200)
    else:  # a kernel missing on this machine: the row says which error
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        rec.status, rec.reason = "error", f"{e.__class__.__name__}: {first}"
    return rec


def measure_device(mut: ModelUnderTest, variants: Sequence[str], device: str, settings: Settings,
                   show_progress: bool = False) -> list:
    """Measure ``variants`` on ``device`` in one session; returns one :class:`Record` each.

    For each available variant: quantize a copy, measure its size, score it on the held-out
    tokens. Then time all of them together with :func:`time_interleaved`, at batch 1 and at
    the large batch. Unavailable variants give ``skipped`` records, failures ``error``/``oom``.
    """
    dev = torch.device(device)
    big = settings.cpu_large_batch if dev.type == "cpu" else settings.large_batch
    ctx = mean_context_tokens(settings.prompt_tokens, settings.new_tokens, mut.block_size)
    records: dict[str, Any] = {}
    models: dict[str, nn.Module] = {}
    for variant in (progress(variants, desc=f"quantize+score ({device})") if show_progress else variants):
        avail = check_variant(variant, device, settings.disabled)
        info = VARIANT_INFO[variant]
        rec = Record(experiment=EXPERIMENT, config={}, dataset=mut.dataset, synthetic=mut.synthetic,
                     hardware=hardware_summary(device, 1),
                     metrics={"label": info.label, "method": info.method, "kernel": avail.kernel,
                              "note": avail.note})
        records[variant] = rec
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
            rec.metrics.update(size_bytes=serialized_size_bytes(model),
                               payload_bytes=payload_bytes(model))
            if settings.compile:
                model = torch.compile(model)
            ev = evaluate_lm(model, mut.val_tokens, mut.block_size, settings.eval_batch_size, dev,
                             settings.eval_tokens)
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
        s = settings
        t1, tb = (time_interleaved(models, make_prompts(mut.val_tokens, batch, s.prompt_tokens), s.new_tokens,
                                   mut.block_size, dev, s.warmup, s.repeats) for batch in (1, big))
        for variant in models:
            rec, a, b = records[variant], t1[variant], tb[variant]
            if isinstance(a, Exception) or isinstance(b, Exception):  # freed in time_interleaved
                _failure(rec, a if isinstance(a, Exception) else b)
                continue
            rec.metrics.update({
                "ms_per_token_b1": a.ms_per_token_median, "ms_per_token_b1_min": a.ms_per_token_min,
                "ms_per_token_b1_max": a.ms_per_token_max, "tokens_per_s_b1": a.tokens_per_s_median,
                "tokens_per_s_large": b.tokens_per_s_median, "tokens_per_s_large_min": b.tokens_per_s_min,
                "tokens_per_s_large_max": b.tokens_per_s_max, "seconds_b1": a.seconds,
                "seconds_large": b.seconds,
            })
    return [records[v] for v in variants]


def measure(lab: Any, settings: Settings, mut: ModelUnderTest | None = None, force: bool = False,
            show_progress: bool | None = None) -> list[Record]:
    """Measure every (device, variant) of ``settings`` into ``lab.store`` (experiment ``quantization``).

    ``mut``: the model under test (default: :func:`load_model_under_test` for ``lab``'s profile).

    Per device, when every available variant already has a row stored for the same
    configuration (same weights, knobs, torch/torchao versions, CPU threads) from one session,
    the stored rows are reused, unless ``force``. Otherwise *all* available variants of that
    device are measured again in one session (:func:`measure_device`), so that their timings
    are interleaved and every speedup compares rows measured side by side
    (:meth:`~lab_utils.store.ResultStore.run_many` with ``together``). Unavailable rows are
    re-checked on every call, so installing torchao later fills its row in.
    Returns the current record of every (device, variant), devices in order.
    """
    lab = session_for(lab)
    store = lab.store
    settings.validate()
    mut = mut or load_model_under_test(lab.profile.name, settings)
    show = (not headless()) if show_progress is None else show_progress
    out = []
    for device in devices_to_run(settings):
        cfgs = {v: _row_config(mut, v, device, settings) for v in settings.variants}
        avail = {v: check_variant(v, device, settings.disabled) for v in settings.variants}
        here = hardware_summary(device, 1)  # reuse only rows measured on this machine's device
        ready = [v for v in settings.variants if avail[v].ok]

        def session(todo, device=device, cfgs=cfgs, ready=ready):
            for v, rec in zip(ready, measure_device(mut, ready, device, settings, show)):
                rec.config = cfgs[v]
                yield rec

        got = dict(zip(ready, store.run_many(EXPERIMENT, [cfgs[v] for v in ready], session, force=force,
                                             hardware=here, together=True)))
        for v in settings.variants:
            if v not in got:  # unavailable: checked again on every call (installing torchao fills it in)
                got[v] = store.run(EXPERIMENT, cfgs[v],
                                   lambda v=v, device=device: measure_device(mut, [v], device, settings)[0],
                                   force=True, hardware=here)
            out.append(got[v])
    return out


# --------------------------------------------------------------------------- the GPT to quantize


def file_sha256(path: str | Path, prefix: int = 16) -> str:
    """The first ``prefix`` hex digits of a file's SHA-256 (identifies the weights measured)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:prefix]


def _corpus_kind(name: str) -> str:
    """The ``corpus=`` choice of :mod:`lab_utils.core.text_data` that produces the corpus ``name``."""
    if name == "tiny-shakespeare":
        return "shakespeare"
    if name.startswith("python-stdlib"):
        return "stdlib"
    raise LabError(f"Unknown corpus {name!r} in the checkpoint; re-run notebook 06 to write a fresh one.")


def _held_out_tokens(payload: dict[str, Any]) -> tuple[torch.Tensor, str, bool, int]:
    """The validation text of the checkpoint's corpus, encoded with the checkpoint's vocabulary.

    The corpus is cut to ``metrics["max_chars"]`` when the checkpoint records it (the
    exact split it trained on), else taken whole: its last 10 % lies after any prefix's
    first 90 %, so it is held out either way. Characters absent from the vocabulary are
    dropped (counted). Returns ``(tokens, corpus name, synthetic, dropped characters)``.
    """
    max_chars = (payload.get("metrics") or {}).get("max_chars")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stand-in warning: the provenance label says it
        corpus = load_corpus(_corpus_kind(payload["corpus"]), max_chars=max_chars)
    text = corpus.text[int(TRAIN_FRACTION * len(corpus.text)):]
    vocab = CharVocab(payload["vocab"])
    allowed = set(vocab.chars)
    kept = "".join(ch for ch in text if ch in allowed)
    return vocab.encode(kept), corpus.name, corpus.synthetic, len(text) - len(kept)


def _fallback_checkpoint_path(profile: str) -> Path:
    """Where notebook 07 keeps the GPT it trains itself when notebook 06's checkpoint is absent."""
    return config.results_dir(profile) / "checkpoints" / "gpt_trained_in_07.pt"


def _train_fallback(path: Path, settings: Settings, device: str = "auto") -> Path:
    """Train the settings' fallback GPT briefly (one process) and save it to ``path``."""
    cfg = TrainConfig(size=settings.fallback_size, batch_size=settings.fallback_batch_size,
                      epochs=1, max_steps=settings.fallback_steps, steps_per_epoch=settings.fallback_steps,
                      max_chars=settings.fallback_max_chars, val_batches=4, probe_steps=0, device=device,
                      save=str(path))
    run = run_training(cfg)[-1]
    if run.status != "ok" or not Path(path).exists():
        raise LabError(f"Training the fallback GPT failed ({run.reason}); run notebook 06 first "
                       "so that its checkpoint exists.")
    return Path(path)


def load_model_under_test(profile: str, settings: Settings, checkpoint: str | Path | None = None,
                          train_if_missing: bool = True) -> ModelUnderTest:
    """Notebook 06's GPT (``results/<profile>/checkpoints/gpt.pt``), or one trained here.

    ``checkpoint`` overrides the path. When the file is absent and ``train_if_missing``,
    the fallback GPT of ``settings`` is trained briefly (and kept, so a re-run reuses it);
    :attr:`ModelUnderTest.source` says which happened.
    """
    path = Path(checkpoint) if checkpoint is not None else checkpoint_path(profile)
    if path.exists():
        source = f"notebook 06's checkpoint {path}"
    elif checkpoint is not None:
        raise LabError(f"No checkpoint at {path}; give the path notebook 06 printed, or checkpoint=None.")
    else:
        fb = _fallback_checkpoint_path(profile)
        if fb.exists():
            source = f"no checkpoint from notebook 06 at {path}: using the GPT trained here before ({fb})"
        elif train_if_missing:
            t0 = time.perf_counter()
            _train_fallback(fb, settings)
            source = (f"no checkpoint from notebook 06 at {path}: trained the '{settings.fallback_size}' GPT "
                      f"here for {settings.fallback_steps} steps ({time.perf_counter() - t0:.0f} s), "
                      f"saved to {fb}")
        else:
            raise LabError(f"No checkpoint at {path}; run notebook 06 first (or allow training here).")
        path = fb
    model, payload = load_checkpoint(path, "cpu")
    model = model.float().eval()
    tokens, corpus, synthetic, dropped = _held_out_tokens(payload)
    if dropped:
        source += f"; {dropped} held-out characters outside the model's vocabulary were dropped"
    return ModelUnderTest(model=model, val_tokens=tokens, block_size=model.config.block_size,
                          model_id=file_sha256(path), dataset=corpus, synthetic=synthetic, source=source)


def describe(mut: ModelUnderTest) -> dict[str, Any]:
    """A small summary of the model under test for the notebook to print."""
    n = sum(p.numel() for p in mut.model.parameters())
    cfg = getattr(mut.model, "config", None)
    return {"source": mut.source, "parameters": n, "config": asdict(cfg) if cfg is not None else None,
            "held_out_tokens": int(mut.val_tokens.numel()), "dataset": mut.dataset,
            "synthetic": mut.synthetic,
            "cpu_threads": torch.get_num_threads(), "torchao": torchao_version(), "torch": torch.__version__,
            "quantized_engine": torch.backends.quantized.engine, "cpu_native_bf16": cpu_has_native_bf16()}
