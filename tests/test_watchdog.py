"""lab_utils.engine.watchdog: in-process work past its limit ends the process with one sentence."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from lab_utils.engine import watchdog


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=60)


def test_block_past_its_deadline_stops_the_process_and_says_why():
    t0 = time.perf_counter()
    res = _run("""
        import time
        from lab_utils.engine.watchdog import deadline
        with deadline(0.5, "the test's sleep", "shorten it",
                      on_expiry=lambda msg: print("recorded:", msg, flush=True)):
            time.sleep(30)
        print("not reached")
    """)
    assert res.returncode == watchdog.EXIT_CODE
    assert time.perf_counter() - t0 < 20
    assert "error: the test's sleep did not finish within 0.5 s, so the process is stopped; shorten it" \
        in res.stderr
    assert "recorded: error: the test's sleep" in res.stdout
    assert "not reached" not in res.stdout
    assert "time.sleep" in res.stderr or "line" in res.stderr  # the stacks were dumped


def test_block_within_its_deadline_cancels_both_watchdogs():
    res = _run("""
        import time
        from lab_utils.engine.watchdog import deadline, GRACE_S
        import lab_utils.engine.watchdog as w
        w.GRACE_S = 0.5
        with deadline(0.5, "quick work", "n/a"):
            pass
        time.sleep(1.5)  # past both the timer and faulthandler's limit
        print("finished")
    """)
    assert res.returncode == 0, res.stderr
    assert "finished" in res.stdout and "did not finish" not in res.stderr


def test_deadline_rejects_a_non_positive_limit():
    with pytest.raises(ValueError, match="positive"):
        with watchdog.deadline(0, "x", "y"):
            pass
    with watchdog.deadline(None, "no limit", "n/a"):
        pass


def test_expiry_message_names_work_limit_and_fix():
    assert watchdog.expiry_message("the warm-up", 900, "raise --row-timeout") == (
        "error: the warm-up did not finish within 900 s, so the process is stopped; raise --row-timeout")


@pytest.mark.timeout(120)
def test_bench_train_row_past_its_limit_is_stored_as_an_error(tmp_path):
    """The lab's own command: a row that outlives --row-timeout ends the run with one sentence,
    and the store keeps an error row saying why (rows before it are untouched)."""
    import json
    import os

    env = dict(os.environ, LAB_RESULTS_DIR=str(tmp_path))
    res = subprocess.run([sys.executable, "-m", "lab_utils", "bench", "train", "--profile", "quick",
                          "--steps", "spec", "--width", "2", "--images", "48", "--batch-size", "32",
                          "--num-workers", "0", "--row-timeout", "0.01"],
                         capture_output=True, text=True, env=env, timeout=100)
    assert res.returncode == watchdog.EXIT_CODE, res.stderr[-2000:]
    assert "error: waterfall row 'spec' (warm-up, compilation and timed epoch) did not finish within 0.01 s" \
        in res.stderr
    store_file = tmp_path / "quick" / "runs" / "bench_train.jsonl"
    rows = [json.loads(line) for line in store_file.read_text().splitlines()]
    assert [(r["config"]["step"], r["status"]) for r in rows] == [("spec", "error")]
    assert "raise --row-timeout" in rows[0]["reason"]
