"""The ``quick`` and ``full`` values of every settings class: how they are registered and read.

Two profiles exist (see :mod:`lab_utils.engine.config`): ``quick`` for CPU machines and CI
(small subsets, minutes on two cores; every table it produces says so) and ``full``, the
assignment as written, for a GPU node. A settings dataclass carries its own values, as two class
attributes next to its fields: ``QUICK`` and ``FULL`` (``ClassVar[dict[str, Any]]``, the keyword
values of each profile; the comments above ``QUICK`` say why each quick value was chosen). So a
notebook's values live in its package (``lab_utils/experiments/nNN_*/experiment.py``: its
``Settings``), the shared knobs with :class:`lab_utils.engine.config.Profile`.

Each module registers its dataclass (:func:`register`: keyed by the class, so the module's import of
this one is a dependency the architecture test sees); :func:`settings` (``lab.settings(cls, ...)`` in
a notebook) gives a profile's values with the parameters cell's overrides (:func:`override`, the one
way a notebook changes them), and :func:`table` all profiles' values of a class.
This module imports nothing of the lab but the learn floor's errors, so every layer can read it.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any, TypeVar

from lab_utils.learn.errors import LabError

T = TypeVar("T")

#: the profiles every settings class has values for; profile ``p``'s are the class attribute ``p.upper()``
PROFILE_NAMES = ("quick", "full")


# The settings of every class, keyed by the class itself (not its name): filled by register(),
# which each module calls for its own dataclass, so the dependency is an import the architecture
# test sees.
_REGISTRY: dict[type, tuple[dict[str, Any], str]] = {}


def register(cls: type[T], what: str = "") -> type[T]:
    """Register the settings class ``cls`` with its ``QUICK`` and ``FULL`` values (class attributes:
    the keyword values of each profile); ``what`` names the settings in error messages ("sweep",
    "GPT", ...). Returns ``cls``."""
    missing = [p.upper() for p in PROFILE_NAMES if not isinstance(getattr(cls, p.upper(), None), dict)]
    if missing:
        raise LabError(f"{cls.__qualname__} has no {' or '.join(missing)} values; give it "
                       f"QUICK: ClassVar[dict[str, Any]] and FULL: ClassVar[dict[str, Any]].")
    values = {p: getattr(cls, p.upper()) for p in PROFILE_NAMES}
    for kw in values.values():
        cls(**kw)  # every profile's values build the class (a typo fails at import)
    _REGISTRY[cls] = (values, what or cls.__name__)
    return cls


def table(cls: type[T]) -> dict[str, T]:
    """``{profile name: cls(**that profile's values)}`` for a registered settings class."""
    if cls not in _REGISTRY:
        raise LabError(f"{cls.__qualname__} has no profile values; register it with profiles.register.")
    return {profile: cls(**values) for profile, values in _REGISTRY[cls][0].items()}


def settings(cls: type[T], profile: str, /, **overrides: Any) -> T:
    """THE settings function: the profile's values of ``cls`` with the notebook's overrides
    (:func:`override`: None keeps the profile's value), checked. ``LabSession.settings`` calls it."""
    base = table(cls).get(profile)
    if base is None:
        raise LabError(f"No {_REGISTRY[cls][1]} settings for profile {profile!r}; "
                       f"use one of: {', '.join(table(cls))}.")
    return override(base, _REGISTRY[cls][1], **overrides)


def override(base: T, what: str | None = None, /, **overrides: Any) -> T:
    """``base`` with every override that is not None applied, then validated: the one way a notebook's
    parameters cell changes a profile's values. A list becomes a tuple (a single string a 1-tuple
    where the field holds one); an unknown name gets one sentence naming the valid ones (``what``
    names the settings); the result's ``validate()``, if any, runs before any work starts.
    """
    cls = type(base)
    valid = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    given = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(given) - valid)
    if unknown:
        raise LabError(f"Unknown {what or cls.__name__} setting(s) {unknown}; "
                       f"use: {', '.join(sorted(valid))}.")
    for k, v in given.items():
        if isinstance(v, list):
            given[k] = tuple(v)
        elif isinstance(v, str) and isinstance(getattr(base, k), tuple):
            given[k] = (v,)
    out = replace(base, **given)  # type: ignore[type-var]
    validate = getattr(out, "validate", None)
    return validate() or out if callable(validate) else out
