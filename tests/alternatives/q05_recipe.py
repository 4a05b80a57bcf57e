def large_batch_recipe(base_lr, base_batch, per_device_batch, devices, dataset_size, warmup_epochs):
    """The peak learning rate and the warm-up length in optimizer steps of a large-batch run."""
    images_per_rank = (dataset_size + devices - 1) // devices
    steps = (images_per_rank + per_device_batch - 1) // per_device_batch
    peak = base_lr / base_batch * (devices * per_device_batch)
    warm = int(warmup_epochs * steps + 0.5)
    return [peak, warm]
