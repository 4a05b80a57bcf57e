def predict_comm_seconds(bucket_bytes, latency_seconds, bandwidth_gb_per_s, steps):
    """(exposed seconds, seconds in flight) per epoch, predicted from DDP's buckets and the line."""
    seconds_per_byte = 1e-9 / bandwidth_gb_per_s
    in_flight = 0.0
    last = None
    for size in bucket_bytes:
        last = latency_seconds + size * seconds_per_byte
        in_flight += last
    return (last * steps, in_flight * steps)
