"""The hand-in (`make report`, lab_utils/app/handin.py), on small hand-made stores: Tables 1-3 in the
handout's layout with the stored numbers, the provenance and `--check`, the student's answers kept
across runs, the HTML self-contained. `make report` after the quick lab, through the Makefile, is in
tests/test_notebooks.py (it needs that run's records)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest

from lab_utils.app import handin
from lab_utils.app.cli import main as cli
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.questions import SECTIONS
from lab_utils.engine.records import Record

pytestmark = pytest.mark.timeout(60)

DDP = "DDP (NCCL)"
FLAG = "|T(N) - T(1)| within 2 standard errors: speedup not distinguishable from 1"
COMM_FLAG = "|comm (a)| within 2 standard errors: (a) not distinguishable from 0"
B_FLAG = "noise >= effect: not a result"
PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c4890000000d4944415478da"
                    "63f8ffff3f0005fe02fea7d6a0c90000000049454e44ae426082")  # a 1x1 PNG


def _table(root: Path, name: str, rows: list[dict], provenance: str) -> None:
    (root / "tables").mkdir(parents=True, exist_ok=True)
    pd.DataFrame([{"provenance": provenance, **r} for r in rows]).to_csv(root / "tables" / f"{name}.csv",
                                                                         index=False)


def _store(tmp_path: Path, monkeypatch, profile: str, gpu: bool, synthetic: bool) -> Path:
    """A results folder with Tables 1-3, the alpha-beta fit, one figure and one record of provenance."""
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path / "results"))
    root = tmp_path / "results" / profile
    prov = f"profile: {profile}"
    t1 = []
    for n, t1s in ((1, (40.0, 32.0)), (2, (21.0, 17.0)), (4, (11.0, 9.0))):
        for b, t in zip((32, 128), t1s, strict=True):
            t1.append({"method": DDP, "devices": n, "per_device_batch": b, "status": "ok",
                       "epoch2_train_seconds": t, "speedup": {32: 40.0, 128: 32.0}[b] / t,
                       "spread_pct": 6.0, "spread_of": "p10-p90 of 97 steps",
                       "speedup_noise_flag": FLAG if (n, b) == (2, 128) else None})
    t1.append({"method": DDP, "devices": 4, "per_device_batch": 512, "status": "oom: CUDA out of memory"})
    _table(root, "scaling", t1, prov)
    _table(root, "compute_vs_comm", [
        {"method": DDP, "devices": n, "per_device_batch": 32, "status": "ok", "compute_a_seconds": 40.0 / n,
         "comm_a_seconds": t - 40.0 / n, "exposed_comm_b_seconds": 0.5, "allreduce_c_seconds": 2.0,
         "comm_a_noise_flag": COMM_FLAG if n == 4 else None, "noise_flag": B_FLAG if n == 2 else None}
        for n, t in ((2, 21.0), (4, 11.0))], prov)
    _table(root, "allreduce_utilization", [
        {"method": DDP, "devices": n, "per_gpu_batch": 32, "comm_source": src, "achieved_gb_per_s": gb,
         "pct_of_bench_peak_busbw": pct, "note": None}
        for n in (2, 4) for src, gb, pct in (("(a) derived T(N)-T(1)/N", 7.5, 50.0),
                                             ("(b) exposed (sync - no_sync)", 99.0, 660.0),
                                             ("(c) hook all-reduce", 12.0, 80.0))], prov)
    _table(root, "allreduce_fit", [{"ranks": 4, "alpha_us": 50.0, "B_gb_per_s": 10.0,
                                    "peak_busbw_gb_per_s": 15.0, "projection": "ok"}], prov)
    _table(root, "allreduce_inputs", [{"input": "link nominal bandwidth", "value": "300",
                                       "kind": "nominal", "source": "NVLink 3, 12 links"}], prov)
    (root / "figures").mkdir(parents=True)
    (root / "figures" / "scaling_speedup.png").write_bytes(PNG)
    hw = ({"device_type": "cuda", "device_name": "NVIDIA A100-SXM4-40GB", "device_count": 4} if gpu else
          {"device_type": "cpu", "device_name": "cpu (AMD EPYC)", "device_count": 2})
    rec = Record("scaling", {"devices": 4}, {"train_seconds": 9.0}, profile=profile, synthetic=synthetic,
                 dataset="synthetic CIFAR-10 stand-in" if synthetic else "CIFAR-10", hardware=hw,
                 software={"torch": "2.11.0", "cuda": "12.8", "cudnn": 91002, "nccl": "2.21.5"},
                 timestamp="2026-11-20T10:00:00+00:00")
    (root / "runs").mkdir(parents=True)
    (root / "runs" / "scaling.jsonl").write_text(rec.to_json() + "\n")
    # a CPU row of the same run (notebook 07 times the CPU too): the GPU's records name the devices
    cpu = Record("quantization", {"device": "cpu"}, {"ms": 1.0}, profile=profile, synthetic=synthetic,
                 hardware={"device_type": "cpu", "device_name": "cpu (AMD EPYC)", "device_count": 1},
                 timestamp="2026-11-20T10:05:00+00:00")
    (root / "runs" / "quantization.jsonl").write_text(cpu.to_json() + "\n")
    return root


def _labs(tmp_path: Path, answered: bool) -> Path:
    """Student notebooks holding each hand-graded answer cell (stamped as the student copy stamps them)."""
    labs = tmp_path / "labs"
    labs.mkdir()
    for s in SECTIONS:
        if not s.by_hand:
            continue
        path = labs / f"{s.notebook}.ipynb"
        nb = json.loads(path.read_text()) if path.exists() else {"cells": [], "metadata": {}, "nbformat": 4,
                                                                "nbformat_minor": 5}
        text = f"My answer to {s.by_hand}: 1.9x at 2 GPUs." if answered else nbs.ANSWER_PLACEHOLDER
        nb["cells"].append({"cell_type": "markdown", "source": text, "metadata": {
            "tags": [nbs.ANSWER_TAG], nbs.METADATA_KEY: {"question": s.by_hand}}})
        path.write_text(json.dumps(nb))
    return labs


def _fill(report: Path) -> None:
    text = report.read_text()
    text = text.replace(handin.PLACEHOLDER, "Answered: see Table 1, 1.9x.")
    report.write_text(text)


def test_table_1_has_rows_1_2_4_gpus_and_per_batch_time_and_speedup(tmp_path, monkeypatch):
    root = _store(tmp_path, monkeypatch, "full", gpu=True, synthetic=False)
    hand = handin.build("full", labs=_labs(tmp_path, answered=False))
    md = (hand.out / "report.md").read_text()
    head = " | ".join(f"{b}: time (s) | {b}: speedup" for b in (32, 128, 512))
    assert f"| GPUs | {head} |" in md
    assert "| 1 | 40 [6%] | 1 | 32 [6%] | 1 | n/a (1) |  |" in md
    assert "| 2 | 21 [6%] | 1.905 | 17 [6%] | 1.882 * | n/a (1) |  |" in md  # 40/21 and 32/17; flagged
    assert f"\\* {FLAG}" in md
    assert "| 4 | 11 [6%] | 3.636 | 9 [6%] | 3.556 | n/a (2) |  |" in md
    assert "(2) oom: CUDA out of memory" in md and "how the steps vary (p10-p90 of n steps: each row" in md
    assert "*: not distinguishable, judged by 2 standard errors" in md
    rows = {(r["gpus"], r["per_gpu_batch"]): r for r in hand.tables["table1"]}
    assert rows[(2, 32)]["seconds"] == 21.0 and rows[(2, 32)]["speedup"] == pytest.approx(40 / 21)
    assert rows[(4, 512)] == {"method": DDP, "gpus": 4, "per_gpu_batch": 512, "seconds": None,
                              "speedup": None, "status": "oom: CUDA out of memory", "spread_pct": None,
                              "not_distinguishable": False}
    assert rows[(2, 128)]["not_distinguishable"] and not rows[(2, 32)]["not_distinguishable"]
    assert (hand.out / "tables" / "scaling.csv").read_text() == (root / "tables" / "scaling.csv").read_text()


def test_tables_2_and_3_have_rows_2_and_4_gpus_and_table_3_is_method_a(tmp_path, monkeypatch):
    _store(tmp_path, monkeypatch, "full", gpu=True, synthetic=False)
    hand = handin.build("full", labs=_labs(tmp_path, answered=False))
    md = (hand.out / "report.md").read_text()
    t2 = md.split("**Table 2 (a)")[1].split("**Table 2 (b)")[0]
    assert "| GPUs | 32: compute (s) | 32: communication (s) |" in t2
    assert "| 2 | 20 | 1 |" in t2 and "| 4 | 10 | 1 * |" in t2  # 40/2, 21 - 20; 40/4, 11 - 10
    assert f"\\* {COMM_FLAG}" in t2 and B_FLAG not in t2   # each table its own flag column
    t2bc = md.split("**Table 2 (b)")[1].split("**Table 3")[0]
    assert "| 2 | 0.5 * | 2 |" in t2bc and "| 4 | 0.5 | 2 |" in t2bc and f"\\* {B_FLAG}" in t2bc  # on (b)
    assert not re.search(r"^\| 1 \|", t2, re.M)  # no 1-GPU row
    t3 = md.split("**Table 3 (a)")[1].split("**Table 3 (c)")[0]
    assert "| 2 | 7.5 | 50 |" in t3 and "99" not in t3  # (b) is not a rate
    assert "| 4 | 12 | 80 |" in md.split("**Table 3 (c)")[1]
    assert {(r["gpus"], r["gb_per_s"]) for r in hand.tables["table3"]} == {(2, 7.5), (4, 7.5)}
    assert [(r["gpus"], r["comm_seconds"]) for r in hand.tables["table2"]] == [(2, 1.0), (4, 1.0)]


def test_q32_formula_gets_the_students_fit(tmp_path, monkeypatch):
    _store(tmp_path, monkeypatch, "full", gpu=True, synthetic=False)
    md = (handin.build("full", labs=_labs(tmp_path, answered=False)).out / "report.md").read_text()
    # P = 4: 2(P-1) = 6 latency steps, 2(P-1)/P = 6/4 of S crosses each link
    assert "T(S, 4) = 6 x 50 us + 6/4 x S / (10 GB/s); the benchmark's peak bus bandwidth: 15 GB/s" in md
    assert "- The link's nominal peak: 300 GB/s (NVLink 3, 12 links)." in md


def test_quick_cpu_synthetic_numbers_fail_the_check(tmp_path, monkeypatch, capsys):
    _store(tmp_path, monkeypatch, "quick", gpu=False, synthetic=True)
    labs = _labs(tmp_path, answered=True)
    assert cli(["report", "--profile", "quick", "--labs", str(labs)]) == 0  # writing is not checking
    _fill(tmp_path / "results" / "quick" / "handin" / "report.md")
    assert cli(["report", "--profile", "quick", "--labs", str(labs), "--check"]) == 1
    out = capsys.readouterr().out
    assert "not ready: profile quick" in out and "not ready: data synthetic" in out
    assert "not ready: device cpu (AMD EPYC): measured without a GPU" in out
    assert "placeholder" not in out and "unanswered" not in out
    data = json.loads((tmp_path / "results" / "quick" / "handin" / "handin.json").read_text())
    assert data["format"] == handin.FORMAT
    assert data["provenance"]["profile"] == "quick" and data["provenance"]["synthetic"] is True
    assert data["provenance"]["device_type"] == "cpu" and len(data["problems"]) == 3
    assert [data["provenance"][k] for k in ("cuda", "cudnn", "nccl")] == [None, None, None]  # a CPU run


def test_answers_survive_a_rerun_and_a_finished_full_gpu_handin_passes(tmp_path, monkeypatch, capsys):
    _store(tmp_path, monkeypatch, "full", gpu=True, synthetic=False)
    out = tmp_path / "handin"
    assert cli(["report", "--profile", "full", "--out", str(out), "--labs", str(_labs(tmp_path, False)),
                "--check"]) == 1
    text = capsys.readouterr().out
    n_slots = sum(len(s.report) for s in SECTIONS if s.key != "Extra") + 1  # + Q3.2's formula
    assert text.count("not ready: placeholder left") == n_slots
    assert text.count("not ready: unanswered") == sum(bool(s.by_hand) for s in SECTIONS)
    _fill(out / "report.md")
    labs = tmp_path / "labs"
    for p in labs.glob("*.ipynb"):
        p.unlink()
    labs.rmdir()
    assert cli(["report", "--profile", "full", "--out", str(out), "--labs", str(_labs(tmp_path, True)),
                "--check"]) == 0, capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert md.count("Answered: see Table 1, 1.9x.") == sum(len(s.report) for s in SECTIONS) + 1
    assert "> My answer to q02_report: 1.9x at 2 GPUs." in md
    assert "- **devices:** NVIDIA A100-SXM4-40GB x 4 (cuda)" in md and "- **data:** CIFAR-10" in md
    page = (out / "report.html").read_text()
    assert 'src="data:image/png;base64,' in page and 'src="figures/' not in page
    assert "Not ready to hand in" not in page
    data = json.loads((out / "handin.json").read_text())
    assert data["problems"] == [] and data["provenance"]["cuda"] == "12.8"
    assert data["provenance"]["cudnn"] == "91002" and data["provenance"]["nccl"] == "2.21.5"


def test_a_missing_table_is_named_and_an_unwritable_folder_is_one_sentence(tmp_path, monkeypatch, capsys):
    root = _store(tmp_path, monkeypatch, "full", gpu=True, synthetic=False)
    (root / "tables" / "compute_vs_comm.csv").unlink()
    hand = handin.build("full", labs=_labs(tmp_path, answered=True))
    assert "table missing: compute_vs_comm (run notebook 03_compute_vs_communication)" in hand.problems
    assert not any(p.startswith("no notebook in") for p in hand.problems)
    pd.DataFrame([{"method": DDP, "batch": 32}]).to_csv(root / "tables" / "scaling.csv", index=False)  # older
    nowhere = handin.build("full", labs=tmp_path / "nowhere").problems
    assert "table from an older lab: scaling (run notebook 02_multi_gpu_scaling)" in nowhere
    assert f"no notebook in {tmp_path / 'nowhere'}: run make report in the lab's folder, or name yours " \
           "with --labs" in nowhere
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert cli(["report", "--profile", "full", "--out", str(blocker / "handin")]) == 2
    err = capsys.readouterr().err
    assert re.match(r"error: could not write the hand-in folder .* check that folder, or choose another with "
                    r"--out DIR\.$", err.strip()) and "Traceback" not in err


def test_a_full_disk_is_one_sentence_and_keeps_the_students_answers(tmp_path, monkeypatch, capsys, tiny_disk):
    root = _store(tmp_path, monkeypatch, "full", gpu=True, synthetic=False)
    out = tiny_disk / "handin"
    labs = _labs(tmp_path, answered=True)
    assert cli(["report", "--profile", "full", "--out", str(out), "--labs", str(labs)]) == 0
    _fill(out / "report.md")
    before = (out / "report.md").read_text()
    (root / "figures" / "scaling_speedup.png").write_bytes(PNG + bytes(1_200_000))  # more than the disk holds
    assert cli(["report", "--profile", "full", "--out", str(out), "--labs", str(labs)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: No space left on the device holding {out}") and "--out DIR" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert (out / "report.md").read_text() == before  # the answers written so far are whole


def test_make_grade_reads_the_handin_json_make_report_writes(tmp_path, monkeypatch):
    """The one format between the two: the reader of make grade (lab_utils/app/grading/provenance.py) takes
    the file handin.build wrote, flags a quick CPU synthetic hand-in and none of a full GPU one, and gets
    its Table 1 speedups and Table 3 GB/s for class_results."""
    from lab_utils.app.grading import provenance as grading

    quick_flags = [grading.QUICK, grading.SYNTHETIC, grading.CPU]
    for profile, gpu, synthetic, flags in (("quick", False, True, quick_flags), ("full", True, False, [])):
        base = tmp_path / profile
        _store(base, monkeypatch, profile, gpu=gpu, synthetic=synthetic)
        hand = handin.build(profile, labs=_labs(base, answered=True))
        read, why = grading.read_handin(hand.out / "handin.json")
        assert read is not None, why
        seen = grading.describe(read, why, {}, {})
        assert seen.flags == flags and seen.columns["profile"] == profile
        speedups = {(r.gpus, r.per_gpu_batch): r.value for r in read.results if r.quantity == "speedup"}
        assert speedups[(2, 32)] == pytest.approx(40 / 21) and (4, 512) not in speedups  # the OOM cell
        assert {r.value for r in read.results if r.quantity == "gb_per_s"} == {7.5}
