import numpy as np


def predict_epoch_seconds(t1_step_seconds, steps, exposed_bytes, latency_seconds, bandwidth_gb_per_s):
    """The N-device epoch's training time predicted in seconds, from one device's step and the all-reduce."""
    bytes_per_second = np.float64(bandwidth_gb_per_s) * 10**9
    per_step = np.float64(t1_step_seconds) + latency_seconds + np.float64(exposed_bytes) / bytes_per_second
    total = 0.0
    for _ in range(int(steps)):
        total += per_step
    return float(total)
