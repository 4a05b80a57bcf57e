def shard_bounds(numel, world_size):
    """Each rank's [start, end) of numel elements, sizes differing by at most one."""
    sizes = [numel // world_size + (r < numel % world_size) for r in range(world_size)]
    ends = [sum(sizes[:r + 1]) for r in range(world_size)]
    return [(end - size, end) for size, end in zip(sizes, ends)]
