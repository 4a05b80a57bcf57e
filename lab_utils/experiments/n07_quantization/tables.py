"""Notebook 07's table, figure and findings from the records of
:data:`lab_utils.experiments.n07_quantization.experiment.QUANTIZATION_EXPERIMENT` (table ``quantization``,
figure ``quantization_quality_vs_speed``), and the availability and arithmetic-intensity tables of the
settings. Sizes in bytes, losses in nats per token, latency in ms per token, throughput in tokens/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from lab_utils.engine.table_view import with_view
from lab_utils.experiments.n07_quantization.experiment import Settings
from lab_utils.experiments.n07_quantization.quant_timing import (
    mean_context_tokens,
    ridge_flops_per_byte,
    weight_flops_per_byte,
)
from lab_utils.experiments.n07_quantization.quant_variants import VARIANT_INFO
from lab_utils.learn.speedup import speedup

#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
QUANTIZATION_VIEW = ("device", "variant", "status", "size_bytes", "size_vs_fp32", "val_loss",
                     "ms_per_token_b1", "speedup_b1", "tokens_per_s_large", "speedup_large")

__all__ = ["availability_frame", "findings", "intensity_frame", "plot_quality_vs_speed", "quantization_table",
           "table_notes"]


def quantization_table(records: Sequence) -> Any:
    """One row per (device, variant): sizes (bytes and fraction of fp32's file), val loss and its increase
    over fp32 on the same device (nats per token), perplexity, batch-1 latency (median ms per token,
    min-max), large-batch throughput (median tokens/s, min-max), both speedups
    (:func:`lab_utils.learn.speedup.speedup`), status, and a note (kernel, deprecation, or why not measured).
    """
    base = {r.config["device"]: r.metrics for r in records
            if r.config.get("variant") == "fp32" and r.status == "ok"}
    rows = []
    for r in records:
        ok, dev = r.status == "ok", r.config.get("device")
        m, b = (r.metrics if ok else {}), base.get(dev) or {}
        note = "; ".join(x for x in (m.get("kernel"), m.get("note")) if x) if ok else r.reason
        rows.append({
            "device": dev, "variant": r.config.get("variant"), "method": r.metrics.get("method"),
            "size_bytes": m.get("size_bytes"),
            "payload_bytes": m.get("payload_bytes"),   # the tensors alone (Exercise 07-a)
            "size_vs_fp32": (m["size_bytes"] / b["size_bytes"]
                             if m.get("size_bytes") is not None and b.get("size_bytes") else None),
            "val_loss": m.get("val_loss"),
            "loss_increase": m["val_loss"] - b["val_loss"] if ok and b else None,
            "perplexity": m.get("perplexity"), "ms_per_token_b1": m.get("ms_per_token_b1"),
            "b1_min_max_ms": f"{m['ms_per_token_b1_min']:.3g}-{m['ms_per_token_b1_max']:.3g}" if ok else "",
            "speedup_b1": speedup(b.get("ms_per_token_b1"), m.get("ms_per_token_b1")) if ok else None,
            "large_batch": m.get("large_batch"), "tokens_per_s_large": m.get("tokens_per_s_large"),
            "large_min_max_tok_s": (f"{m['tokens_per_s_large_min']:.4g}-{m['tokens_per_s_large_max']:.4g}"
                                    if ok else ""),
            "speedup_large": (speedup(*(_inverse(x.get("tokens_per_s_large")) for x in (b, m)))
                              if ok else None),
            "status": r.status, "note": note or ""})
    df = pd.DataFrame(rows)
    # Whole numbers stay whole in the Markdown/CSV (missing values as empty cells).
    for col in ("size_bytes", "payload_bytes", "large_batch"):
        df[col] = df[col].astype("Int64").astype(object).where(df[col].notna(), "")
    return with_view(df, QUANTIZATION_VIEW)


def _inverse(rate: float | None) -> float | None:
    """Seconds per token of a tokens/s rate (a speedup of rates is one of times per token)."""
    return 1.0 / rate if rate else None


def table_notes(records: Sequence, settings: Settings, block_size: int) -> list[str]:
    """Notes under the table: what each timing means, with this run's knobs."""
    ctx = mean_context_tokens(settings.prompt_tokens, settings.new_tokens, block_size)
    reps = f"{settings.warmup} warm-up + {settings.repeats} timed repetitions, median and min-max"
    notes = [
        f"val_loss: mean next-token cross-entropy (nats/token) on the same {settings.eval_tokens or 'all'} "
        "held-out tokens for every row; perplexity = exp(val_loss); loss_increase is over fp32 on the same "
        "device.",
        "size_bytes: length of torch.save(state_dict); size_vs_fp32 against fp32's file; payload_bytes: "
        "the tensors' bytes alone, each storage once (the file adds its zip container: data.pkl, headers, "
        "padding).",
        f"ms_per_token_b1: greedy decoding of {settings.new_tokens} tokens after a "
        f"{settings.prompt_tokens}-token prompt at batch 1, wall time / tokens ({reps}; device "
        "synchronized).",
        "tokens_per_s_large: the same decoding at the large batch (column large_batch): "
        "batch x tokens / time.",
        f"No KV cache: each step re-reads the whole context (mean {ctx:.1f} tokens), so a batch-B step "
        f"multiplies each weight by B x {ctx:.1f} rows.",
        "speedups are over fp32 on the same device and the same settings; a row without numbers says why.",
    ]
    if settings.compile:
        notes.append("Every row, fp32 included, ran under torch.compile (compile time is in the warm-up).")
    return notes


def plot_quality_vs_speed(df):
    """Two panels: perplexity against batch-1 latency and against large-batch throughput."""
    import matplotlib.pyplot as plt

    ok = df[df["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    markers = {"cpu": "o", "cuda": "s"}
    for (dev, variant), g in ok.groupby(["device", "variant"], sort=False):
        for ax, col in zip(axes, ("ms_per_token_b1", "tokens_per_s_large")):
            x, y = float(g[col].iloc[0]), float(g["perplexity"].iloc[0])
            ax.scatter([x], [y], marker=markers.get(dev, "^"), s=50)
            ax.annotate(f"{variant} ({dev})", (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    axes[0].set_xlabel("latency at batch 1 (ms per generated token, median; lower is better)")
    big = ", ".join(sorted({str(v) for v in ok["large_batch"]})) if len(ok) else "?"
    axes[1].set_xlabel(f"throughput at batch {big} (tokens/s, median; higher is better)")
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

    for ax in axes:
        ax.set_ylabel("validation perplexity (lower is better)")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.ticklabel_format(axis="y", useOffset=False, style="plain")
        ax.grid(alpha=0.3)
    fig.suptitle("Quality against speed of each int8 / bf16 variant (o: CPU, s: GPU)")
    fig.tight_layout()
    return fig


def availability_frame(records: Sequence):
    """What this stack offers, from the rows (the worker checked each variant where it ran): one row per
    (device, variant) with its kernel, note, or the reason it did not run."""
    rows = [{"device": r.config["device"], "variant": r.config["variant"],
             "method": VARIANT_INFO[r.config["variant"]].method, "available": r.status != "skipped",
             "kernel / reason": r.metrics.get("kernel") if r.status != "skipped" else r.reason,
             "note": r.metrics.get("note") or ""} for r in records]
    return pd.DataFrame(rows)


def intensity_frame(settings: Settings, block_size: int):
    """The roofline of one decoding step, a row per (step, variant): the rows each weight matrix multiplies
    (batch x the timed decoding's mean context: no KV cache), the bytes per weight as stored, the precision
    the matmul multiplies in (weight-only int8 dequantizes to the fp32 activations), the intensity against the
    weights (FLOP per weight byte) and the reference H100 SXM's ridge for THAT precision
    (:func:`~lab_utils.experiments.n07_quantization.quant_timing.ridge_flops_per_byte`), and which side of
    it the step is on."""
    ctx = mean_context_tokens(settings.prompt_tokens, settings.new_tokens, block_size)
    rows = []
    for what, batch in (("batch 1", 1), ("large batch, CPU", settings.cpu_large_batch),
                        ("large batch, GPU", settings.large_batch)):
        for v in settings.variants:
            info = VARIANT_INFO[v]
            intensity = weight_flops_per_byte(batch * ctx, info.bytes_per_weight)
            ridge = ridge_flops_per_byte(info.arithmetic)
            rows.append({"decoding step": what, "batch": batch, "rows per matmul": batch * ctx, "variant": v,
                         "bytes per weight": info.bytes_per_weight, "multiplies in": info.arithmetic,
                         "FLOP/byte": intensity, "H100 SXM ridge (FLOP/byte)": ridge,
                         "on an H100 SXM": "compute-bound" if intensity > ridge else "memory-bound"})
    return pd.DataFrame(rows)


def _fmt_x(v: float) -> str:
    return f"{v:.2f}x"


def findings(records: Sequence) -> list[str]:
    """Sentences that state what *these* measurements show (nothing unmeasured): per device each variant's
    size, loss increase and speedups; the two int8 *dynamic* implementations side by side (same arithmetic,
    different kernels); a variant on CPU and GPU; a warning when repetitions varied a lot."""
    df = quantization_table(records)
    ok = df[df["status"] == "ok"]
    out: list[str] = []
    for dev, sub in ok.groupby("device", sort=False):
        if "fp32" not in set(sub["variant"]):
            out.append(f"On {dev} the fp32 baseline was not measured, so no speedups are stated.")
            continue
        for _, r in sub[sub["variant"] != "fp32"].iterrows():
            out.append(f"On {dev}, {r['variant']}: file {_fmt_x(r['size_vs_fp32'])} of fp32's, val loss "
                       f"{r['loss_increase']:+.4f} nats/token, batch-1 decoding {_fmt_x(r['speedup_b1'])} "
                       f"fp32's speed, batch-{r['large_batch']} throughput {_fmt_x(r['speedup_large'])}.")
        dyn = sub[sub["method"] == "dynamic"]
        if len(dyn) >= 2:
            parts = [f"{r['variant']} {_fmt_x(r['speedup_large'])} (batch {r['large_batch']}) and "
                     f"{_fmt_x(r['speedup_b1'])} (batch 1)" for _, r in dyn.iterrows()]
            faster = (dyn["speedup_large"] > 1).any() and (dyn["speedup_large"] < 1).any()
            out.append(f"Same scheme, different kernels, on {dev}: int8 dynamic activation + int8 weight "
                       "ran at " + "; ".join(parts) + " of fp32's speed"
                       + (": one implementation beats fp32, the other loses to it." if faster else "."))
    for variant, sub in ok.groupby("variant", sort=False):
        if variant != "fp32" and sub["device"].nunique() > 1:
            parts = [f"{_fmt_x(r['speedup_b1'])} at batch 1 and {_fmt_x(r['speedup_large'])} at batch "
                     f"{r['large_batch']} on {r['device']}" for _, r in sub.iterrows()]
            out.append(f"{variant} across devices: " + "; ".join(parts) + ".")
    spreads = [r.metrics["ms_per_token_b1_max"] / r.metrics["ms_per_token_b1_min"] for r in records
               if r.status == "ok" and r.metrics.get("ms_per_token_b1_min")]
    if spreads and max(spreads) > 1.5:
        out.append(f"Repetitions varied by up to {max(spreads):.1f}x (slowest / fastest at batch 1): the "
                   "machine was busy or clocks changed; trust only differences well beyond that spread, and "
                   "re-run on an idle machine before drawing conclusions.")
    if not out:
        out.append("No variant was measured successfully; the table says why for each row.")
    return out
