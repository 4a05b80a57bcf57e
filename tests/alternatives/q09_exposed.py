import math


def exposed_seconds(bucket_bytes, gradient_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s,
                    backward_seconds):
    """Seconds of communication after backward: the buckets' all-reduces played out one by one."""
    k = math.ceil(gradient_bytes / bucket_bytes)
    p = world_size
    one = 2 * (p - 1) * alpha_seconds + 2 * (p - 1) / p * (gradient_bytes / k) / bandwidth_bytes_per_s
    done = 0.0
    for j in range(1, k + 1):
        ready = j * backward_seconds / k
        done = max(done, ready) + one       # it starts when its bucket is ready and the previous one is done
    return done - backward_seconds
