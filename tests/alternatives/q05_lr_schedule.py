def warmup_lr(step, base_lr, global_batch, base_batch, warmup_steps):
    """Learning rate (in the units of base_lr) of optimizer step `step` (0-based)."""
    k = global_batch / base_batch
    if warmup_steps == 0 or step >= warmup_steps:
        return base_lr * k
    fraction = step / warmup_steps
    return base_lr * ((1 - fraction) + fraction * k)
