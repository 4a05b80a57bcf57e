def speedup_and_efficiency(t1_seconds, tn_seconds, n_devices):
    """(speedup, efficiency) of N devices over one, from epoch times in seconds."""
    rate_one, rate_n = 1.0 / t1_seconds, 1.0 / tn_seconds   # epochs per second
    efficiency = rate_n / (n_devices * rate_one)
    return efficiency * n_devices, efficiency
