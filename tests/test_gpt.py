"""The GPT model, its formulas and checkpoints, and the character-level text data."""

from __future__ import annotations

import hashlib
import math
import urllib.error

import pytest
import torch

from lab_utils.experiments.shared import text_data
from lab_utils.experiments.shared.gpt_checkpoint import load_checkpoint, save_checkpoint
from lab_utils.learn.errors import LabError
from lab_utils.learn.models.gpt import GPT, GPTConfig, count_parameters, lm_loss
from lab_utils.learn.models.gpt_sizes import (
    gpt_config,
    measure_train_flops_per_token,
    parameter_count,
    train_flops_per_token,
)


def tiny(vocab: int = 65, **kw) -> GPTConfig:
    return gpt_config("tiny", vocab_size=vocab, **kw)


# --------------------------------------------------------------------------- formulas


def test_parameter_count_of_tiny_by_hand():
    # V=65, T=64, C=64, L=2. Embeddings 65*64 + 64*64 = 8256. Per block 12*64^2 = 49152
    # weights, linear biases 3C+C+4C+C = 576, two LayerNorms 4C = 256 -> 49984.
    # Final LayerNorm 2C = 128. Tied head: 0. Total 8256 + 2*49984 + 128 = 108352.
    cfg = tiny()
    assert parameter_count(cfg) == 108_352
    assert count_parameters(GPT(cfg)) == 108_352


def test_parameter_count_without_bias_by_hand():
    # Per block 49152 + LayerNorm weights 2C = 128 -> 49280; final LayerNorm 64.
    cfg = tiny(bias=False)
    assert parameter_count(cfg) == 8256 + 2 * 49_280 + 64
    assert count_parameters(GPT(cfg)) == parameter_count(cfg)


def test_small_is_about_ten_million_parameters():
    # 65*384 + 256*384 + 6*(12*384^2 + 9*384 + 4*384) + 2*384 = 10,770,816
    cfg = gpt_config("small", vocab_size=65)
    assert parameter_count(cfg) == 10_770_816
    assert count_parameters(GPT(cfg)) == 10_770_816


def test_head_is_tied_to_the_token_embedding():
    m = GPT(tiny())
    assert m.lm_head.weight is m.wte.weight


def test_train_flops_per_token_by_hand_and_by_counter():
    # matmul weights 2*12*64^2 + 65*64 = 102464; 6x = 614784; attention 12*L*C*T = 12*2*64*64 = 98304
    cfg = tiny()
    assert train_flops_per_token(cfg) == 713_088
    assert measure_train_flops_per_token(GPT(cfg)) == pytest.approx(713_088)


def test_config_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(LabError, match="divisible"):
        GPTConfig(n_embd=65, n_head=2)
    with pytest.raises(LabError, match="size"):
        gpt_config("huge")


# --------------------------------------------------------------------------- behaviour


def test_forward_shape_and_initial_loss_near_uniform():
    torch.manual_seed(0)
    cfg = tiny()
    m = GPT(cfg)
    x = torch.randint(0, 65, (3, 20))
    logits = m(x)
    assert logits.shape == (3, 20, 65)
    # Small init: predictions close to uniform, loss close to ln(vocab).
    y = torch.randint(0, 65, (3, 20))
    assert lm_loss(logits, y).item() == pytest.approx(math.log(65), abs=0.1)


def test_future_token_cannot_change_an_earlier_logit():
    torch.manual_seed(0)
    m = GPT(tiny()).eval()
    x = torch.randint(0, 65, (2, 32))
    j = 17
    x2 = x.clone()
    x2[:, j] = (x2[:, j] + 1) % 65
    a, b = m(x), m(x2)
    assert torch.equal(a[:, :j], b[:, :j])          # positions before j never see token j
    assert not torch.allclose(a[:, j:], b[:, j:])   # positions from j on do


def test_too_long_input_is_rejected():
    m = GPT(tiny())
    with pytest.raises(LabError, match="block_size"):
        m(torch.zeros(1, 65, dtype=torch.long))


def test_generate_is_reproducible_and_crops_its_context():
    torch.manual_seed(0)
    m = GPT(tiny())
    start = torch.zeros(1, 70, dtype=torch.long)  # longer than block_size=64: cropped each step
    g1 = m.generate(start, 10, generator=torch.Generator().manual_seed(1))
    g2 = m.generate(start, 10, generator=torch.Generator().manual_seed(1))
    assert g1.shape == (1, 80)
    assert torch.equal(g1, g2)
    assert int(g1.min()) >= 0 and int(g1.max()) < 65
    greedy = m.generate(start[:, :5], 3, temperature=0)
    assert torch.equal(greedy, m.generate(start[:, :5], 3, temperature=0))
    assert m.training  # mode restored


def test_checkpoint_round_trip(tmp_path):
    torch.manual_seed(0)
    cfg = tiny(vocab=4)
    m = GPT(cfg)
    path = save_checkpoint(tmp_path / "c" / "gpt.pt", m, "abcd", "unit-test", {"val_loss": 1.5})
    raw = torch.load(path, weights_only=True)  # a plain dict: safe loading works
    assert raw["vocab"] == "abcd" and raw["config"]["n_layer"] == 2 and raw["metrics"]["val_loss"] == 1.5
    m2, payload = load_checkpoint(path)
    x = torch.randint(0, 4, (2, 10))
    assert torch.equal(m.eval()(x), m2(x))
    assert m2.lm_head.weight is m2.wte.weight
    assert payload["corpus"] == "unit-test"


def test_checkpoint_errors(tmp_path):
    m = GPT(tiny(vocab=4))
    with pytest.raises(LabError, match="vocab"):
        save_checkpoint(tmp_path / "x.pt", m, "abc", "c")
    with pytest.raises(LabError, match="notebook 06"):
        load_checkpoint(tmp_path / "missing.pt")


# --------------------------------------------------------------------------- text data


def test_vocab_round_trip_and_unknown_character():
    v = text_data.CharVocab.from_text("hello world")
    assert v.chars == " dehlorw"
    ids = v.encode("hold")
    assert ids.tolist() == [3, 5, 4, 1]
    assert v.decode(ids) == "hold"
    with pytest.raises(LabError, match="vocabulary"):
        v.encode("z")


def test_split_is_90_10_by_position():
    c = text_data.Corpus("t", "abcdefghij" * 10, "here", synthetic=True)
    s = text_data.split_corpus(c)
    assert (s.train_tokens, s.val_tokens) == (90, 10)
    assert s.vocab.decode(s.val) == "abcdefghij"


def test_token_windows_shift_by_one():
    data = torch.arange(20)
    ds = text_data.TokenWindows(data, block_size=5, stride=3)
    # windows start at 0, 3, ..., s with s + 6 <= 20: (20 - 5 - 1) // 3 + 1 = 5 windows
    assert len(ds) == 5
    x, y = ds[4]
    assert x.tolist() == [12, 13, 14, 15, 16] and y.tolist() == [13, 14, 15, 16, 17]
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(LabError, match="block_size"):
        text_data.TokenWindows(torch.arange(5), block_size=5)


def test_stdlib_corpus_is_deterministic_ascii_and_labelled():
    a = text_data.stdlib_corpus(50_000)
    b = text_data.stdlib_corpus(50_000)
    assert a.text == b.text and len(a.text) == 50_000
    assert a.synthetic and a.name.startswith("python-stdlib-")
    assert all(ch == "\n" or " " <= ch <= "~" for ch in set(a.text))


def test_auto_uses_the_stand_in_without_prepared_data(tmp_path):
    assert text_data.resolve_corpus("auto", tmp_path) == "stdlib"
    with pytest.raises(LabError, match="prepare"):
        text_data.resolve_corpus("shakespeare", tmp_path) and text_data.shakespeare_corpus(tmp_path)
    with pytest.raises(LabError, match="corpus"):
        text_data.resolve_corpus("klingon")


def test_prepare_offline_names_the_fix(tmp_path, monkeypatch):
    def offline(*a, **k):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(text_data.urllib.request, "urlopen", offline)
    with pytest.raises(LabError, match="machine with internet"):
        text_data.prepare_corpus(tmp_path)
    assert not (tmp_path / text_data.SHAKESPEARE_FILE).exists()


class _Response:
    def __init__(self, payload: bytes):
        self.payload = payload

    def read(self):
        return self.payload

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_prepare_checks_the_checksum(tmp_path, monkeypatch):
    payload = b"First Citizen:\nBefore we proceed any further, hear me speak.\n" * 10
    monkeypatch.setattr(text_data.urllib.request, "urlopen", lambda *a, **k: _Response(payload))
    with pytest.raises(LabError, match="SHA-256"):  # wrong bytes are refused
        text_data.prepare_corpus(tmp_path)
    monkeypatch.setattr(text_data, "SHAKESPEARE_SHA256", hashlib.sha256(payload).hexdigest())
    monkeypatch.setattr(text_data, "SHAKESPEARE_BYTES", len(payload))
    path = text_data.prepare_corpus(tmp_path)
    assert path.read_bytes() == payload
    assert text_data.resolve_corpus("auto", tmp_path) == "shakespeare"
    c = text_data.load_corpus("auto", tmp_path)
    assert c.name == "tiny-shakespeare" and not c.synthetic
