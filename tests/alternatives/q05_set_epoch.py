def epoch_orders(sampler, epochs):
    """The indices a DistributedSampler yields in each of `epochs` epochs, as a training loop draws them."""
    def one_epoch(epoch):
        sampler.set_epoch(epoch)
        return list(map(int, iter(sampler)))

    return [one_epoch(e) for e in range(epochs)]
