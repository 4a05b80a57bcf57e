"""A submission's code read without running it: its code cells parsed (:func:`parse_program`), and
which names a statement binds and which it uses."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

from lab_utils.app.grading.notebooks import source

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


def assigned_targets(node: ast.AST) -> list[ast.AST]:
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


def bound_names(node: ast.stmt) -> list[str]:
    """The names a top-level statement binds (imports, definitions, assignments to names)."""
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return [(a.asname or a.name).split(".")[0] for a in node.names if a.name != "*"]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Delete):
        return []
    # not x in x.attr = ... or x[i] = ...
    return [t.id for t in assigned_targets(node) if isinstance(t, ast.Name)]


def definable(node: ast.stmt) -> bool:
    """Statements the grader may run: imports, definitions, and constants."""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return True
    if isinstance(node, ast.Assign):
        return all(isinstance(t, ast.Name) for t in node.targets) and _is_constant_expr(node.value)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.value is not None and _is_constant_expr(node.value)
    return False


def free_names(node: ast.AST) -> set[str]:
    """Names a definition reads that it does not bind itself (a close over-approximation)."""
    loads, stores = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            (loads if isinstance(n.ctx, ast.Load) else stores).add(n.id)
        elif isinstance(n, ast.arg):
            stores.add(n.arg)
        elif isinstance(n, (ast.Import, ast.ImportFrom)) and n is not node:
            stores.update(bound_names(n))
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n is not node:
            stores.add(n.name)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            stores.add(n.name)
    return loads - stores
