"""What in a submission's code needs a human look: an exercise that reaches other code, files,
processes or the network (:func:`exercise_flags`), a cell that changes another module
(:func:`monkeypatches`)."""

from __future__ import annotations

import ast

from lab_utils.app.grading.programs import Program, assigned_targets, bound_names

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
                bound.update(bound_names(n))
            if isinstance(n, ast.Import):
                plain.update(bound_names(n))
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
    for t in assigned_targets(n):   # the targets themselves: not x in x.attr[i] = ... or f(x.attr) = ...
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
