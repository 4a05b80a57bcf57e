"""The exercises of notebooks 06 and 07 (the GPT): FLOPs per token, MFU, an epoch's time over
ranks, tokens per second, an int8 model's bytes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lab_utils.app.grading.exercises.answers import plain
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake
from lab_utils.experiments.shared import anchors

# --------------------------------------------------------------------------- q06, q07: the GPT


def _gpt_config(fields: dict):
    from lab_utils.learn.models.gpt import GPTConfig

    return GPTConfig(**fields)


def _cfg_text(case: dict) -> str:
    return "GPTConfig(" + ", ".join(f"{k}={v!r}" for k, v in case.items()) + ")"


def _flops_parameter_count(cfg):
    L, C, V, T = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size
    return 6 * (V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C) + 12 * L * C * T


def _flops_forward_only(cfg):
    L, C, V, T = cfg.n_layer, cfg.n_embd, cfg.vocab_size, cfg.block_size
    return 2 * (12 * L * C * C + V * C) + 4 * L * C * T


def _flops_no_head(cfg):
    L, C, T = cfg.n_layer, cfg.n_embd, cfg.block_size
    return 6 * 12 * L * C * C + 12 * L * C * T


def _step_line(batch_sizes, step_seconds, block_size):
    """(fixed seconds, seconds per token) through the two measured points (as
    lab_utils.learn.flops.step_time_line, written again here: this module imports no torch)."""
    (b1, b2), (t1, t2) = batch_sizes, step_seconds
    per_token = (t2 - t1) / ((b2 - b1) * block_size)
    return t1 - b1 * block_size * per_token, per_token


def _tokens_fixed_once(batch_sizes, step_seconds, micro_batch, effective_batch, block_size):
    fixed, per_token = _step_line(batch_sizes, step_seconds, block_size)
    return effective_batch * block_size / (fixed + effective_batch * block_size * per_token)


def _tokens_one_rate(batch_sizes, step_seconds, micro_batch, effective_batch, block_size, which=max):
    b = which(batch_sizes)
    return b * block_size / step_seconds[list(batch_sizes).index(b)]


_ONE_RATE_WHY = ("the measured step has a fixed part that does not shrink with the batch: fit t(b) = fixed + "
                 "b x block_size x per_token through both points and use it at micro_batch")


def _tokens_show(case: dict) -> str:
    return "predict_tokens_per_s(" + ", ".join(f"{k}={v!r}" for k, v in case.items()) + ")"


# The earlier GPT report at batch 128 on 4 GPUs: T(1) over its slowest rank (SPEC.md: 2.95).
_GPT_SLOWEST_128x4 = anchors.GPT_REPORTED_MEAN_SECONDS[(128, 1)] / max(anchors.GPT_RANK_SECONDS[(128, 4)])


def _int8_call(fn: Callable, case: dict) -> Any:
    import torch

    from lab_utils.learn.models.gpt import GPT

    torch.manual_seed(0)
    model = GPT(_gpt_config(case["cfg"]))
    return plain(fn(model, keep_in_float=tuple(case["keep"])) if case.get("keep") else fn(model))


def _int8_show(case: dict) -> str:
    keep = f", keep_in_float={tuple(case['keep'])!r}" if case.get("keep") else ""
    return f"int8_weight_only_bytes(GPT({_cfg_text(case['cfg'])}){keep})"


def _quantized_rows(model, keep_in_float=()):
    from torch import nn

    return sum(m.weight.shape[0] for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and n not in keep_in_float)


def _tied_head_bytes(model):
    """Bytes of the head's weight when another module shares it (the tied embedding), else 0."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return 0
    shared = any(m is not head and getattr(m, "weight", None) is head.weight for m in model.modules())
    return head.weight.numel() * head.weight.element_size() if shared else 0


# --------------------------------------------------------------------------- the exercises


#: Notebooks 06 and 07's exercises, in the order of :data:`lab_utils.app.grading.exercises.EXERCISES`.
EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "q06_flops_per_token", "flops_per_token", call=lambda fn, case: plain(fn(_gpt_config(case))),
        needs=("lab_utils.learn.models.gpt",), show=lambda case: f"flops_per_token({_cfg_text(case)})",
        giveaways=("12LC^2 + VC", r"re:6\s*(\\,\s*)?\(\s*12\s*l\s*c", "12LCT", "12 L C T", "70,928,640",
                   "70928640"),
        implemented_by=("lab_utils.learn.models.gpt_sizes.train_flops_per_token",),
        mistakes=(
            Mistake("6 x the parameter count", "N in 6N is the weights that take part in a matrix multiply, "
                    "12LC^2 + VC: embeddings look up (they do not multiply), biases and LayerNorms add no "
                    "matmul FLOPs", wrong=_flops_parameter_count),
            Mistake("attention left out", "add attention's two T x T products: 12 L C T per token",
                    wrong=lambda cfg: 6 * (12 * cfg.n_layer * cfg.n_embd ** 2 + cfg.vocab_size * cfg.n_embd)),
            Mistake("forward only", "training does the forward pass and a backward pass of twice its cost: "
                    "6 FLOPs per weight per token, not 2", wrong=_flops_forward_only),
            Mistake("the head left out", "the tied head V x C is a matrix multiply too (it shares the "
                    "embedding's weight but does the FLOPs)", wrong=_flops_no_head),
        )),
    Exercise(
        "q06_mfu", "mfu",
        giveaways=(r"re:devices\s*(x|×)?\s*(the\s+)?peak flop", "peak FLOP/s of all the devices",
                   r"re:flops per token\s*(x|×)?\s*tokens/s\s*(/|over|divided by)",
                   r"re:divided?\s+by\s+(the\s+)?(number\s+of\s+)?devices"),
        implemented_by=("lab_utils.learn.flops.mfu",),
        mistakes=(
            Mistake("a percentage", "MFU is a fraction here (0.42 for 42 %)", factor=100.0),
            Mistake("one device's peak", "tokens_per_s counts all devices: divide by devices x the peak "
                    "of one device", wrong=lambda flops, tokens_per_s, peak, n: flops * tokens_per_s / peak),
        )),
    Exercise(
        "q06_rank_time", "run_epoch_seconds", find_the_bug=True,
        giveaways=("max(rank_seconds)", "1.61 / 2.68", "1.75 / 2.95", "2082.29 / 706.41", "2,082.29 / 706.41",
                   r"re:(took|taken|came) (them |its speedups )?from the mean over ranks",
                   r"re:t\(n\) is the slowest rank"),
        implemented_by=("lab_utils.learn.ranks.aggregate_epoch",),
        mistakes=(
            Mistake("averaging ranks", "every step ends with an all-reduce that waits for the slowest rank, "
                    "so the epoch lasts as long as the slowest rank: T(N) is its time, not the mean over "
                    f"ranks (the earlier GPT report's mean made {_GPT_SLOWEST_128x4:.2f} look like "
                    f"{anchors.GPT_REPORTED_SPEEDUPS[(128, 4)]:.2f})",
                    wrong=lambda ranks: sum(ranks) / len(ranks)),
            Mistake("the fastest rank", "a fast rank waits for the others at every all-reduce: the epoch "
                    "is over when the slowest rank is done", wrong=min),
            Mistake("rank 0's time", "rank 0 is not always the slowest (a slow loader or a busy device can "
                    "be on any rank): T(N) is the slowest rank's time", wrong=lambda ranks: ranks[0]),
            Mistake("all ranks added", "the ranks run at the same time, side by side: T(N) is a wall time, "
                    "the slowest rank's, not the sum of their times", wrong=sum),
        )),
    Exercise(
        "q06_tokens_per_s", "predict_tokens_per_s", call=lambda fn, case: plain(fn(**case)),
        show=_tokens_show,
        giveaways=(r"re:\bk\b\s+cancels", r"re:micro(batch)?\s*(x|×)?\s*block(size)?\s*/\s*\(\s*fixed",
                   "independent of the accumulation steps"),
        implemented_by=("lab_utils.learn.flops.predicted_tokens_per_s",
                        "lab_utils.learn.flops.step_time_line"),
        mistakes=(
            Mistake("the fixed part once per optimizer step", "each of the k = effective_batch / micro_batch "
                    "micro-steps runs its own forward and backward, so each pays the fixed part of the "
                    "measured step (one micro-step per measured step): an optimizer step takes "
                    "k x (fixed + micro_batch x block_size x per_token)", wrong=_tokens_fixed_once),
            Mistake("one measured rate for every micro-batch", _ONE_RATE_WHY, wrong=_tokens_one_rate),
            Mistake("one measured rate for every micro-batch", _ONE_RATE_WHY,
                    wrong=lambda **case: _tokens_one_rate(**case, which=min)),
            Mistake("sequences per second", "a sequence is block_size tokens: tokens/s = sequences/s x "
                    "block_size", given_right=lambda right, **case: right / case["block_size"]),
            Mistake("seconds per token", "that is the inverse: return tokens per second",
                    given_right=lambda right, **case: 1.0 / right if right else None),
        )),
    Exercise(
        "q07_int8_size", "int8_weight_only_bytes", call=_int8_call, show=_int8_show,
        needs=("torch", "lab_utils.learn.models.gpt"),
        giveaways=(r"re:fp32 embedding and an int8 copy", r"re:not exactly 4x smaller",
                   r"re:(the )?head gets? (its own|an) int8 copy and the embedding"),
        implemented_by=("lab_utils.experiments.n07_quantization.quant_model.payload_bytes",),
        mistakes=(
            Mistake("int8 is 4x smaller", "only the Linear weights become int8 (plus a scale and a zero "
                    "point per row); embeddings, biases and LayerNorms stay in float, and the tied head "
                    "gets its own int8 copy",
                    wrong=lambda model, keep_in_float=(): sum(p.nbytes for p in model.parameters()) / 4),
            Mistake("no scales or zero points", "each output row of a quantized weight also stores one fp32 "
                    "scale and one int8 zero point (5 bytes per row)",
                    given_right=lambda right, model, keep_in_float=(): (
                        right - 5 * _quantized_rows(model, keep_in_float))),
            Mistake("the tied embedding counted once", "quantizing the head gives it its own int8 copy "
                    "while the embedding it shared stays in float: count both",
                    given_right=lambda right, model, keep_in_float=(): (
                        right if "lm_head" in keep_in_float else right - _tied_head_bytes(model))),
            Mistake("a shared float tensor counted twice", "a tensor shared by two modules (the tied head "
                    "and embedding, both kept in float) is stored once",
                    given_right=lambda right, model, keep_in_float=(): (
                        right + _tied_head_bytes(model) if "lm_head" in keep_in_float else right)),
        )),
)
