import torchvision.transforms as T

CIFAR10_MEAN = [0.4914, 0.4822, 0.4465]
CIFAR10_STD = [0.2023, 0.1994, 0.2010]


def cifar10_train_transform():
    """The assignment's CIFAR-10 training transform: takes a 32 x 32 RGB PIL image, returns the
    normalized 3 x 32 x 32 float tensor the model trains on."""
    # ToTensor first: the crop and the flip work on tensors as well, and the padding is 0 either way
    steps = [T.ToTensor(), T.RandomCrop(size=(32, 32), padding=4), T.RandomHorizontalFlip(),
             T.Normalize(mean=CIFAR10_MEAN, std=CIFAR10_STD)]
    return T.Compose(steps)
