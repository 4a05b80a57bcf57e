"""The autograded exercises (:data:`EXERCISES`, one per otter question): how each is called, how an
answer is compared (:func:`same`), which known mistakes it names (:func:`explain`), and :func:`check`,
the call in every check cell. The cases live in the master notebooks' test cells (the package
docstring says how an exercise is written); the grader runs the same :meth:`Exercise.run` in its
sandbox. Importing this module is cheap: torch is imported only by the cases that build a model.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from lab_utils.app.grading.fakes import FakeAsyncDevice
from lab_utils.experiments.shared import anchors

NOT_DONE = "not done yet"
REL_TOL = 1e-9
ABS_TOL = 1e-12


# --------------------------------------------------------------------------- answers as data


def plain(value: Any, _depth: int = 0) -> Any:
    """``value`` as plain data: bool, int, float, str, None, lists and dicts of those.

    numpy and torch scalars and arrays become numbers and lists (``tolist``); tuples become lists.
    Anything else becomes ``{"unsupported": "<type name>"}``, which never equals an answer.
    """
    if _depth > 20:
        return {"unsupported": "nesting deeper than 20"}
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (list, tuple)):
        return [plain(v, _depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v, _depth + 1) for k, v in value.items()}
    tolist = getattr(value, "tolist", None)
    if callable(tolist) and hasattr(value, "shape"):  # numpy / torch arrays and scalars
        return plain(tolist(), _depth + 1)
    return {"unsupported": type(value).__name__}


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def same(got: Any, want: Any, rel_tol: float = REL_TOL, abs_tol: float = ABS_TOL) -> bool:
    """Whether answer ``got`` equals ``want`` (numbers within ``rel_tol``, or ``abs_tol`` near zero)."""
    if _is_number(want):
        return _is_number(got) and math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol)
    if isinstance(want, list):
        return (isinstance(got, list) and len(got) == len(want)
                and all(same(g, w, rel_tol, abs_tol) for g, w in zip(got, want)))
    if isinstance(want, dict):
        return (isinstance(got, dict) and got.keys() == want.keys()
                and all(same(got[k], want[k], rel_tol, abs_tol) for k in want))
    return type(got) is type(want) and got == want


def _kind(x: Any) -> str:
    if _is_number(x):
        return "a number"
    if isinstance(x, list):
        return f"{len(x)} values"
    if isinstance(x, dict) and "unsupported" in x:
        return f"a {x['unsupported']}"
    return f"a {type(x).__name__}"


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.10g}"
    if isinstance(x, list) and all(_is_number(v) for v in x):   # an answer of several numbers
        text = "[" + ", ".join(_fmt(v) for v in x) + "]"
    else:
        text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def difference(got: Any, want: Any, names: Sequence[str] = (), rel_tol: float = REL_TOL) -> str:
    """How ``got`` differs from ``want``, without showing ``want`` (safe for hidden cases)."""
    if _is_number(want) and _is_number(got):
        if want == 0:
            return f"yours is {got:.4g} where the answer is 0"
        return f"yours is {got / want:.4g} x the right value"
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            what = f" ({', '.join(names)})" if names and len(names) == len(want) else ""
            return f"it returns {len(got)} values, expected {len(want)}{what}"
        for i, (g, w) in enumerate(zip(got, want)):
            if not same(g, w, rel_tol):
                name = names[i] if i < len(names) else f"value {i + 1}"
                right = [n for n, gg, ww in zip(names, got, want) if same(gg, ww, rel_tol)]
                also = f" ({', '.join(right)} right)" if right else ""
                return f"the {name} is wrong{also}: {difference(g, w, (), rel_tol)}"
    if type(got) is not type(want) or (isinstance(got, dict) and "unsupported" in got):
        return f"it returns {_kind(got)}, expected {_kind(want)}"
    return "the answer differs"


# --------------------------------------------------------------------------- exercises


@dataclass(frozen=True)
class Mistake:
    """A known wrong answer, named in the sentence "<name>: <why>": a wrong version of the function
    (``wrong``, same signature), the right answer times a wrong unit (``factor``), or computed from the
    right answer and the arguments (``given_right(right, *args)``: one piece off the right answer)."""
    name: str
    why: str
    wrong: Callable | None = None
    factor: float | None = None
    given_right: Callable | None = None


def call_positional(fn: Callable, case: Sequence) -> Any:
    """The default way to run a case: ``fn(*case)``; the answer as plain data."""
    return plain(fn(*case))


@dataclass(frozen=True)
class Exercise:
    """One autograded question (its fields: the package docstring). ``hint(got, want)`` may add an
    exercise-specific reason when no known mistake matches ("" for none)."""
    name: str
    function: str
    mistakes: tuple[Mistake, ...] = ()
    call: Callable[[Callable, Any], Any] = call_positional
    show: Callable[[Any], str] | None = None
    outputs: tuple[str, ...] = ()
    rel_tol: float = REL_TOL
    abs_tol: float = ABS_TOL   # numbers near 0 (a float32 answer's rounding: 1e-6 fits values up to ~10)
    hint: Callable[[Any, Any], str] | None = None
    needs: tuple[str, ...] = ()   # loaded by the grader before the timed cases start
    # Claims that state the answer: none may be visible in the student copy before the exercise
    # (matched case-insensitively, markdown emphasis removed; "re:..." is a regex).
    giveaways: tuple[str, ...] = ()
    # A find-the-bug exercise: the student copy starts from a buggy body (otter's PROMPT), one of the
    # mistakes, which the check names while it is still there.
    find_the_bug: bool = False
    # The lab's own implementation(s) of the function ("lab_utils.learn.speedup.speedup"): no show_source
    # cell before the exercise may show them.
    implemented_by: tuple[str, ...] = ()

    def run(self, fn: Callable, case: Any) -> Any:
        """The answer of ``fn`` on ``case`` (plain data; None = returned None)."""
        return self.call(fn, case)

    def describe(self, case: Any) -> str:
        if self.show is not None:
            return self.show(case)
        return f"{self.function}({', '.join(_fmt(a) for a in case)})"

    def mistake_answer(self, mistake: Mistake, case: Any, want: Any) -> Any:
        """What ``mistake`` answers on ``case`` (None when it cannot be computed)."""
        given = mistake.given_right
        wrong = mistake.wrong or (given and (lambda *a, **k: given(want, *a, **k)))
        if wrong is not None:
            try:
                return self.run(wrong, case)
            except Exception:  # a wrong formula may divide by zero where the right one does not
                return None
        if mistake.factor is not None and _is_number(want):
            return want * mistake.factor
        return None


def explain(ex: Exercise, case: Any, got: Any, want: Any, mistake_answers: Sequence[Any],
            label: str, hidden: bool) -> str:
    """One sentence on what is wrong with answer ``got`` ("" when it is right).

    ``label`` names the case ("hidden case 2 of 5", or the call for a public case).
    ``mistake_answers[i]`` is what ``ex.mistakes[i]`` answers on this case. For a hidden case the
    sentence names the mistake (or how far off the answer is) but never the inputs or the answer.
    """
    if got is None:
        return f"{NOT_DONE}: {ex.function} returns None; write its body."
    if same(got, want, ex.rel_tol, ex.abs_tol):
        return ""
    for m, answer in zip(ex.mistakes, mistake_answers):
        if (answer is not None and not same(answer, want, ex.rel_tol, ex.abs_tol)
                and same(got, answer, ex.rel_tol, ex.abs_tol)):
            numbers = "" if hidden else f" gives {_fmt(got)}, expected {_fmt(want)}"
            return f"{label}{numbers}: {m.name}: {m.why}."
    hint = ex.hint(got, want) if ex.hint else ""
    if hidden:
        return f"{label}: wrong answer ({hint or difference(got, want, ex.outputs, ex.rel_tol)})."
    return f"{label}: yours {_fmt(got)}, expected {_fmt(want)}" + (f" ({hint})." if hint else ".")


#: What a check cell prints when every case is right: the expected output of otter's doctest.
OK = "ok"


def verdict(question: str, function: Any, cases: Sequence[Any], expected: Sequence[Any] | None = None,
            hidden: bool = False) -> str:
    """"" when ``function`` answers every case right, else one sentence on the first case it gets
    wrong: "not done yet", a known mistake by name, how far off it is, or what it raised. The build
    writes ``expected`` in (without it, in the master, the answers are only computed); ``hidden=True``
    names a case by its number, never by its inputs."""
    ex = EXERCISES[question]
    if not callable(function):
        return f"{ex.function} is not a function ({type(function).__name__}): run the cell that defines it."
    for i, case in enumerate(cases):
        label = f"hidden case {i + 1} of {len(cases)}" if hidden else ex.describe(case)
        try:
            got = ex.run(function, case)
        except Exception as e:  # the student's code failing is an answer, said in one sentence
            return f"{label}: {ex.function} raised {type(e).__name__}: {e}"
        if got is None:
            return f"{NOT_DONE}: {ex.function} returns None; write its body above."
        if expected is None:
            continue
        want = expected[i]
        if not same(got, want, ex.rel_tol, ex.abs_tol):
            mistakes = [ex.mistake_answer(m, case, want) for m in ex.mistakes]
            return explain(ex, case, got, want, mistakes, label, hidden)
    return ""


def check(question: str, function: Any, cases: Sequence[Any], expected: Sequence[Any] | None = None,
          hidden: bool = False) -> None:
    """A check cell: print ``ok``, or the sentence of :func:`verdict`. Otter runs the cell as a doctest
    expecting ``ok``, so a failure reads "Expected: ok / Got: <the sentence>", never a traceback."""
    print(verdict(question, function, cases, expected, hidden) or OK)


# --------------------------------------------------------------------------- q01: a step timer


def _time_step_call(fn: Callable, case: dict) -> Any:
    """Case ``{"queued_s", "work_s", "launch_s"}``: time one step of a :class:`FakeAsyncDevice`;
    answer ``{"seconds", "steps"}``. Case ``{"real_sleep_s": s}``: a real step that sleeps ``s``
    seconds, ``sync`` a no-op and ``clock`` left at its default; answer ``{"steps", "plausible"}``
    (the time is at least ``s`` and under 2 s)."""
    if "real_sleep_s" in case:
        calls: list[int] = []

        def step():
            calls.append(1)
            time.sleep(case["real_sleep_s"])

        t = plain(fn(step, lambda: None))
        if t is None:
            return None
        return {"steps": len(calls), "plausible": _is_number(t) and case["real_sleep_s"] <= t < 2.0}
    dev = FakeAsyncDevice(queued_seconds=case["queued_s"], launch_seconds=case["launch_s"])
    t = plain(fn(dev.step_fn(case["work_s"]), dev.sync, dev.clock))
    return None if t is None else {"seconds": t, "steps": dev.steps}


def _time_step_show(case: dict) -> str:
    if "real_sleep_s" in case:
        return f"time_step(a real {case['real_sleep_s']} s step, sync=a no-op)"
    return (f"time_step on a fake GPU ({case['queued_s']} s of earlier work queued, a step of "
            f"{case['work_s']} s launched in {case['launch_s']} s)")


def _time_step_hint(got: Any, want: Any) -> str:
    if not isinstance(got, dict):
        return ""
    if got.get("steps") != 1:
        return f"call step() exactly once; it was called {got.get('steps')} times"
    if "plausible" in want:
        return "with the real clock (the clock argument left at its default) the time is not plausible"
    if not _is_number(got.get("seconds")):
        return f"return the seconds as a number, not {_kind(got.get('seconds'))}"
    return ""


def _timer_no_sync(step, sync, clock=time.perf_counter):
    start = clock()
    step()
    return clock() - start


def _timer_no_sync_before(step, sync, clock=time.perf_counter):
    start = clock()
    step()
    sync()
    return clock() - start


# --------------------------------------------------------------------------- q01: the train transforms

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)   # a known mistake's values
#: Crop offsets per axis of RandomCrop(32, padding=4) on a 32 x 32 image (0..8), and so the draws that
#: enumerate every augmented image once: 9 x 9 offsets x (flipped, not flipped).
CROP_OFFSETS = 9
DRAWS = CROP_OFFSETS * CROP_OFFSETS * 2


def _canonical_step(name: str, attrs: dict) -> list:
    """One transform as data, spelled one way: a padding as [left, top, right, bottom], without
    Normalize's ``inplace`` (it changes no value)."""
    attrs = dict(attrs)
    pad = attrs.get("padding")
    if isinstance(pad, int):
        attrs["padding"] = [pad] * 4
    elif isinstance(pad, list) and len(pad) == 2:
        attrs["padding"] = pad * 2
    if isinstance(attrs.get("size"), int):
        attrs["size"] = [attrs["size"]] * 2
    if name == "Normalize":
        attrs.pop("inplace", None)
    return [name, attrs]


def _transform_steps(pipeline: Any) -> Any:
    """The transforms of a pipeline as data, ``[[class name, {public attribute: value}], ...]``, sorted by
    name: which four transforms with which values (the order is judged by what the pipeline outputs)."""
    steps = getattr(pipeline, "transforms", pipeline)
    if not isinstance(steps, (list, tuple)):
        return {"unsupported": type(pipeline).__name__}
    out = [_canonical_step(type(t).__name__, {k: plain(v) for k, v in getattr(t, "__dict__", {}).items()
                                              if not k.startswith("_") and k != "training"}) for t in steps]
    return sorted(out, key=lambda step: step[0])


class _EveryCropAndFlip:
    """``torch.randint`` and ``torch.rand`` replaced, while in use, by two counters, so that
    :data:`DRAWS` calls of a CIFAR train pipeline give every crop offset with and without the flip once.

    Draw k (0 <= k < DRAWS) of a pipeline with one RandomCrop (two ``randint``: top, then left) and one
    RandomHorizontalFlip (one ``rand``, flipped when below p) crops at offset (top, left) = divmod(k // 2,
    9) and draws u = 0.5 (k % 2) + 0.5 (k // 2 + 0.5) / 81: flipped when k is even at p = 0.5, a share
    that follows p otherwise. The streams are separate, so the draws of call k are the same whichever of
    the crop and the flip runs first: two orders that make the same images make them draw for draw."""

    def __init__(self) -> None:
        self.ints = 0
        self.uniforms = 0

    def randint(self, *args, size=None, low=None, high=None, **_ignored):
        import torch

        if size is None and len(args) >= 2:        # randint(high, size) or randint(low, high, size)
            *bounds, size = args
        else:
            bounds = list(args)
        if high is None:
            high = bounds.pop()
        if low is None:
            low = bounds.pop() if bounds else 0
        k, which = divmod(self.ints, 2)
        self.ints += 1
        top, left = divmod((k // 2) % (CROP_OFFSETS * CROP_OFFSETS), CROP_OFFSETS)
        value = low + (left if which else top) % max(int(high) - int(low), 1)
        return torch.full(tuple(size) if isinstance(size, (list, tuple)) else (int(size),), value,
                          dtype=torch.int64)

    def rand(self, *size, **_ignored):
        import torch

        k = self.uniforms
        self.uniforms += 1
        u = 0.5 * (k % 2) + 0.5 * ((k // 2) % (DRAWS // 2) + 0.5) / (DRAWS // 2)
        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (list, tuple)) else size
        return torch.full(shape or (1,), u)

    def __enter__(self):
        import torch

        self._saved = torch.randint, torch.rand
        torch.randint, torch.rand = self.randint, self.rand
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.randint, torch.rand = self._saved


def _transformed(pipeline: Any, case: dict) -> Any:
    """Every augmented image ``pipeline`` makes of the case's random 32 x 32 RGB PIL image (:data:`DRAWS`
    calls under :class:`_EveryCropAndFlip`), summarized: the tensors' shape and dtype, how many differ,
    their per-channel mean, and per-channel means weighted by column and by row (they change when the
    images are cropped, padded or flipped otherwise); ``{"error": type}`` if it raised."""
    import numpy as np
    import torch
    from PIL import Image

    pixels = np.random.default_rng(case["image"]).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    try:
        with _EveryCropAndFlip():
            outs = [pipeline(image) for _ in range(DRAWS)]
    except Exception as e:  # Normalize before ToTensor raises on a PIL image: an answer, not a crash
        return {"error": type(e).__name__}
    first = outs[0]
    if not all(isinstance(o, torch.Tensor) and o.dim() == 3 and o.shape == first.shape for o in outs):
        return {"returns": type(first).__name__, "shape": list(getattr(first, "shape", []))}
    x = sum(o.detach().double() for o in outs) / len(outs)   # the mean image over the draws, C x H x W
    cols = torch.arange(1, x.shape[2] + 1, dtype=torch.float64) / x.shape[2]
    rows = torch.arange(1, x.shape[1] + 1, dtype=torch.float64)[:, None] / x.shape[1]
    return {"shape": list(first.shape), "dtype": str(first.dtype).removeprefix("torch."),
            "distinct": len({o.detach().cpu().numpy().tobytes() for o in outs}),
            "mean": x.mean(dim=(1, 2)).tolist(), "column_weighted": (x * cols).mean(dim=(1, 2)).tolist(),
            "row_weighted": (x * rows).mean(dim=(1, 2)).tolist()}


def _transform_call(fn: Callable, case: dict) -> Any:
    """Case ``{"image"}``: the transforms (:func:`_transform_steps`, in any order) and every augmented
    image of that random image (:func:`_transformed`). Any order whose images are the assignment's,
    draw for draw, gives the assignment's answer."""
    pipeline = fn()
    if pipeline is None:
        return None
    return {"transforms": _transform_steps(pipeline), "images": _transformed(pipeline, case)}


def _transform_show(case: dict) -> str:
    return (f"cifar10_train_transform() applied to random image {case['image']} (32 x 32 RGB), every crop "
            "offset with and without the flip")


def _transform_hint(got: Any, want: Any) -> str:
    """What differs, in words (never the expected pipeline)."""
    if not isinstance(got, dict) or not isinstance(want, dict):
        return ""
    mine, right = got.get("transforms"), want["transforms"]
    if not isinstance(mine, list) or not all(isinstance(m, list) and len(m) == 2 and isinstance(m[1], dict)
                                             for m in mine):
        return "it returns no list of transforms: return one transforms.Compose([...])"
    if [m[0] for m in mine] != [r[0] for r in right]:
        names = ", ".join(str(m[0]) for m in mine) or "none"
        return f"its transforms are {names}, not the four the prompt names"
    for m, r in zip(mine, right):
        if not same(m, r, 1e-6):
            keys = [k for k in r[1] if not same(m[1].get(k), r[1][k], 1e-6)]
            return f"{m[0]} has other values: {', '.join(keys) or 'its arguments'}"
    got, want = got.get("images"), want["images"]
    if isinstance(got, dict) and "error" in got:
        return f"applied to a PIL image it raises {got['error']}"
    if isinstance(got, dict) and "returns" in got:
        return f"it returns a {got['returns']}, not a 3 x 32 x 32 tensor"
    if isinstance(got, dict) and got.get("shape") != want.get("shape"):
        return f"the tensor's shape is {got.get('shape')}"
    if isinstance(got, dict) and not same(got.get("mean"), want.get("mean"), 1e-6):
        return "the pixel values differ (the padding's colour, or the normalization)"
    return "the images are cropped or flipped otherwise"


def _pipeline(order: tuple[str, ...], padding: int | None = 4, mean=None, std=None):
    """A train transform with the steps in ``order`` ("crop", "flip", "tensor", "normalize"); by default
    the assignment's values (those of :mod:`lab_utils.experiments.shared.data`)."""
    from torchvision import transforms as T

    from lab_utils.experiments.shared.data import CIFAR10_MEAN, CIFAR10_STD

    mean, std = mean or CIFAR10_MEAN, std or CIFAR10_STD
    make = {"crop": lambda: T.RandomCrop(32, padding=padding), "flip": lambda: T.RandomHorizontalFlip(p=0.5),
            "tensor": T.ToTensor, "normalize": lambda: T.Normalize(mean, std)}
    return T.Compose([make[step]() for step in order])


# --------------------------------------------------------------------------- q01: peak memory


def _memory_line(batch_a, peak_a, batch_b, peak_b):
    per_image = (peak_b - peak_a) / (batch_b - batch_a)
    return peak_a - per_image * batch_a, per_image


def _peak_through_zero(batch_a, peak_a, batch_b, peak_b, batch, limit):
    """A known mistake: the peak proportional to the batch, from the larger measurement alone."""
    per_image = peak_b / batch_b
    return per_image * batch, math.floor(limit / per_image)


def _peak_through_zero_small(batch_a, peak_a, batch_b, peak_b, batch, limit):
    """The same mistake from the smaller measurement."""
    per_image = peak_a / batch_a
    return per_image * batch, math.floor(limit / per_image)


def _peak_fixed_left_in_limit(batch_a, peak_a, batch_b, peak_b, batch, limit):
    fixed, per_image = _memory_line(batch_a, peak_a, batch_b, peak_b)
    return fixed + per_image * batch, math.floor(limit / per_image)


def _peak_rounded_up(batch_a, peak_a, batch_b, peak_b, batch, limit):
    fixed, per_image = _memory_line(batch_a, peak_a, batch_b, peak_b)
    return fixed + per_image * batch, math.ceil((limit - fixed) / per_image)


def _peak_hint(got: Any, want: Any) -> str:
    if isinstance(got, list) and len(got) == 2 and _is_number(got[1]) and got[1] != round(got[1]):
        return "the largest batch is a whole number of images"
    return ""


_PROPORTIONAL = Mistake("no fixed part", "the peak is not proportional to the batch: the line through your "
                        "two measurements does not pass through 0 bytes at batch 0; take its slope and its "
                        "intercept from both", wrong=_peak_through_zero)


# --------------------------------------------------------------------------- q04: bytes


def _resnet(case: dict):
    """ResNet-18 of ``case``: ``width`` (64 = spec), ``classes``, ``dtype``, ``frozen`` submodules."""
    import torch

    from lab_utils.learn.models import ResNet18

    torch.manual_seed(0)
    model = ResNet18(num_classes=case.get("classes", 10), width=case.get("width", 64))
    model = model.to(getattr(torch, case.get("dtype", "float32")))
    for name in case.get("frozen", ()):
        for p in model.get_submodule(name).parameters():
            p.requires_grad_(False)
    return model


def _grad_bytes_show(case: dict) -> str:
    frozen = f", {' and '.join(case['frozen'])} frozen" if case.get("frozen") else ""
    classes = f", {case['classes']} classes" if case.get("classes", 10) != 10 else ""
    return (f"grad_bytes(ResNet18(width={case.get('width', 64)}{classes}) in "
            f"{case.get('dtype', 'float32')}{frozen})")


BITS_FOR_BYTES = Mistake("bits for bytes", "that is bits; sizes here are in bytes (8 bits each)", factor=8.0)


def _iterations(dataset_size, world_size, per_device_batch):
    return math.ceil(math.ceil(dataset_size / world_size) / per_device_batch)


# "2(P-1)" in any form: the ring's step count, the heart of q04_ring_bytes' answer (phrases are matched on
# lower-cased text: lab_utils.app.grading.giveaways.normalized).
_TWO_P_MINUS_1 = "re:2\\s*\\(\\s*p\\s*-\\s*1\\s*\\)"


def _predicted(buckets, p, alpha, bw_gb_per_s, latency=1.0):
    """q04_predicted_bandwidth with ``latency`` x the ring's 2(P-1) alpha per bucket (1: the right one)."""
    seconds = sum(latency * 2 * (p - 1) * alpha + 2 * (p - 1) / p * b / (bw_gb_per_s * 1e9) for b in buckets)
    return sum(2 * (p - 1) / p * b for b in buckets) / seconds / 1e9


# The earlier cohort's Table 3: one gradient's bytes over an epoch's communication time (SPEC.md).
# The earlier cohort's 4 x 512 bandwidth: one gradient over its Q4.1 output's epoch communication time, the
# 250.10 MB/s of its Q4.1 and of its Table 3 (SPEC.md).
_T3_BYTES, _T3_SECONDS = anchors.TABLE3_GRADIENT_BYTES, anchors.TABLE3_COMM_SECONDS[0]
_TABLE3 = f"{_T3_BYTES:,} B / {_T3_SECONDS} s = {_T3_BYTES / _T3_SECONDS / 1e6:.1f} MB/s"
ONE_ALLREDUCE_PER_EPOCH = "one all-reduce per epoch"
_ONE_PER_EPOCH_WHY = (
    "every step of the epoch ends with its own all-reduce, in which each rank sends 2(P-1)/P x S: an epoch "
    "moves that once per step, not once (the earlier cohort's 4 x 512 bandwidth, in its Q4.1 output and its "
    f"Table 3, is one gradient over the epoch's communication time, {_TABLE3}, leaving out the steps and the "
    "ring's 2(P-1)/P), so the error grows with the steps per epoch")


# --------------------------------------------------------------------------- q05: schedules, samplers


def _recipe(base_lr, base_batch, per_device_batch, devices, dataset_size, warmup_epochs, rule="linear",
            steps="ddp"):
    """q05_recipe with one known mistake switched on (``rule``: how the peak scales; ``steps``: how the
    warm-up is counted); the right answer with the defaults."""
    k = per_device_batch * devices / base_batch
    scale = {"linear": k, "none": 1.0, "sqrt": math.sqrt(k), "per_device": per_device_batch / base_batch}
    per_epoch = {"base": math.ceil(dataset_size / base_batch),
                 "whole": math.ceil(dataset_size / per_device_batch),
                 "floor": dataset_size // devices // per_device_batch,
                 "epochs": 1}.get(steps, _iterations(dataset_size, devices, per_device_batch))
    warm = warmup_epochs * per_epoch
    return base_lr * scale[rule], (warmup_epochs if steps == "epochs" else int(warm) if steps == "truncate"
                                   else round(warm))


def _lr_from_zero(step, base_lr, global_batch, base_batch, warmup_steps):
    peak = base_lr * global_batch / base_batch
    return peak * step / warmup_steps if step < warmup_steps else peak


def _lr_sqrt(step, base_lr, global_batch, base_batch, warmup_steps):
    peak = base_lr * math.sqrt(global_batch / base_batch)
    return base_lr + (peak - base_lr) * step / warmup_steps if step < warmup_steps else peak


def _sampler(case: dict):
    from torch.utils.data.distributed import DistributedSampler

    return DistributedSampler(range(case["n"]), num_replicas=case["replicas"], rank=case["rank"],
                              shuffle=True, seed=case.get("seed", 0))


def _orders_show(case: dict) -> str:
    return (f"epoch_orders(DistributedSampler(range({case['n']}), num_replicas={case['replicas']}, "
            f"rank={case['rank']}, seed={case.get('seed', 0)}), {case['epochs']})")


def _orders_set_after(sampler, epochs):
    orders = []
    for epoch in range(epochs):
        orders.append([int(i) for i in sampler])
        sampler.set_epoch(epoch)
    return orders


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


# --------------------------------------------------------------------------- q09: data parallelism by hand


# How long q09_average's forked gloo ranks get to meet and answer (s). Below the grader's case limit
# (lab_utils.app.grading.sandbox.Limits.case_seconds, 20 s), so that a deadlocked answer (an all-reduce on
# one rank only) ends here as "timed out" with its ranks killed, not at the case alarm with its ranks
# left running; above the 10 s that `make student` once needed on a loaded node for the master's answers.
RANKS_TIMEOUT_S = 15.0


def _average_call(fn: Callable, case: dict) -> Any:
    """Case ``{"grads": [rank 0's gradients, rank 1's, ...]}`` (each a list of nested lists): ``fn`` runs
    in that many gloo ranks (:func:`lab_utils.engine.fork_ranks.run_in_ranks`, forked processes), each on its
    own gradients as float32 tensors. The answer, per rank: ``{"grads": what the given tensors hold
    afterwards, "returns": what fn returned}`` (:func:`_returned`); None (not done yet) when a rank's fn
    returned None and changed nothing."""
    import torch

    from lab_utils.engine.fork_ranks import run_in_ranks

    def rank(r: int, world: int) -> Any:
        given = [torch.tensor(g, dtype=torch.float32) for g in case["grads"][r]]
        before = [g.clone() for g in given]
        out = fn(given)
        if out is None and all(torch.equal(g, b) for g, b in zip(given, before)):
            return None
        return {"grads": [g.tolist() for g in given], "returns": _returned(out, given)}

    answers = run_in_ranks(rank, len(case["grads"]), timeout_s=RANKS_TIMEOUT_S)
    for r, a in enumerate(answers):
        if isinstance(a, dict) and "error" in a:
            raise RuntimeError(f"on rank {r} of {len(answers)}: {a['error']}")
    return None if any(a is None for a in answers) else plain(answers)


#: What q09_average's answer says it returned: the list it was given (or its tensors), or not.
RETURNS_GRADS = "the tensors it was given"


def _returned(out: Any, given: list) -> str:
    if out is None:
        return "None"
    if isinstance(out, (list, tuple)) and len(out) == len(given) and all(o is g for o, g in zip(out, given)):
        return RETURNS_GRADS
    if isinstance(out, (list, tuple)) and all(hasattr(o, "shape") for o in out):
        return "new tensors"
    return f"a {type(out).__name__}"


def _average_show(case: dict) -> str:
    held = "; ".join(f"rank {r} holds {g}" for r, g in enumerate(case["grads"]))
    return f"average_gradients on {len(case['grads'])} gloo ranks ({held})"


def _average_hint(got: Any, want: Any) -> str:
    """What the prompt requires and the answer lacks: the return value, then the work in place."""
    if not (isinstance(got, list) and all(isinstance(r, dict) and "returns" in r for r in got)):
        return ""
    returns = {r["returns"] for r in got}
    if "None" in returns:
        return "average_gradients returns None: the prompt asks it to return grads, the list it was given"
    if "new tensors" in returns:
        return ("it returns new tensors: the prompt asks for the mean in place, in the tensors of grads "
                "(g /= n changes g, g = g / n makes a new tensor), and grads returned")
    if returns != {RETURNS_GRADS}:
        return f"it returns {sorted(returns)[0]}: the prompt asks it to return grads, the list it was given"
    return "the tensors of grads do not hold the mean over the ranks afterwards"


def _average(grads, before=False, reduce=True, after="world", copy=False, give_back=True):
    """Gradient averaging with one known mistake switched on (the right one with none): divide by the
    world size ``before`` the all-reduce too, skip the all-reduce, divide ``after`` it by 2 or not, work
    on a ``copy`` (new tensors returned, the given ones unchanged), or forget to ``give_back`` grads."""
    import torch.distributed as dist

    world = dist.get_world_size()
    work = [g.clone() for g in grads] if copy else grads
    for g in work:
        if before:
            g /= world
        if reduce:
            dist.all_reduce(g)
        if after:
            g /= world if after == "world" else after
    return work if give_back else None


def _ddp_buckets(sizes, cap, first, forward=False, under=False, above=False, first_ignored=False,
                 first_everywhere=False, drop_last=False):
    """DDP's bucket rule with one known mistake switched on (the right one with none)."""
    order = range(len(sizes)) if forward else reversed(range(len(sizes)))
    buckets, current, filled = [], [], 0
    for i in order:
        limit = first if (first_everywhere or not buckets) and not first_ignored else cap
        if under and current and filled + sizes[i] > limit:   # the stay-under rule: close BEFORE it
            buckets.append(current)
            current, filled = [], 0
            limit = cap
        current.append(i)
        filled += sizes[i]
        if not under and (filled > limit if above else filled >= limit):
            buckets.append(current)
            current, filled = [], 0
    if current and not drop_last:
        buckets.append(current)
    return buckets


def _exposed(bucket_bytes, gradient_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s,
             backward_seconds, overlap=True, queue=True, floor=False, ring_steps=True):
    """Exercise 09-d's exposed seconds with one known mistake switched on (the right one with none)."""
    s, p, t = gradient_bytes, world_size, backward_seconds
    k = max(1, math.floor(s / bucket_bytes) if floor else math.ceil(s / bucket_bytes))
    c = (2 * (p - 1) if ring_steps else 1) * alpha_seconds + 2 * (p - 1) / p * (s / k) / bandwidth_bytes_per_s
    if not overlap:
        return k * c
    return max(c, t / k + k * c - t) if queue else c


def _shards_floor(numel, world_size):
    size = numel // world_size
    return [(r * size, (r + 1) * size) for r in range(world_size)]


def _shards_last(numel, world_size):
    size = numel // world_size
    return [(r * size, (r + 1) * size if r < world_size - 1 else numel) for r in range(world_size)]


def _shards_ceil(numel, world_size):
    size = -(-numel // world_size)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(world_size)]


def _shards_inclusive(numel, world_size):
    base, extra = divmod(numel, world_size)
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size - 1))
        start += size
    return out


# --------------------------------------------------------------------------- q02, q03: an all-reduce


def _wait(nbytes, latency, gbps, giga=1e9):
    """One all-reduce of ``nbytes`` on the line: latency + bytes / (GB/s x ``giga``), seconds."""
    return latency + nbytes / (gbps * giga)


def _comm_pair(buckets, latency, gbps, steps, exposed_index=-1):
    """(b) and (c) per epoch with bucket ``exposed_index`` the exposed one (a known mistake's variant)."""
    each = [_wait(b, latency, gbps) for b in buckets]
    return steps * each[exposed_index], steps * sum(each)


# --------------------------------------------------------------------------- the registry


EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in (
    Exercise(
        "q01_step_timer", "time_step", call=_time_step_call, show=_time_step_show, hint=_time_step_hint,
        implemented_by=("lab_utils.learn.timing.timed", "lab_utils.learn.loop.run_epoch"),
        giveaways=("at both ends", "at its ends", "at each phase boundary", r"re:sync\(\)\s*(#[^\n]*)?start",
                   "before the clock starts and after the step"),
        mistakes=(
            Mistake("the launch time only", "you read the clock before the device finished (on a GPU a "
                    "step only queues its kernels): call sync() after step() and before reading the clock",
                    wrong=_timer_no_sync),
            Mistake("earlier work billed to the step", "the time includes work queued BEFORE the step "
                    "(the previous step, a copy): call sync() before you start the clock too",
                    wrong=_timer_no_sync_before),
        )),
    Exercise(
        "q01_train_transform", "cifar10_train_transform", call=_transform_call, show=_transform_show,
        hint=_transform_hint, needs=("torchvision",), rel_tol=1e-6,
        implemented_by=("lab_utils.experiments.shared.data.train_transform",),
        giveaways=("ToTensor must come before Normalize", "Normalize before ToTensor", "mean colour",
                   "Normalize before the crop",
                   r"re:RandomCrop[^;.]{0,40}RandomHorizontalFlip[^;.]{0,40}ToTensor[^;.]{0,40}Normalize"),
        mistakes=(
            Mistake("Normalize before ToTensor", "Normalize works on a tensor and the dataset hands over "
                    "a PIL image, so it raises: ToTensor must come before Normalize",
                    wrong=lambda: _pipeline(("crop", "flip", "normalize", "tensor"))),
            Mistake("Normalize before the crop", "it runs, but the crop then pads with 0 in normalized "
                    "units, which is the data set's mean colour, not black: pad and crop before Normalize",
                    wrong=lambda: _pipeline(("tensor", "normalize", "crop", "flip"))),
            Mistake("no padding", "RandomCrop(32) of a 32 x 32 image crops nothing: pad 4 pixels on each "
                    "side (padding=4) so that the 32 x 32 crop shifts the image",
                    wrong=lambda: _pipeline(("crop", "flip", "tensor", "normalize"), padding=None)),
            Mistake("ImageNet's mean and std", "those are ImageNet's statistics; normalize with CIFAR-10's "
                    "per-channel mean and std, as the assignment gives them",
                    wrong=lambda: _pipeline(("crop", "flip", "tensor", "normalize"), mean=IMAGENET_MEAN,
                                           std=IMAGENET_STD)),
        )),
    Exercise(
        "q01_peak_memory", "predict_peak_memory", outputs=("peak_bytes", "largest_batch"), hint=_peak_hint,
        implemented_by=("lab_utils.experiments.n01_batch_sweep.experiment.predict_peak_memory",
                        "lab_utils.experiments.n01_batch_sweep.experiment.memory_line",
                        "lab_utils.experiments.n01_batch_sweep.experiment.MemoryLine"),
        giveaways=("line through the two", "through your two measurements", r"re:limit\W*-\W*fixed",
                   "round the largest batch down", "does not pass through 0"),
        mistakes=(
            _PROPORTIONAL,
            Mistake(_PROPORTIONAL.name, _PROPORTIONAL.why, wrong=_peak_through_zero_small),
            Mistake("the fixed part left in the limit", "the part of the peak that does not grow with the "
                    "batch takes its share of the limit at every batch: only the limit minus that part is "
                    "left for the images", wrong=_peak_fixed_left_in_limit),
            Mistake("rounded up", "a batch whose predicted peak is over the limit does not fit: round the "
                    "largest batch down", wrong=_peak_rounded_up),
        )),
    Exercise(
        "q02_speedup", "speedup_and_efficiency", outputs=("speedup", "efficiency"),
        giveaways=("1.784", r"re:t\(1\)\s*/\s*t\(n\)"), implemented_by=("lab_utils.learn.speedup.speedup",),
        mistakes=(
            Mistake("N x T(1)/T(N)", "on epoch times that counts N twice (each of the N devices already "
                    "does 1/N of the epoch); the speedup is T(1)/T(N)",
                    wrong=lambda t1, tn, n: (n * t1 / tn, t1 / tn)),
            Mistake("upside down", "that is T(N)/T(1); the speedup is T(1)/T(N)",
                    wrong=lambda t1, tn, n: (tn / t1, tn / t1 / n)),
            Mistake("efficiency = speedup", "the efficiency is the speedup divided by N",
                    wrong=lambda t1, tn, n: (t1 / tn, t1 / tn)),
        )),
    Exercise(
        "q02_predict_epoch", "predict_epoch_seconds",
        giveaways=(r"re:steps\s*(x|\*|×)\s*\(\s*t\(1\)\s*\+",
                   r"re:t\(1\)\s*\+\s*(the\s*)?(latency|all-reduce)"),
        implemented_by=("lab_utils.learn.scaling_model.predicted_epoch_seconds",),
        mistakes=(
            Mistake(ONE_ALLREDUCE_PER_EPOCH, "every step of the epoch waits for its own all-reduce of the "
                    "gradient, not the epoch once (the earlier cohort's Table 3 mistake)",
                    wrong=lambda t1, steps, nbytes, lat, gbps: steps * t1 + _wait(nbytes, lat, gbps)),
            Mistake("the all-reduce left out", "each step computes what one device's step does AND waits "
                    "for the exposed all-reduce", wrong=lambda t1, steps, nbytes, lat, gbps: steps * t1),
            Mistake("the latency left out", "an all-reduce of any size costs at least the line's latency, "
                    "once per all-reduce", wrong=lambda t1, steps, nbytes, lat, gbps: steps * (
                        t1 + _wait(nbytes, 0.0, gbps))),
            Mistake("GiB for GB", "the bandwidth is in decimal GB/s (10^9 bytes per second), not GiB/s",
                    wrong=lambda t1, steps, nbytes, lat, gbps: steps * (
                        t1 + _wait(nbytes, lat, gbps, 2**30))),
            Mistake("bits for bytes", "exposed_bytes and GB/s both count bytes: no factor 8",
                    wrong=lambda t1, steps, nbytes, lat, gbps: steps * (t1 + _wait(8 * nbytes, lat, gbps))),
        )),
    Exercise(
        "q03_compute_comm", "compute_and_comm", outputs=("compute_seconds", "comm_seconds"),
        find_the_bug=True,
        giveaways=(r"re:compute[^.]{0,30}=\s*t\(1\)\s*/\s*n", r"re:t\(n\)\s*-\s*t\(1\)\s*/\s*n"),
        implemented_by=("lab_utils.learn.comm_probe.derived_comm",),
        mistakes=(
            Mistake("compute = T(N)", "the compute column is T(1)/N, the one-device work split N ways; T(N) "
                    f"is the whole N-device epoch, communication included (the earlier cohort's Table 2 "
                    f"printed T(N) = {anchors.FIRST_COHORT_TABLE1_SECONDS[anchors.TABLE2_COMPUTE_IS_TN]} s, "
                    "its Q2 time, as compute)", wrong=lambda t1, tn, n: (tn, tn - t1 / n)),
            Mistake("compute = T(N)", "the compute column is T(1)/N, the one-device work split N ways, and "
                    "communication is what T(N) takes beyond it, T(N) - T(1)/N: with compute = T(N) nothing "
                    "is left for communication", wrong=lambda t1, tn, n: (tn, 0.0)),
            Mistake("compute from T(N)/N", "the compute time on N devices is T(1)/N (the one-device work "
                    "split N ways), not T(N)/N", wrong=lambda t1, tn, n: (tn / n, tn - tn / n)),
            Mistake("negative communication clipped", "return T(N) - T(1)/N as is when it is negative: "
                    "a negative value says the perfect-split assumption failed, and clipping it hides that",
                    wrong=lambda t1, tn, n: (t1 / n, max(tn - t1 / n, 0.0))),
            Mistake("T(N) - T(1)", "the communication is T(N) - T(1)/N, not T(N) - T(1)",
                    wrong=lambda t1, tn, n: (t1 / n, tn - t1)),
        )),
    Exercise(
        "q03_predict_comm", "predict_comm_seconds", outputs=("exposed_seconds", "allreduce_seconds"),
        giveaways=(r"re:\(c\) adds (every|each) bucket", r"re:\(b\)[^.]{0,20}(is|=) the last (one|bucket)",
                   r"re:latency[^.]{0,40}(each|every|per) bucket"),
        implemented_by=("lab_utils.learn.scaling_model.predicted_comm_seconds",),
        mistakes=(
            Mistake("(b) from the first bucket", "DDP all-reduces the first bucket (the last layers' "
                    "gradients) while backward still computes the others; the one that cannot hide is the "
                    "LAST, ready when backward ends",
                    wrong=lambda b, lat, gbps, steps: _comm_pair(b, lat, gbps, steps, 0)),
            Mistake("(b) with no overlap", "(b) is what backward could NOT hide; every bucket but the last "
                    "hides behind the rest of backward",
                    wrong=lambda b, lat, gbps, steps: (_comm_pair(b, lat, gbps, steps)[1],) * 2),
            Mistake("one latency for (c)", "each bucket is an all-reduce of its own and pays the latency: "
                    "(c) adds one all-reduce per bucket, not one of all the bytes",
                    wrong=lambda b, lat, gbps, steps: (_comm_pair(b, lat, gbps, steps)[0],
                                                       steps * _wait(sum(b), lat, gbps))),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, "every step all-reduces its buckets: multiply by the epoch's "
                    "steps", wrong=lambda b, lat, gbps, steps: _comm_pair(b, lat, gbps, 1)),
            Mistake("GiB for GB", "the bandwidth is in decimal GB/s (10^9 bytes per second), not GiB/s",
                    wrong=lambda b, lat, gbps, steps: _comm_pair(b, lat, gbps * 2**30 / 1e9, steps)),
        )),
    Exercise(
        "q04_gradient_bytes", "grad_bytes", call=lambda fn, case: plain(fn(_resnet(case))),
        show=_grad_bytes_show, needs=("torch", "lab_utils.learn.models"),
        giveaways=("re:element_?size", "re:numel\\s*(x|×)?\\s*(the )?element", "undercounts the bytes 4x"),
        implemented_by=("lab_utils.learn.ring.gradient_bytes",),
        mistakes=(
            Mistake("parameters counted as bytes", "that is the parameter count; the all-reduce moves "
                    "bytes: elements x p.element_size() (4 for fp32)",
                    wrong=lambda model: sum(p.numel() for p in model.parameters() if p.requires_grad)),
            Mistake("4 bytes per element whatever the dtype", "use each tensor's own element size "
                    "(p.element_size()): bf16 gradients are 2 bytes",
                    wrong=lambda model: sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)),
            Mistake("frozen parameters counted", "a parameter that does not require grad has no gradient "
                    "and is not all-reduced",
                    wrong=lambda model: sum(p.numel() * p.element_size() for p in model.parameters())),
            BITS_FOR_BYTES,
        )),
    Exercise(
        "q04_ring_bytes", "ring_bytes_per_rank_per_epoch", find_the_bug=True,
        giveaways=(_TWO_P_MINUS_1, "re:\\(\\s*p\\s*-\\s*1\\s*\\)\\s*/\\s*p", "bandwidth-optimal"),
        implemented_by=("lab_utils.learn.ring.ring_bytes_per_epoch",
                        "lab_utils.learn.ring.ring_bytes_per_rank"),
        mistakes=(
            Mistake("the log2 tree formula", "a ring all-reduce sends 2(P-1)/P x S bytes per rank per "
                    "iteration, not S x log2(P) (a tree's step count; the two agree only at P = 2)",
                    wrong=lambda s, p, n, b: _iterations(n, p, b) * s * math.log2(p)),
            Mistake("one gradient per all-reduce", "each rank sends 2(P-1)/P x S (reduce-scatter, then "
                    "all-gather), not S", wrong=lambda s, p, n, b: _iterations(n, p, b) * s),
            Mistake("all ranks together", "2(P-1) x S is what all P ranks send together; one rank sends "
                    "2(P-1)/P x S", wrong=lambda s, p, n, b: _iterations(n, p, b) * 2 * (p - 1) * s),
            Mistake("iterations over the whole data set", "each rank sees ceil(N/P) samples, so an epoch "
                    "has ceil(ceil(N/P)/b) iterations, not ceil(N/b)",
                    wrong=lambda s, p, n, b: math.ceil(n / b) * 2 * (p - 1) / p * s),
            Mistake("iterations rounded down", "the sampler pads to a multiple of P and the last partial "
                    "batch is kept: round both divisions up",
                    wrong=lambda s, p, n, b: (n // p) // b * 2 * (p - 1) / p * s),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY, wrong=lambda s, p, n, b: s),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY,
                    wrong=lambda s, p, n, b: 2 * (p - 1) / p * s),
            BITS_FOR_BYTES,
        )),
    Exercise(
        "q04_utilization", "achieved_gb_per_s", find_the_bug=True,
        giveaways=("one gradient per epoch", ONE_ALLREDUCE_PER_EPOCH, "250.1 MB/s",
                   "re:steps?(\\s*per\\s*epoch)?\\s*(x|×)?\\s*2\\s*\\("),
        implemented_by=("lab_utils.learn.ring.achieved_gb_per_s",),
        mistakes=(
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY,
                    wrong=lambda s, p, steps, secs: s / secs / 1e9),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY,
                    wrong=lambda s, p, steps, secs: 2 * (p - 1) / p * s / secs / 1e9),
            Mistake("one gradient per all-reduce", "in a ring all-reduce each rank sends 2(P-1)/P x S, not S "
                    "(the two agree only at P = 2)", wrong=lambda s, p, steps, secs: steps * s / secs / 1e9),
            Mistake("GiB for GB", "that is GiB/s (2^30 bytes); bandwidths here are decimal GB/s "
                    "(10^9 bytes), as nccl-tests reports", factor=1e9 / 2 ** 30),
            Mistake("MB for GB", "that is MB/s; divide bytes per second by 10^9 for GB/s", factor=1e3),
            Mistake("bits for bytes", "that is Gbit/s; GB/s counts bytes (8 bits each)", factor=8.0),
            Mistake("bytes per second", "divide bytes per second by 10^9 for decimal GB/s", factor=1e9),
        )),
    Exercise(
        "q04_predicted_bandwidth", "predicted_gb_per_s",
        giveaways=("once per bucket", "re:(k|buckets)\\s*(x|×)?\\s*2\\s*\\(\\s*p\\s*-\\s*1\\s*\\)"),
        implemented_by=("lab_utils.learn.ring.predicted_allreduce_gb_per_s",),
        mistakes=(
            Mistake("latency left out", "each bucket's ring all-reduce also pays 2(P-1) alpha, so the rate "
                    "stays below B; without it the prediction is B itself",
                    wrong=lambda b, p, a, bw: _predicted(b, p, a, bw, latency=0)),
            Mistake("one latency for all buckets", "DDP all-reduces each bucket separately, and every one "
                    "pays the latency term 2(P-1) alpha",
                    wrong=lambda b, p, a, bw: _predicted([sum(b)], p, a, bw)),
            Mistake("P-1 latency steps", "a ring all-reduce takes 2(P-1) steps (P-1 of reduce-scatter, P-1 "
                    "of all-gather), each paying alpha",
                    wrong=lambda b, p, a, bw: _predicted(b, p, a, bw, latency=0.5)),
            Mistake("algbw for busbw", "Table 3 counts the bytes one rank sends, 2(P-1)/P x each bucket "
                    "(nccl-tests' busbw), not the bucket's size (algbw)",
                    wrong=lambda b, p, a, bw: _predicted(b, p, a, bw) * p / (2 * (p - 1))),
        )),
    Exercise(
        "q05_lr_schedule", "warmup_lr",
        # matched on the text without markdown emphasis: base_lr reads "baselr", x * y "x y"
        giveaways=("re:base_?lr\\s*(x|×)?\\s*global_?batch\\s*/\\s*base_?batch",
                   "re:base_?lr\\s*\\+\\s*\\(\\s*peak"),
        implemented_by=("lab_utils.learn.schedules.LRSchedule", "lab_utils.learn.schedules.scaled_lr",
                        "lab_utils.learn.schedules.make_schedule"),
        mistakes=(
            Mistake("warm-up from 0", "the warm-up starts at base_lr (the small-batch rate) at step 0, "
                    "not at 0 (Goyal et al. 2017)", wrong=_lr_from_zero),
            Mistake("no linear scaling", "the peak is base_lr x global_batch / base_batch (the linear "
                    "scaling rule)", wrong=lambda step, base_lr, batch, base_batch, warmup: base_lr),
            Mistake("no warm-up", "during the first warmup_steps steps the lr rises linearly from base_lr "
                    "to the peak",
                    wrong=lambda step, base_lr, batch, base_batch, warmup: base_lr * batch / base_batch),
            Mistake("square-root scaling", "the linear scaling rule multiplies by global_batch / base_batch, "
                    "not by its square root", wrong=_lr_sqrt),
        )),
    Exercise(
        "q05_recipe", "large_batch_recipe", outputs=("peak_lr", "warmup_steps"),
        giveaways=("1.6 for 2,048", "re:0\\.1\\s*(x|×)?\\s*2,?048\\s*/\\s*128", "re:(?<![\\d,])125 steps"),
        implemented_by=("lab_utils.learn.schedules.linear_scaling_recipe",
                        "lab_utils.learn.schedules.make_schedule"),
        mistakes=(
            Mistake("no linear scaling", "the peak lr is base_lr x global batch / base_batch (the linear "
                    "scaling rule), not the small-batch rate", wrong=lambda *a: _recipe(*a, rule="none")),
            Mistake("square-root scaling", "the linear scaling rule multiplies by global batch / base_batch, "
                    "not by its square root", wrong=lambda *a: _recipe(*a, rule="sqrt")),
            Mistake("the per-device batch for the global batch", "the global batch is devices x per-device "
                    "batch: scale by it", wrong=lambda *a: _recipe(*a, rule="per_device")),
            Mistake("warm-up in the reference's steps", "the warm-up epochs count the LARGE run's optimizer "
                    "steps, ceil(ceil(N/P)/b) per epoch, not the small batch's",
                    wrong=lambda *a: _recipe(*a, steps="base")),
            Mistake("every device on the whole data set", "DistributedSampler gives each device ceil(N/P) "
                    "images: an epoch is ceil(ceil(N/P)/b) steps, not ceil(N/b)",
                    wrong=lambda *a: _recipe(*a, steps="whole")),
            Mistake("the last partial batch dropped", "the loader keeps the last partial batch: round both "
                    "divisions up", wrong=lambda *a: _recipe(*a, steps="floor")),
            Mistake("warm-up length in epochs", "return the warm-up in optimizer steps (epochs x steps per "
                    "epoch), as the schedule counts it", wrong=lambda *a: _recipe(*a, steps="epochs")),
            Mistake("warm-up rounded down", "round the warm-up to the nearest whole step, as the lab's "
                    "schedule does", wrong=lambda *a: _recipe(*a, steps="truncate")),
        )),
    Exercise(
        "q05_set_epoch", "epoch_orders", call=lambda fn, case: plain(fn(_sampler(case), case["epochs"])),
        show=_orders_show, needs=("torch.utils.data.distributed",),
        giveaways=("re:seed\\s*\\+\\s*epoch", "repeats epoch 0", "the same images in the same order"),
        implemented_by=("lab_utils.experiments.n05_large_batch.experiment.sampler_epoch_orders",),
        mistakes=(
            Mistake("set_epoch never called", "every epoch repeats epoch 0's order: call "
                    "sampler.set_epoch(epoch) at the start of each epoch",
                    wrong=lambda sampler, epochs: [[int(i) for i in sampler] for _ in range(epochs)]),
            Mistake("set_epoch after the epoch", "each epoch gets the previous epoch's order: call "
                    "sampler.set_epoch(epoch) BEFORE iterating the sampler", wrong=_orders_set_after),
        )),
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
    Exercise(
        "q09_average", "average_gradients", call=_average_call, show=_average_show, hint=_average_hint,
        rel_tol=1e-5, abs_tol=1e-6, needs=("torch", "torch.distributed", "lab_utils.learn.handmade"),
        implemented_by=("lab_utils.learn.handmade.Naive",),
        giveaways=(r"re:/=\s*(dist\.)?get_?world_?size\(\)", r"re:grad /=\s*self\.world",
                   "then divided by the number of ranks", "leaves the sum over ranks on every rank"),
        mistakes=(
            Mistake("summing without dividing", "an all-reduce adds the ranks' gradients: divide by the "
                    "number of ranks for their mean, the gradient of the global batch",
                    wrong=lambda grads: _average(grads, after=None)),
            Mistake("dividing twice", "divide by the number of ranks once, before or after the all-reduce, "
                    "not both", wrong=lambda grads: _average(grads, before=True)),
            Mistake("two ranks hard-coded", "divide by dist.get_world_size(), not by 2",
                    wrong=lambda grads: _average(grads, after=2)),
            Mistake("no all-reduce", "each rank divided its own gradient: the ranks never exchanged "
                    "anything, so they still disagree", wrong=lambda grads: _average(grads, reduce=False)),
            Mistake("new tensors, not in place", "the averages went into new tensors and grads kept this "
                    "rank's own values: change the tensors of grads themselves (dist.all_reduce(g) and "
                    "g /= n work in place) and return grads", wrong=lambda grads: _average(grads, copy=True)),
            Mistake("the return missing", "grads hold the mean, but average_gradients returns None: the "
                    "prompt asks it to return grads (end it with return grads)",
                    wrong=lambda grads: _average(grads, give_back=False)),
        )),
    Exercise(
        "q09_buckets", "assign_buckets", implemented_by=("lab_utils.learn.buckets.assign_buckets",),
        giveaways=(r"re:if filled\s*>=", r"re:for i in reversed\(range\(len\(sizes"),
        mistakes=(
            Mistake("forward order", "backward produces the LAST layer's gradient first: fill buckets from "
                    "the last parameter backwards", wrong=partial(_ddp_buckets, forward=True)),
            Mistake("the stay-under-the-cap rule", "closing a bucket BEFORE a parameter would take it over "
                    "the cap is a valid design, but not DDP's, which this asks for: DDP adds the parameter, "
                    "then closes the bucket once it holds at least its cap",
                    wrong=partial(_ddp_buckets, under=True)),
            Mistake("a full bucket left open", "a bucket that holds exactly its cap is full: DDP closes it "
                    "once it reaches OR exceeds the cap (>=)", wrong=partial(_ddp_buckets, above=True)),
            Mistake("the first cap ignored", "the first bucket (the first one sent) has its own cap, "
                    "first_cap_bytes; every later one cap_bytes",
                    wrong=partial(_ddp_buckets, first_ignored=True)),
            Mistake("the first cap everywhere", "only the first bucket has first_cap_bytes; every later "
                    "one closes at cap_bytes", wrong=partial(_ddp_buckets, first_everywhere=True)),
            Mistake("a parameter missed", "the last bucket, still open when the loop ends, holds parameters "
                    "too: append it", wrong=partial(_ddp_buckets, drop_last=True)),
        )),
    Exercise(
        "q09_shards", "shard_bounds", implemented_by=("lab_utils.learn.buckets.shard_bounds",),
        giveaways=(r"re:divmod\(numel,\s*world_?size\)", r"re:min\(r \+ 1, extra\)"),
        mistakes=(
            Mistake("the remainder dropped", "with numel // world_size elements per shard, the last numel % "
                    "world_size elements belong to no rank: no rank steps them", wrong=_shards_floor),
            Mistake("the remainder on the last rank", "shard sizes must differ by at most one: give one "
                    "extra element to each of the first numel % world_size ranks", wrong=_shards_last),
            Mistake("ceil-sized shards", "shards of ceil(numel / world_size) leave the last ranks short or "
                    "empty (sizes differ by more than one)", wrong=_shards_ceil),
            Mistake("end inclusive", "end is one past the shard's last element: shards [start, end) meet "
                    "without a gap", wrong=_shards_inclusive),
        )),
    Exercise(
        "q09_exposed", "exposed_seconds", call=lambda fn, case: plain(fn(**case)), rel_tol=1e-6,
        implemented_by=("lab_utils.learn.traffic.overlap_exposed_seconds",
                        "lab_utils.learn.traffic.optimal_bucket_bytes"),
        show=lambda case: "exposed_seconds(" + ", ".join(f"{k}={_fmt(v)}" for k, v in case.items()) + ")",
        giveaways=("T/k + k c - T", r"re:max\(\s*c\s*,\s*t\s*/\s*k", "they queue from the first bucket on",
                   "a bucket's communication takes exactly as long as its computation"),
        mistakes=(
            Mistake("no overlap", "the all-reduces of the first k - 1 buckets run while backward goes on: "
                    "not all k of them are exposed", wrong=partial(_exposed, overlap=False)),
            Mistake("the last bucket only", "when a bucket's all-reduce takes longer than backward takes to "
                    "make the next bucket, the all-reduces queue up and more than the last one is left "
                    "after backward", wrong=partial(_exposed, queue=False)),
            Mistake("buckets rounded down", "k = ceil(S / bucket_bytes): a partial last bucket is a bucket "
                    "too", wrong=partial(_exposed, floor=True)),
            Mistake("alpha once per all-reduce", "a ring all-reduce takes 2(P-1) steps, each paying alpha "
                    "(notebook 04)", wrong=partial(_exposed, ring_steps=False)),
        )),
)}
