def predicted_gb_per_s(bucket_bytes, world_size, alpha_seconds, bandwidth_gb_per_s):
    """Predicted bandwidth (decimal GB/s) of one rank's gradient all-reduces in one step, by the fit."""
    factor = 2 * (world_size - 1) / world_size
    gradient = sum(bucket_bytes)
    latency = len(bucket_bytes) * 2 * (world_size - 1) * alpha_seconds
    transfer = factor * gradient / (bandwidth_gb_per_s * 1e9)
    return factor * gradient / (latency + transfer) / 1e9
