import numpy as np


def predict_peak_memory(batch_a, peak_a_bytes, batch_b, peak_b_bytes, batch, limit_bytes):
    """Predicted peak memory at batch (bytes) and the largest batch within limit_bytes (images)."""
    slope, intercept = np.polyfit([batch_a, batch_b], [peak_a_bytes, peak_b_bytes], 1)
    largest = int((limit_bytes - intercept) // slope)
    return float(intercept + slope * batch), largest
