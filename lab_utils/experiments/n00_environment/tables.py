"""Notebook 00's table: this machine and set-up, one (item, value) row each (:func:`environment_rows`),
read from :mod:`lab_utils.engine.environment` (the machine, the driver, the stack) and
:func:`lab_utils.experiments.shared.data.dataset_status` (is real CIFAR-10 here)."""

from __future__ import annotations

from lab_utils.engine import cuda_builds
from lab_utils.engine.environment import software_stack, topology_summary
from lab_utils.engine.hardware import describe_machine, peak_flops_per_s, peak_note
from lab_utils.experiments.shared import data


def environment_rows(why_profile: str, profile: str) -> list[dict[str, str]]:
    """Rows of (item, value) describing this machine and set-up, for a table."""
    m = describe_machine()
    driver = cuda_builds.query_driver()
    sw = m["software"]
    rows = [{"item": "profile", "value": f"{profile} ({why_profile})"}]
    for item, value in software_stack(driver).items():
        rows.append({"item": item, "value": value})
    if m["gpus"]:
        for g in m["gpus"]:
            peak = peak_flops_per_s(g["name"], "bf16")
            peak_s = (f"{peak / 1e12:.0f} TFLOP/s dense bf16" if peak
                      else peak_note(g["name"]) or "peak unknown (no % of peak shown)")
            rows.append({"item": f"GPU {g['index']}",
                         "value": f"{g['name']}, {g['memory_bytes'] / 2**30:.1f} GiB, {peak_s}"})
    elif driver is not None and driver.gpus:
        for g in driver.gpus:
            mem = f"{g.memory_mib / 1024:.1f} GiB" if g.memory_mib else "memory unknown"
            rows.append({"item": f"GPU {g.index}",
                         "value": f"{g.name}, {mem} (listed by the driver; torch cannot use it)"})
    else:
        rows.append({"item": "GPUs", "value": "none: CPU only; DDP runs as gloo processes"})
    rows.append({"item": "GPU topology", "value": topology_summary(m["interconnect"], driver)})
    rows.append({"item": "CPU", "value": f"{m['cpu']} ({m['cpu_cores']} cores usable)"})
    backends = [k for k, v in m["distributed_backends"].items() if v]
    rows.append({"item": "distributed backends", "value": ", ".join(backends) or "none"})
    for k in ("python", "torch", "torchvision"):
        rows.append({"item": k, "value": str(sw.get(k))})
    st = data.dataset_status()
    rows.append({"item": "CIFAR-10", "value": "present in " + st["data_dir"] if st["cifar10_present"]
                 else f"missing from {st['data_dir']}: using the SYNTHETIC stand-in; "
                      f"to fix: {st['to_prepare']}"})
    return rows
