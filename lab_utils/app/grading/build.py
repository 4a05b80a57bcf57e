"""``make student``: the student edition and the grading bundle, from the master notebooks.

For every master notebook (``labs/NN_*.ipynb`` with an ``# ASSIGNMENT CONFIG`` cell), each test
cell's cases are answered by **the master's own solution** and by each known mistake
(:func:`exercise_spec`, which stops the build when a mistake is not told apart by a public and a
hidden case); the answers are written into the test cells of a copy, ``otter assign`` makes the
student notebook from it, which is stamped and searched for solution or hidden-test text.
Notebooks without exercises (00, 08) are stamped too. What ``<out>/student/`` and
``<out>/grading/`` hold: ``docs/grading.md``, step 1.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab_utils.app import docs, handin, questions
from lab_utils.app.grading import exercise_code, programs, reaching
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.exercises import EXERCISES, OK
from lab_utils.app.grading.exercises.answers import same
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake
from lab_utils.app.grading.giveaways import without_discussion
from lab_utils.engine import config
from lab_utils.learn.errors import LabError

REPO = Path(__file__).resolve().parents[3]  # lab_utils/app/grading/build.py
LABS_DIR = REPO / "labs"
DIST_DIR = REPO / "dist"
MANIFEST = "manifest.json"
# The output of a check cell whose cases are all right (exercises.check prints it): written into every
# test cell before otter assign, which takes it as the doctest's expected output.
CHECK_OUTPUT = {"name": "stdout", "output_type": "stream", "text": [OK + "\n"]}
# Text that must never reach a student notebook (otter's own markers).
LEAK_MARKERS = ("# BEGIN SOLUTION", "# END SOLUTION", "# HIDDEN", "BEGIN TESTS", "END TESTS")
# What a student gets besides the notebooks: the lab's code, how to install and run it, and the pages its
# README and notebooks link to (docs/cluster.md; docs/generated/ is written fresh: lab_utils.app.docs).
STUDENT_FILES = ("lab_utils", "Makefile", "requirements.txt", "constraints.txt", "pyproject.toml",
                 "data/README.md", "slurm", ".gitignore", "tools/cuda_wheels.py", "docs/cluster.md")
STUDENT_README = """# Deep-learning training performance lab (student edition)

## Install (once, on the cluster's login node)

```bash
make venv            # installs the lab into .venv (the torch build this node's driver runs)
make prepare         # downloads CIFAR-10 and the text corpus into data/ (needs internet)
make kernel          # registers the Jupyter kernel "DL performance lab (.venv)"
```

## Work

Start JupyterLab on a GPU node (`slurm/jupyter.sbatch`: `docs/cluster.md`, section 3, says how, and
which torch build `make venv` chose and why), open `labs/`, pick the kernel
"DL performance lab (.venv)" and run the notebooks in order. Each notebook's `parameters` cell
holds its knobs. Results are stored as they are measured: after a dead kernel or an expired
session, run the notebook again and only what is missing runs.

To run a notebook headless instead (no browser; the executed copy goes to `results/<profile>/executed/`):

```bash
make lab NOTEBOOKS=labs/01_batch_size_sweep.ipynb
```

Exercises: complete the function under each "Exercise" heading (or, where the exercise hands you an
earlier report's function, find its bug and fix it) and run the check cell below it
(`grader.check(...)`): it says "not done yet", names the mistake, or passes. The instructor grades
your functions with other values as well. Where an exercise asks for a prediction, the notebook then
measures the same quantity and shows your prediction beside it. Answer the questions marked "graded
by hand" in the cell under them. A line "*Discussed after the deadline.*" stands where the lab's own
discussion of a result goes: your instructor publishes it after the deadline.

Without a GPU, the same notebooks run in a small CPU profile (`LAB_PROFILE=quick`): their numbers
are not the assignment's, and every table and figure says so. What each notebook costs in GPU time in
the full profile: `docs/generated/time-budget.md`.
"""


def student_readme() -> str:
    """The student copy's README: install, work, the question map, and how to hand in (``make report``): the
    same text as ``docs/generated/question-map.md`` and ``handin.md``, which the copy carries too."""
    return (STUDENT_README + "\n## Questions: where each is answered\n\n" + questions.question_map_markdown()
            + "\n\n## Handing in\n\n" + handin.HOWTO)


def master_notebooks(labs_dir: Path = LABS_DIR) -> list[Path]:
    """The labs/NN_*.ipynb that carry an ``# ASSIGNMENT CONFIG`` cell, in order."""
    return [p for p in sorted(Path(labs_dir).glob(config.NOTEBOOK_GLOB)) if nbs.is_master(p)]


def find_leaks(student_nb_text: str, master: nbs.Master) -> list[str]:
    """Solution or hidden-test text found in a student notebook (its JSON text).

    Cell sources are searched for otter's markers and every solution / hidden-test line of the
    master; the public tests otter stores in the metadata must all be public, one per public
    test cell of the master.
    """
    nb = json.loads(student_nb_text)
    sources = "\n".join(nbs.source(c) for c in nb["cells"])
    found = [m for m in LEAK_MARKERS if m in sources]
    found += [line for line in sorted(master.secret_lines) if line in sources]
    tests = nb.get("metadata", {}).get("otter", {}).get("tests", {})
    for q in master.questions:
        public = sum(not t.hidden for t in q.tests)
        cases = [c for suite in tests.get(q.name, {}).get("suites", []) for c in suite.get("cases", [])]
        if any(c.get("hidden") for c in cases) or len(cases) != public:
            found.append(f"{q.name}: {len(cases)} test cases in the student notebook, {public} public "
                         "ones in the master")
    meta = json.dumps(nb.get("metadata", {}), ensure_ascii=False)
    found += [m for m in LEAK_MARKERS if m in meta]
    return found


def _finite(value) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


def exercise_spec(master: nbs.Master, q: nbs.MasterQuestion) -> dict:
    """Every case of question ``q`` with the master solution's answer and each mistake's answer."""
    where = f"{master.path.name}, {q.name}"
    ex: Exercise | None = EXERCISES.get(q.name)
    if ex is None:
        raise LabError(f"{where}: no Exercise named {q.name} in "
                       "lab_utils/app/grading/exercises/ (its notebook's module); add one "
                       "(docs/grading.md, 'Writing an exercise').")
    ns: dict = {"__name__": "master_solution"}
    try:
        exec(compile(q.solution, f"<{where} solution>", "exec"), ns)
    except Exception as e:
        raise LabError(f"{where}: the solution cell fails to run ({type(e).__name__}: {e}).") from None
    fn = ns.get(ex.function)
    if not callable(fn):
        raise LabError(f"{where}: the solution cell defines no function {ex.function}.")
    buggy = _handed_out_function(q, ex, where)
    named = False   # a find-the-bug exercise: its handed-out body answers a public case as a known mistake
    tests, seen = [], {"public": [False] * len(ex.mistakes), "hidden": [False] * len(ex.mistakes)}
    for t in q.tests:
        try:
            call = nbs.parse_check(t.source)
        except (ValueError, SyntaxError) as e:
            raise LabError(f"{where}: test cell {t.cell_index}: {e}.") from None
        if call.question != q.name or call.function != ex.function:
            raise LabError(f"{where}: test cell {t.cell_index} checks {call.question}/{call.function}, "
                           f"expected {q.name}/{ex.function}.")
        cases = []
        for case in call.cases:
            want = ex.run(fn, case)
            if want is None or not _finite(want):
                raise LabError(f"{where}: the master's solution answers {want!r} on {case!r}.")
            answers = [ex.mistake_answer(m, case, want) for m in ex.mistakes]
            for i, a in enumerate(answers):
                if a is not None and not same(a, want, ex.rel_tol, ex.abs_tol):
                    seen["hidden" if t.hidden else "public"][i] = True
            if buggy is not None and not t.hidden:
                got = ex.mistake_answer(Mistake("handed out", "", wrong=buggy), case, want)
                named = named or any(a is not None and not same(got, want, ex.rel_tol)
                                     and same(got, a, ex.rel_tol) for a in answers)
            cases.append({"case": case, "expected": want, "mistakes": answers})
        tests.append({"hidden": t.hidden, "points": t.points, "cell": t.cell_index, "cases": cases,
                      "source": nbs.with_expected(t.source, call, [c["expected"] for c in cases], t.hidden)})
    for kind in ("public", "hidden"):
        for m, ok in zip(ex.mistakes, seen[kind]):
            if not ok:
                raise LabError(f"{where}: no {kind} case tells the known mistake '{m.name}' from the right "
                               f"answer; add a {kind} case where they differ.")
    if buggy is not None and not named:
        raise LabError(f"{where}: the handed-out (buggy) {ex.function} answers no public case as one of "
                       "the known mistakes; the bug it carries must be a Mistake that a public case names.")
    if not any(t["hidden"] for t in tests) or not any(not t["hidden"] for t in tests) or q.points <= 0:
        raise LabError(f"{where}: an autograded question needs a public test cell, a hidden one, and points.")
    return {"function": ex.function, "points": q.points, "tests": tests}


def handed_out(solution: str) -> str:
    """A solution cell as the student copy hands it out: otter's rule (a ``# BEGIN PROMPT`` block's lines
    kept, the solution's replaced by ``...`` or, with ``NO PROMPT``, dropped)."""
    from otter.assign.solutions import replace_solutions

    return "\n".join(replace_solutions(solution.split("\n"), "python"))


def _handed_out_function(q: nbs.MasterQuestion, ex: Exercise, where: str):
    """The buggy function a find-the-bug exercise hands out (None for other exercises)."""
    has_prompt = "# BEGIN PROMPT" in q.solution
    if has_prompt != ex.find_the_bug:
        raise LabError(f"{where}: the Exercise says find_the_bug={ex.find_the_bug}, but its solution cell "
                       f"{'has' if has_prompt else 'has no'} a '# BEGIN PROMPT' block (the buggy body handed "
                       "out); make the two agree.")
    if not has_prompt:
        return None
    ns: dict = {"__name__": "handed_out"}
    try:
        exec(compile(handed_out(q.solution), f"<{where} handed out>", "exec"), ns)
    except Exception as e:
        raise LabError(f"{where}: the handed-out cell fails to run ({type(e).__name__}: {e}).") from None
    return ns.get(ex.function)


def _use_lab_grader(nb: dict, name: str) -> None:
    """Make the student notebook's ``grader`` :class:`lab_utils.app.grading.checker.Notebook` (otter's,
    showing a failing check's sentence first) in the init cell otter assign wrote."""
    otter_init = f'grader = otter.Notebook("{name}")'
    cells = [c for c in nb["cells"] if c["cell_type"] == "code" and otter_init in nbs.source(c)]
    if len(cells) != 1:
        raise LabError(f"otter assign wrote {len(cells)} cells with {otter_init!r} in {name}, not 1.")
    src = nbs.source(cells[0]).replace(otter_init, f"from lab_utils.app.grading.checker import Notebook\n\n"
                                                   f'grader = Notebook("{name}")')
    cells[0]["source"] = src


def _stamp(nb: dict, master: nbs.Master, stem: str, version: str) -> None:
    """Write the notebook's lab version and each answer cell's question into the metadata."""
    nb.setdefault("metadata", {})[nbs.METADATA_KEY] = {"notebook": stem, "version": version}
    manual = iter(q.name for q in master.questions if q.manual)
    current = None
    cells = nb["cells"]
    for i, c in enumerate(cells):
        if nbs.ANSWER_TAG not in c.get("metadata", {}).get("tags", []):
            if c["cell_type"] == "markdown":
                current = nbs.question_after(nbs.source(c), current, manual)
            continue
        name = current
        if c["cell_type"] == "code":
            nxt = next((nbs.source(d) for d in cells[i + 1:] if d["cell_type"] == "code"), "")
            name = next((q.name for q in master.questions if f'grader.check("{q.name}")' in nxt), None)
        if name:
            c["metadata"][nbs.METADATA_KEY] = {"question": name}


def _otter_assign(master: Path, rewritten: Path, out: Path, timeout_s: float) -> None:
    try:
        r = subprocess.run([sys.executable, "-m", "otter", "assign", str(rewritten), str(out)],
                           cwd=rewritten.parent, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise LabError(f"otter assign {master.name} took longer than {timeout_s:.0f} s.") from None
    if r.returncode != 0:
        raise LabError(f"otter assign failed on {master.name}:\n{(r.stdout + r.stderr)[-3000:]}")


def _copy_student_files(repo: Path, dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".ipynb_checkpoints")
    for rel in STUDENT_FILES:
        src = repo / rel
        if src.is_dir():
            shutil.copytree(src, dest / rel, ignore=ignore)
        elif src.exists():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    docs.write(dest / "docs" / "generated")
    (dest / "README.md").write_text(student_readme())


def tree_leaks(root: Path, masters: list[nbs.Master]) -> list[str]:
    """Solution or hidden-test lines of any master in a notebook under ``root``, hidden-test lines
    in any other text file (the lab's code holds the reference functions the exercises name, so
    solution-like lines are expected there; the hidden cases are not)."""
    secrets = set().union(*(m.secret_lines for m in masters)) if masters else set()
    hidden = set().union(*(m.hidden_lines for m in masters)) if masters else set()
    found = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path.suffix in (".png", ".jpg", ".whl", ".zip"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        lines = hidden
        if path.suffix == ".ipynb":  # compare cell sources, not JSON-escaped text
            text = "\n".join(nbs.source(c) for c in json.loads(text).get("cells", []))
            lines = secrets
        found += [f"{path.relative_to(root)}: {line}" for line in sorted(lines) if line in text]
    return found


def build(out_dir: str | Path = DIST_DIR, labs_dir: str | Path = LABS_DIR,
          notebooks: list[str] | None = None, timeout_s: float = 300, jobs: int = 2,
          discussion: bool = False) -> dict:
    """Build ``<out>/student/`` and ``<out>/grading/`` from the master notebooks; return the manifest.

    ``notebooks``: only these (stems, file names or ``NN`` prefixes). Raises :class:`LabError`
    when a master's exercise cannot be built or anything solution-like reaches the student copy.
    The student copy leaves out the masters' discussion cells (a pointer line stays);
    ``discussion=True`` builds the post-deadline copy with them in, ``<out>/discussion/``, and leaves
    the grading bundle as it is.
    """
    out, labs = Path(out_dir).resolve(), Path(labs_dir).resolve()
    masters = master_notebooks(labs)
    if notebooks:
        masters = [m for m in masters
                   if m.stem in notebooks or m.name in notebooks or m.stem[:2] in notebooks]
    if not masters:
        raise LabError(f"No notebook in {labs} has an '{nbs.CONFIG_MARK}' cell (or none matches "
                       f"{notebooks}).")
    import otter

    student = out / ("discussion" if discussion else "student")
    grading = out / ("grading" if not discussion else ".discussion-bundle")   # the latter removed below
    for d in (student, grading):
        shutil.rmtree(d, ignore_errors=True)
    (student / "labs").mkdir(parents=True)
    (grading / "otter").mkdir(parents=True)
    manifest = {"lab_version": "", "otter_version": otter.__version__,
                "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "notebooks": {}}
    parsed = [nbs.parse_master(m) for m in masters]
    with tempfile.TemporaryDirectory(prefix="lab-build-") as tmp:
        specs = []
        for path, master in zip(masters, parsed):
            t0 = time.perf_counter()
            spec = {q.name: exercise_spec(master, q) for q in master.questions if not q.manual}
            nb = json.loads(path.read_text())
            for q in spec.values():
                for t in q["tests"]:
                    cell = nb["cells"][t["cell"]]
                    cell["source"] = t["source"]
                    cell["outputs"] = [CHECK_OUTPUT]   # otter takes a test cell's output as what it expects
            if not discussion:
                nb["cells"] = without_discussion(nb["cells"])
            rewritten = Path(tmp) / "masters" / path.stem / path.name
            rewritten.parent.mkdir(parents=True)
            rewritten.write_text(json.dumps(nb, indent=1, ensure_ascii=False))
            specs.append((spec, rewritten, time.perf_counter() - t0))

        def assign(item):
            path, (_, rewritten, _) = item
            t0 = time.perf_counter()
            _otter_assign(path, rewritten, Path(tmp) / "out" / path.stem, timeout_s)
            return time.perf_counter() - t0

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            seconds = list(pool.map(assign, zip(masters, specs)))
        for path, master, (spec, _, t_cases), t_assign in zip(masters, parsed, specs, seconds):
            res = Path(tmp) / "out" / path.stem
            version = nbs.notebook_version(path)
            nb = json.loads((res / "student" / path.name).read_text())
            _use_lab_grader(nb, path.name)
            _stamp(nb, master, path.stem, version)
            text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
            leaks = find_leaks(text, master)
            if leaks:
                raise LabError(f"The student edition of {path.name} still holds solution or hidden-test "
                               f"text: {leaks[:5]}; put it between '# BEGIN SOLUTION' / '# END SOLUTION' "
                               "(or in a raw SOLUTION block) or mark the test '# HIDDEN'.")
            (student / "labs" / path.name).write_text(text)
            zips = sorted((res / "autograder").glob("*-autograder_*.zip"))
            if len(zips) != 1:
                raise LabError(f"otter assign made {len(zips)} autograder zips for {path.name}, not 1.")
            shutil.copy(zips[0], grading / "otter" / f"{path.stem}-autograder.zip")
            prog = programs.parse_program(nb)
            blanks = {st.node.name: exercise_code.function_dump(st.node) for st in prog.statements
                      if hasattr(st.node, "name")}
            for q in spec.values():
                q["blank"] = blanks.get(q["function"], "")
                for t in q["tests"]:
                    del t["source"]
            cases_file = f"{path.stem}.json"
            (grading / cases_file).write_text(json.dumps({"notebook": path.stem, "version": version,
                                                          "questions": spec}, indent=1) + "\n")
            questions = [{"name": q.name, "points": q.points, "manual": q.manual,
                          "function": spec[q.name]["function"] if q.name in spec else ""}
                         for q in master.questions]
            manifest["notebooks"][path.stem] = {
                "file": path.name, "version": version, "title": nbs.title(nb), "cases": cases_file,
                "otter_zip": f"otter/{path.stem}-autograder.zip", "questions": questions,
                "auto_points": sum(q.points for q in master.questions if not q.manual),
                "manual_points": sum(q.points for q in master.questions if q.manual),
                "baseline_patches": sorted(reaching.patch_targets(reaching.monkeypatches(prog))),
            }
            n_cases = sum(len(t["cases"]) for q in spec.values() for t in q["tests"])
            print(f"built {path.name}: {len(master.questions)} questions, {n_cases} cases, version {version} "
                  f"(answers {t_cases:.1f} s, otter assign {t_assign:.1f} s)", flush=True)
    manifest["ungraded"] = {}
    for path in sorted(labs.glob(config.NOTEBOOK_GLOB)):
        if not nbs.is_master(path):
            # a notebook without exercises (00, 08): stamped too, so that one handed in is recognised
            # as the lab's ("nothing to grade"), not mistaken for another course's
            nb = json.loads(path.read_text())
            if not discussion:
                nb["cells"] = without_discussion(nb["cells"])
            version = nbs.notebook_version(path)
            nb.setdefault("metadata", {})[nbs.METADATA_KEY] = {"notebook": path.stem, "version": version}
            (student / "labs" / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
            manifest["ungraded"][path.stem] = {"file": path.name, "version": version, "title": nbs.title(nb)}
    _copy_student_files(labs.parent, student)
    leaks = tree_leaks(student, parsed)
    if leaks:
        raise LabError(f"The student copy in {student} holds solution or hidden-test text: {leaks[:5]}.")
    versions = {k: v["version"] for k, v in manifest["notebooks"].items()}
    manifest["lab_version"] = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:12]
    if discussion:
        shutil.rmtree(grading, ignore_errors=True)
        print(f"discussion copy: {student} (the student copy with the discussion: publish it after the "
              "deadline)")
        return manifest
    (grading / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"student copy:   {student} (hand it out; no solutions, no hidden tests, no discussion)\n"
          f"grading bundle: {grading} (keep it; lab version {manifest['lab_version']})")
    return manifest


def load_manifest(bundle_dir: Path) -> dict:
    path = Path(bundle_dir) / MANIFEST
    if not path.exists():
        raise LabError(f"No grading bundle in {bundle_dir} ({MANIFEST} missing): build it first with "
                       "`make student` (python -m lab_utils student).")
    return json.loads(path.read_text())
