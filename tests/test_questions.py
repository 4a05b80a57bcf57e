"""The assignment's numbering everywhere (issue 24): one table, checked against every place that names a
question, and no lab label that could be read as the assignment's number.

:data:`ASSIGNMENT` is the one table: the assignment's questions as the earlier cohort's report
answers them (SPEC.md, "The assignment's own question numbers"), the notebook that answers each,
and words its title must carry. It is checked against ``lab_utils.app.questions.SECTIONS``, the question
map ``make docs`` writes (docs/generated/question-map.md), the README's notebook table, the report
template, every notebook's title, answering section, hand-graded cell and "For your report" cell,
and the time budget's column. Nothing here runs a notebook: each test parses files (well under a
second each).
"""

from __future__ import annotations

import re

import nbformat
import pytest
import yaml

from lab_utils.app import questions, time_budget
from lab_utils.engine.config import repo_root

# The assignment: key -> (notebook answering it, words its title must contain), in the assignment's order.
ASSIGNMENT = {
    "Q1": ("01", ("batch-size sweep", "one gpu")),
    "Q2": ("02", ("speedup", "1, 2 and 4 gpus", "strong or weak")),
    "Q3.1": ("03", ("compute vs communication",)),
    "Q3.2": ("04", ("all-reduce", "bandwidth utilization")),
    "Q4.1": ("05", ("large-batch accuracy", "5 epochs")),
    "Q4.2": ("05", ("falls behind", "improve")),
    "Q5": ("05", ("set_epoch", "distributedsampler")),
    "Q6": ("05", ("gradients the only messages",)),
    "Q7": ("05", ("4 gpus x 512", "only the gradients enough")),
}
KEYS = set(ASSIGNMENT) | {"Q3", "Q4"}  # "Q3 and Q4 in two parts" may name the groups
LABS = repo_root() / "labs"
README = repo_root() / "README.md"
QUESTION_MAP = repo_root() / "docs" / "generated" / "question-map.md"
NOTEBOOKS = sorted(LABS.glob("[0-9][0-9]_*.ipynb"))


def _nb(path):
    return nbformat.read(str(path), as_version=4)


@pytest.fixture(scope="module")
def notebooks():
    return {p.name[:2]: _nb(p) for p in NOTEBOOKS}


def _words(text: str) -> str:
    return " ".join(text.split())


def _label(key: str) -> str:
    return "Part 2 project" if key == questions.PART2 else key


# --------------------------------------------------------------------------- the one table


def test_sections_follow_the_assignment():
    mine = [s for s in questions.SECTIONS if s.key.startswith("Q")]
    assert [s.key for s in mine] == list(ASSIGNMENT) == list(questions.ASSIGNMENT_KEYS)
    for s in mine:
        notebook, words = ASSIGNMENT[s.key]
        assert s.notebook[:2] == notebook, (s.key, s.notebook)
        for w in words:
            assert w in s.title.lower(), f"{s.key}'s title {s.title!r} lacks {w!r}"
    q42 = next(s for s in mine if s.key == "Q4.2")
    assert "linear learning-rate scaling" in q42.asks and "warm-up" in q42.asks  # the remedies live in Q4.2


def test_the_question_map_rows_follow_the_table():
    """The map `make docs` writes (tests/test_docs.py checks that docs/generated/ is current)."""
    text = QUESTION_MAP.read_text(encoding="utf-8")
    rows = re.findall(r"^\| \*\*(Q[\d.]+)\*\* (.*?) \| `(\d\d)_\w+` \|", text, re.M)
    assert [k for k, _, _ in rows] == list(ASSIGNMENT)
    for key, title, notebook in rows:
        assert notebook == ASSIGNMENT[key][0]
        assert all(w in title.lower() for w in ASSIGNMENT[key][1]), (key, title)


@pytest.fixture(scope="module")
def handin_report(tmp_path_factory) -> str:
    """The hand-in's report.md (`make report`) written from an empty result store: every heading and slot."""
    import os

    from lab_utils.app import handin

    tmp = tmp_path_factory.mktemp("handin")
    old = os.environ.get("LAB_RESULTS_DIR")
    os.environ["LAB_RESULTS_DIR"] = str(tmp / "results")
    try:
        return (handin.build("full", out=tmp / "out", labs=tmp).out / "report.md").read_text()
    finally:
        if old is None:
            os.environ.pop("LAB_RESULTS_DIR")
        else:
            os.environ["LAB_RESULTS_DIR"] = old


def test_report_headings_follow_the_table(handin_report):
    heads = re.findall(r"^## (Q[\d.]+) · (.*) \(notebook (\d\d)\)$", handin_report, re.M)
    assert [k for k, _, _ in heads] == list(ASSIGNMENT)
    for key, title, notebook in heads:
        assert notebook == ASSIGNMENT[key][0] and all(w in title.lower() for w in ASSIGNMENT[key][1])


def test_readme_notebook_table_and_time_budget_name_the_same_questions():
    table = {m.group(1): m.group(2) for m in
             re.finditer(r"^\| `(\d\d)_\w+` \| ([^|]*?) \|", README.read_text(encoding="utf-8"), re.M)}
    budget = time_budget.budget_table().set_index("notebook")["answers"]
    for path in NOTEBOOKS:
        number = path.name[:2]
        want = [_label(k) for k in dict.fromkeys(s.key for s in questions.sections_for(number))]
        assert table[number].split(" (")[0] == ", ".join(dict.fromkeys(want)), (number, table[number])
        assert budget[number] == ", ".join(dict.fromkeys(want))
    for key, (notebook, _) in ASSIGNMENT.items():
        assert key in table[notebook].split(", ")


def test_notebook_titles_name_their_questions(notebooks):
    for number, nb in notebooks.items():
        title = nb.cells[0].source
        for key in questions.labels_for(number).split(", "):
            assert _label(key) in title, f"notebook {number}'s title does not name {_label(key)}"
        for key, (notebook, _) in ASSIGNMENT.items():
            if notebook != number:
                assert f"**{key}" not in title, f"notebook {number}'s title claims {key}"


def test_each_question_is_answered_in_its_named_section(notebooks):
    """The section (markdown heading) the map names exists and opens with the question's bold key; a bold
    key in a notebook is always one that notebook answers."""
    for s in questions.SECTIONS:
        cells = [c for c in notebooks[s.notebook[:2]].cells if c.cell_type == "markdown"
                 and re.search(rf"^#+ {re.escape(s.cell)}$", c.source, re.M)]
        assert len(cells) == 1, f"{s.notebook} has {len(cells)} sections named {s.cell!r}"
        if s.key.startswith("Q"):
            body = cells[0].source.split(s.cell, 1)[1]
            assert f"**{s.key}" in body, f"{s.notebook}, section {s.cell!r} does not say **{s.key}**"
    for number, nb in notebooks.items():
        answered = set(questions.labels_for(number).split(", "))
        for c in (c for c in nb.cells if c.cell_type == "markdown"):
            for key in re.findall(r"\*\*(Q\d(?:\.\d)?)(?![.]\d)", c.source):
                assert key in answered, f"notebook {number} marks **{key}** but answers {sorted(answered)}"


def _manual_questions(nb) -> dict[str, tuple[int, str]]:
    """otter name -> (points, prompt) of every hand-graded question of a master notebook."""
    out = {}
    for i, c in enumerate(nb.cells):
        if c.cell_type == "raw" and c.source.startswith("# BEGIN QUESTION"):
            cfg = yaml.safe_load("\n".join(c.source.splitlines()[1:]))
            if cfg.get("manual"):
                out[cfg["name"]] = (cfg["points"], nb.cells[i + 1].source)
    return out


def test_hand_graded_cells_are_labelled_with_their_question(notebooks):
    for number, nb in notebooks.items():
        manual = _manual_questions(nb)
        mine = {s.by_hand: s for s in questions.sections_for(number) if s.by_hand}
        assert set(manual) == set(mine), (number, sorted(manual), sorted(mine))
        for name, (points, prompt) in manual.items():
            s = mine[name]
            assert _words(prompt) == _words(questions.by_hand_prompt(s, points)), f"{name}'s prompt"
            assert prompt.startswith(f"**{s.label} (graded by hand, {points} point")


def test_for_your_report_cells_are_the_reports_slots(notebooks, handin_report):
    """Each notebook asks in its "For your report" cell exactly what the hand-in's report.md asks, and
    names its hand-graded question instead of asking it twice."""
    template = handin_report
    for number, nb in notebooks.items():
        cells = [c for c in nb.cells if c.cell_type == "markdown" and re.search(r"^## .*[Ff]or your report",
                                                                               c.source, re.M)]
        want = questions.for_your_report_markdown(number)
        if not any(s.report or s.first for s in questions.sections_for(number)):
            assert not cells, number
            continue
        assert len(cells) == 1 and cells[0].source.endswith(want), f"notebook {number}: regenerate the cell"
        for s in questions.sections_for(number):
            for q in s.report:
                assert f"_{q}_" in template
            if s.by_hand:
                assert s.by_hand_asks not in want and not any(s.by_hand_asks in q for q in s.report)


def test_report_holds_every_table_and_asks_each_answer_once(handin_report):
    from lab_utils.app.handin import PLACEHOLDER
    from lab_utils.app.handout import LAYOUTS

    text = handin_report
    assert text.count(PLACEHOLDER) == sum(len(s.report) for s in questions.SECTIONS) + sum(
        1 for s in questions.SECTIONS if s.first)  # one slot per report question, and the formula
    parts = re.split(r"^## ", text, flags=re.M)[2:]  # after the provenance
    for s, part in zip(questions.SECTIONS, parts, strict=True):
        assert part.startswith(s.heading)
        for t in s.tables:  # not measured yet: each table says so, by name
            assert f"tables/{t}.csv" in part if t in LAYOUTS else f"`tables/{t}` is not measured yet" in part
        if s.by_hand:
            assert part.count(s.by_hand_asks) == 1 and f"`{s.by_hand}`" in part and "Not answered yet" in part
    by_key = {s.key: s for s in questions.SECTIONS}
    assert "scaling_fixed_global_batch" in by_key["Q2"].tables
    assert "scaling_definitions" not in by_key["Q2"].tables   # it answers Q2: the discussion shows it
    q32 = parts[list(by_key).index("Q3.2")]
    assert q32.index("First, the formula") < q32.index("tables/allreduce_utilization")  # asked first
    gpt = next(s for s in questions.SECTIONS if s.notebook.startswith("06"))
    assert "gpt_rank_breakdown" in gpt.tables and "per-rank table" in gpt.by_hand_asks


# --------------------------------------------------------------------------- labels


FORBIDDEN = re.compile(r"\bQuestions?\s+\d|\bExercise\s+(?!\d\d-[a-z]\b)\d")


def _texts():
    for path in [README, *sorted((repo_root() / "docs").rglob("*.md"))]:
        yield str(path.relative_to(repo_root())), path.read_text(encoding="utf-8")
    for path in NOTEBOOKS:
        for i, c in enumerate(_nb(path).cells):
            yield f"{path.name} cell {i}", c.source
    for path in sorted((repo_root() / "lab_utils").rglob("*.py")):
        yield str(path.relative_to(repo_root())), path.read_text(encoding="utf-8")


def test_no_lab_label_reads_as_an_assignment_number():
    bad = [f"{where}: {m.group()!r}" for where, text in _texts() for m in FORBIDDEN.finditer(text)]
    assert not bad, ("name lab exercises 'Exercise NN-a' and the assignment's questions 'Q<n>':\n"
                     + "\n".join(bad))
    unknown = [f"{where}: {m.group()}" for where, text in _texts()
               for m in re.finditer(r"\bQ\d+(?:\.\d+)?\b", text) if m.group() not in KEYS]
    assert not unknown, "not a question of the assignment:\n" + "\n".join(unknown)


def test_exercises_are_named_after_their_notebook():
    for path in NOTEBOOKS:
        heads = [m for c in _nb(path).cells if c.cell_type == "markdown"
                 for m in re.findall(r"^## Exercise (\S+)", c.source, re.M)]
        assert heads == [f"{path.name[:2]}-{x}" for x in "abcdefgh"[:len(heads)]], (path.name, heads)


def _exercise_blocks(nb) -> list[tuple[str, str]]:
    """(heading's exercise, otter name) of each autograded question, in notebook order."""
    out, heading = [], None
    for c in nb.cells:
        m = re.search(r"^## Exercise (\S+)", c.source, re.M) if c.cell_type == "markdown" else None
        heading = m.group(1) if m else heading
        if c.cell_type == "raw" and c.source.startswith("# BEGIN QUESTION"):
            cfg = yaml.safe_load("\n".join(c.source.splitlines()[1:]))
            if not cfg.get("manual"):
                out.append((heading, cfg["name"]))
    return out


def test_every_graded_question_has_its_assignment_question_and_gradebook_column(notebooks):
    """Issue 35: the gradebook's column of each graded question names the assignment's question it
    belongs to and where it is (``Q3.2 ring bytes (04-b)``): each exercise is in the section of the
    notebook that answers its question, with the letter of its "## Exercise NN-x" heading."""
    from lab_utils.app.grading import EXERCISES

    seen = []
    for number, nb in notebooks.items():
        for heading, name in _exercise_blocks(nb):
            s = questions.section_of(name)
            assert s is not None and s.notebook[:2] == number, (name, s)
            assert heading == f"{number}-{questions.exercise_letter(name)}", (name, heading)
            assert questions.gradebook_column(name) == f"{s.label} {name[4:].replace('_', ' ')} ({heading})"
            seen.append(name)
        for name in _manual_questions(nb):
            s = questions.section_of(name)
            short = name[4:].replace("_", " ")
            assert questions.gradebook_column(name) == f"{s.label} {short} ({number}, by hand)", name
    assert sorted(seen) == sorted(EXERCISES) == sorted(q for s in questions.SECTIONS for q in s.exercises)
    assert questions.gradebook_column("q04_ring_bytes") == "Q3.2 ring bytes (04-b)"
    assert questions.gradebook_column("q05_set_epoch") == "Q5 set epoch (05-c)"
    assert questions.gradebook_column("q05_recipe") == "Q4.2 recipe (05-b)"
    assert questions.gradebook_column("q04_predicted_bandwidth") == "Q3.2 predicted bandwidth (04-d)"
    assert questions.gradebook_column("q05_report") == "Q4.2 report (05, by hand)"
    # issue 35: Q4.1, Q6 and Q7 have hand-graded slots of their own, each asked once (not in the report)
    assert questions.gradebook_column("q05_accuracy") == "Q4.1 accuracy (05, by hand)"
    assert questions.gradebook_column("q05_messages") == "Q6 messages (05, by hand)"
    assert questions.gradebook_column("q05_gradients_only") == "Q7 gradients only (05, by hand)"
    by_key = {s.key: s for s in questions.SECTIONS}
    assert all(by_key[k].by_hand and not by_key[k].report for k in ("Q4.1", "Q6", "Q7"))
    manual = _manual_questions(notebooks["05"])
    assert {n: p for n, (p, _) in manual.items()} == {"q05_accuracy": 2, "q05_report": 2, "q05_messages": 2,
                                                      "q05_gradients_only": 2}
    assert questions.gradebook_column("q99_unknown") == "q99_unknown"


def test_the_label_scan_catches_the_old_labels():
    for old in ("**Question 5.3 (graded by hand, 2 points).**", "## Exercise 4.1 (autograded, 1 point)",
                "(Question 3.2 below)", "Exercise 4.1-4.3"):
        assert FORBIDDEN.search(old), old
    assert not FORBIDDEN.search("## Exercise 04-a (autograded, 1 point)")


# --------------------------------------------------------------------------- Q7 from the ledger


def _ledger_record(grad_bytes: int = 705_608, broadcast_buffers: bool = True):
    """A comm_accounting record as the worker writes it (2 gloo ranks, ResNet-18 width 8, 3 steps; the
    payloads of a real quick run), with the gradient payload per step replaceable."""
    from lab_utils.engine.store import Record

    def row(phase, kind, calls, nbytes):
        return {"phase": phase, "kind": kind, "calls": calls, "bytes": nbytes, "bytes_by_src": {}}

    ledger = [row("construction", "broadcast_coalesced", 1, 710_568),
              row("construction", "verify_params_across_processes", 1, 0),
              row("evaluation", "all_reduce", 1, 24), row("evaluation", "broadcast", 60, 4_960),
              row("loss_logging", "all_reduce", 3, 12),
              row("step", "broadcast_coalesced", 3 * broadcast_buffers, 14_880 * broadcast_buffers),
              row("step", "gradient_bucket_all_reduce", 3, 3 * grad_bytes)]
    model = {"buffer_bytes": 4_960, "buffers": 60, "floating_buffer_bytes": 4_800, "parameter_bytes": 705_608,
             "parameters": 176_402, "trainable_parameter_bytes": 705_608}
    config = {"backend": "gloo", "batch_size": 8, "broadcast_buffers": broadcast_buffers, "devices": 2,
              "seed": 0, "steps": 3, "width": 8, "zero": False}
    return Record("comm_accounting", config,
                  {"model_bytes": model, "world_size": 2, "ranks": [{"rank": 0, "ledger": ledger}]})


def test_q7_ledger_at_4_x_512_by_hand():
    """Spec ResNet-18: 11,173,962 fp32 parameters = 44,695,848 B; 20 BatchNorm layers over 4,800 channels:
    2 x 4,800 x 4 + 20 x 8 = 38,560 B of buffers. 4 x 512 on 50,000 images: ceil(12,500 / 512) = 25 steps
    per epoch, 125 in 5 epochs. Gradients 125 x 44,695,848 = 5,586,981,000 B; initial broadcast 44,734,408;
    buffers 125 x 38,560 = 4,820,000; logged loss 125 x 4 = 500; 5 evaluations x (38,560 + 24) = 192,920.
    Not gradients: 49,747,828 of 5,636,728,828 B = 0.883 %."""
    from lab_utils.experiments.n05_large_batch import accounting_tables as at

    table, verdict = at.gradients_only_table(_ledger_record(), epochs=5)
    rows = table.set_index("what")
    spec = rows["spec payload in the run (bytes)"]
    assert spec["gradients"] == 5_586_981_000 and spec["initial parameter + buffer broadcast"] == 44_734_408
    assert spec["BatchNorm buffers (rank 0's running mean/var)"] == 4_820_000
    assert spec["global loss for logging"] == 500
    evaluation = ("rank 0's BatchNorm statistics before evaluating",
                  "test metric sums (loss, correct, count)")
    assert sum(spec[w] for w in evaluation) == 192_920
    assert spec["learning rate (linear scaling, warm-up, decay)"] == 0
    assert spec["data order (DistributedSampler + set_epoch)"] == 0
    assert rows["times in the run (4 x 512)"]["gradients"] == 125
    assert set(rows["measured = model's sizes"]) == {"yes", ""}
    assert rows["share of the run's bytes %"].sum() == pytest.approx(100)
    assert verdict.startswith("**No: gradients alone are not enough.**")
    assert "5.587 GB" in verdict and "(0.88%)" in verdict and "6 of 6 items" in verdict
    # a payload that differs from the model's sizes is said, not hidden; broadcast_buffers=False sends none
    _, wrong = at.gradients_only_table(_ledger_record(grad_bytes=705_600), epochs=5)
    assert "differ from the model's sizes: gradients" in wrong
    off, _ = at.gradients_only_table(_ledger_record(broadcast_buffers=False), epochs=5)
    assert off.set_index("what")["spec payload in the run (bytes)"]["BatchNorm buffers (rank 0's running "
                                                                   "mean/var)"] == 0


def test_a_report_handed_in_beside_the_notebooks_is_left_to_the_instructor(tmp_path):
    """docs/grading.md, "Handing in": the hand-in folder (report.md, report.html, handin.json, figures/,
    tables/) travels in the student's folder; grading finds the notebooks there and raises no problem for
    the rest."""
    from lab_utils.app.grading.submissions import find_submissions

    alice = tmp_path / "alice"
    (alice / "figures").mkdir(parents=True)
    (alice / "report.md").write_text("# Report\n")
    (alice / "figures" / "batch_sweep.png").write_bytes(b"\x89PNG")
    (alice / "tables").mkdir()
    (alice / "tables" / "scaling.csv").write_text("method,devices\n")
    (alice / "report.html").write_text("<html></html>")
    (alice / "handin.json").write_text("{}")
    (alice / "01_batch_size_sweep.ipynb").write_text("{}")
    (alice / "02_multi_gpu_scaling.ipynb").write_text("{}")
    subs = find_submissions(tmp_path, tmp_path / "staging")
    assert sorted((s.student.name, s.path.name, s.problem) for s in subs) == [
        ("alice", "01_batch_size_sweep.ipynb", ""), ("alice", "02_multi_gpu_scaling.ipynb", ""),
        ("alice", "handin.json", "")]  # the hand-in's provenance, which make grade reads
    (tmp_path / "bob").mkdir()
    (tmp_path / "bob" / "report.md").write_text("# only a report\n")
    [bob] = [s for s in find_submissions(tmp_path, tmp_path / "staging2") if s.student.name == "bob"]
    assert (bob.student.name, bob.problem) == ("bob", "no notebook in the folder (report.md)")
    grading = (repo_root() / "docs" / "grading.md").read_text(encoding="utf-8")
    assert "handed_in/<student>/" in grading and "\n## Handing in\n" in grading
