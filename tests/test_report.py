"""report.md is ordered by question and embeds the figures; every question has its section and notebook (the
question map `make docs` writes is checked by tests/test_docs.py)."""


import pandas as pd

from lab_utils.app import questions, runner
from lab_utils.engine.store import ResultStore


def _figure(store, name):
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [1, 2])
    store.save_figure(fig, name)
    plt.close(fig)


def test_report_is_ordered_by_question_and_embeds_figures(results_dir):
    store = ResultStore("quick")
    # written in an order that alphabetical sorting would get wrong (Table 3 before Table 1)
    for name, title in (("allreduce_utilization", "Table 3"), ("scaling", "Table 1"),
                        ("batch_sweep", "Sweep"), ("quantization", "Quant"), ("zz_unmapped", "Stray"),
                        ("compute_vs_comm", "Table 2"), ("large_batch", "Large batch")):
        store.save_table(pd.DataFrame({"x": [1.23456]}), name, title=title)
    for name in ("batch_sweep", "scaling_speedup", "large_batch_lr"):
        _figure(store, name)
    text = runner.write_report("quick").read_text()
    order = [text.index(f"### {t}") for t in ("Sweep", "Table 1", "Table 2", "Table 3", "Large batch",
                                                "Quant", "Stray")]
    assert order == sorted(order)
    assert text.index("## Q1 ") < text.index("## Q2 ") < text.index("## Q3.1 ") < text.index("## Q3.2 ")
    assert text.index("## Q4.1 ") < text.index("## Q4.2 ") < text.index(f"## {questions.PART2}")
    for f in ("batch_sweep", "scaling_speedup", "large_batch_lr"):
        assert f"![{f}](figures/{f}.png)" in text
        assert (store.figures_dir / f"{f}.png").exists()  # the link resolves relative to report.md
    assert text.index("![batch_sweep]") < text.index("### Table 1")  # each figure in its section
    assert text.count("### Large batch") == 1  # a table shared by Q4.1 and Q4.2 appears once
    assert "## Other tables and figures" in text and "1.235" in text


def test_empty_report_says_so(results_dir):
    assert "No tables yet" in runner.write_report("quick").read_text()


def test_every_question_has_a_section_and_a_notebook():
    keys = [s.key for s in questions.SECTIONS]
    for q in ("Q1", "Q2", "Q3.1", "Q3.2", "Q4.1", "Q4.2", "Q5", "Q6", "Q7"):
        assert q in keys
    nbs = {p.stem for p in runner.all_notebooks()}
    assert all(s.notebook in nbs for s in questions.SECTIONS)
    assert questions.labels_for("05") == "Q4.1, Q4.2, Q5, Q6, Q7"


# Notebooks whose title cell is checked against the question map (part B adds 02, 04, 05, 06).
# Every notebook's title is also checked against the one table in tests/test_questions.py.
LABELLED = ("01", "03", "07", "08")


def test_notebook_titles_name_their_questions_and_show_their_budget():
    import nbformat

    for path in runner.all_notebooks():
        nb = nbformat.read(str(path), as_version=4)
        number = path.name[:2]
        budget = [c for c in nb.cells if "budget_line(" in c.source]
        for c in budget:
            assert f'budget_line("{number}")' in c.source, f"{path.name} shows another notebook's budget"
        if number not in LABELLED:
            continue
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert "budget_line(" in first_code.source, f"{path.name}: the first code cell shows the time budget"
        title = nb.cells[0].source
        for key in questions.labels_for(number).split(", "):
            word = {"Extra": "Extra", questions.PART2: "Part 2 project"}.get(key, key)
            assert word in title, f"{path.name}'s title does not name {key}"
