"""THE measure of every experiment (lab_utils.engine.plan) on a toy worker: rows for runs that cannot run,
reuse on the same devices, one launch per group, the out-of-memory rule, failures as rows and one
error, the same records in this process and under torchrun."""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import ddp_toy_worker as toy
import pytest

from lab_utils.engine import plan
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run
from lab_utils.engine.records import Record, aggregates, is_rank_record, ranks_of, run_key, run_records
from lab_utils.learn.errors import LabError, LaunchError
from lab_utils.learn.ranks import epochs_over_ranks

TESTS = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ToySettings:
    sizes: tuple[int, ...] = (1, 2, 4)
    fits: int = 2
    processes: int = 1
    in_process: bool = True
    mode: str = "oom"
    needs_gpus: int = 0


def toy_plan(s: ToySettings, machine: Machine, profile: str) -> list[Run]:
    return [Run("toy", {"mode": s.mode, "size": b, "fits": s.fits, "fail_rank": 0}, toy,
                processes=s.processes, group="sizes", in_process=s.in_process, label=f"size {b}",
                timeout_s=60,
                skip=f"needs {s.needs_gpus} GPUs" if s.needs_gpus > machine.gpus else None)
            for b in s.sizes]


TOY = Experiment("toy", "99", ToySettings, toy_plan)


@pytest.fixture
def launched(monkeypatch):
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", str(TESTS) + (os.pathsep + path if path else ""))


def test_in_process_runs_are_stored_and_an_oom_ends_the_group(store, capsys):
    recs = plan.measure("quick", TOY, ToySettings())
    assert [(r.config["size"], r.status) for r in recs] == [(1, "ok"), (2, "ok"), (4, "oom")]
    assert "out of memory" in recs[2].reason.lower()
    assert len(store.records("toy")) == 3  # the oom row is stored: a resume does not try it again
    again = plan.measure("quick", TOY, ToySettings(sizes=(1, 2, 4, 8)))
    assert [r.status for r in again] == ["ok", "ok", "oom", "skipped"]
    assert again[3].reason == "not tried: size 4 already ran out of memory"
    assert len(store.records("toy")) == 3  # nothing measured twice
    assert "nothing (all from the store)" in capsys.readouterr().out


def test_a_run_that_cannot_run_here_is_a_row_not_stored(store):
    recs = plan.measure("quick", TOY, ToySettings(needs_gpus=4), machine=Machine(gpus=0, cores=2))
    assert {(r.status, r.reason) for r in recs} == {("skipped", "needs 4 GPUs")}
    assert store.records("toy") == []


def test_a_record_of_another_metrics_version_is_measured_again_and_the_table_shows_the_new(store, capsys,
                                                                                         monkeypatch):
    """The worker's METRICS_VERSION is part of every key (plan.versioned): a record an older lab stored
    (another version, or none) is not reused; measure says why; one record per configuration is read."""
    [first] = plan.measure("quick", TOY, ToySettings(sizes=(1,), mode="ok"))
    assert first.config["metrics_version"] == toy.METRICS_VERSION == 1
    assert store.records("toy")[0].config["metrics_version"] == 1  # what the worker echoed, stored
    monkeypatch.setattr(toy, "METRICS_VERSION", 2)  # a metric of the worker changed meaning
    capsys.readouterr()
    [again] = plan.measure("quick", TOY, ToySettings(sizes=(1,), mode="ok"))
    out = capsys.readouterr().out
    assert "size 1: the stored record is from an older lab (metrics version 1, now 2): measured again" in out
    assert again.config["metrics_version"] == 2 and len(store.records("toy")) == 2
    assert [r.config["metrics_version"] for r in store.latest("toy")] == [2]  # one row per configuration
    plan.measure("quick", TOY, ToySettings(sizes=(1,), mode="ok"))  # the new record is reused
    assert len(store.records("toy")) == 2
    monkeypatch.delattr(toy, "METRICS_VERSION")
    with pytest.raises(LabError, match="defines no METRICS_VERSION"):
        plan.measure("quick", TOY, ToySettings(sizes=(1,), mode="ok"))


def test_a_record_stored_before_metrics_versions_is_measured_again(store, capsys):
    from lab_utils.engine.records import Record

    old = Record("toy", {"mode": "ok", "size": 1, "fits": 2, "fail_rank": 0}, {"x": 1.0}, profile="quick")
    store.run_many("toy", [old.config], lambda todo: [old])
    [rec] = plan.measure("quick", TOY, ToySettings(sizes=(1,), mode="ok"))
    assert "(metrics version none, now 1): measured again" in capsys.readouterr().out
    assert rec.config["metrics_version"] == 1 and len(store.records("toy")) == 2


def test_the_older_lab_check_reads_the_stored_records_once_per_group(store, capsys, monkeypatch):
    """Three configurations stored by an older lab: three sentences, one read of the records file."""
    plan.measure("quick", TOY, ToySettings(sizes=(1, 2), mode="ok"))
    monkeypatch.setattr(toy, "METRICS_VERSION", 2)
    reads = []  # the function that read the records file, each time
    real = type(store).records
    monkeypatch.setattr(type(store), "records",
                        lambda self, exp: reads.append(traceback.extract_stack()[-2].name) or real(self, exp))
    capsys.readouterr()
    plan.measure("quick", TOY, ToySettings(sizes=(1, 2), mode="ok"))
    assert capsys.readouterr().out.count("from an older lab (metrics version 1, now 2)") == 2
    assert reads.count("_group") == 1  # the check's one read (store.reusable reads once per run)


def test_force_measures_again(store):
    plan.measure("quick", TOY, ToySettings(sizes=(1,)))
    plan.measure("quick", TOY, ToySettings(sizes=(1,)), force=True)
    assert len(store.records("toy")) == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_launched_group_is_one_job_and_a_rank_oom_is_a_row(store, launched):
    """Two gloo ranks: sizes 1 and 2 fit, rank 1 runs out of memory at 4 (its failure file, not the log,
    says so), 8 is not tried; the records equal what the in-process run gives."""
    s = ToySettings(sizes=(1, 2, 4, 8), processes=2, in_process=False)
    recs = plan.measure("quick", TOY, s)
    assert [r.status for r in recs] == ["ok", "ok", "oom", "skipped"]
    assert [m["rank"] for m in recs[0].metrics["ranks"]] == [0, 1]
    assert "toy" in recs[2].reason and recs[3].reason.startswith("not tried")
    assert [r.config["size"] for r in store.records("toy")] == [1, 2, 4]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_failed_launch_is_an_error_row_and_one_error_at_the_end(store, launched):
    s = ToySettings(sizes=(1, 2), processes=2, in_process=False, mode="fail")
    with pytest.raises(LaunchError, match="1 run\\(s\\) of toy failed") as e:
        plan.measure("quick", TOY, s)
    assert "RuntimeError: deliberate failure on rank 0" in str(e.value)
    stored = store.records("toy")
    assert [r.status for r in stored] == ["error"]  # the second was never run: not stored
    # an error is measured again next time
    with pytest.raises(LaunchError):
        plan.measure("quick", TOY, s)
    assert len(store.records("toy")) == 2


def test_gpu_work_is_never_planned_in_process(store):
    bad = Experiment("toy", "99", ToySettings, lambda s, m, p: [Run("toy", {"mode": "ok"}, toy, device="cuda",
                                                                    in_process=True)])
    with pytest.raises(Exception, match="GPU work runs through the launcher"):
        plan.measure("quick", bad, ToySettings())


def test_one_rule_tells_a_runs_record_from_a_ranks():
    """A DDP aggregate and a one-process worker's record (no "record" key: the sweep's) are their runs'
    records; a rank's record is not, and belongs to its aggregate's run."""
    agg = Record("scaling", {"record": "aggregate", "rank": None, "devices": 2, "batch_size": 32})
    ranks = [Record("scaling", {**agg.config, "record": "rank", "rank": r}) for r in (0, 1)]
    other = Record("scaling", {"record": "rank", "rank": 0, "devices": 2, "batch_size": 64})
    sweep = Record("batch_sweep", {"batch_size": 32})
    records = [agg, *ranks, other, sweep]
    assert [is_rank_record(r) for r in records] == [False, True, True, True, False]
    assert aggregates(records) == [agg, sweep] and plan.aggregates is aggregates
    assert ranks_of(agg, records) == ranks and ranks_of(sweep, records) == []
    assert {run_key(r) for r in ranks} == {agg.key}


def test_one_rank_aggregation_path_for_every_ddp_worker():
    """core.ranks.epochs_over_ranks and run_records, by hand: rank 0's epochs take 2 s and 4 s, rank 1's 3 s
    and 1 s; epoch 1's T is rank 1's 3 s (mean 2.5 s), epoch 2's rank 0's 4 s; one record for the run and
    one per rank, holding its last epoch (less ``drop``) and what the worker adds."""
    def ep(e, seconds):
        return {"epoch": e, "epoch_seconds": seconds, "train_seconds": seconds, "steps": 2, "images": 8,
                "sample_order_head": [e]}

    gathered = [{"epochs": [ep(1, 2.0), ep(2, 4.0)], "startup": 0.1},
                {"epochs": [ep(1, 3.0), ep(2, 1.0)], "startup": 0.2}]
    history = epochs_over_ranks(gathered)
    assert [(h["slowest_rank"], h["epoch_seconds"], h["epoch_seconds_mean"]) for h in history] == [
        (1, 3.0, 2.5), (0, 4.0, 2.5)]
    assert history[0]["images"] == 16 and history[0]["images_per_s"] == 16 / 3.0
    config = {"record": "aggregate", "rank": None, "devices": 2}
    recs = run_records("scaling", config, {"train_seconds": 4.0}, gathered, {"profile": "quick"},
                       rank_extra=lambda g: {"startup_seconds": g["startup"]}, drop=("sample_order_head",))
    assert [r.config for r in recs] == [config, {**config, "record": "rank", "rank": 0},
                                        {**config, "record": "rank", "rank": 1}]
    assert recs[2].metrics == {"epoch_seconds": 1.0, "train_seconds": 1.0, "steps": 2, "images": 8,
                               "reported_epoch": 2, "epochs": gathered[1]["epochs"], "startup_seconds": 0.2}
    assert ranks_of(recs[0], recs) == recs[1:] and {r.profile for r in recs} == {"quick"}
