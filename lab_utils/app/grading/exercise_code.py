"""The code the grader runs for one question: the exercise function and what it uses, in the
order the cells define them (:func:`extract_exercise`)."""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass, field

from lab_utils.app.grading.programs import Program, bound_names, definable, free_names
from lab_utils.app.grading.reaching import exercise_flags


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
        for name in bound_names(st.node):
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
        for name in sorted(free_names(node)):
            if name in last and last[name] not in keep and name != function:
                st = prog.statements[last[name]]
                if definable(st.node):
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
