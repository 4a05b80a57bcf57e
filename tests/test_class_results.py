"""Issue 35, the instructor's view of a class: handin.json read and checked, the gradebook's provenance
flags, and class_results (outliers beyond 3 MADs of a GPU model's group). Nothing here runs a notebook
or a sandbox (each test well under a second); the end-to-end run through `make grade` is
tests/test_grading_sandbox.py::test_a_class_through_make_grade."""

from __future__ import annotations

import csv
import json
import zipfile

import pytest
from handin_files import A100, handin, write_handin

from lab_utils.app.grading import class_results, provenance
from lab_utils.app.grading.submissions import find_submissions

MANIFEST = {"lab_version": "abc", "notebooks": {"03_compute_vs_communication": {"version": "v03"}},
            "ungraded": {"00_environment": {"version": "v00"}}}


@pytest.mark.timeout(30)
def test_mad_rule_by_hand():
    """[1.80, 1.85, 1.90, 1.87, 0.90]: median 1.85; |x - 1.85| = 0.05, 0, 0.05, 0.02, 0.95, whose median
    (the MAD) is 0.05; 3 MADs = 0.15: only 0.90 (0.95 away) is beyond. [1, 2, 3, 4, 6]: median 3, MAD 1;
    6 is exactly 3 MADs away: not beyond. Two values: too few to judge."""
    got = class_results.mad_verdicts([1.80, 1.85, 1.90, 1.87, 0.90])
    assert [v.outlier for v in got] == ["no", "no", "no", "no", "yes"]
    assert got[0].median == pytest.approx(1.85) and got[0].mad == pytest.approx(0.05)
    edge = class_results.mad_verdicts([1, 2, 3, 4, 6])
    assert (edge[0].median, edge[0].mad, [v.outlier for v in edge]) == (3, 1, ["no"] * 5)
    assert [v.outlier for v in class_results.mad_verdicts([1.0, 9.0])] == ["too few to judge"] * 2
    # three identical values and one other: MAD 0, so any difference is beyond it
    assert [v.outlier for v in class_results.mad_verdicts([2.0, 2.0, 2.0, 2.1])] == ["no", "no", "no", "yes"]


@pytest.mark.timeout(30)
def test_handin_json_is_checked_and_a_bad_one_is_one_sentence(tmp_path):
    good, why = provenance.read_handin(write_handin(tmp_path / "a", handin()))
    assert why == "" and good.device == f"{A100} x 4" and good.skipped == []
    # the row "needs 8 GPUs" (null numbers) is not a result; Table 1 speedups and Table 3 GB/s are
    assert sorted((r.quantity, r.gpus, r.per_gpu_batch, r.value) for r in good.results) == [
        ("gb_per_s", 2, 128, 45.0), ("gb_per_s", 4, 128, 60.0),
        ("speedup", 2, 128, 1.85), ("speedup", 4, 128, 3.4), ("speedup", 4, 512, 3.8)]
    bad_row = handin()
    bad_row["tables"]["table1"][0]["speedup"] = "fast"
    got, _ = provenance.read_handin(write_handin(tmp_path / "b", bad_row))
    assert len(got.results) == 4 and got.skipped == [
        "table1 row 1 (status ok) lacks method, gpus, per_gpu_batch or a number speedup"]
    no_device = handin()
    no_device["provenance"]["device_count"] = "four"
    newer = {**handin(), "format": 2}
    for data, said in (("{not json", "handin.json is not JSON (Expecting property name"),
                       ("[1, 2]", "handin.json is not a JSON object"),
                       (newer, "handin.json has format 2; this grader reads format 1"),
                       (no_device, "handin.json's provenance lacks or mistypes device_count"),
                       ({**handin(), "tables": []}, "handin.json's tables is not an object")):
        got, why = provenance.read_handin(write_handin(tmp_path / "x.json", data))
        assert got is None and why.startswith(said) and why.endswith("run `make report` again and hand in "
                                                                     "the folder it writes)"), why
    got, why = provenance.read_handin(tmp_path / "missing" / "handin.json")
    assert got is None and "cannot be read" in why


@pytest.mark.timeout(30)
def test_flags_name_quick_synthetic_cpu_other_version_and_no_handin(tmp_path):
    quick, _ = provenance.read_handin(write_handin(tmp_path / "q", handin(quick_cpu=True)))
    p = provenance.describe(quick, "", {}, MANIFEST)
    assert p.flags == ["quick profile", "synthetic data", "CPU (no GPU)"]
    assert p.columns == {"profile": "quick", "device": "cpu (AMD EPYC) x 1",
                         "data": "synthetic CIFAR-10 stand-in", "lab version": "0.1.0"}
    assert p.notes == ["handin.json lists 1 problem(s): profile quick: not the assignment's sizes"]
    full, _ = provenance.read_handin(write_handin(tmp_path / "f", handin(versions={
        "03_compute_vs_communication": "v03"})))
    p = provenance.describe(full, "", {"03_compute_vs_communication": "v03"}, MANIFEST)
    assert p.flags == [] and p.notes == [] and p.device == A100 and p.device_count == 4
    # a notebook version other than the bundle's, from the handin or from a notebook's stamp
    p = provenance.describe(full, "", {"00_environment": "old"}, MANIFEST)
    assert p.flags == ["other lab version (00: old (bundle: v00))"]
    older, _ = provenance.read_handin(write_handin(tmp_path / "o", handin(versions={
        "03_compute_vs_communication": "v02"})))      # the numbers came from an older 03 than handed in
    p = provenance.describe(older, "", {"03_compute_vs_communication": "v03"}, MANIFEST)
    assert p.flags == ["other lab version (03: v02 (bundle: v03))"]
    # as make report writes it: the data sets as a list; no measured record: nulls (flagged as no GPU)
    empty = handin()
    empty["provenance"].update(device_type=None, device=None, device_count=None,
                               data=["CIFAR-10", "synthetic"])
    got, why = provenance.read_handin(write_handin(tmp_path / "e", empty))
    p = provenance.describe(got, why, {}, MANIFEST)
    assert (p.columns["device"], p.columns["data"], p.flags) == ("unknown", "CIFAR-10, synthetic",
                                                                 ["CPU (no GPU)"])
    p = provenance.describe(None, "", {"03_compute_vs_communication": "v02"}, MANIFEST)
    assert p.flags == ["no handin.json", "other lab version (03: v02 (bundle: v03))"] and p.results == []
    assert p.columns == dict.fromkeys(provenance.COLUMNS, "")
    p = provenance.describe(None, "handin.json is not JSON (...)", {}, MANIFEST)
    assert p.flags == ["no handin.json (unreadable: see notes)"]
    assert p.notes == ["where the numbers came from is unknown: handin.json is not JSON (...)"]


def _state(entries: dict[str, tuple[str, int, str, list]]) -> dict:
    """A gradebook state whose students carry provenance: name -> (device, count, profile, results)."""
    return {"students": {name: {"name": name, "provenance": {
        "device": dev, "device_count": n, "profile": prof, "flags": [],
        "results": [{"quantity": q, "method": "DDP", "gpus": g, "per_gpu_batch": b, "value": v}
                    for q, g, b, v in results]}} for name, (dev, n, prof, results) in entries.items()}}


@pytest.mark.timeout(60)
def test_class_results_group_by_gpu_model_and_name_the_outlier(tmp_path):
    state = _state({
        "ann": (A100, 4, "full", [("speedup", 4, 128, 3.40), ("gb_per_s", 4, 128, 60.0)]),
        "ben": (A100, 4, "full", [("speedup", 4, 128, 3.45), ("gb_per_s", 4, 128, 61.0)]),
        "cyd": (A100, 4, "full", [("speedup", 4, 128, 3.35), ("gb_per_s", 4, 128, 59.0)]),
        "dan": (A100, 4, "full", [("speedup", 4, 128, 1.20), ("gb_per_s", 4, 128, 60.5)]),
        "eve": ("Tesla V100", 4, "full", [("speedup", 4, 128, 1.20)]),   # another GPU model: its own group
        "fay": ("Tesla V100", 4, "full", [("speedup", 4, 128, 3.40)]),
        "gus": ("Tesla V100", 2, "quick", []),
    })
    lines = class_results.write(state, tmp_path, "grades")
    with open(tmp_path / "class_results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == class_results.COLUMNS and len(rows) == 10
    by = {(r["student"], r["quantity"]): r for r in rows}
    # A100 speedups 3.40, 3.45, 3.35, 1.20: median 3.375, |x - m| = 0.025, 0.075, 0.025, 2.175, MAD 0.05
    dan = by[("dan", "speedup")]
    assert (dan["outlier"], float(dan["group_median"]), float(dan["group_mad"])) == ("yes", 3.375, 0.05)
    assert [by[(s, "speedup")]["outlier"] for s in ("ann", "ben", "cyd")] == ["no"] * 3
    assert by[("dan", "gb_per_s")]["outlier"] == "no"
    assert by[("eve", "speedup")]["outlier"] == "too few to judge"      # two V100s: not flagged
    assert (dan["device"], dan["device_count"], dan["profile"], dan["method"], dan["gpus"],
            dan["per_gpu_batch"], float(dan["value"])) == (A100, "4", "full", "DDP", "4", "128", 1.2)
    text = "\n".join(lines)
    assert lines[0].startswith("class results: 10 number(s) of 6 student(s) in grades/class_results.csv")
    assert "outlier: dan: speedup 1.2 for DDP, 4 GPU(s) x 128 on NVIDIA A100-SXM4-40GB (group median " \
           "3.375, MAD 0.05: beyond 3 MADs)" in text
    assert "eve" not in text and "too few to judge: 1 group(s) with fewer than 3 students" in text
    assert (tmp_path / "class_results.png").stat().st_size > 10_000
    # nobody handed in numbers: the header, no figure, and the console says so
    assert "no student handed in a handin.json" in class_results.write(_state({}), tmp_path)[0]
    assert not (tmp_path / "class_results.png").exists()
    assert (tmp_path / "class_results.csv").read_text().strip() == ",".join(class_results.COLUMNS)


@pytest.mark.timeout(30)
def test_handin_json_is_found_in_folders_lms_names_and_zips(tmp_path):
    subs = tmp_path / "subs"
    write_handin(subs / "alice" / "report", handin())                  # make report's folder, in hers
    (subs / "alice" / "01_batch_size_sweep.ipynb").write_text("{}")
    write_handin(subs / "doejane_1001_5007_handin-1.json", handin())   # Canvas, a resubmission
    with zipfile.ZipFile(subs / "bob.zip", "w") as z:
        z.writestr("labs/02_multi_gpu_scaling.ipynb", "{}")
        z.writestr("report/handin.json", json.dumps(handin()))
        z.writestr("report/report.md", "# Report")
    write_handin(subs / "carl", handin())                              # a folder with no notebook
    found = find_submissions(subs, tmp_path / "staging")
    kinds = sorted((s.student.name, s.kind, s.original, s.problem[:22]) for s in found)
    assert kinds == [("alice", "handin", "handin.json", ""),
                     ("alice", "notebook", "01_batch_size_sweep.ipynb", ""),
                     ("bob", "handin", "handin.json", ""),
                     ("bob", "notebook", "02_multi_gpu_scaling.ipynb", ""),
                     ("bob", "other", "report.md", ""), ("carl", "handin", "handin.json", ""),
                     ("carl", "notebook", "", "no notebook in the fol"),
                     ("doejane", "handin", "handin-1.json", "")], kinds
    assert [s.resubmission for s in found if s.original == "handin-1.json"] == [1]
    assert all(provenance.read_handin(s.path)[0] for s in found if s.kind == "handin")
