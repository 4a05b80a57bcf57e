def mfu(flops_per_token, tokens_per_s, peak_flops_per_s, devices):
    """MFU: achieved FLOP/s per device over one device's peak."""
    per_device = tokens_per_s / devices
    achieved = flops_per_token * per_device
    return achieved / peak_flops_per_s
