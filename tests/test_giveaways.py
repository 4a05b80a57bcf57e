"""The discussion cells and the give-away phrases, on small notebooks whose answer is known."""

from __future__ import annotations

from lab_utils.app.grading import giveaways as g


def _md(text: str, *tags: str) -> dict:
    return {"cell_type": "markdown", "id": text[:8].replace(" ", "-") or "x",
            "metadata": {"tags": list(tags)}, "source": text}


def _raw(text: str) -> dict:
    return {"cell_type": "raw", "id": "r", "metadata": {}, "source": text}


def test_each_run_of_discussion_cells_leaves_one_pointer():
    cells = [_md("a"), _md("b", "discussion"), _md("c", "discussion"), _md("d"), _md("e", "discussion")]
    out = g.without_discussion(cells)
    assert [c["source"] for c in out] == ["a", g.DISCUSSION_POINTER, "d", g.DISCUSSION_POINTER]
    assert len({c["id"] for c in out}) == 4


def test_phrases_come_from_the_give_aways_paragraph_only():
    ref = ("_Reference:_ weak per step.\n\n**Give-aways:** `weak scaling per step`; `re:counts? n twice`\n"
           "and `1.784`\n\nA later paragraph with `code`.")
    assert g.phrases(ref) == ("weak scaling per step", "re:counts? n twice", "1.784")
    assert g.phrases("no such paragraph `x`") == ()


def test_matching_ignores_case_emphasis_and_line_breaks():
    text = g.normalized("It is **Weak\n scaling** per _step_; the forum's formula `counts N twice`.")
    assert g.matches("weak scaling per step", text)
    assert g.matches("re:counts? n twice", text)
    assert not g.matches("strong scaling", text)


def test_a_phrase_is_found_above_its_answer_cell_and_in_earlier_notebooks_not_below():
    def question(c):
        return c.get("q")

    first = g.student_view([_md("intro"), {**_md("answer here"), "q": "q1"}, _md("it is weak scaling")],
                           question)
    assert "weak" not in first.before["q1"] and "weak scaling" in first.whole
    second = g.student_view([{**_md(""), "q": "q2"}], question)
    phrase = ("weak scaling",)
    found = g.find_giveaways([("01", first), ("02", second)], {"q1": phrase, "q2": phrase})
    assert found == ["02, q2: 'weak scaling' is visible before its answer cell"]


def test_the_master_view_skips_discussion_solutions_and_hidden_tests_and_reads_outputs():
    out = {"cell_type": "code", "id": "o", "metadata": {}, "source": "show()",
           "outputs": [{"output_type": "stream", "name": "stdout", "text": "speedup 1.784\n"}]}
    hidden = {"cell_type": "code", "id": "h", "metadata": {}, "source": "# HIDDEN\ncheck(2.5)", "outputs": []}
    cells = [out, _md("explains: strong per epoch", "discussion"), _raw("# BEGIN QUESTION\nname: q"),
             _md("prompt"), _raw("# BEGIN SOLUTION"), _md("the answer"), _raw("# END SOLUTION"),
             _raw("# BEGIN TESTS"), hidden, _raw("# END TESTS"), _raw("# END QUESTION"), _md("after")]
    seen = g.master_view(cells, ["q"])
    assert "1.784" in seen.before["q"] and "prompt" in seen.before["q"]
    assert "strong per epoch" not in seen.whole and "the answer" not in seen.whole and "2.5" not in seen.whole
    assert "after" in seen.whole


def _given_away(phrases, text: str) -> bool:
    return any(g.matches(p, g.normalized(text)) for p in phrases)


def test_the_speedup_give_away_is_the_stated_answer_not_a_measured_time_that_prints_alike():
    """q02_speedup's public answer, 41.30 / 23.15 = 1.784 (efficiency 0.892), is given away when stated
    or shown as its pair (the earlier-report row notebook 02 shows after the exercise); a measured 1.784 s
    is not: notebook 01's quick phase table once printed one, and the lab-run test failed on it."""
    from lab_utils.app.grading import EXERCISES

    phrases = EXERCISES["q02_speedup"].giveaways
    assert _given_away(phrases, "the first cohort's speedup: 41.30 / 23.15 = 1.784")
    # notebook 02's earlier-report row (after the exercise), and notebook 01's measured phase row
    earlier = "DataParallel  per-GPU batch    2          23.15   1.784            1.86      0.892"
    measured = ("       128     8                      1.784           0.1782          5.873e-05"
                "                     1.443                 1.443                1.622       180.3")
    assert _given_away(phrases, earlier) and not _given_away(phrases, measured)
    assert _given_away(phrases, "speedup = T(1) / T(N)")
    assert not _given_away(phrases, "11.7840 and 1.7845 and 0.892")


def test_a_numeric_give_away_is_not_found_inside_a_longer_number():
    """A measured value can contain a give-away's digits (0.1955 s holds 1955): such a number gives
    nothing away, the answer's own number does."""
    from lab_utils.app.grading import EXERCISES, build
    from lab_utils.app.grading import notebooks as nbs

    found = g.all_giveaways([nbs.parse_master(p) for p in build.master_notebooks()])
    accuracy, utilization = found["q05_accuracy"], found["q04_utilization"]
    assert utilization == EXERCISES["q04_utilization"].giveaways
    assert _given_away(accuracy, "125 steps instead of 1,955 at 128")
    assert _given_away(accuracy, "about 1955 steps")
    assert not _given_away(accuracy, "the all-reduce took 0.1955 s, the epoch 21955 ms")
    assert _given_away(utilization, "it reached 250.1 MB/s")
    assert not _given_away(utilization, "it reached 1250.1 MB/s")
