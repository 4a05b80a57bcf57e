"""Tests of experiments.quantize: accuracy of each int8/bf16 path, size accounting, unavailable rows.

Tolerances (stated here, asserted below), for a small trained language model whose
largest fp32 logit is a few units:

- bf16 and int8 weight-only: max |logit - fp32 logit| <= 2 % of max |fp32 logit|.
  Why: per-row symmetric int8 rounds each weight by at most scale/2 = max|w_row| / 254
  (0.4 % of the row's largest weight); bf16 keeps 8 significant bits (relative rounding
  <= 2^-9 = 0.2 %). Rounding errors of mixed signs partly cancel in a dot product; 2 %
  leaves a margin of about 5x over those per-element bounds (measured: about 0.3 %).
- int8 dynamic (activations quantized too, per tensor in torch.ao with 7-bit range on
  x86, per token in torchao): <= 5 % (measured: 0.5-1 %).
- validation loss increase over fp32: <= 0.01 nats per token for every variant
  (measured: below 1e-4).
"""

from __future__ import annotations

import importlib
import math
import sys
import types
import warnings

import pandas as pd
import pytest
import torch
from store_helpers import lab_for
from torch import nn

from lab_utils.engine import profiles
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import make_plan, measure
from lab_utils.experiments.n07_quantization import experiment as Q
from lab_utils.experiments.n07_quantization import quant_model as QM
from lab_utils.experiments.n07_quantization import quant_timing as QT
from lab_utils.experiments.n07_quantization import quant_variants as QV
from lab_utils.experiments.n07_quantization import tables as QTab
from lab_utils.experiments.n07_quantization import worker as QW
from lab_utils.learn.errors import LabError

LOGIT_TOL = {"fp32": 0.0, "bf16": 0.02, "torchao_int8_weight_only": 0.02,
             "ao_dynamic_int8": 0.05, "torchao_int8_dynamic": 0.05}
LOSS_INCREASE_BOUND = 0.01  # nats per token
V, C, T = 32, 32, 32


class ToyLM(nn.Module):
    """Token embedding, a residual MLP, LayerNorm and a Linear head: (B, T) ids -> (B, T, V) logits."""

    def __init__(self, vocab: int = V, dim: int = C):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = x + self.proj(torch.nn.functional.gelu(self.fc(x)))
        return self.head(self.ln(x))


def pattern_tokens(n: int, seed: int) -> torch.Tensor:
    """next = (3 * current + 1) mod V, with 10 % of tokens replaced by random ones."""
    g = torch.Generator().manual_seed(seed)
    noise, rnd = torch.rand(n, generator=g), torch.randint(0, V, (n,), generator=g)
    out = [0]
    for i in range(1, n):
        out.append(int(rnd[i]) if noise[i] < 0.1 else (3 * out[-1] + 1) % V)
    return torch.tensor(out, dtype=torch.long)


@pytest.fixture(scope="module")
def toy():
    """A ToyLM trained for a few dozen steps on the pattern (val loss well below ln V)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster and immune to contention
    try:
        torch.manual_seed(0)
        train, val = pattern_tokens(8000, 0), pattern_tokens(2049, 1)
        model = ToyLM()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(80):
            i = torch.randint(0, train.numel() - T - 1, (16,))
            x = torch.stack([train[j: j + T] for j in i])
            y = torch.stack([train[j + 1: j + T + 1] for j in i])
            loss = nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        yield model, val
    finally:
        torch.set_num_threads(threads)


def available_cpu_variants() -> list[str]:
    return [v for v in Q.VARIANTS if Q.check_variant(v, "cpu").ok]


# --------------------------------------------------------------------------- accuracy


def test_toy_model_learned_the_pattern(toy):
    model, val = toy
    ev = QT.evaluate_lm(model, val, T, 16, "cpu")
    assert ev.loss < 0.5 * math.log(V)  # far better than guessing: the comparison below means something


@pytest.mark.parametrize("variant", Q.VARIANTS)
def test_quantized_logits_and_loss_close_to_fp32(toy, variant):
    model, val = toy
    avail = Q.check_variant(variant, "cpu")
    if not avail.ok:
        pytest.skip(f"{variant} unavailable here: {avail.reason}")
    x = val[: 8 * T].view(8, T)
    with torch.no_grad():
        ref = model(x)
        out = Q.quantize_model(model, variant, "cpu")(x).float()
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    assert err <= LOGIT_TOL[variant] * ref.abs().max().item() + 1e-6, (variant, err)
    base = QT.evaluate_lm(model, val, T, 16, "cpu")
    q = QT.evaluate_lm(Q.quantize_model(model, variant, "cpu"), val, T, 16, "cpu")
    assert q.tokens == base.tokens
    assert q.loss - base.loss <= LOSS_INCREASE_BOUND, (variant, q.loss - base.loss)


def test_quantize_model_leaves_the_input_untouched(toy):
    model, _ = toy
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for variant in available_cpu_variants():
        Q.quantize_model(model, variant, "cpu")
    after = model.state_dict()
    assert all(type(after[k]) is torch.Tensor and torch.equal(before[k], after[k]) for k in before)


def test_weight_only_int8_error_within_hand_bound():
    """One Linear: |y_q - y|_j <= sum_k |x_k| * scale_j / 2, scale_j = max_k |W_jk| / 127."""
    if not Q.check_variant("torchao_int8_weight_only", "cpu").ok:
        pytest.skip("torchao unavailable")
    torch.manual_seed(1)
    lin = nn.Linear(48, 24, bias=False).eval()
    x = torch.randn(5, 48)
    q = Q.quantize_model(nn.Sequential(lin), "torchao_int8_weight_only", "cpu")
    with torch.no_grad():
        err = (q(x) - lin(x)).abs()
    scale = lin.weight.detach().abs().amax(dim=1) / 127          # (24,)
    bound = x.abs().sum(dim=1, keepdim=True) * scale / 2            # (5, 24)
    assert (err <= bound * (1 + 1e-4) + 1e-6).all()
    assert err.max() > 0  # it really was rounded


# --------------------------------------------------------------------------- sizes


def test_payload_bytes_by_hand():
    lin = nn.Sequential(nn.Linear(64, 32))
    assert Q.payload_bytes(lin.state_dict()) == (64 * 32 + 32) * 4  # 8320 bytes of fp32
    tied = nn.Module()
    tied.a = nn.Linear(16, 8, bias=False)
    tied.b = nn.Linear(16, 8, bias=False)
    tied.b.weight = tied.a.weight
    assert Q.payload_bytes(tied.state_dict()) == 16 * 8 * 4  # one storage, counted once
    if Q.check_variant("torchao_int8_weight_only", "cpu").ok:
        q = Q.quantize_model(lin, "torchao_int8_weight_only", "cpu")
        # int8 weight + fp32 scale per row + int8 zero point per row + fp32 bias
        assert Q.payload_bytes(q.state_dict()) == 64 * 32 + 32 * 4 + 32 + 32 * 4


@pytest.mark.parametrize("variant", Q.VARIANTS)
def test_serialized_size_matches_the_file(tmp_path, variant):
    avail = Q.check_variant(variant, "cpu")
    if not avail.ok:
        pytest.skip(avail.reason)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    q = Q.quantize_model(model, variant, "cpu")
    size = QM.serialized_size_bytes(q)
    path = tmp_path / f"{variant}.pt"
    assert QM.save_state_dict(q, path) == size == path.stat().st_size
    if variant in ("fp32", "bf16"):  # the file is an ordinary torch.save file
        loaded = torch.load(path, weights_only=True)
        assert all(torch.equal(loaded[k], v) for k, v in q.state_dict().items())
    payload = Q.payload_bytes(q.state_dict())
    assert payload <= size <= payload + 8192  # the container adds headers, never fewer bytes
    fp32 = QM.serialized_size_bytes(model)
    expected = {"fp32": 1.0, "bf16": 0.5}.get(variant, 0.25)  # bytes per weight / 4
    assert size / fp32 == pytest.approx(expected, abs=0.06)


# --------------------------------------------------------------------------- evaluation, timing


class ZeroLM(nn.Module):
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.dummy = nn.Linear(1, 1)

    def forward(self, idx):
        return torch.zeros(*idx.shape, self.vocab)


def test_uniform_logits_give_log_vocab_loss_and_vocab_perplexity():
    tokens = torch.arange(101) % 7
    ev = QT.evaluate_lm(ZeroLM(7), tokens, block_size=10, batch_size=3, device="cpu")
    assert ev.windows == 10 and ev.tokens == 100  # (101 - 1) // 10 windows of 10 predictions
    assert ev.loss == pytest.approx(math.log(7))
    assert ev.perplexity == pytest.approx(7.0)
    assert QT.evaluate_lm(ZeroLM(7), tokens, 10, 3, "cpu", max_tokens=31).tokens == 30
    with pytest.raises(LabError):
        QT.evaluate_lm(ZeroLM(7), tokens[:5], 10, 3, "cpu")


def test_decode_timing_statistics_with_a_fake_clock():
    ticks = iter([0.0, 2.0, 10.0, 13.0, 20.0, 24.0])  # repetitions of 2, 3 and 4 s
    t = QT.time_interleaved({"m": ZeroLM(5)}, torch.zeros(4, 3, dtype=torch.long), new_tokens=8,
                            block_size=16, device="cpu", warmup=1, repeats=3, clock=lambda: next(ticks))["m"]
    assert t.seconds == [2.0, 3.0, 4.0]
    ms = QT.median_min_max("ms", t.ms_per_token)
    assert ms["ms"] == pytest.approx(3.0 * 1000 / 8)
    assert (ms["ms_min"], ms["ms_max"]) == (pytest.approx(250.0), pytest.approx(500.0))
    assert QT.median_min_max("rate", t.tokens_per_s)["rate"] == pytest.approx(4 * 8 / 3.0)


class LoggingLM(ZeroLM):
    def __init__(self, name: str, log: list, fail: bool = False):
        super().__init__(5)
        self.name, self.log, self.fail = name, log, fail

    def forward(self, idx):
        if self.fail:
            raise RuntimeError("no kernel for this")
        self.log.append(self.name)
        return super().forward(idx)


def test_time_interleaved_rotates_the_order_and_isolates_failures():
    log: list[str] = []
    models = {"a": LoggingLM("a", log), "b": LoggingLM("b", log), "bad": LoggingLM("bad", log, fail=True)}
    ticks = iter(range(100))
    out = QT.time_interleaved(models, torch.zeros(1, 2, dtype=torch.long), new_tokens=1, block_size=8,
                             device="cpu", warmup=1, repeats=3, clock=lambda: float(next(ticks)))
    assert isinstance(out["bad"], RuntimeError)
    assert log == ["a", "b", "a", "b", "b", "a", "a", "b"]  # warm-ups, then rotated repetitions
    assert out["a"].seconds == [1.0, 1.0, 1.0] and len(out["b"].seconds) == 3


def test_greedy_decode_shape_and_block_crop():
    out = QT.greedy_decode(ZeroLM(5), torch.ones(2, 3, dtype=torch.long), new_tokens=6, block_size=4)
    assert out.shape == (2, 9) and (out[:, 3:] == 0).all()  # argmax of equal logits is id 0


def test_context_and_intensity_formulas():
    assert QT.mean_context_tokens(8, 16, 64) == pytest.approx(15.5)  # mean of 8..23
    assert QT.mean_context_tokens(60, 8, 64) == pytest.approx((60 + 61 + 62 + 63 + 64 * 4) / 8)
    assert QT.weight_flops_per_byte(10, 4) == 5.0     # fp32, 10 rows: 2*10 FLOPs per 4 bytes
    assert QT.weight_flops_per_byte(10, 1) == 20.0    # int8 weights: 4x the intensity
    with pytest.raises(LabError):
        QT.weight_flops_per_byte(0, 1)


def test_the_roofline_gives_each_row_its_own_precisions_ridge():
    """Issue 52, B6. The full profile decodes 64 tokens after a 32-token prompt (block 256): mean context
    63.5 tokens, no KV cache, so batch 1 multiplies each weight by 63.5 rows. On an H100 SXM (3.35 TB/s):
    fp32 2 x 63.5 / 4 = 31.75 FLOP/B above its ridge 67 / 3.35 = 20: compute-bound; bf16 63.5 below 989 /
    3.35 = 295.2: memory-bound; int8 weight-only multiplies in fp32: 127 above 20; int8 dynamic multiplies in
    int8: 127 below 1979 / 3.35 = 590.7. At batch 64 every row is compute-bound. (With one bf16 ridge for
    every row, as before, fp32 batch 1 read memory-bound.)"""
    from lab_utils.engine import profiles
    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.experiments.n07_quantization import tables as quantize_tables

    assert QT.ridge_flops_per_byte("fp32") == pytest.approx(20.0, abs=0.01)
    assert QT.ridge_flops_per_byte("bf16") == pytest.approx(295.2, abs=0.1)
    assert QT.ridge_flops_per_byte("int8") == pytest.approx(590.7, abs=0.1)
    with pytest.raises(LabError, match="fp32, bf16 or int8"):
        QT.ridge_flops_per_byte("fp8")
    s = profiles.settings(Q.Settings, "full")
    df = quantize_tables.intensity_frame(s, 256).set_index(["decoding step", "variant"])
    one = df.loc["batch 1"]
    assert set(one["rows per matmul"]) == {63.5}
    assert one.loc["fp32", "FLOP/byte"] == pytest.approx(31.75)
    assert one["on an H100 SXM"].to_dict() == {
        "fp32": "compute-bound", "bf16": "memory-bound", "ao_dynamic_int8": "memory-bound",
        "torchao_int8_weight_only": "compute-bound", "torchao_int8_dynamic": "memory-bound"}
    assert one.loc["torchao_int8_weight_only", "multiplies in"] == "fp32"
    assert one.loc["bf16", "H100 SXM ridge (FLOP/byte)"] == pytest.approx(295.2, abs=0.1)
    assert set(df.loc["large batch, GPU"]["on an H100 SXM"]) == {"compute-bound"}


# --------------------------------------------------------------------------- unavailable paths


@pytest.fixture
def gpt_checkpoint(tmp_path):
    """A tiny (untrained) GPT checkpoint on 20,000 characters of the offline corpus."""
    from lab_utils.experiments.shared.gpt_checkpoint import save_checkpoint
    from lab_utils.experiments.shared.text_data import load_corpus
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    corpus = load_corpus("stdlib", max_chars=20_000)
    vocab = "".join(sorted(set(corpus.text)))
    torch.manual_seed(0)
    gpt = GPT(gpt_config("tiny", vocab_size=len(vocab)))
    return save_checkpoint(tmp_path / "gpt.pt", gpt, vocab, corpus.name, {"max_chars": 20_000})


TINY = dict(devices=("cpu",), eval_tokens=256, prompt_tokens=4, new_tokens=2, cpu_large_batch=2, warmup=0,
            repeats=1)


def test_a_devices_variants_are_measured_together_and_reused_whole(gpt_checkpoint, store):
    """THE measure on notebook 07's plan (the CPU: in this process): a disabled variant is a row that says
    so (not stored), the others share one session; a re-run reuses them, a new variant measures the
    device's group again side by side, ``force`` too."""
    kw = dict(TINY, checkpoint=str(gpt_checkpoint))
    s = profiles.settings(Q.Settings, "quick", variants=("fp32", "bf16", "torchao_int8_dynamic"),
                          disabled=("torchao_int8_dynamic",), **kw)
    recs = measure(lab_for(store), Q.QUANTIZATION_EXPERIMENT, s)
    assert [r.status for r in recs] == ["ok", "ok", "skipped"]
    assert recs[2].reason == Q.DISABLED and recs[0].config["model_id"] == QW.file_sha256(gpt_checkpoint)
    assert recs[0].metrics["run_id"] == recs[1].metrics["run_id"]   # one session: interleaved timings
    assert [r.metrics["group_runs"] for r in recs[:2]] == [2, 2]     # the disabled variant is not run
    df = QTab.quantization_table(recs)
    fp, skipped = df.iloc[0], df.iloc[2]
    assert fp["speedup_b1"] == pytest.approx(1.0) and fp["size_vs_fp32"] == pytest.approx(1.0)
    assert skipped["status"] == "skipped" and "disabled" in skipped["note"]
    assert skipped["size_bytes"] == "" and pd.isna(skipped["val_loss"])
    avail = QTab.availability_frame(recs)
    assert list(avail["available"]) == [True, True, False] and avail["kernel / reason"][2] == Q.DISABLED
    again = measure(lab_for(store), Q.QUANTIZATION_EXPERIMENT, s)
    assert [r.metrics["run_id"] for r in again[:2]] == [r.metrics["run_id"] for r in recs[:2]]
    assert len(store.records(Q.EXPERIMENT)) == 2
    one = profiles.settings(Q.Settings, "quick", variants=("fp32",), **kw)
    [fp32] = measure(lab_for(store), Q.QUANTIZATION_EXPERIMENT, one)
    assert fp32.metrics["run_id"] == recs[0].metrics["run_id"]
    both = measure(lab_for(store), Q.QUANTIZATION_EXPERIMENT,
                   profiles.settings(Q.Settings, "quick", variants=("fp32", "ao_dynamic_int8"), **kw))
    assert both[0].metrics["run_id"] == both[1].metrics["run_id"] != recs[0].metrics["run_id"]
    assert both[0].metrics["group_runs"] == 2
    assert len(store.records(Q.EXPERIMENT)) == 4
    measure(lab_for(store), Q.QUANTIZATION_EXPERIMENT, one, force=True)
    assert len(store.records(Q.EXPERIMENT)) == 5


def test_the_plan_for_a_gpu_node_and_its_cost(gpt_checkpoint):
    """For 4 GPUs, on this CPU: the CPU's variants in this process, the GPU's launched (one process, no
    process group), each device one side-by-side group; the model is a job option, not part of the key."""
    s = profiles.settings(Q.Settings, "full", checkpoint=str(gpt_checkpoint), disabled=("bf16",))
    runs = make_plan(Q.QUANTIZATION_EXPERIMENT, s, Machine(gpus=4, gpu_name="G", cores=8), "full")
    assert [(r.device, r.config["variant"]) for r in runs[:2]] == [("cpu", "fp32"), ("cpu", "bf16")]
    assert {(r.device, r.in_process, r.together, r.group, r.processes) for r in runs} == {
        ("cpu", True, True, "quantization cpu", 1), ("cuda", False, True, "quantization cuda", 1)}
    assert len(runs) == 2 * len(Q.VARIANTS) and [r.skip for r in runs].count(Q.DISABLED) == 2
    assert runs[-1].options == {"checkpoint": str(gpt_checkpoint), "process_group": False}
    assert "cpu_threads" in runs[0].config and "cpu_threads" not in runs[-1].config
    assert [Q.cost(r) for r in (runs[0], runs[-1])] == [45.0, 10.0]
    cpu_only = make_plan(Q.QUANTIZATION_EXPERIMENT, s, Machine(gpus=0, cores=2), "full")
    assert {r.device for r in cpu_only} == {"cpu"}
    small = Q.doctor_settings(s)
    assert (small.repeats, small.new_tokens, small.warmup) == (1, 2, 0) and small.variants == s.variants


def test_without_notebook_06s_checkpoint_a_gpt_is_trained_here_once(store, monkeypatch):
    """No checkpoint from notebook 06: the fallback GPT is trained through THE measure (in this process on
    a CPU) and kept; the next call uses the file."""
    s = profiles.settings(Q.Settings, "quick", fallback_steps=2, fallback_max_chars=20_000)
    path, source = Q.model_checkpoint(lab_for(store), s)
    assert path.exists() and "trained here for 2 steps" in source
    rec, rank0 = store.records("gpt_fallback")                        # the aggregate and its one rank
    assert rec.metrics["steps_done"] == 2 and rec.config["size"] == "tiny" and rank0.config["rank"] == 0
    assert Q.model_checkpoint(lab_for(store), s)[0] == path and len(store.records("gpt_fallback")) == 2
    mut = Q.load_model_under_test(path, source)
    assert mut.source == source and mut.val_tokens.numel() > 0


def test_missing_torchao_module_gives_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    for variant in QV.TORCHAO_CONFIGS:
        a = Q.check_variant(variant, "cpu")
        assert not a.ok and "torchao is not installed" in a.reason
    assert QV.torchao_version() is None


def test_torchao_version_is_the_packages_own_without_importing_it():
    """Notebook 07's plan keys its runs by torchao's version, and every notebook's time-budget cell builds
    that plan: the version is read without importing torchao (which loads torch._dynamo, ~3 s of CPU)."""
    import subprocess

    code = ("import sys; from lab_utils.app.time_budget import budget_line; budget_line('07'); "
            "from lab_utils.experiments.n07_quantization.quant_variants import torchao_version; "
            "print(torchao_version(), 'torchao' in sys.modules, 'torch._dynamo' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    import torchao

    assert res.stdout.split() == [torchao.__version__, "False", "False"], res.stderr


def test_missing_quantize_dynamic_and_cuda_only_rows(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.ao.quantization", types.ModuleType("torch.ao.quantization"))
    a = Q.check_variant("ao_dynamic_int8", "cpu")
    assert not a.ok and "removed upstream" in a.reason
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    a = Q.check_variant("ao_dynamic_int8", "cuda")
    assert not a.ok and "CPU only" in a.reason


def test_deprecation_is_detected_and_labelled(monkeypatch):
    real = importlib.import_module("torch.ao.quantization")

    def warns(model, *args, **kw):
        warnings.warn("quantize_dynamic is deprecated, use torchao", DeprecationWarning, stacklevel=2)
        return model

    def silent(model, *args, **kw):
        return model

    for fn, expect in ((warns, "deprecated upstream"), (silent, None)):
        fake = types.ModuleType("torch.ao.quantization")
        fake.quantize_dynamic = fn
        monkeypatch.setitem(sys.modules, "torch.ao.quantization", fake)
        a = QV.ao_dynamic_status()
        assert a.ok
        assert (a.note is None) if expect is None else (expect in a.note and "use torchao" in a.note)
    monkeypatch.setitem(sys.modules, "torch.ao.quantization", real)


def test_a_probe_failing_without_a_message_is_still_a_row(monkeypatch):
    """An exception with an empty message (``RuntimeError()``) becomes a row naming its class, not an
    IndexError from taking the first of no lines (core.errors.first_line, the one way to quote a line)."""
    from lab_utils.learn.errors import error_line, first_line

    assert first_line(RuntimeError()) == "" and first_line(RuntimeError("  a\nb")) == "a"
    assert error_line(RuntimeError()) == "RuntimeError" and error_line(KeyError("k")) == "KeyError: 'k'"
    assert first_line("x" * 500, 120) == "x" * 120

    def fails(model, *args, **kw):
        raise RuntimeError()

    fake = types.ModuleType("torch.ao.quantization")
    fake.quantize_dynamic = fails
    monkeypatch.setitem(sys.modules, "torch.ao.quantization", fake)
    a = QV.ao_dynamic_status()
    assert not a.ok and a.reason == "quantize_dynamic fails here: RuntimeError"


def test_no_cuda_row_and_unknown_variant():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    a = Q.check_variant("fp32", "cuda")
    assert not a.ok and "no CUDA device" in a.reason
    with pytest.raises(LabError):
        Q.check_variant("int3", "cpu")


# --------------------------------------------------------------------------- table, settings


def _rec(variant, status="ok", **m):
    from lab_utils.engine.store import Record

    return Record(experiment="quantization", config={"variant": variant, "device": "cpu"}, metrics=m,
                  status=status, reason=None if status == "ok" else "needs torchao")


def test_table_speedups_by_hand():
    common = {"ms_per_token_b1_min": 1.0, "ms_per_token_b1_max": 2.0, "tokens_per_s_large_min": 1.0,
              "tokens_per_s_large_max": 2.0, "large_batch": 16}
    recs = [_rec("fp32", size_bytes=4000, val_loss=1.50, perplexity=math.exp(1.5), ms_per_token_b1=10.0,
                 tokens_per_s_large=100.0, **common),
            _rec("torchao_int8_weight_only", size_bytes=1100, val_loss=1.52, perplexity=math.exp(1.52),
                 ms_per_token_b1=5.0, tokens_per_s_large=150.0, **common),
            _rec("torchao_int8_dynamic", status="skipped")]
    df = QTab.quantization_table(recs).set_index("variant")
    assert df.loc["torchao_int8_weight_only", "speedup_b1"] == pytest.approx(2.0)
    assert df.loc["torchao_int8_weight_only", "speedup_large"] == pytest.approx(1.5)
    assert df.loc["torchao_int8_weight_only", "size_vs_fp32"] == pytest.approx(0.275)
    assert df.loc["torchao_int8_weight_only", "loss_increase"] == pytest.approx(0.02)
    assert df.loc["torchao_int8_dynamic", "note"] == "needs torchao"
    assert df.loc["fp32", "size_bytes"] == 4000


def test_findings_state_the_measured_numbers():
    common = {"ms_per_token_b1_min": 1.0, "ms_per_token_b1_max": 1.2, "tokens_per_s_large_min": 1.0,
              "tokens_per_s_large_max": 2.0, "large_batch": 16, "size_bytes": 1000}
    recs = [_rec("fp32", val_loss=1.5, perplexity=4.5, ms_per_token_b1=10.0, tokens_per_s_large=100.0,
                 method="float", **common),
            _rec("ao_dynamic_int8", val_loss=1.51, perplexity=4.6, ms_per_token_b1=8.0,
                 tokens_per_s_large=180.0, method="dynamic", **common),
            _rec("torchao_int8_dynamic", val_loss=1.51, perplexity=4.6, ms_per_token_b1=20.0,
                 tokens_per_s_large=50.0, method="dynamic", **common)]
    text = "\n".join(QTab.findings(recs))
    assert "ao_dynamic_int8 1.80x (batch 16)" in text and "torchao_int8_dynamic 0.50x (batch 16)" in text
    assert "one implementation beats fp32, the other loses to it" in text
    assert "+0.0100 nats/token" in text and "varied" not in text  # spreads of 1.2x: no warning
    recs[1].metrics["ms_per_token_b1_max"] = 3.0
    assert "varied by up to 3.0x" in "\n".join(QTab.findings(recs))


def test_settings_validation():
    assert profiles.settings(Q.Settings, "quick").repeats >= 1
    with pytest.raises(LabError):
        profiles.settings(Q.Settings, "quick", variants=("int4",))
    with pytest.raises(LabError):
        profiles.settings(Q.Settings, "quick", repeats=0)
    with pytest.raises(LabError):
        profiles.settings(Q.Settings, "quick", devices=("tpu",))
    with pytest.raises(LabError):
        profiles.settings(Q.Settings, "nope")
    assert profiles.settings(Q.Settings, "quick", disabled="bf16").disabled == ("bf16",)


# --------------------------------------------------------------------------- the GPT


def test_gpt_checkpoint_round_trip_and_quantized_gpt(gpt_checkpoint, tmp_path):
    mut = Q.load_model_under_test(gpt_checkpoint, "notebook 06's")
    assert mut.val_tokens.numel() == 2_000 and mut.synthetic is True and mut.source == "notebook 06's"
    x = mut.val_tokens[:64].view(1, 64)
    with torch.no_grad():
        ref = mut.model(x)
    fp32_size = QM.serialized_size_bytes(mut.model)
    for variant in available_cpu_variants():
        q = Q.quantize_model(mut.model, variant, "cpu")  # the tied head must not break anything
        with torch.no_grad():
            out = q(x).float()
        assert torch.isfinite(out).all() and out.shape == ref.shape
        assert (out - ref).abs().max() <= 0.05 * ref.abs().max() + 1e-3
        if variant != "fp32":
            assert QM.serialized_size_bytes(q) < 0.6 * fp32_size
    with pytest.raises(LabError, match="run notebook 06 first"):
        Q.load_model_under_test(tmp_path / "absent.pt")


# --------------------------------------------------------------------------- int8 mm shapes


def test_int8_mm_shape_rule():
    assert QM.int8_mm_shape_problem(384, 1536) is None
    assert QM.int8_mm_shape_problem(384, 65) == "(N=65) kept in fp32: int8 mm needs N % 8 == 0"
    assert QM.int8_mm_shape_problem(60, 65) == ("(K=60, N=65) kept in fp32: int8 mm needs K % 8 == 0 "
                                               "and N % 8 == 0")


def test_lm_head_with_65_outputs_stays_fp32_in_the_cuda_int8_dynamic_row(store, monkeypatch):
    """torchao's CUDA int8 mm would run lm_head (N = 65) as a CPU int32 matmul: the layer is
    kept in fp32 and the row says so. CUDA is simulated: the layer choice for "cuda" is
    applied to a run on the CPU."""
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    if not Q.check_variant("torchao_int8_dynamic", "cpu").ok:
        pytest.skip("torchao int8 dynamic is not available on this CPU")
    torch.manual_seed(0)
    gpt = GPT(gpt_config("tiny", vocab_size=65)).eval()
    want = {"lm_head": "(N=65) kept in fp32: int8 mm needs N % 8 == 0"}
    assert QM.float_layers(gpt, "torchao_int8_dynamic", "cuda") == want
    assert QM.float_layers(gpt, "torchao_int8_dynamic", "cpu") == {}          # CPU _int_mm takes any N
    assert QM.float_layers(gpt, "torchao_int8_weight_only", "cuda") == {}     # float mm, no _int_mm

    real = QM.float_layers
    on_cuda = lambda model, variant, device: real(model, variant, "cuda")  # noqa: E731
    monkeypatch.setattr(QM, "float_layers", on_cuda)  # quantize_model's
    monkeypatch.setattr(QW, "float_layers", on_cuda)  # measure_device's
    q = Q.quantize_model(gpt, "torchao_int8_dynamic", "cpu")
    assert type(q.lm_head.weight.data) is torch.Tensor                      # left in fp32
    assert type(q.blocks[0].mlp.fc.weight.data) is not torch.Tensor         # quantized (Int8Tensor)
    x = torch.randint(0, 65, (1, 16))
    with torch.no_grad():
        assert torch.isfinite(q(x)).all()

    val = torch.randint(0, 65, (600,))
    mut = Q.ModelUnderTest(gpt, val, 64, dataset="random", synthetic=True)
    s = profiles.settings(Q.Settings, "quick", variants=("fp32", "torchao_int8_dynamic"), **TINY)
    recs = QW.measure_device(mut, s.variants, "cpu", s.measure_key())
    for v, r in zip(s.variants, recs):
        r.config = {"variant": v, "device": "cpu"}
    assert [r.status for r in recs] == ["ok", "ok"]
    assert "kept_in_float" not in recs[0].metrics
    assert recs[1].metrics["kept_in_float"] == want
    note = QTab.quantization_table(recs).iloc[1]["note"]
    assert "lm_head (N=65) kept in fp32: int8 mm needs N % 8 == 0" in note
