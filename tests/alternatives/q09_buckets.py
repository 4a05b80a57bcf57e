def assign_buckets(sizes_bytes, cap_bytes, first_cap_bytes):
    """Buckets of parameter indices, last parameter first, by DDP's rule."""
    buckets = [[]]
    total = 0
    for i in list(range(len(sizes_bytes)))[::-1]:
        buckets[-1].append(i)
        total += sizes_bytes[i]
        if total >= (first_cap_bytes if len(buckets) == 1 else cap_bytes):
            buckets.append([])
            total = 0
    return [b for b in buckets if b]
