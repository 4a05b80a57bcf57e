import numpy as np


def predict_tokens_per_s(batch_sizes, step_seconds, micro_batch, effective_batch, block_size):
    """Tokens/s of one device: a fitted line of seconds against tokens per micro-step."""
    tokens = np.array(batch_sizes, dtype=np.float64) * block_size
    slope, intercept = np.polyfit(tokens, np.array(step_seconds, dtype=np.float64), 1)
    micro_tokens = micro_batch * block_size
    steps = effective_batch / micro_batch
    seconds_per_optimizer_step = steps * (intercept + slope * micro_tokens)
    return float(effective_batch * block_size / seconds_per_optimizer_step)
