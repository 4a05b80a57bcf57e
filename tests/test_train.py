import math

import torch

from lab_utils.experiments.shared.data import make_loaders
from lab_utils.learn.devices import wrap_data_parallel
from lab_utils.learn.evaluation import evaluate
from lab_utils.learn.loop import StepOptions, make_optimizer, run_epoch, train_steps
from lab_utils.learn.models import ResNet18


def test_spec_optimizer():
    opt = make_optimizer(ResNet18(width=8))
    g = opt.param_groups[0]
    assert (g["lr"], g["momentum"], g["weight_decay"]) == (0.1, 0.9, 5e-4)


def test_two_epoch_quick_run_loss_falls():
    torch.manual_seed(0)
    loaders = make_loaders(batch_size=32, num_workers=0, train_images=512, test_images=200,
                           dataset="synthetic")
    model = ResNet18(width=8)
    opt = make_optimizer(model, lr=0.05)
    r1 = run_epoch(model, loaders.train, opt, "cpu", epoch=1)
    r2 = run_epoch(model, loaders.train, opt, "cpu", epoch=2)
    after = evaluate(model, loaders.test, "cpu")
    assert r1.images == r2.images == 512 and r1.steps == 16
    assert r2.loss < r1.loss
    assert after.accuracy > 0.3  # chance is 0.1
    # the reported time excludes waiting on the loader and is made of the phases
    assert math.isclose(r2.train_seconds, r2.data_movement_seconds + r2.compute_seconds
                        + r2.communication_seconds)
    assert r2.epoch_seconds >= r2.train_seconds + r2.data_loading_seconds * 0.99
    assert r2.images_per_s == r2.images / r2.train_seconds
    assert r2.peak_memory_bytes is None  # not tracked on CPU
    assert r2.micro_steps == r2.steps == 16 and r2.skew_wait_seconds == 0.0 and r2.global_loss is None


def test_max_steps_and_data_parallel_wrapper_on_cpu():
    model = wrap_data_parallel(ResNet18(width=8))  # no GPUs: DataParallel just calls the module
    batches = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))) for _ in range(5)]
    r = run_epoch(model, batches, make_optimizer(model), "cpu", options=StepOptions(max_steps=2))
    assert r.steps == 2 and r.images == 8


def test_untimed_epoch_has_only_its_wall_clock():
    """timed=False (the fast path): no phase boundaries, so no train_seconds and no rate over it."""
    model = ResNet18(width=8)
    batches = [(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))) for _ in range(3)]
    r = run_epoch(model, batches, make_optimizer(model), "cpu", timed=False)
    assert r.epoch_seconds > 0 and r.train_seconds is None and r.images_per_s is None
    assert r.compute_seconds == r.data_loading_seconds == 0.0 and r.images == 12


def test_ranks_aggregate_the_slowest_rank_by_hand():
    """T(N) is the slowest rank's training time; phases come from the rank with the longest epoch."""
    from lab_utils.learn.ranks import aggregate_epoch

    r0 = {"rank": 0, "epoch": 2, "steps": 5, "micro_steps": 5, "images": 80, "tokens": 800,
          "epoch_seconds": 10.0, "train_seconds": 6.0, "compute_seconds": 5.0, "skew_wait_seconds": 3.0,
          "train_loss": 1.5, "eval_seconds": 1.0}
    r1 = {"rank": 1, "epoch": 2, "steps": 5, "micro_steps": 5, "images": 80, "tokens": 800,
          "epoch_seconds": 8.0, "train_seconds": 7.0, "compute_seconds": 6.5, "skew_wait_seconds": 0.5,
          "train_loss": 1.5, "eval_seconds": 2.0}
    a = aggregate_epoch([r0, r1])
    assert (a["epoch_seconds"], a["epoch_seconds_mean"], a["epoch_seconds_min"]) == (10.0, 9.0, 8.0)
    assert (a["slowest_rank"], a["fastest_rank"], a["imbalance"]) == (0, 1, 1.25)
    assert (a["train_seconds"], a["train_seconds_mean"]) == (7.0, 6.5)  # T(N): max over ranks
    assert (a["compute_seconds"], a["compute_seconds_mean"], a["compute_seconds_max"]) == (5.0, 5.75, 6.5)
    assert a["train_plus_skew_wait_seconds"] == 9.0 and a["eval_seconds"] == 2.0
    assert (a["images"], a["tokens"], a["steps"]) == (160, 1600, 5)
    assert a["images_per_s"] == 160 / 7.0 and a["tokens_per_s"] == 1600 / 7.0 and a["train_loss"] == 1.5


# --------------------------------------------------------------------------- the loop's options


class _TinyLM(torch.nn.Module):
    """Logits (B, T, V) from tokens (B, T): the shape of the GPT's output."""

    def __init__(self, vocab: int = 7):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, vocab)

    def forward(self, x):
        return self.emb(x)


def _lm_loss(logits, y):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _lm_batches(n: int, b: int = 2, t: int = 5):
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 7, (b, t), generator=g), torch.randint(0, 7, (b, t), generator=g))
            for _ in range(n)]


def test_untimed_loop_never_synchronizes(monkeypatch):
    from lab_utils.learn import timing

    calls = []
    monkeypatch.setattr(timing, "synchronize", lambda *a: calls.append(a))
    model = ResNet18(width=8)
    batches = [(torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))) for _ in range(3)]
    sums = train_steps(model, batches, 3, make_optimizer(model), torch.nn.CrossEntropyLoss(), None,
                       torch.device("cpu"))
    assert calls == [] and sums.steps == 3 and sums.images == 6
    train_steps(model, batches, 3, make_optimizer(model), torch.nn.CrossEntropyLoss(),
                timing.PhaseTimer(torch.device("cpu")), torch.device("cpu"))
    assert len(calls) > 3  # a timed pass synchronizes at every phase boundary


def test_lr_at_max_steps_and_language_model_logits():
    model = _TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = []

    def lr_at(step):
        seen.append(step)
        return 0.1 * (step + 1)

    sums = train_steps(model, _lm_batches(6), 6, opt, _lm_loss, None, torch.device("cpu"),
                       StepOptions(count_correct=False, lr_at=lr_at, first_step=10, max_steps=4))
    assert sums.steps == 4 and seen == [10, 11, 12, 13]
    assert math.isclose(opt.param_groups[0]["lr"], 1.4)
    assert float(sums.correct) == 0.0  # not counted for a language model


def test_autocast_bf16_reaches_the_loss():
    dtypes = []

    def loss_fn(logits, y):
        dtypes.append(logits.dtype)
        return _lm_loss(logits.float(), y)

    model = torch.nn.Sequential(torch.nn.Embedding(7, 8), torch.nn.Linear(8, 7))
    train_steps(model, _lm_batches(1), 1, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, None,
                torch.device("cpu"), StepOptions(count_correct=False, autocast_dtype=torch.bfloat16))
    assert dtypes == [torch.bfloat16]


def test_accumulation_on_a_plain_model_equals_one_big_batch():
    torch.manual_seed(0)
    a, b = _TinyLM(), _TinyLM()
    b.load_state_dict(a.state_dict())
    batches = _lm_batches(4)
    cpu = torch.device("cpu")
    train_steps(a, batches, 4, torch.optim.SGD(a.parameters(), lr=0.5), _lm_loss, None, cpu,
                StepOptions(count_correct=False, accumulation_steps=4))
    big = (torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    train_steps(b, [big], 1, torch.optim.SGD(b.parameters(), lr=0.5), _lm_loss, None, cpu,
                StepOptions(count_correct=False))
    torch.testing.assert_close(a.emb.weight, b.emb.weight)


def test_evaluate_counts_tokens_stops_early_and_restores_training_mode():
    model = _TinyLM()
    model.train()
    batches = _lm_batches(5)
    ev = evaluate(model, batches, "cpu", loss_fn=_lm_loss, count_correct=False, max_batches=2)
    assert model.training and ev.images == 2 * 2 * 5 and math.isnan(ev.accuracy)
    with torch.no_grad():
        want = sum(float(_lm_loss(model(x), y)) for x, y in batches[:2]) / 2
    assert math.isclose(ev.loss, want, rel_tol=1e-6)


def test_every_epoch_record_field_is_in_the_glossary():
    """The epoch driver's record and the rank aggregate use the glossary's names (one meaning each)."""
    from dataclasses import fields

    from lab_utils.learn.epoch_record import EpochRecord
    from lab_utils.learn.metrics import GLOSSARY, define, unknown

    assert unknown(f.name for f in fields(EpochRecord)) == []
    assert define("compute_seconds_mean").unit == "s" and define("loss_mean") is None  # suffixes: times only
    assert {m.unit for m in GLOSSARY.values()} <= {
        "s", "us", "ms", "bytes", "count", "fraction", "%", "nats", "lr", "-", "ratio", "images/s",
        "tokens/s", "GB/s", "FLOP", "FLOP/s", "TFLOP/s", "FLOP/byte", "MiB"}
