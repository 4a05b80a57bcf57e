"""Multi-node DDP simulated on one machine: two torchrun agents, one process each, on the job that
``python -m lab_utils measure NAME --nodes 2 --job DIR`` writes, as ``slurm/multinode.sbatch`` runs it.

The script's three steps, here without SLURM: ``measure --nodes 2 --job DIR`` writes the plan's runs
over the two "nodes" as the harness's JSON job; two agents (``--nnodes 2 --nproc-per-node 1``,
rendezvous on 127.0.0.1) train notebook 02's DDP worker on it; ``measure ... --collect`` stores what
global rank 0 wrote. Their records must equal those of one agent with two processes (the same
settings through ``lab_utils.engine.plan.measure``): same configuration but the tag ``nodes=2``, same
losses and accuracies, same parameter-derived figures, same sampler order per rank. Only timings
may differ. The agents run with the torch threads the job file gives (``THREADS_PER_RANK``), as the
script runs them, although their environment says otherwise.

Without launches: ``job.env``'s threads are the plan's in the quick and the full profile, and
``--collect`` of a launch that SLURM stopped says ``stopped`` for the configuration it cut short.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab_utils.engine import multinode, proc, profiles
from lab_utils.engine.dist import free_port
from lab_utils.engine.launcher import torchrun_command
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import make_plan
from lab_utils.engine.records import Record, RecordsReader, append_records, write_rank_failure
from lab_utils.engine.store import ResultStore
from lab_utils.experiments import registry

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
# Tiny run: notebook 02's experiment, a narrow ResNet-18 on synthetic images, two epochs.
SETS = ["devices=2", "batch_sizes=32", "epochs=2", "width=8", "train_images=128", "seed=3",
        "dataset='synthetic'"]
MEASURE = [sys.executable, "-m", "lab_utils", "measure", "scaling", "--profile", "quick",
           *[a for s in SETS for a in ("--set", s)]]
SAME_EPOCH_KEYS = ("epoch", "steps", "images", "train_loss", "train_accuracy", "lr", "lr_first")
SAME_METRIC_KEYS = ("parameters", "gradient_bytes", "steps_per_epoch", "global_batch", "peak_lr",
                    "world_size", "backend", "reported_epoch", "warmup_steps", "threads_per_rank")


def _env(results: Path) -> dict[str, str]:
    # Two threads per process in the environment: the launches must give each rank the plan's one
    # (notebook 02's cpu_threads), as `measure`'s launcher and the job script do.
    # LOGLEVEL=INFO makes each agent log its rendezvous result (group_rank, global_ranks).
    return dict(os.environ, LAB_RESULTS_DIR=str(results), OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1",
                LAB_HEADLESS="1", LOGLEVEL="INFO")


def _measure(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    res = subprocess.run([*MEASURE, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def run_two_agents(job_dir: Path, env: dict[str, str]) -> list[str]:
    """The job's two torchrun agents, one worker each, meeting at a c10d rendezvous on 127.0.0.1, with
    the job's threads per rank (``OMP_NUM_THREADS``, as slurm/multinode.sbatch sets it)."""
    values = dict(line.split("=", 1) for line in (job_dir / "job.env").read_text().split())
    assert values == {"WORKER": "lab_utils.experiments.n02_scaling.ddp_worker", "NPROC_PER_NODE": "1",
                      "THREADS_PER_RANK": "1"}
    env = dict(env, OMP_NUM_THREADS=values["THREADS_PER_RANK"])
    rdzv = f"127.0.0.1:{free_port()}"
    children, logs = [], []
    try:
        for node in range(2):
            cmd = torchrun_command(values["WORKER"], [str(job_dir / "job.json")], nproc=1, nnodes=2,
                                   node_rank=node, rdzv=rdzv, agent_dir=job_dir / f"torchrun{node}")
            logs.append(job_dir / f"agent{node}.log")
            with logs[-1].open("wb") as f:
                children.append(proc.start(cmd, env=env, cwd=REPO, stdout=f, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + TIMEOUT_S
        for c in children:
            c.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("the two agents did not finish in time:\n" + _tails(logs))
    finally:
        for c in children:
            c.stop()
    codes = [c.popen.returncode for c in children]
    assert codes == [0, 0], f"agents exited with {codes}:\n" + _tails(logs)
    return [p.read_text(errors="replace") for p in logs]


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in logs if p.exists())


def _by_record(records: list[dict]) -> dict[tuple, dict]:
    return {(r["config"]["record"], r["config"]["rank"]): r for r in records}


def _stored(results: Path) -> list[dict]:
    from dataclasses import asdict

    path = results / "quick" / "runs" / "scaling.jsonl"
    return [asdict(r) for r in RecordsReader(path).new()]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    env = _env(tmp / "nodes")
    job_dir = tmp / "job"
    prepared = _measure("--nodes", "2", "--job", str(job_dir), env=env)
    agent_logs = run_two_agents(job_dir, env)
    collected = _measure("--nodes", "2", "--job", str(job_dir), "--collect", env=env)
    again = _measure("--nodes", "2", "--job", str(job_dir), env=env)
    single = _measure(env=_env(tmp / "single"))
    return {"nodes": _stored(tmp / "nodes"), "single": _stored(tmp / "single"), "agent_logs": agent_logs,
            "job_dir": job_dir, "out": {"prepared": prepared.stdout, "collected": collected.stdout,
                                        "again": again.stdout, "single": single.stdout}}


@pytest.mark.slow
def test_two_agents_form_one_group_of_two(both):
    """Each agent joined the rendezvous as its own node and ran one of the two global ranks."""
    groups = sorted(re.search(r"group_rank=(\d+)", log).group(1) for log in both["agent_logs"])
    ranks = sorted(re.search(r"global_ranks=\[(\d+)\]", log).group(1) for log in both["agent_logs"])
    assert groups == ["0", "1"] and ranks == ["0", "1"]
    recs = _by_record(both["nodes"])
    assert set(recs) == {("aggregate", None), ("rank", 0), ("rank", 1)}
    assert recs[("aggregate", None)]["metrics"]["world_size"] == 2
    assert recs[("aggregate", None)]["metrics"]["backend"] == "gloo"


@pytest.mark.slow
def test_same_records_as_one_agent_with_two_processes(both):
    nodes, single = _by_record(both["nodes"]), _by_record(both["single"])
    assert set(nodes) == set(single)
    for key in single:
        a, b = nodes[key], single[key]
        assert a["config"]["tag"] == "nodes=2" and b["config"]["tag"] == ""
        assert {**a["config"], "tag": ""} == b["config"], key
        assert (a["synthetic"], a["dataset"], a["profile"]) == (b["synthetic"], b["dataset"], b["profile"])
        for ea, eb in zip(a["metrics"]["epochs"], b["metrics"]["epochs"], strict=True):
            for k in SAME_EPOCH_KEYS:
                if k in eb:
                    assert ea[k] == pytest.approx(eb[k], rel=1e-6, abs=1e-9), (key, k)
            if key[0] == "rank":  # the sampler gives each rank the same shard in both set-ups
                assert ea["sample_order_head"] == eb["sample_order_head"]
                assert ea["train_loss_rank"] == pytest.approx(eb["train_loss_rank"], rel=1e-6)
        if key[0] == "aggregate":
            for k in SAME_METRIC_KEYS:
                assert a["metrics"][k] == b["metrics"][k], k
    loss = [e["train_loss"] for e in single[("aggregate", None)]["metrics"]["epochs"]]
    assert all(x > 0 for x in loss)


@pytest.mark.slow
def test_the_job_is_the_plans_and_a_resubmitted_job_measures_nothing(both):
    """The job holds the plan's one run over 2 nodes; collect printed one line for it and where the records
    are; the same command again writes no job."""
    out = both["out"]
    assert "scaling (notebook 02), profile quick: 1 run(s) on 2 nodes x 1 process(es)" in out["prepared"]
    assert re.search(r"DDP 2 x 32 +ok +train_seconds \d", out["collected"])
    assert "records: " in out["collected"] and "scaling.jsonl" in out["collected"]
    assert len(both["nodes"]) == 3  # aggregate + 2 ranks, stored once
    assert "nothing to measure: every run is in the store" in out["again"]
    assert not (both["job_dir"] / "job.json").exists()  # and the earlier launch's files are gone


@pytest.mark.slow
def test_a_plan_without_a_run_over_the_nodes_is_one_sentence(tmp_path):
    res = subprocess.run([*MEASURE, "--set", "max_cpu_processes=1", "--nodes", "2", "--job", str(tmp_path)],
                         cwd=REPO, env=_env(tmp_path / "r"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("error: scaling's plan has no run over 2 nodes here")
    assert res.stderr.count("\n") == 1 and not (tmp_path / "job.json").exists()


# --------------------------------------------------------------------------- without launches

SCALING = registry.by_name("scaling")


def _job(tmp_path: Path, profile: str, machine: Machine, devices: int = 2,
         **sets) -> tuple[ResultStore, list]:
    """``measure --nodes 2 --job DIR``'s files for notebook 02's experiment on 2 nodes of ``machine``."""
    store = ResultStore(profile, root=tmp_path / profile)
    settings = profiles.settings(SCALING.settings, profile, devices=(devices,), batch_sizes=(32,), **sets)
    runs = multinode.runs_across(SCALING, settings, 2, profile, machine)
    return store, multinode.prepare(store, SCALING, runs, tmp_path / "job", profile)


def _job_env(tmp_path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in (tmp_path / "job" / "job.env").read_text().splitlines())


@pytest.mark.parametrize("profile", ["quick", "full"])
def test_each_rank_gets_the_plans_threads_on_two_nodes_as_on_one(tmp_path, profile):
    """job.env's THREADS_PER_RANK is the one-node plan's threads for the same settings: the profile's
    cpu_threads for CPU processes (the full profile needs max_cpu_processes for any), whatever CPUs the
    job has; with GPUs none (the launch shares the node's CPUs, as on one node)."""
    sets = {"max_cpu_processes": 2} if profile == "full" else {}
    cpu = Machine(gpus=0, cores=8)
    _, todo = _job(tmp_path, profile, cpu, **sets)
    settings = profiles.settings(SCALING.settings, profile, devices=(2,), batch_sizes=(32,), **sets)
    [one_node] = [r for r in make_plan(SCALING, settings, cpu, profile) if r.skip is None]
    assert one_node.threads == settings.cpu_threads == 1
    assert _job_env(tmp_path)["THREADS_PER_RANK"] == str(one_node.threads)
    assert [r.threads for r in todo] == [one_node.threads]
    _job(tmp_path, profile, Machine(gpus=4, gpu_name="NVIDIA H100 80GB HBM3", cores=32, bf16=True), devices=8)
    assert _job_env(tmp_path) == {"WORKER": "lab_utils.experiments.n02_scaling.ddp_worker",
                                  "NPROC_PER_NODE": "4", "THREADS_PER_RANK": ""}


def test_collect_of_a_stopped_launch_says_stopped_and_stores_what_finished(tmp_path):
    """Three configurations; rank 0 had written the first's records when SLURM stopped the launch, and
    the other rank a failure file as its peer went (what a stop can leave). With the job script's
    note ``stopped``: ok (stored), stopped, not run (neither stored). Without it, the same files are a
    failure: an error row, stored."""
    store, todo = _job(tmp_path, "quick", Machine(gpus=0, cores=2), repeats=3)
    folder = tmp_path / "job"
    job = json.loads((folder / "job.json").read_text())
    done = Record("scaling", dict(job["configs"][0]), {"train_seconds": 1.0}, profile="quick",
                  hardware=job["hardware"])
    append_records(job["out"], [done])
    write_rank_failure(folder, 1, "error", "RuntimeError: Connection reset by peer", 1)
    (folder / multinode.STOPPED).write_text("SIGTERM 2026-12-01T20:17:12+00:00\n")
    rows = [rec for _, rec in multinode.collect(store, folder, "quick")]
    assert [r.status for r in rows] == ["ok", "stopped", "skipped"]
    assert rows[1].reason == ("stopped by SIGTERM (SLURM) before it finished; not stored: submit again to "
                              "measure it")
    assert rows[2].reason == "not run: the job was stopped during configuration 2"
    assert [r.status for r in store.records("scaling")] == ["ok"]
    (folder / multinode.STOPPED).unlink()
    rows = [rec for _, rec in multinode.collect(store, folder, "quick")]
    assert [r.status for r in rows] == ["ok", "error", "skipped"]
    assert rows[1].reason == "RuntimeError: Connection reset by peer"
    assert [r.status for r in store.records("scaling")] == ["ok", "ok", "error"]
    assert len(todo) == 3
