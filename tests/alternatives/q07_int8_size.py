import torch


def int8_weight_only_bytes(model, keep_in_float=()):
    """Bytes of the int8 weight-only model's tensors: quantized Linear weights plus the float storages."""
    quantized = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name not in keep_in_float:
            quantized[name] = module.weight
    total = sum(w.shape[0] * w.shape[1] + 5 * w.shape[0] for w in quantized.values())
    float_storages = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if pname == "weight" and name in quantized:
                continue
            float_storages[p.untyped_storage().data_ptr()] = p.numel() * p.element_size()
    return total + sum(float_storages.values())
