"""Reading notebooks without running them: master notebooks' otter blocks (:func:`parse_master`), and
a submission's hand-graded answers (:func:`answers`). A submission's code:
:mod:`lab_utils.app.grading.programs` (its cells parsed), :mod:`lab_utils.app.grading.exercise_code` (the
exercise function and what it uses) and :mod:`lab_utils.app.grading.reaching` (what needs a human look).
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_MARK = "# ASSIGNMENT CONFIG"
METADATA_KEY = "dl_perf_lab"   # notebook metadata {notebook, version}; cell metadata {question}
ANSWER_TAG = "otter_answer_cell"
ANSWER_PLACEHOLDER = "_Type your answer here, replacing this text._"
HIDDEN_RE = re.compile(r"^\s*#.*\bhidden\b", re.IGNORECASE)


def source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else str(s)


def read_notebook(path: Path, max_bytes: int = 50_000_000) -> tuple[dict | None, str]:
    """(notebook, "") or (None, why it cannot be read, in a few words that say what to do)."""
    try:
        size = Path(path).stat().st_size
        if size == 0:
            return None, "the file is empty (0 bytes): hand in the saved notebook again"
        if size > max_bytes:
            return None, (f"too large for a notebook ({size / 1e6:.0f} MB; the limit is "
                          f"{max_bytes / 1e6:.0f} MB): clear its outputs (Edit > Clear Outputs of All "
                          "Cells), save, hand it in again")
        raw = Path(path).read_bytes()
    except OSError as e:
        return None, f"the file cannot be opened ({e.strerror or e})"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "not a notebook: binary data, not text (another file renamed .ipynb?)"
    head = text.lstrip()[:300].lower()
    if head.startswith("<") and ("<html" in head or "<!doctype" in head):
        return None, ("not a notebook: a web page (HTML) saved as .ipynb; download the notebook file itself "
                      "(JupyterLab: File > Download)")
    try:
        nb = json.loads(text)
    except json.JSONDecodeError as e:
        at_end = e.pos >= len(text.rstrip()) - 1 or e.msg.startswith("Unterminated")
        if text.lstrip().startswith("{") and at_end:
            return None, (f"the notebook is cut off (it ends after {len(raw):,} bytes, in the middle of its "
                          "JSON): a truncated upload or copy; hand in the saved notebook again")
        return None, f"not a notebook: not JSON ({e.msg} at line {e.lineno}, column {e.colno})"
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list) or \
            not all(isinstance(c, dict) for c in nb["cells"]):
        return None, "not a notebook: JSON without notebook cells"
    return nb, ""


def title(nb: dict) -> str:
    """The notebook's title: the first line of its first markdown cell ("" when it has none)."""
    first = next((c for c in nb.get("cells", []) if isinstance(c, dict) and c.get("cell_type") == "markdown"),
                 None)
    return source(first).strip().split("\n", 1)[0].strip() if first else ""


def raw_mark(cell: dict) -> str:
    """'# BEGIN QUESTION' etc. for an otter block cell, else ''."""
    if cell.get("cell_type") != "raw":
        return ""
    first = source(cell).strip().split("\n", 1)[0].strip()
    marks = r"# (BEGIN|END) (QUESTION|SOLUTION|TESTS|PROMPT)|" + CONFIG_MARK
    return first if re.fullmatch(marks, first) else ""


def is_master(path: Path) -> bool:
    nb = json.loads(Path(path).read_text())
    return any(raw_mark(c) == CONFIG_MARK for c in nb["cells"])


def notebook_version(path: Path) -> str:
    """A hash of the master notebook's cells (type and source; outputs and ids ignored)."""
    nb = json.loads(Path(path).read_text())
    h = hashlib.sha256()
    for c in nb["cells"]:
        h.update(c["cell_type"].encode() + b"\0" + source(c).encode() + b"\0")
    return h.hexdigest()[:12]


# --------------------------------------------------------------------------- masters


@dataclass
class CheckCall:
    """A test cell's ``check(QUESTION, FUNCTION, [cases])``."""
    question: str
    function: str
    cases: list
    insert_at: tuple[int, int]   # (line, column) of the call's closing parenthesis (1-based line)


@dataclass
class TestCell:
    hidden: bool
    points: float
    source: str
    cell_index: int
    check: CheckCall | None = None


@dataclass
class MasterQuestion:
    name: str
    points: float
    manual: bool
    solution: str = ""            # the SOLUTION block's code cell (autograded questions)
    reference: str = ""           # the SOLUTION block's markdown (hand-graded: the reference answer)
    tests: list[TestCell] = field(default_factory=list)


@dataclass
class Master:
    path: Path
    questions: list[MasterQuestion] = field(default_factory=list)
    secret_lines: set[str] = field(default_factory=set)   # solution and hidden-test lines
    hidden_lines: set[str] = field(default_factory=set)   # hidden-test lines only

    def question(self, name: str) -> MasterQuestion:
        return next(q for q in self.questions if q.name == name)


def parse_check(src: str) -> CheckCall:
    """The ``check(QUESTION, FUNCTION, [case, ...])`` call of a test cell; ValueError says what is off.

    The cell may hold imports and comments besides; the cases must be plain literals (numbers,
    strings, tuples, lists, dicts), so that the build can compute and store their answers.
    """
    tree = ast.parse(src)
    calls = [s for s in tree.body if not isinstance(s, (ast.Import, ast.ImportFrom))]
    if len(calls) != 1 or not isinstance(calls[0], ast.Expr) or not isinstance(calls[0].value, ast.Call) \
            or not (isinstance(calls[0].value.func, ast.Name) and calls[0].value.func.id == "check"):
        raise ValueError("a test cell holds imports and exactly one call check(QUESTION, FUNCTION, [cases])")
    call = calls[0].value
    if len(call.args) != 3 or call.keywords:
        raise ValueError("check takes three arguments here: check(QUESTION, FUNCTION, [cases]); the "
                         "build adds expected=")
    qn, fn, cases = call.args
    if not (isinstance(qn, ast.Constant) and isinstance(qn.value, str)) or not isinstance(fn, ast.Name):
        raise ValueError("check's first argument is the question name (a string), its second the "
                         "student's function (a name)")
    try:
        values = ast.literal_eval(cases)
    except ValueError:
        raise ValueError("the cases must be a list of literals (numbers, strings, tuples, lists, "
                         "dicts): no names or calls") from None
    if not isinstance(values, list) or not values:
        raise ValueError("the cases must be a non-empty list")
    return CheckCall(qn.value, fn.id, values, (call.end_lineno, call.end_col_offset - 1))


def with_expected(src: str, call: CheckCall, expected: list, hidden: bool) -> str:
    """``src`` with ``expected=[...]`` (and ``hidden=True``) added to its check call."""
    lines = src.split("\n")
    line_no, col = call.insert_at
    head = "\n".join(lines[:line_no - 1] + [lines[line_no - 1][:col]]).rstrip()
    tail = "\n".join([lines[line_no - 1][col:]] + lines[line_no:])
    if head.endswith(","):
        head = head[:-1]
    extra = f", expected={expected!r}" + (", hidden=True" if hidden else "")
    return head + extra + tail


def _points(cfg_points: Any, n_tests: int) -> tuple[float, list[float]]:
    if isinstance(cfg_points, list):
        pts = [float(p or 0) for p in cfg_points]
        return sum(pts), pts
    total = 1.0 if cfg_points is None else float(cfg_points)
    return total, [total / n_tests] * n_tests if n_tests else []


def parse_master(path: Path) -> Master:
    """The questions, solutions, tests and secret text of a master notebook."""
    import yaml

    nb = json.loads(Path(path).read_text())
    master = Master(Path(path))
    public: list[str] = []
    block: list[str] = []
    configs: dict[str, Any] = {}
    for i, c in enumerate(nb["cells"]):
        mark, src = raw_mark(c), source(c)
        if mark:
            kind, what = mark.split()[1:3] if mark != CONFIG_MARK else ("", "")
            if kind == "BEGIN":
                block.append(what)
                if what == "QUESTION":
                    cfg = yaml.safe_load(src.split("\n", 1)[1]) or {}
                    configs[cfg["name"]] = cfg
                    master.questions.append(MasterQuestion(cfg["name"], 0.0, bool(cfg.get("manual", False))))
            elif kind == "END" and block:
                block.pop()
            continue
        q = master.questions[-1] if master.questions and "QUESTION" in block else None
        secret: list[str] = []
        if block and block[-1] == "SOLUTION" and c["cell_type"] == "markdown":
            secret = src.split("\n")
            if q is not None:
                q.reference += src + "\n"
        elif block and block[-1] == "SOLUTION" and c["cell_type"] == "code" and q is not None:
            q.solution = src
            inside = False
            for line in src.split("\n"):
                if line.strip().startswith("# END SOLUTION"):
                    inside = False
                elif line.strip().startswith("# BEGIN SOLUTION"):
                    inside = True
                elif inside:
                    secret.append(line)
                else:
                    public.append(line)
        elif block and block[-1] == "TESTS" and q is not None:
            first = src.lstrip().split("\n", 1)[0]
            hidden = bool(HIDDEN_RE.match(first))
            q.tests.append(TestCell(hidden, 0.0, src, i))
            if hidden:
                secret = src.split("\n")
            else:
                public.extend(src.split("\n"))
        else:
            public.extend(src.split("\n"))
        for line in secret:
            code = line.split("#", 1)[0].strip() if c["cell_type"] == "code" else line.strip()
            if len(code) >= 10:
                master.secret_lines.add(code)
                if block and block[-1] == "TESTS":
                    master.hidden_lines.add(code)
    for q in master.questions:
        q.points, per_test = _points(configs[q.name].get("points"), len(q.tests))
        for t, p in zip(q.tests, per_test):
            t.points = p
    public_text = "\n".join(public)   # everything a student may see
    master.secret_lines = {s for s in master.secret_lines if s not in public_text}
    master.hidden_lines &= master.secret_lines
    return master


# --------------------------------------------------------------------------- hand-graded answers


def answers(nb: dict, manual_questions: list[str]) -> dict[str, str]:
    """The text of each hand-graded question's answer cells; "" for an untouched or missing answer.

    Answer cells are found by the question name the build writes into their metadata, else by
    their order among the ``<!-- BEGIN QUESTION -->`` blocks.
    """
    out = {q: "" for q in manual_questions}
    order = iter(manual_questions)
    current = None
    for c in nb.get("cells", []):
        src = source(c)
        tags = (c.get("metadata") or {}).get("tags") or []
        if ANSWER_TAG in tags:
            name = ((c.get("metadata") or {}).get(METADATA_KEY) or {}).get("question") or current
            text = src.strip()
            if name in out and text and text != ANSWER_PLACEHOLDER:
                out[name] = (out[name] + "\n\n" + text).strip()
        elif c.get("cell_type") == "markdown":
            current = question_after(src, current, order)
    return out


def question_after(src: str, current: str | None, order) -> str | None:
    """The hand-graded question open after a markdown cell: its ``<!-- BEGIN/END QUESTION -->`` marks in
    the order they appear (otter writes one question's END and the next one's BEGIN into one cell)."""
    for mark in re.findall(r"<!-- (BEGIN|END) QUESTION -->", src):
        current = next(order, None) if mark == "BEGIN" else None
    return current


def check_cells_deleted(nb: dict, questions: list[str]) -> list[str]:
    """Autograded questions whose ``grader.check`` cell is gone (noted; grading does not need it)."""
    text = "\n".join(source(c) for c in nb.get("cells", []) if c.get("cell_type") == "code")
    return [q for q in questions if not re.search(rf"""\.check\(\s*["']{re.escape(q)}["']""", text)]
