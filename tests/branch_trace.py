"""A pytest plugin (``-p branch_trace``) that records which code of ``lab_utils`` each test executes.

Used by ``python tests/gpu_branches.py --verify`` (and ``--discover``) to check that the test
named for a CUDA-only branch really runs that branch's CUDA arm. Set ``LAB_BRANCH_TRACE`` to
the JSON file to write: ``{test node id: {"code": [[file, line, end line, col, end col], ...],
"fake": [[file, line], ...]}}``: the source position of every bytecode instruction executed (so the arm of a
conditional *expression* can be told from its other arm), and the lines executed while the
fake GPU (tests/fake_gpu.py) was patched in. Only frames of files under ``lab_utils/`` are
traced; subprocesses (torchrun ranks) are not.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest
import torch

PKG = str(Path(__file__).resolve().parent.parent / "lab_utils") + os.sep
_REAL_IS_AVAILABLE = torch.cuda.is_available
_hits: dict[str, dict[str, set]] = {}
_current: list[dict[str, set]] = []
_positions: dict = {}


def _local(frame, event, arg):
    if not _current:
        return _local
    code = frame.f_code
    if event == "opcode":
        pos = _positions.get(code)
        if pos is None:
            pos = _positions[code] = list(code.co_positions())
        i = frame.f_lasti // 2
        if i < len(pos) and pos[i][0] is not None:
            _current[-1]["code"].add((code.co_filename, *pos[i]))  # line, end line, column, end column
    elif event == "line" and torch.cuda.is_available is not _REAL_IS_AVAILABLE:
        _current[-1]["fake"].add((code.co_filename, frame.f_lineno))
    return _local


def _global(frame, event, arg):
    if event == "call" and frame.f_code.co_filename.startswith(PKG):
        frame.f_trace_opcodes = True
        return _local
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(_hits.setdefault(item.nodeid, {"code": set(), "fake": set()}))
    sys.settrace(_global)
    threading.settrace(_global)
    try:
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)
        _current.pop()


def pytest_sessionfinish(session, exitstatus):
    out = os.environ.get("LAB_BRANCH_TRACE")
    if out:
        data = {k: {kind: sorted(v) for kind, v in d.items()} for k, d in _hits.items()}
        Path(out).write_text(json.dumps(data))
