"""Reading notebooks without running them: master notebooks' otter blocks (:func:`parse_master`), and
submissions: the exercise function and what it uses (:func:`extract_exercise`), what needs a human
look (:func:`exercise_flags`, :func:`monkeypatches`), the hand-graded answers (:func:`answers`).
"""

from __future__ import annotations

import ast
import builtins
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


# --------------------------------------------------------------------------- submissions: code


@dataclass
class Statement:
    cell: int          # code cell number (1-based, as a student counts them)
    node: ast.stmt
    text: str          # the statement's source (with decorators)


def _strip_magics(src: str) -> str:
    """IPython lines (``%magic``, ``!shell``) become blank; a ``%%cell`` magic blanks the cell."""
    if src.lstrip().startswith("%%"):
        return ""
    return "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in src.split("\n"))


@dataclass
class Program:
    """A notebook's code cells, parsed (cells with a syntax error are left out and listed)."""
    statements: list[Statement] = field(default_factory=list)
    trees: list[tuple[int, ast.Module]] = field(default_factory=list)
    syntax_errors: list[str] = field(default_factory=list)


def parse_program(nb: dict) -> Program:
    prog = Program()
    n = 0
    for c in nb.get("cells", []):
        if c.get("cell_type") != "code":
            continue
        n += 1
        src = _strip_magics(source(c))
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError) as e:
            first = (source(c).strip().split("\n") or [""])[0][:60]
            line = getattr(e, "lineno", "?")
            prog.syntax_errors.append(f"syntax error in code cell {n} (line {line}: "
                                      f"{getattr(e, 'msg', e)}; cell starts {first!r})")
            continue
        prog.trees.append((n, tree))
        lines = src.split("\n")
        for node in tree.body:
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            prog.statements.append(Statement(n, node, "\n".join(lines[start - 1:node.end_lineno])))
    return prog


_CONST_NODES = (ast.Constant, ast.BinOp, ast.UnaryOp, ast.Tuple, ast.List, ast.Set, ast.Dict,
                ast.operator, ast.unaryop, ast.expr_context)


def _is_constant_expr(node: ast.AST) -> bool:
    return all(isinstance(n, _CONST_NODES) for n in ast.walk(node))


def _targets(node: ast.AST) -> list[ast.AST]:
    """What an assignment or ``del`` writes to, tuples, lists and starred targets unpacked."""
    if isinstance(node, (ast.Assign, ast.Delete)):
        todo = list(node.targets)
    elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        todo = [node.target]
    else:
        return []
    out = []
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo += t.elts
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def _bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Delete):
        return []
    return [t.id for t in _targets(node) if isinstance(t, ast.Name)]   # not x in x.attr = ... or x[i] = ...


def _definable(node: ast.stmt) -> bool:
    """Statements the grader may run: imports, definitions, and constants."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, ast.Assign):
        return all(isinstance(t, ast.Name) for t in node.targets) and _is_constant_expr(node.value)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.value is not None and _is_constant_expr(node.value)
    return False


def _free_names(node: ast.AST) -> set[str]:
    """Names a definition reads that it does not bind itself (a close over-approximation)."""
    loads, stores = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else stores).add(n.id)
        elif isinstance(n, ast.arg):
            stores.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)) and n is not node:
            stores.update(_bound_names(n))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not node:
            stores.add(n.name)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            stores.add(n.name)
    return loads - stores


@dataclass
class ExerciseCode:
    """What the grader runs for one question: the function and what it uses, in notebook order."""
    question: str
    function: str
    source: str = ""
    cell: int = 0                 # the code cell that defines the function
    blank: bool = False           # the student edition's stub, untouched
    problem: str = ""             # why there is nothing to run
    notes: list[str] = field(default_factory=list)
    flags: list[str] = field(default_factory=list)   # check by hand


def function_dump(node: ast.AST) -> str:
    """A definition's AST without positions (to tell an untouched stub)."""
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def extract_exercise(prog: Program, question: str, function: str, blank_dump: str = "") -> ExerciseCode:
    """The function ``function`` and the imports, definitions and constants it uses."""
    out = ExerciseCode(question, function)
    last: dict[str, int] = {}
    for i, st in enumerate(prog.statements):
        for name in _bound_names(st.node):
            last[name] = i
    if function not in last:
        why = f"no function {function} in the notebook"
        out.problem = f"{why} ({prog.syntax_errors[0]})" if prog.syntax_errors else \
            f"{why}: its cell was deleted or renamed"
        return out
    top = prog.statements[last[function]]
    if not isinstance(top.node, ast.FunctionDef):
        out.problem = (f"{function} is not defined with def (cell {top.cell} binds it with "
                       f"{type(top.node).__name__.lower()}): write it as the function the exercise asks for")
        return out
    out.cell = top.cell
    if blank_dump and function_dump(top.node) == blank_dump:
        out.blank = True
    keep, todo, unseen = {last[function]}, [top.node], set()
    while todo:
        node = todo.pop()
        for name in sorted(_free_names(node)):
            if name in last and last[name] not in keep and name != function:
                st = prog.statements[last[name]]
                if _definable(st.node):
                    keep.add(last[name])
                    todo.append(st.node)
                else:
                    unseen.add((name, st.cell))
            elif name not in last and not hasattr(builtins, name):
                unseen.add((name, 0))
    for name, cell in sorted(unseen):
        where = f"set in code cell {cell} by a statement the grader does not run" if cell else \
            "defined nowhere in the notebook"
        out.notes.append(f"{function} uses {name}, {where}: compute it inside the function "
                         "(only functions, imports and constants are graded)")
    chosen = [prog.statements[i] for i in sorted(keep)]
    out.source = "\n\n".join(st.text for st in chosen) + "\n"
    out.flags = exercise_flags([st.node for st in chosen], function)
    return out


# Modules and built-ins that reach other code, files, processes or the network: an exercise never
# needs them, so their use is shown to the instructor ("check by hand").
REACHING_MODULES = {"importlib", "sys", "builtins", "inspect", "gc", "ctypes", "os", "subprocess", "socket",
                    "shutil", "pickle", "marshal", "multiprocessing", "signal", "resource", "pty", "runpy",
                    "code", "codeop", "types", "pathlib", "io", "urllib", "http", "requests", "threading",
                    "asyncio", "tempfile", "glob", "posix", "_thread", "sysconfig", "site", "zipimport"}
# The same modules reached as an attribute of another (``torch.sys``, ``np.os``: many modules import
# them, and through them any loaded module, the grader's own included, is one step away), or
# imported from one (``from torch import sys``). Names an exercise may use for other things
# (``model.modules()``, ``torchvision.io``, ``torch.signal``) are not among them.
REACHING_ATTRS = {"sys", "os", "builtins", "importlib", "subprocess", "posix", "_os", "_sys", "ctypes",
                  "inspect", "gc", "shutil", "socket", "pickle", "marshal", "runpy", "multiprocessing",
                  "_thread", "pty", "sysconfig", "zipimport", "_imp", "_frozen_importlib",
                  "_frozen_importlib_external"}
REACHING_CALLS = {"__import__", "eval", "exec", "compile", "globals", "locals", "vars", "open",
                  "breakpoint", "input", "setattr", "delattr", "getattr"}
SAFE_DUNDERS = {"__name__", "__doc__", "__init__", "__len__", "__iter__", "__next__", "__call__"}
FRAME_ATTRS = {"f_globals", "f_locals", "f_back", "f_builtins", "gi_frame", "cr_frame", "tb_frame",
               "co_code", "co_consts"}
# Methods that change a dict or list in place: called on another module's attribute
# (``lab.EXERCISES.update(...)``, ``math.__dict__.update(...)``) or on an object imported from one
# (``from m import EXERCISES``), they rewire that module. (Not ``add``: ``torch.add`` is arithmetic.)
MUTATORS = {"update", "setdefault", "pop", "popitem", "clear", "append", "extend", "insert", "remove",
            "__setitem__", "__delitem__", "__setattr__", "__delattr__"}
SETTINGS = {"environ", "rcParams", "path"}   # settings: os.environ, plt.rcParams, sys.path


def _imported(trees) -> tuple[set[str], set[str], set[str]]:
    """Names bound by imports in ``trees``: (modules, ``import``-ed names, the ``sys`` module's names)."""
    bound, plain, sys_names = {"builtins", "__builtins__"}, {"builtins", "__builtins__"}, set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                bound.update(_bound_names(n))
            if isinstance(n, ast.Import):
                plain.update(_bound_names(n))
                sys_names.update(a.asname or a.name for a in n.names if a.name == "sys")
    return bound, plain, sys_names


def _reach(n: ast.AST, sys_names: set[str]) -> str:
    """How ``n`` reaches a module that opens everything (``torch.sys``, ``sys.modules``), or ""."""
    if isinstance(n, ast.Attribute) and n.attr in REACHING_ATTRS:
        return f"reaches {n.attr} through {ast.unparse(n)}"
    if isinstance(n, ast.Attribute) and n.attr == "modules" and isinstance(n.value, ast.Name) \
            and n.value.id in sys_names:
        return f"reads {ast.unparse(n)}"
    name = n.args[1] if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "getattr" \
        and len(n.args) >= 2 else None
    if isinstance(name, ast.Constant) and name.value in REACHING_ATTRS:
        return f"reaches {name.value} through {ast.unparse(n)}"
    if isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] not in REACHING_MODULES:
        hit = [a.name for a in n.names if a.name in REACHING_ATTRS]
        if hit:
            return f"reaches {hit[0]} through from {n.module} import {hit[0]}"
    return ""


def exercise_flags(nodes: list[ast.stmt], function: str) -> list[str]:
    """Why the exercise code needs a human look: the lab's own code, or reaching past the function
    (other modules' internals, files, frames), or changing another module."""
    flags: list[str] = []
    bound, plain, sys_names = _imported(nodes)
    for top in nodes:
        for n in ast.walk(top):
            reach = _reach(n, sys_names)
            if reach:
                flags.append(f"the exercise code {reach}")
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in n.names] if isinstance(n, ast.Import) else [n.module or ""]
                for mod in mods:
                    root = mod.split(".")[0]
                    if root == "lab_utils":
                        names = ", ".join(a.name for a in n.names)
                        what = mod if isinstance(n, ast.Import) else f"{mod} ({names})"
                        flags.append(f"{function} imports the lab's own code, {what}: the exercise is to "
                                     "write it yourself")
                    elif root in REACHING_MODULES:
                        flags.append(f"the exercise code imports {mod}")
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in REACHING_CALLS:
                name = n.args[1] if n.func.id == "getattr" and len(n.args) >= 2 else None
                literal = isinstance(name, ast.Constant) and isinstance(name.value, str) \
                    and not name.value.startswith("_")
                if not literal:
                    flags.append(f"the exercise code calls {n.func.id}()")
            elif isinstance(n, ast.Attribute) and ((n.attr.startswith("__") and n.attr not in SAFE_DUNDERS)
                                                   or n.attr in FRAME_ATTRS):
                flags.append(f"the exercise code reads .{n.attr}")
            elif isinstance(n, ast.Name) and n.id in ("__builtins__", "__loader__", "__spec__"):
                flags.append(f"the exercise code uses {n.id}")
            change = _module_change(n, bound, plain)
            if change:
                flags.append(f"the exercise code {change}")
    return list(dict.fromkeys(flags))


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _path_attrs(node: ast.AST) -> list[str]:
    """The attribute names along ``a.b[c].d`` (``["b", "d"]``)."""
    out = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            out.append(node.attr)
        node = node.value
    return out[::-1]


def _module_change(n: ast.AST, bound: set[str], modules: set[str]) -> str:
    """How statement or call ``n`` changes an imported module (or builtins), or "".

    ``bound``: every name an import binds; ``modules``: those bound by ``import`` (modules).
    Assignment, ``del`` or augmented assignment to an imported name's attribute (``math.isclose =
    ...``); ``setattr``/``delattr`` on one; a method that changes a container in place, called on a
    module's attribute (``lab.EXERCISES.update(...)``) or on an imported object (``EXERCISES.pop(...)``,
    after ``from m import EXERCISES``); an item written into a module's namespace (``sys.modules['x']
    = ...``, ``math.__dict__['isclose'] = ...``). Module settings (``plt.rcParams['font.size'] = 8``,
    ``os.environ.update(...)``, ``sys.path.append(...)``) are not changes.
    """
    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.args and n.func.id in ("setattr",
                                                                                                 "delattr"):
        if _root_name(n.args[0]) in bound:
            attr = n.args[1].value if len(n.args) > 1 and isinstance(n.args[1], ast.Constant) else "?"
            return f"assigns to {ast.unparse(n.args[0])}.{attr} ({n.func.id})"
        return ""
    elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in MUTATORS:
        receiver = n.func.value
        attrs = _path_attrs(receiver)
        root = _root_name(receiver)
        if root in bound and (attrs or root not in modules) and (attrs or [root])[-1] not in SETTINGS:
            return f"calls {ast.unparse(n.func)}() on another module"
        return ""
    for t in _targets(n):   # the targets themselves: not x in x.attr[i] = ... or f(x.attr) = ...
        if isinstance(t, ast.Attribute) and _root_name(t) in bound:
            return f"assigns to {ast.unparse(t)}"
        elif isinstance(t, ast.Subscript) and _root_name(t) in bound:
            attrs = _path_attrs(t.value)
            if any(a == "modules" or a.startswith("__") for a in attrs) or \
                    (not attrs and _root_name(t) in ("builtins", "__builtins__")):
                return f"assigns to {ast.unparse(t)}"
    return ""


def monkeypatches(prog: Program) -> list[str]:
    """Changes to imported modules or builtins, and reaches into modules that open everything, anywhere.

    Each is described with its cell: ``"assigns to math.isclose (code cell 12)"``,
    ``"calls lab.EXERCISES.update() on another module (code cell 3)"``, ``"reaches sys through
    torch.sys (code cell 5)"`` (:func:`_module_change`, :func:`_reach`). Settings written by item
    (``plt.rcParams['x'] = 1``) are not listed.
    """
    bound, plain, sys_names = _imported(tree for _, tree in prog.trees)
    found: list[str] = []
    for cell, tree in prog.trees:
        for n in ast.walk(tree):
            what = _module_change(n, bound, plain) or _reach(n, sys_names)
            if what:
                found.append(f"{what} (code cell {cell})")
    return list(dict.fromkeys(found))


def patch_targets(found: list[str]) -> set[str]:
    """``"assigns to math.isclose (code cell 12)"`` -> ``"assigns to math.isclose"`` (to compare with
    the student edition)."""
    return {f.rsplit(" (code cell", 1)[0] for f in found}


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
