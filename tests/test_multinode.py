"""Multi-node DDP simulated on one machine: two torchrun agents, one process each, on the job that
``python -m lab_utils measure NAME --nodes 2 --job DIR`` writes, as ``slurm/multinode.sbatch`` runs it.

The script's three steps, here without SLURM: ``measure --nodes 2 --job DIR`` writes the plan's runs
over the two "nodes" as the harness's JSON job; two agents (``--nnodes 2 --nproc-per-node 1``,
rendezvous on 127.0.0.1) train notebook 02's DDP worker on it; ``measure ... --collect`` stores what
global rank 0 wrote. Their records must equal those of one agent with two processes (the same
settings through ``lab_utils.plan.measure``): same configuration but the tag ``nodes=2``, same
losses and accuracies, same parameter-derived figures, same sampler order per rank. Only timings
may differ.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab_utils import proc
from lab_utils.core.dist import free_port
from lab_utils.core.records import RecordsReader
from lab_utils.launcher import torchrun_command

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 240
# Tiny run: notebook 02's experiment, a narrow ResNet-18 on synthetic images, two epochs.
SETS = ["devices=2", "batch_sizes=32", "epochs=2", "width=8", "train_images=128", "seed=3",
        "dataset='synthetic'"]
MEASURE = [sys.executable, "-m", "lab_utils", "measure", "scaling", "--profile", "quick",
           *[a for s in SETS for a in ("--set", s)]]
SAME_EPOCH_KEYS = ("epoch", "steps", "images", "train_loss", "train_accuracy", "lr", "lr_first")
SAME_METRIC_KEYS = ("parameters", "gradient_bytes", "steps_per_epoch", "global_batch", "peak_lr",
                    "world_size", "backend", "reported_epoch", "warmup_steps")


def _env(results: Path) -> dict[str, str]:
    # One thread per process: the same arithmetic in both set-ups, and 2 cores are enough.
    # LOGLEVEL=INFO makes each agent log its rendezvous result (group_rank, global_ranks).
    return dict(os.environ, LAB_RESULTS_DIR=str(results), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                LAB_HEADLESS="1", LOGLEVEL="INFO")


def _measure(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    res = subprocess.run([*MEASURE, *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def run_two_agents(job_dir: Path, env: dict[str, str]) -> list[str]:
    """The job's two torchrun agents, one worker each, meeting at a c10d rendezvous on 127.0.0.1."""
    values = dict(line.split("=", 1) for line in (job_dir / "job.env").read_text().split())
    assert values == {"WORKER": "lab_utils.workers.ddp", "NPROC_PER_NODE": "1"}
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


def test_two_agents_form_one_group_of_two(both):
    """Each agent joined the rendezvous as its own node and ran one of the two global ranks."""
    groups = sorted(re.search(r"group_rank=(\d+)", log).group(1) for log in both["agent_logs"])
    ranks = sorted(re.search(r"global_ranks=\[(\d+)\]", log).group(1) for log in both["agent_logs"])
    assert groups == ["0", "1"] and ranks == ["0", "1"]
    recs = _by_record(both["nodes"])
    assert set(recs) == {("aggregate", None), ("rank", 0), ("rank", 1)}
    assert recs[("aggregate", None)]["metrics"]["world_size"] == 2
    assert recs[("aggregate", None)]["metrics"]["backend"] == "gloo"


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


def test_a_plan_without_a_run_over_the_nodes_is_one_sentence(tmp_path):
    res = subprocess.run([*MEASURE, "--set", "max_cpu_processes=1", "--nodes", "2", "--job", str(tmp_path)],
                         cwd=REPO, env=_env(tmp_path / "r"), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stderr.startswith("error: scaling's plan has no run over 2 nodes here")
    assert res.stderr.count("\n") == 1 and not (tmp_path / "job.json").exists()
