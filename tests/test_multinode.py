"""Multi-node DDP simulated on one machine: two torchrun agents, one process each.

``slurm/multinode.sbatch`` starts one torchrun agent per node with a c10d rendezvous on
the first node. Here two agents (``--nnodes 2 --nproc-per-node 1``, rendezvous on
127.0.0.1) train the DDP worker together, and their records must equal those of one
agent with two processes: same configuration, same losses and accuracies, same
parameter-derived figures, same sampler order per rank. Only timings may differ.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from lab_utils.core.records import RecordsReader
from lab_utils.launcher import free_port, kill_tree, launch, torchrun_command
from lab_utils.store import ResultStore

pytestmark = pytest.mark.slow

WORKER = "lab_utils.workers.ddp"
EXPERIMENT = "multinode_check"
TIMEOUT_S = 240
# Tiny run: a narrow ResNet-18 on synthetic images, with evaluation, two epochs.
ARGS = ["--experiment", EXPERIMENT, "--profile", "quick", "--batch-size", "16", "--epochs", "2",
        "--width", "8", "--train-images", "96", "--test-images", "40", "--dataset", "synthetic",
        "--eval", "--seed", "3"]
# Identical per-epoch values expected from both set-ups (all-reduced or parameter-derived).
SAME_EPOCH_KEYS = ("epoch", "steps", "images", "train_loss", "train_accuracy", "test_loss",
                   "test_accuracy", "test_images", "lr", "lr_first")
SAME_METRIC_KEYS = ("parameters", "gradient_bytes", "steps_per_epoch", "global_batch", "peak_lr",
                    "world_size", "backend", "reported_epoch", "warmup_steps")


def _env(results: Path, log_dir: Path) -> dict[str, str]:
    # One thread per process: the same arithmetic in both set-ups, and 2 cores are enough.
    # LOGLEVEL=INFO makes each agent log its rendezvous result (group_rank, global_ranks).
    return dict(os.environ, LAB_RESULTS_DIR=str(results), LAB_RANK_LOG_DIR=str(log_dir),
                OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", LAB_HEADLESS="1", LOGLEVEL="INFO")


def run_two_agents(tmp: Path) -> tuple[list[dict], list[str]]:
    """Two torchrun agents, one worker each, meeting at a c10d rendezvous on 127.0.0.1."""
    results, logs = tmp / "results", tmp / "logs"
    logs.mkdir(parents=True)
    out = tmp / "records.jsonl"
    rdzv = f"127.0.0.1:{free_port()}"
    procs, agent_logs = [], []
    try:
        for node in range(2):
            cmd = torchrun_command(WORKER, [*ARGS, "--out", str(out)], nproc=1, port=0, nnodes=2,
                                   node_rank=node, rdzv=rdzv)
            log = logs / f"agent{node}.log"
            agent_logs.append(log)
            with log.open("wb") as f:
                procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                              env=_env(results, logs), start_new_session=True))
        deadline = time.monotonic() + TIMEOUT_S
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pytest.fail("the two agents did not finish in time:\n" + _tails(logs))
    finally:
        for p in procs:
            kill_tree(p)
    codes = [p.returncode for p in procs]
    assert codes == [0, 0], f"agents exited with {codes}:\n" + _tails(logs)
    return [asdict(r) for r in RecordsReader(out).new()], [p.read_text(errors="replace") for p in agent_logs]


def _tails(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in sorted(logs.glob("*.log")))


def _by_record(records: list[dict]) -> dict[tuple, dict]:
    return {(r["config"]["record"], r["config"]["rank"]): r for r in records}


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multinode")
    two_agents, agent_logs = run_two_agents(tmp / "nodes")
    one = launch(WORKER, ARGS, nproc=2, timeout_s=TIMEOUT_S, log_dir=tmp / "single" / "logs",
                 env={"LAB_RESULTS_DIR": str(tmp / "single" / "results"), "OMP_NUM_THREADS": "1"})
    return {"nodes": two_agents, "single": [asdict(r) for r in one.records], "agent_logs": agent_logs,
            "tmp": tmp, "files": [tmp / "nodes" / "records.jsonl", one.log_dir / "records.jsonl"]}


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
        assert a["config"] == b["config"], key
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


def test_records_are_handed_back_by_rank_zero_only_once(both, monkeypatch):
    """Global rank 0 (on whichever node) appends the records to the file once; no worker writes the
    store (the parent does)."""
    for name, path in zip(("nodes", "single"), both["files"]):
        assert len(RecordsReader(path).new()) == 3, name  # aggregate + one per rank, written once
        monkeypatch.setenv("LAB_RESULTS_DIR", str(both["tmp"] / name / "results"))
        assert ResultStore("quick").records(EXPERIMENT) == [], name
