"""The oneDNN AVX2 backward-weights defect (uxlfoundation/oneDNN#6035) and the lab's workaround.

The defect hangs, crashes or corrupts the weight gradient of a strided 1x1 convolution with
fewer than 8 input channels in channels-last on AVX2 CPUs. These tests check that the
workaround finds exactly those convolutions, changes no number, and that with oneDNN capped
at AVX2 (as on the CPU where the suite hung) the faulty kernel is no longer called.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from lab_utils.engine import onednn
from lab_utils.experiments.n08_speed_limits import fast_train
from lab_utils.learn.models import ResNet18


def test_affected_convs_are_the_narrow_strided_shortcuts():
    # width 2: shortcut convs 2 -> 4, 4 -> 8 and 8 -> 16, all 1x1 stride 2; the first two have < 8 inputs
    assert onednn.affected_convs(ResNet18(width=2)) == ["layer2.0.shortcut.0", "layer3.0.shortcut.0"]
    assert onednn.affected_convs(ResNet18(width=8)) == []  # 8, 16, 32 input channels: one full block


def test_workaround_changes_no_output_or_gradient():
    torch.manual_seed(0)
    ref = ResNet18(width=2).double()
    fixed = ResNet18(width=2).double()
    fixed.load_state_dict(ref.state_dict())
    reason = onednn.apply_workaround(fixed, "cpu", channels_last_possible=True)
    assert reason is not None and "oneDNN#6035" in reason and "layer2.0.shortcut.0" in reason
    assert fixed.state_dict().keys() == ref.state_dict().keys()  # same parameters, same names
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3])
    outs = []
    for m in (ref, fixed):
        out = m(x)
        torch.nn.functional.cross_entropy(out, y).backward()
        outs.append((out.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-12, atol=1e-12)
    for name, g in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], g, rtol=1e-10, atol=1e-12, msg=name)


def test_workaround_only_where_the_defect_can_strike():
    assert onednn.apply_workaround(ResNet18(width=2), "cuda", channels_last_possible=True) is None
    assert onednn.apply_workaround(ResNet18(width=2), "cpu", channels_last_possible=False) is None
    assert onednn.apply_workaround(ResNet18(width=8), "cpu", channels_last_possible=True) is None
    t = fast_train.build_trainer(fast_train.TrainOptions(channels_last=True), width=2, device="cpu")
    assert t.onednn_workaround is not None
    plain = fast_train.build_trainer(fast_train.TrainOptions(), width=2, device="cpu")
    assert plain.onednn_workaround is None


_STEP = textwrap.dedent("""
    import torch
    from lab_utils.experiments.n08_speed_limits import experiment as fastpath, tables as fastpath_tables
    from lab_utils.experiments.n08_speed_limits import fast_train
    t = fast_train.build_trainer(fast_train.TrainOptions(channels_last=True), width=2, device="cpu")
    x = torch.randn(32, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (32,))
    for _ in range(2):
        t.step(x, y)
    print("steps done", flush=True)
""")

# One oneDNN verbose line per executed primitive, e.g.
# ...,convolution,jit_1x1:avx2,backward_weights,...,mb32_ic4oc8_ih16oh8kh1sh2dh0ph0_...
_SHAPE = re.compile(r"ic(\d+)oc\d+_ih\d+oh\d+kh(\d+)sh(\d+)")


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="oneDNN's AVX2 kernels are x86")
@pytest.mark.timeout(150)
def test_channels_last_step_avoids_the_faulty_avx2_kernel():
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ONEDNN_VERBOSE="1", OMP_NUM_THREADS="2")
    res = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "steps done" in res.stdout
    bwd_w = [ln for ln in res.stdout.splitlines() if ",convolution," in ln and ",backward_weights," in ln]
    assert bwd_w, "oneDNN verbose printed no weight-gradient convolution: the check would be vacuous"
    faulty = []
    for ln in bwd_w:
        m = _SHAPE.search(ln)
        if m and "jit_1x1" in ln and int(m.group(1)) < onednn.AVX2_CHANNEL_BLOCK and int(m.group(3)) > 1:
            faulty.append(ln)
    assert not faulty, f"the defective kernel still runs: {faulty[:2]}"
