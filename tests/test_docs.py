"""The documentation: ``docs/generated/`` is what ``make docs`` writes now; the README is a front door whose
commands, links and quoted numbers hold; every page a README or notebook names is there.

Nothing here runs a notebook or a training step: the generator runs in process (about a second, the time
budget's plans), and each command of the README and of ``docs/*.md`` is checked the way it can be
without running it: ``make -n`` from the repository root for a make line (the target exists and its
variables parse), the lab's own argument parser for ``python -m lab_utils ...``, the script and its
arguments for ``sbatch`` (``tests/test_slurm.py`` submits the CPU lines as written).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import shlex
import subprocess
from pathlib import Path

import nbformat
import pytest

from lab_utils.app import docs, handin, questions, time_budget
from lab_utils.experiments.shared import anchors, estimates
from lab_utils.learn.errors import LabError

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docs.pages()


# --------------------------------------------------------------------------- docs/generated


def test_docs_generated_is_what_make_docs_writes(tmp_path, pages):
    """The one check that the generated pages are current: written afresh into a scratch folder, they must
    equal docs/generated/ file for file (no page missing, none stale, none left over)."""
    docs.write(tmp_path)
    fresh = {p.name: p.read_text(encoding="utf-8") for p in sorted(tmp_path.glob("*.md"))}
    assert fresh == pages
    committed = {p.name: p.read_text(encoding="utf-8") for p in sorted(docs.GENERATED.glob("*.md"))}
    stale = sorted(set(fresh) ^ set(committed) | {n for n in fresh if committed.get(n) != fresh[n]})
    assert not stale, f"docs/generated/ is not current ({', '.join(stale)}): run `make docs`"


def test_each_page_carries_the_codes_own_text(pages):
    """What each page is written from, whole: the time budget's table and every assumption of the cost
    model, the question map, how to hand in; each page names its source and `make docs`."""
    budget = pages["time-budget.md"]
    assert time_budget.budget_markdown() in budget and estimates.LABEL in budget
    assert all(a in budget for a in estimates.ASSUMPTIONS)
    assert questions.question_map_markdown() in pages["question-map.md"]
    assert handin.HOWTO.strip() in pages["handin.md"]
    for name, (_, source) in docs.PAGES.items():
        first = pages[name].splitlines()[0]
        assert first.startswith("<!--") and "`make docs`" in first and source in first, name
    rows = re.findall(r"^\| \*\*(Q[\d.]+)\*\* .*? \| `(\d\d)_\w+` \|", pages["question-map.md"], re.M)
    assert [k for k, _ in rows] == list(questions.ASSIGNMENT_KEYS)  # the map follows SECTIONS' order


def test_the_check_finds_a_stale_a_missing_and_a_stray_page(tmp_path, capsys):
    """`python -m lab_utils docs --check` (what the test above asserts, as a command): 0 on a current folder;
    1 naming each wrong page and `make docs` after a page is edited by hand, removed, or not the generator's;
    writing again removes the stray page and makes the folder current."""
    assert docs.main(["--out", str(tmp_path)]) == 0
    assert docs.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "question-map.md").write_text("edited by hand\n")
    (tmp_path / "handin.md").unlink()
    (tmp_path / "old-table.md").write_text("x\n")
    capsys.readouterr()
    assert docs.main(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err
    assert "question-map.md: stale" in err and "handin.md: missing" in err
    assert "old-table.md: not written" in err
    assert "make docs" in err
    assert docs.main(["--out", str(tmp_path)]) == 0
    assert docs.differences(tmp_path) == [] and not (tmp_path / "old-table.md").exists()


def test_make_docs_is_a_target_with_its_help_line():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^docs: venv +## .*docs/generated", makefile, re.M)
    assert re.search(r"^docs:.*\n\t\$\(PY\) -m lab_utils docs$", makefile, re.M)
    assert re.search(r"^\.PHONY:[^\n]*(\\\n[^\n]*)*\bdocs\b", makefile, re.M)


# --------------------------------------------------------------------------- the README


def test_the_readme_is_a_front_door_in_the_order_a_newcomer_acts():
    """Issue 50: at most 150 lines; what the lab is, the notebook table, the two commands, the student path,
    how one number is measured, links into docs/; no block pasted from code output."""
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 150
    heads = re.findall(r"^## (.+)$", text, re.M)
    assert heads == ["The two commands", "Student path (JupyterLab on a GPU node)",
                     "How one number is measured", "Where to read next"]
    assert text.index("| notebook |") < text.index("## The two commands")
    assert "<!--" not in text
    for page in ("instructor", "grading", "cluster", "developing"):
        assert f"(docs/{page}.md)" in text, page


def test_how_one_number_is_measured_names_files_that_hold_it():
    """The three files the README names for notebook 01's epoch-2 time exist and hold what it says they do;
    the notebook cell it quotes is in notebook 01."""
    text = README.read_text(encoding="utf-8")
    part = text[text.index("## How one number is measured"):text.index("## Where to read next")]
    said = re.findall(r"^\d\. `([\w/]+\.py)`, `(\w+)`", part, re.M)
    assert [f for f, _ in said] == ["lab_utils/experiments/n01_batch_sweep/worker.py",
                                    "lab_utils/learn/loop.py",
                                    "lab_utils/experiments/n01_batch_sweep/tables.py"]
    for path, function in said:
        assert re.search(rf"^def {function}\(", (REPO / path).read_text(), re.M), (path, function)
    cell = re.search(r"cell `(records = measure\(.*?\))`", part).group(1)
    nb = nbformat.read(str(REPO / "labs" / "01_batch_size_sweep.ipynb"), as_version=4)
    assert any(cell in c.source for c in nb.cells if c.cell_type == "code")
    # item 3, by hand: repeats of 10 and 14 s at batch 32 give 12 s (the lower repeat keeps its own 10 s);
    # one of 20 s at batch 64 gives 20 s
    assert "`train_seconds_median`, the median of the repeats' `train_seconds`" in " ".join(part.split())
    from lab_utils.engine.records import Record
    from lab_utils.experiments.n01_batch_sweep.tables import sweep_table

    def rec(batch, repeat, seconds):
        return Record("sweep", {"batch_size": batch, "repeat": repeat}, {"train_seconds": seconds},
                      status="ok")

    df = sweep_table([rec(32, 0, 10.0), rec(32, 1, 14.0), rec(64, 0, 20.0)])
    assert df["epoch-2 training (s)"].tolist() == [12.0, 20.0]


def _anchor_numbers() -> set[float]:
    """Every number lab_utils.experiments.shared.anchors quotes (values, and the GPUs and batch sizes of
    their keys)."""
    out: set[float] = set()

    def walk(v):
        if isinstance(v, bool):
            return
        if isinstance(v, int | float):
            out.add(float(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k)
                walk(x)
        elif isinstance(v, tuple | list):
            for x in v:
                walk(x)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            walk(dataclasses.asdict(v))

    for name in anchors.__all__:
        walk(getattr(anchors, name))
    return out


def test_the_notebook_tables_reference_numbers_are_the_anchors_or_recomputed_from_them():
    """Each number in the README's "earlier cohorts' reference numbers" column is one
    lab_utils.experiments.shared.anchors quotes, or one recomputed here from them (a number typed wrong, or
    no longer in the code, fails)."""
    a = anchors
    t1 = a.FIRST_COHORT_TABLE1_SECONDS
    slowest = {(b, n): a.GPT_RANK_SECONDS[(b, 1)][0] / max(a.GPT_RANK_SECONDS[(b, n)]) for b in (64, 128)
               for n in (2, 4)}
    split = (t1[(1, 32)] / 2, t1[(2, 32)] - t1[(1, 32)] / 2)          # T(1)/N and T(N) - T(1)/N at 2 x 32
    spread = [a.first_cohort_q1_over_q2(b) for b in (32, 128, 512)]
    derived = {t1[(1, 32)] / t1[(2, 32)], *split, *slowest.values(), min(spread), max(spread)}
    assert round(t1[(1, 32)] / t1[(2, 32)], 2) == 1.78 and [round(x, 2) for x in split] == [20.65, 2.5]
    assert [round(slowest[(64, n)], 2) for n in (2, 4)] == [1.61, 2.68]
    allowed = _anchor_numbers() | derived
    rows = re.findall(r"^\| `(\d\d)_\w+` \|[^|]*\|[^|]*\| ([^|]*) \|$", README.read_text(encoding="utf-8"),
                      re.M)
    assert [n for n, _ in rows] == [p.name[:2] for p in sorted((REPO / "labs").glob("[0-9][0-9]_*.ipynb"))]
    quoted = 0
    for number, cell in rows:
        for token in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", cell):
            value, places = float(token.replace(",", "")), len(token.partition(".")[2])
            assert any(round(v, places) == value for v in allowed), f"{number}: {token} is not the code's"
            quoted += 1
    assert quoted >= 30


# --------------------------------------------------------------------------- commands, links, sections


def _commands(path: Path) -> list[str]:
    """The command lines of the page's ```bash blocks, comments cut off."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line and not line.startswith("#"):
                out.append(line)
    return out


#: Lines of the pages that are not the lab's commands (a placeholder to fill in, the cluster's own tools),
#: each with the reason it is not checked here; every one must still be on its page.
NOT_THE_LABS = {
    "git clone <this repository> dl-perf-lab && cd dl-perf-lab": "the clone itself: a placeholder URL",
    "module load pytorch": "the cluster's module system, named by the site",
    "cat slurm-lab-jupyter-<jobid>.out": "reads a job's output: a placeholder job id",
}


def _check_command(line: str) -> None:
    from lab_utils.app.cli import build_parser
    from lab_utils.experiments import registry

    words = shlex.split(line)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
        words.pop(0)
    if words[0] == "make":
        r = subprocess.run(["make", "-n", "--no-print-directory", *words[1:]], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, f"{line!r}: make -n says {r.stderr.strip()}"
    elif words[0] in (".venv/bin/python", "python") and words[1:3] == ["-m", "lab_utils"]:
        if words[3] in ("doctor", "docs"):  # their options are their own parsers'
            assert words[3] in build_parser()._subparsers._group_actions[0].choices
        else:
            build_parser().parse_args(words[3:])  # exits (a failure) on an unknown subcommand or option
        for w in words[4:]:
            if w.startswith("labs/"):
                assert (REPO / w).is_file(), line
    elif words[0] == "sbatch":
        scripts = [w for w in words if w.startswith("slurm/")]
        assert len(scripts) == 1 and (REPO / scripts[0]).is_file(), line
        args = words[words.index(scripts[0]) + 1:]
        if scripts[0] == "slurm/experiment.sbatch" and args:  # the arguments are measure's
            build_parser().parse_args(["measure", *args])
            registry.by_name(args[0])  # an experiment that exists (LabError otherwise)
        for w in args:
            if w.startswith("labs/"):
                assert (REPO / w).is_file(), line
    else:
        raise AssertionError(f"{line!r} is not a command of the lab this test can check")


@pytest.mark.timeout(300)
def test_every_command_of_the_readme_and_docs_is_the_labs_and_parses_from_the_repository_root():
    """Issue 50: every command written in a ```bash block of README.md or docs/*.md, as written, from the
    repository root: `make -n ...` succeeds (target and variables), `python -m lab_utils ...` parses with
    the lab's parser, `sbatch` names a script of slurm/ (and an experiment of the registry); anything else
    is one of the few lines listed, with a reason, in NOT_THE_LABS."""
    seen = set()
    readme = _commands(README)
    assert {"make lab", "make test", "make venv", "make prepare", "make kernel", "make report"} <= set(readme)
    for path in PAGES:
        for line in _commands(path):
            if line in NOT_THE_LABS:
                seen.add(line)
                continue
            _check_command(line)
    assert seen == set(NOT_THE_LABS)


def test_the_command_check_refuses_what_does_not_exist():
    for bad in ("make no-such-target", "python -m lab_utils no-such-command", "sbatch slurm/missing.sbatch",
                "sbatch slurm/experiment.sbatch no_such_experiment", "pip install something"):
        with pytest.raises((AssertionError, SystemExit, LabError)):
            _check_command(bad)


def test_every_relative_link_of_the_readme_and_docs_resolves():
    for path in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target):
                continue
            assert (path.parent / target).exists(), f"{path.relative_to(REPO)} links to {target}"


def _headings(text: str) -> set[str]:
    return {" ".join(h.split()) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_what_the_notebooks_and_the_code_name_is_there():
    """A master notebook's sentence naming a README section ("README, "Handing in"") names a heading of the
    README; a file of docs/ it names exists; the sections the code's messages name exist on their page."""
    heads = _headings(README.read_text(encoding="utf-8"))
    for path in sorted((REPO / "labs").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        for c in nb.cells:
            for section in re.findall(r"README(?:'s|,)\s+\(?\"([^\"]+)\"", c.source):
                assert " ".join(section.split()) in heads, f"{path.name} names README section {section!r}"
            for name in re.findall(r"`?(docs/[\w/.-]+\.md)", c.source):
                assert (REPO / name).is_file(), f"{path.name} names {name}"
    said = {"docs/grading.md": ("The sandbox", "Writing an exercise", "Handing in"),
            "docs/instructor.md": ("Time budget: GPU hours to book", "Data")}
    for page, sections in said.items():
        have = _headings((REPO / page).read_text(encoding="utf-8"))
        assert all(s in have for s in sections), (page, sections)
    assert "How it is estimated: docs/generated/time-budget.md" in time_budget.budget_line("01")


_ROLE = re.compile(r":(?:func|class|data|mod|meth|attr|obj|exc|const):`~?([A-Za-z_][\w.]*)`")
_DOTTED = re.compile(r"\blab_utils(?:\.[A-Za-z_]\w*)+")


def _resolves(name: str, module=None) -> bool:
    """Whether ``name`` is an attribute path in ``module`` (or one of its classes), or an absolute one
    (the longest importable prefix, then attributes)."""
    def walk(obj, parts):
        for a in parts:
            if not hasattr(obj, a):
                return False
            obj = getattr(obj, a)
        return True

    parts = name.split(".")
    if module is not None and (walk(module, parts) or any(
            walk(v, parts) for v in vars(module).values() if isinstance(v, type))):
        return True
    for i in range(len(parts), 0, -1):
        try:
            m = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        return walk(m, parts[i:])
    return False


def _stale_references(path: Path, module=None) -> list[str]:
    """The ``:func:``-style and ``lab_utils.x.y`` names in one file that name nothing (the README's
    add-a-notebook example, ``n10_toy``/``nNN_name``, is a package still to be written)."""
    text = path.read_text(encoding="utf-8")
    names = set(_ROLE.findall(text)) | {m.rstrip(".") for m in _DOTTED.findall(text)}
    return sorted(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: {n}" for n in names
                  if "n10_toy" not in n and "nNN_" not in n and not _resolves(n, module))


@pytest.mark.timeout(120)
def test_every_name_the_code_notebooks_and_docs_give_exists():
    """A docstring's ``:func:`merge_repeats``` or a notebook's ``lab_utils.learn.spread.x`` names a thing
    that is there: a student who follows it finds it (after a move, the old path is caught here)."""
    stale = []
    for path in sorted((REPO / "lab_utils").rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        stale += _stale_references(path, importlib.import_module(name))
    for path in [README, *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "labs").glob("*.ipynb")),
                 *sorted((REPO / "lab_utils").rglob("*.md"))]:
        stale += _stale_references(path)
    assert not stale, "names that name nothing:\n" + "\n".join(stale)


def test_the_name_check_finds_a_moved_function(tmp_path):
    page = tmp_path / "page.py"
    page.write_text('"""See :func:`lab_utils.learn.spread.merge_repeats` and :func:`time_spread`, '
                    'lab_utils.engine.records.Record and :class:`LabError`."""\n')
    from lab_utils.learn import spread
    assert [s.split(": ")[1] for s in _stale_references(page, spread)] == [
        "LabError", "lab_utils.learn.spread.merge_repeats"]
