import json
import os
import re
import subprocess
import sys

import pandas as pd
import pytest
from store_helpers import put

from lab_utils.engine.store import Record, ResultStore, canonical_key, markdown_table
from lab_utils.experiments.shared.rows import blank, blank_missing
from lab_utils.learn.errors import LabError


def test_canonical_key_ignores_order():
    assert canonical_key({"a": 1, "b": (2, 3)}) == canonical_key({"b": [2, 3], "a": 1})


def test_record_carries_provenance(store):
    r = put(store, "exp", {"batch_size": 32}, {"seconds": 1.5}, synthetic=True, dataset="synthetic")
    got = store.records("exp")[0]
    assert got.config == {"batch_size": 32} and got.metrics == {"seconds": 1.5}
    assert got.profile == "quick" and got.synthetic is True
    assert got.software["torch"] and got.hardware["device_name"] and got.timestamp
    assert r.status == "ok"


def test_resume_measures_only_missing(store):
    calls = []

    def measure(bs):
        def f():
            calls.append(bs)
            return {"seconds": bs / 10}
        return f

    for bs in (32, 128):
        store.run("sweep", {"bs": bs}, measure(bs))
    # "kernel died": a new store object on the same folder
    again = ResultStore("quick")
    for bs in (32, 128, 512):
        again.run("sweep", {"bs": bs}, measure(bs))
    assert calls == [32, 128, 512]
    again.run("sweep", {"bs": 32}, measure(32), force=True)
    assert calls[-1] == 32 and len(again.records("sweep")) == 4
    assert len(again.latest("sweep")) == 3


def test_a_run_stopped_midway_keeps_what_it_handed_back_and_resumes_with_the_rest(store):
    """One launch for two configurations (a worker handing back its records as it goes): the kernel
    stops after the first. Its record is stored; the re-run, in a new session, measures only the second."""
    cfgs, calls = [{"bs": 32}, {"bs": 128}], []

    def stopped(todo):
        calls.append([c["bs"] for c in todo])
        yield Record("", todo[0], {"seconds": 1.0})
        raise KeyboardInterrupt  # the kernel was stopped mid-launch

    with pytest.raises(KeyboardInterrupt):
        store.run_many("scaling", cfgs, stopped)

    def rest(todo):
        calls.append([c["bs"] for c in todo])
        for c in todo:
            yield Record("", c, {"seconds": 2.0})

    got = ResultStore("quick").run_many("scaling", cfgs, rest)
    assert calls == [[32, 128], [128]]
    assert [r.metrics["seconds"] for r in got] == [1.0, 2.0]


def test_measure_may_return_a_record(store):
    rec = store.run("sweep", {"bs": 8192}, lambda: Record("", {}, status="oom", reason="OOM at 8192"))
    assert rec.status == "oom" and store.get("sweep", {"bs": 8192}).reason == "OOM at 8192"


def test_torn_last_line_is_skipped_and_not_lost(store):
    put(store, "exp", {"k": 1}, {"v": 1})
    with open(store.path("exp"), "a") as f:
        f.write('{"experiment": "exp", "config": {"k": 2')  # a crash mid-write
    with pytest.warns(UserWarning, match="torn"):
        recs = store.records("exp")
    assert [r.config["k"] for r in recs] == [1]


def test_concurrent_appends_stay_whole(store, tmp_path):
    # two processes appending 200 records each: every line is a whole record
    code = (
        "import sys; from lab_utils.engine.store import Record, ResultStore\n"
        "s = ResultStore('quick')\n"
        "for i in range(200): s.run('race', {'who': sys.argv[1], 'i': i}, lambda: Record('race', {},"
        " {'pad': 'x' * 2000}, hardware={'device_name': 'cpu'}, software={'torch': 'x'}), force=True)\n"
    )
    env = dict(os.environ)
    procs = [subprocess.Popen([sys.executable, "-c", code, w], env=env) for w in "ab"]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    lines = store.path("race").read_text().splitlines()
    assert len(lines) == 400
    assert all(json.loads(line)["experiment"] == "race" for line in lines)


def test_bad_experiment_name(store):
    with pytest.raises(LabError):
        store.path("../escape")
    with pytest.raises(LabError, match="status"):
        store.run("exp", {}, lambda: Record("exp", {}, status="great"), force=True)


def test_tables_and_figures_are_labelled(store):
    recs = [put(store, "exp", {"bs": 32}, {"t": 1.0}, synthetic=True, dataset="synthetic CIFAR-10 stand-in")]
    md = store.save_table(pd.DataFrame({"bs": [32], "t": [1.0]}), "exp_table", recs, title="T",
                          notes=["a note"])
    text = md.read_text()
    assert "SYNTHETIC" in text and "profile: quick" in text and "a note" in text
    assert re.search(r"\|\s+32 \|", text)
    csv = pd.read_csv(md.with_suffix(".csv"))
    assert "SYNTHETIC" in csv["provenance"][0]
    import matplotlib
    matplotlib.use("agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([1, 2], [1, 2])
    png = store.save_figure(fig, "exp_fig", recs)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert any("SYNTHETIC" in t.get_text() for t in fig.texts)


def test_format_number_significant_digits():
    from lab_utils.engine.store import format_number

    assert format_number(40390.372158) == "40390"
    assert format_number(33.6449) == "33.64"
    assert format_number(33.95) == "33.95"
    assert format_number(0.0123456) == "0.01235"
    assert format_number(32.0) == "32"
    assert format_number(1e-9) == "1e-09"
    assert format_number(128) == "128"
    assert format_number(None) == "" and format_number(float("nan")) == ""
    assert format_number("OOM") == "OOM"
    assert format_number(0.8629, percent=True) == "0.8629%"


def test_percent_columns_are_recognised():
    from lab_utils.engine.store import is_percent_column

    for name in ("hidden_percent", "percent_of_peak", "pct_of_bench_peak_busbw", "util_pct",
                 "epoch-5 test accuracy %"):
        assert is_percent_column(name), name
    for name in ("seconds", "speedup", "compute_seconds", "impact"):
        assert not is_percent_column(name), name


def test_display_table_and_markdown_agree():
    from lab_utils.engine.store import display_table

    df = pd.DataFrame({"batch_size": [32, 128], "seconds": [40390.372158, 0.123456789],
                       "hidden_percent": [0.8629, None], "note": ["a", "b"]}, index=[7, 9])
    html = display_table(df).to_html()
    for cell in ("40390", "0.1235", "0.8629%", ">32<"):
        assert cell in html, cell
    assert "40390.372158" not in html and ">7<" not in html and ">9<" not in html  # no raw floats, no index


def test_saved_markdown_uses_the_display_format(store):
    df = pd.DataFrame({"batch_size": [32], "seconds": [40390.372158], "hidden_percent": [0.8629]})
    text = store.save_table(df, "fmt", title="T").read_text()
    assert "40390 " in text and "40390.37" not in text and "0.8629%" in text
    assert pd.read_csv(store.tables_dir / "fmt.csv")["seconds"][0] == pytest.approx(40390.372158)


def test_records_carry_the_torch_thread_count(store):
    import torch

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        rec = put(store, "exp", {"bs": 1}, {"t": 1.0})
    finally:
        torch.set_num_threads(before)
    assert rec.threads == 1 and store.records("exp")[0].threads == 1
    assert Record.from_dict({"experiment": "old", "config": {}}).threads is None  # stored before the field
    md = store.save_table(pd.DataFrame({"t": [1.0]}), "thr", [rec])
    assert "torch threads/process: 1" in md.read_text()


def _saved_figure(store):
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [1, 2])
    store.save_figure(fig, "wm")
    store.save_figure(fig, "wm")  # saving twice draws one watermark
    return fig


def test_quick_figures_are_watermarked(store):
    from lab_utils.engine.store import QUICK_WATERMARK

    fig = _saved_figure(store)
    marks = [t for t in fig.texts if t.get_text() == QUICK_WATERMARK]
    assert len(marks) == 1 and marks[0].get_rotation() != 0 and marks[0].get_alpha() < 0.5
    assert marks[0].get_fontsize() >= 14


def test_full_figures_are_not_watermarked(tmp_path):
    from lab_utils.engine.store import QUICK_WATERMARK

    fig = _saved_figure(ResultStore("full", root=tmp_path / "full"))
    assert not any(t.get_text() == QUICK_WATERMARK for t in fig.texts)


def test_a_full_disk_mid_append_is_one_sentence_and_loses_no_record(store, monkeypatch):
    """ENOSPC after half a line (simulated): the torn half is cut off again, the error names the
    folder and the fix, and once space is back the next record appends on a line of its own."""
    import errno

    from lab_utils.engine import store as store_mod
    from lab_utils.learn.errors import WriteError

    put(store, "exp", {"bs": 32}, {"seconds": 1.0})
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod.os, "write", half_then_full)
    with pytest.raises(WriteError, match=r"^No space left on the device holding .*runs .*: the exp record "
                                         r"was not saved\. Free space there, or set LAB_RESULTS_DIR"):
        put(store, "exp", {"bs": 128}, {"seconds": 2.0})
    monkeypatch.setattr(store_mod.os, "write", real_write)
    put(store, "exp", {"bs": 512}, {"seconds": 3.0})
    assert [r.config["bs"] for r in store.records("exp")] == [32, 512]
    assert store.path("exp").read_text().count("\n") == 2


def test_a_table_on_a_full_disk_keeps_the_old_one(store, monkeypatch):
    import errno
    import pathlib

    from lab_utils.learn.errors import WriteError

    store.save_table(pd.DataFrame({"a": [1]}), "t")
    before = (store.tables_dir / "t.md").read_text()

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "open", full)
    with pytest.raises(WriteError, match="No space left on the device holding .*tables"):
        store.save_table(pd.DataFrame({"a": [2]}), "t")
    monkeypatch.undo()
    assert (store.tables_dir / "t.md").read_text() == before
    assert sorted(p.name for p in store.tables_dir.iterdir()) == ["t.csv", "t.md"]


def test_a_label_names_only_devices_a_record_ran_on():
    """A skipped run's record holds hardware without a device name: the label leaves it out (it printed
    "device: None" above the accuracy table when the quick lab skipped that check)."""
    from lab_utils.engine.store import provenance_label

    ran = Record("exp", {"bs": 32}, {"t": 1.0}, hardware={"device_name": "cpu (x86)"})
    skipped = Record("exp", {"bs": 64}, {}, status="skipped", reason="nothing to compare",
                     hardware={"device_name": None})
    assert "device: cpu (x86)" in provenance_label([ran, skipped], "quick")
    assert "device" not in provenance_label([skipped], "quick")


def test_a_missing_value_is_one_blank_cell_in_every_table():
    """rows.blank: None and NaN become None, every other value (0, "", a string) stays; blank_missing does
    it to a frame's cells, and the saved table prints the blank as an empty cell in a right-aligned
    (numeric) column."""
    assert blank(None) is None and blank(float("nan")) is None
    assert blank(0.0) == 0.0 and blank(0) == 0 and blank("") == "" and blank("oom") == "oom"
    df = blank_missing(pd.DataFrame({"seconds": [1.5, float("nan")], "what": ["a", None], "n": [1, 2]}))
    assert df["seconds"].tolist() == [1.5, None] and df["what"].tolist() == ["a", None]
    assert df["n"].tolist() == [1, 2]
    md = markdown_table(df)
    assert md.splitlines()[1].split("|")[1].endswith(":")  # the seconds column: right-aligned, numbers
    assert md.splitlines()[3].split("|")[1].strip() == "" and "nan" not in md and "None" not in md
