"""The metric glossary (lab_utils.learn.metrics) says each thing once.

Twelve definitions were written twice: a string literal repeated after a missing comma, which Python
joins into one string (issue 32, item 6). No sentence or clause of a definition may occur twice in it,
and the module holds no implicit concatenation of two equal literals. Names that meant two things get
one meaning: ``images`` are always trained on (the loader benchmark counts ``loader_images``).
"""

from __future__ import annotations

import ast
import re

import pytest

from lab_utils.learn import metrics

pytestmark = pytest.mark.timeout(60)


def _clauses(text: str) -> list[str]:
    """The clauses of a definition: split at ; : , ( ) and sentence ends, lower-cased, 3 words or more."""
    parts = (p.strip(" .").lower() for p in re.split(r"[;:,()]|\.\s", text))
    return [p for p in parts if len(p.split()) >= 3]


def test_no_definition_repeats_itself():
    repeated = {}
    for name, m in metrics.GLOSSARY.items():
        clauses = _clauses(m.definition)
        twice = sorted({c for c in clauses if clauses.count(c) > 1})
        half = len(m.definition) // 2
        if twice or (m.definition[:half] == m.definition[half:] and half):
            repeated[name] = twice or [m.definition[:half]]
    assert repeated == {}


def test_the_check_catches_a_repeated_definition():
    doubled = "images the data loader alone delivers per second of wall time (no model)"
    assert _clauses(doubled + doubled) != sorted(set(_clauses(doubled + doubled)))
    assert len(_clauses(doubled + "; " + doubled)) == 2 * len(_clauses(doubled))


def test_no_implicit_concatenation_of_equal_literals():
    """The source itself: two adjacent equal string literals (the missing comma) are a defect."""
    tree = ast.parse(open(metrics.__file__, encoding="utf-8").read())
    source = open(metrics.__file__, encoding="utf-8").read()
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.end_lineno > node.lineno:
            literals = re.findall(r'"((?:[^"\\]|\\.)*)"', ast.get_source_segment(source, node) or "")
            bad += [a for a, b in zip(literals, literals[1:]) if a and a == b]
    assert bad == []


def test_each_name_has_one_meaning():
    defs = {n: m.definition for n, m in metrics.GLOSSARY.items()}
    assert "loader" not in defs["images"] and "trained on" in defs["images"]
    assert defs["loader_images"].startswith("the loader benchmark")
    assert "loader_images" in defs["loader_images_per_s"]
    assert defs["ranks"].startswith("one entry per rank") and " or, " not in defs["ranks"]
    assert defs["allreduce_seconds"].startswith("(c) per epoch") and ", or " not in defs["allreduce_seconds"]
    assert metrics.define("loader_images").unit == "count"
