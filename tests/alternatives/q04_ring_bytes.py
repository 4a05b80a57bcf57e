def ring_bytes_per_rank_per_epoch(size_bytes, world_size, dataset_size, per_device_batch):
    """Bytes one rank sends in one epoch of ring all-reduces of a `size_bytes` gradient."""
    share = -(-dataset_size // world_size)            # the sampler pads to a multiple of P
    steps = -(-share // per_device_batch)             # the loader keeps the last partial batch
    chunk = size_bytes / world_size
    sends_per_allreduce = 2 * (world_size - 1)        # P-1 reduce-scatter steps, then P-1 all-gather steps
    return steps * sends_per_allreduce * chunk
