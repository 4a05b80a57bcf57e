"""What notebook 00 reports: the machine, the versions, the profile and the data."""

from __future__ import annotations

from lab_utils import data
from lab_utils.hardware import describe_machine, peak_flops_per_s


def environment_rows(why_profile: str, profile: str) -> list[dict[str, str]]:
    """Rows of (item, value) describing this machine and set-up, for a table."""
    m = describe_machine()
    sw = m["software"]
    rows = [{"item": "profile", "value": f"{profile} ({why_profile})"}]
    if m["gpus"]:
        for g in m["gpus"]:
            peak = peak_flops_per_s(g["name"], "bf16")
            peak_s = f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak else "peak unknown (no % of peak shown)"
            rows.append({"item": f"GPU {g['index']}",
                         "value": f"{g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, {peak_s}"})
    else:
        rows.append({"item": "GPUs", "value": "none: CPU only; DDP runs as gloo processes"})
    rows.append({"item": "CPU", "value": f"{m['cpu']} ({m['cpu_cores']} cores usable)"})
    topo = m["interconnect"]
    rows.append({"item": "interconnect",
                 "value": "see `nvidia-smi topo -m` below" if topo else "unknown (no nvidia-smi)"})
    backends = [k for k, v in m["distributed_backends"].items() if v]
    rows.append({"item": "distributed backends", "value": ", ".join(backends) or "none"})
    for k in ("python", "torch", "torchvision", "cuda", "cudnn"):
        rows.append({"item": k, "value": str(sw.get(k))})
    st = data.dataset_status()
    rows.append({"item": "CIFAR-10", "value": "present in " + st["data_dir"] if st["cifar10_present"]
                 else f"missing from {st['data_dir']}: using the SYNTHETIC stand-in; "
                      f"to fix: {st['to_prepare']}"})
    return rows
