import torch


def grad_bytes(model):
    """Bytes of the gradients DDP all-reduces for `model` (an nn.Module)."""
    total = 0
    for tensor in model.parameters():
        if tensor.requires_grad:
            total += tensor.numel() * torch.finfo(tensor.dtype).bits // 8   # floating dtypes only
    return total
