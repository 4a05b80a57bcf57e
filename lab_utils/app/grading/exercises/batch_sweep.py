"""The exercises of notebook 01 (batch-size sweep): a step timer on a fake asynchronous device,
CIFAR-10's train transforms judged on every augmented image, the peak memory's line."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from lab_utils.app.grading.exercises.answers import is_number, kind, plain, same
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake
from lab_utils.app.grading.fakes import FakeAsyncDevice

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
        return {"steps": len(calls), "plausible": is_number(t) and case["real_sleep_s"] <= t < 2.0}
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
    if not is_number(got.get("seconds")):
        return f"return the seconds as a number, not {kind(got.get('seconds'))}"
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
    if isinstance(got, list) and len(got) == 2 and is_number(got[1]) and got[1] != round(got[1]):
        return "the largest batch is a whole number of images"
    return ""


_PROPORTIONAL = Mistake("no fixed part", "the peak is not proportional to the batch: the line through your "
                        "two measurements does not pass through 0 bytes at batch 0; take its slope and its "
                        "intercept from both", wrong=_peak_through_zero)


# --------------------------------------------------------------------------- the exercises


#: Notebook 01's exercises, in the order of :data:`lab_utils.app.grading.exercises.EXERCISES`.
EXERCISES: tuple[Exercise, ...] = (
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
)
