"""Answers as data: :func:`plain` turns what a function returns into plain data, :func:`same` compares two
answers within a tolerance, :func:`difference` says in words how far off one is (for a hidden case, whose
inputs and answer are never shown)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

REL_TOL = 1e-9
ABS_TOL = 1e-12


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


def is_number(x: Any) -> bool:
    """Whether ``x`` is an int or a float (a bool is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def same(got: Any, want: Any, rel_tol: float = REL_TOL, abs_tol: float = ABS_TOL) -> bool:
    """Whether answer ``got`` equals ``want`` (numbers within ``rel_tol``, or ``abs_tol`` near zero)."""
    if is_number(want):
        return is_number(got) and math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol)
    if isinstance(want, list):
        return (isinstance(got, list) and len(got) == len(want)
                and all(same(g, w, rel_tol, abs_tol) for g, w in zip(got, want)))
    if isinstance(want, dict):
        return (isinstance(got, dict) and got.keys() == want.keys()
                and all(same(got[k], want[k], rel_tol, abs_tol) for k in want))
    return type(got) is type(want) and got == want


def kind(x: Any) -> str:
    """What ``x`` is, in words ("a number", ...), for a sentence on a wrong answer."""
    if is_number(x):
        return "a number"
    if isinstance(x, list):
        return f"{len(x)} values"
    if isinstance(x, dict) and "unsupported" in x:
        return f"a {x['unsupported']}"
    return f"a {type(x).__name__}"


def fmt(x: Any) -> str:
    """``x`` as a message shows it (floats to 10 significant digits)."""
    if isinstance(x, float):
        return f"{x:.10g}"
    if isinstance(x, list) and all(is_number(v) for v in x):   # an answer of several numbers
        text = "[" + ", ".join(fmt(v) for v in x) + "]"
    else:
        text = repr(x)
    return text if len(text) <= 120 else text[:117] + "..."


def difference(got: Any, want: Any, names: Sequence[str] = (), rel_tol: float = REL_TOL) -> str:
    """How ``got`` differs from ``want``, without showing ``want`` (safe for hidden cases)."""
    if is_number(want) and is_number(got):
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
        return f"it returns {kind(got)}, expected {kind(want)}"
    return "the answer differs"
