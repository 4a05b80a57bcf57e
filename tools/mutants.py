#!/usr/bin/env python3
"""``make mutants``: plant each bug of tests/gpu_mutants.py, alone, in a scratch copy of the repository and
run the tests of its site; store the verdicts and rewrite tests/GPU_BRANCHES.md.

A site of the GPU path counts as tested when a realistic bug in it fails a test (issue 33). The
working tree is never modified: the repository is copied once into a temporary folder (without
.git, .venv, results and data), each mutant replaces its ``original`` text (which must occur
exactly once in its file) by ``mutated`` there, the mutant's tests run with this interpreter under
a time limit, and the file is put back before the next one. First the same tests run unmutated:
a verdict means nothing if they fail without a bug.

Verdicts: ``killed`` (a test failed; the first failing test is kept), ``killed (time limit)`` (the
bug made a test hang: pytest was stopped), ``survived`` (every test passed: listed with the mutant's
``survives`` reason when it is an equivalent mutant, else as a missing test), ``error`` (pytest could
not run them, e.g. exit code 2-5). The mutants cover the inventory's decision sites and GPU lines
(tests/gpu_branches.py: synchronizes, event records, peak resets, device indices, peak-table rows).
tests/gpu_mutants_results.json keeps them by mutant (``Mutant.ident``, a digest of its file and text:
a changed mutant is "not run" until the next run); tests/GPU_BRANCHES.md is then regenerated from the
inventory, the mutants and the verdicts.

    python tools/mutants.py [--only TEXT] [--timeout S] [--list]

``--only`` runs the mutants whose ident, file or function contains one of its comma-separated
texts (the others keep their stored verdicts). Run it with ``nice`` on a shared machine: ``make
mutants`` does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import gpu_branches  # noqa: E402  (tests/ is not a package: its inventory and mutants are read from there)
from gpu_mutants import MUTANTS, Mutant  # noqa: E402

SKIP = {".git", ".venv", "results", "data", "dist", "grades", "__pycache__", ".pytest_cache", ".ruff_cache"}
DEFAULT_TIMEOUT_S = 300.0


def scratch_copy(dst: Path) -> Path:
    """The repository without its heavy or generated folders, at ``dst``."""
    def ignore(folder: str, names: list[str]) -> set[str]:
        return {n for n in names if n in SKIP or n.endswith(".pyc")}

    shutil.copytree(REPO, dst, ignore=ignore, symlinks=True)
    (dst / "data").mkdir(exist_ok=True)
    return dst


def run_tests(root: Path, tests: list[str], timeout_s: float) -> tuple[str, float, str]:
    """``(verdict, seconds, first failing test)`` of pytest on ``tests`` in ``root`` (its own session)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           *[f"tests/{t}" for t in tests]]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")]),
           "PYTHONDONTWRITEBYTECODE": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # pytest and whatever it started (torchrun ranks)
        out, _ = proc.communicate()
        return "killed (time limit)", time.monotonic() - t0, ""
    seconds = time.monotonic() - t0
    failed = re.search(r"^(?:FAILED|ERROR) tests/(\S+?)(?: - |$)", out or "", re.M)
    by = failed.group(1) if failed else ""
    if proc.returncode == 0:
        return "survived", seconds, ""
    if proc.returncode == 1:
        return "killed", seconds, by
    tail = " ".join((out or "").strip().splitlines()[-3:])[:300]
    return f"error (pytest exit code {proc.returncode}: {tail})", seconds, by


def plant(root: Path, m: Mutant) -> str:
    """Apply ``m`` in the copy at ``root``; returns the file's original text (to put back)."""
    path = root / "lab_utils" / m.file
    text = path.read_text()
    if text.count(m.original) != 1:
        raise SystemExit(f"error: mutant {m.ident}: its original text occurs {text.count(m.original)} times "
                         f"in lab_utils/{m.file} (it must occur once); update tests/gpu_mutants.py.")
    path.write_text(text.replace(m.original, m.mutated))
    return text


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, timeout=30).stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/mutants.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=None,
                   help="comma-separated texts: run the mutants whose ident, file or function contains one")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per mutant (300)")
    p.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    a = p.parse_args(argv)
    wanted = [w.strip() for w in (a.only or "").split(",") if w.strip()]
    chosen = [m for m in MUTANTS
              if not wanted or any(w in m.ident or w in m.file or w in m.site[1] for w in wanted)]
    if a.list:
        for m in chosen:
            print(f"{m.ident}: {m.models} -> {', '.join(gpu_branches.tests_of(m))}")
        return 0
    if not chosen:
        print(f"error: no mutant matches {a.only!r}", file=sys.stderr)
        return 2
    results = gpu_branches.load_results()
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lab_mutants_") as tmp:
        root = scratch_copy(Path(tmp) / "repo")
        union = list(dict.fromkeys(t for m in chosen for t in gpu_branches.tests_of(m)))
        print(f"baseline: {len(union)} tests without a mutant ...", flush=True)
        verdict, seconds, by = run_tests(root, union, max(a.timeout, 60.0) * 4)
        if verdict != "survived":
            print(f"error: the mutants' tests fail without a mutant ({verdict}; {by or 'see pytest'}): fix "
                  "them first, a verdict would mean nothing.", file=sys.stderr)
            return 1
        print(f"baseline: passed in {seconds:.0f} s; {len(chosen)} mutants", flush=True)
        for i, m in enumerate(chosen, 1):
            original = plant(root, m)
            try:
                verdict, seconds, by = run_tests(root, gpu_branches.tests_of(m), a.timeout)
            finally:
                (root / "lab_utils" / m.file).write_text(original)
            results["mutants"][m.ident] = {"verdict": verdict, "seconds": round(seconds, 1), "by": by,
                                           "tests": gpu_branches.tests_of(m)}
            print(f"[{i}/{len(chosen)}] {verdict:<20} {seconds:5.0f} s  {m.ident}: {m.models}", flush=True)
    known = {m.ident for m in MUTANTS}
    results["mutants"] = {k: v for k, v in sorted(results["mutants"].items()) if k in known}
    results.update(ran_at=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   commit=git_commit(), seconds=round(time.monotonic() - t_start), only=a.only)
    gpu_branches.RESULTS.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    (REPO / "tests" / "GPU_BRANCHES.md").write_text(gpu_branches.markdown(results))
    c = gpu_branches.mutant_counts(results)
    print(f"\n{c['killed']} of {c['mutants']} mutants killed ({c['killed'] / c['mutants']:.0%}), "
          f"{c['survived']} survived, {c['not_run']} not run, {c['other']} other; "
          f"{time.monotonic() - t_start:.0f} s. "
          "Written: tests/gpu_mutants_results.json, tests/GPU_BRANCHES.md")
    for m in MUTANTS:
        r = results["mutants"].get(m.ident, {})
        if r.get("verdict") == "survived":
            why = m.survives or "no reason given: a test that sees this bug is missing"
            print(f"  survived: {m.ident}: {m.models} ({', '.join(r.get('tests', []))}); why: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
