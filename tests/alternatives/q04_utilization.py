import numpy as np


def achieved_gb_per_s(gradient_bytes, world_size, steps_per_epoch, comm_seconds):
    """Achieved bandwidth of one rank in decimal GB/s over one epoch, from the gradient's size in
    bytes, the number of ranks, the steps of the epoch and the epoch's communication seconds."""
    per_step = np.float64(gradient_bytes) * (2.0 - 2.0 / world_size)
    return float(per_step * steps_per_epoch / (comm_seconds * 1e9))
