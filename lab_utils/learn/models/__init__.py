"""Models of the lab: the CIFAR ResNet-18 (part 1) and a small GPT (part 2)."""

from lab_utils.learn.models.gpt import GPT, GPTConfig
from lab_utils.learn.models.resnet import FlopsPerImage, ResNet18, count_parameters, flops_per_image

__all__ = ["GPT", "GPTConfig", "FlopsPerImage", "ResNet18", "count_parameters", "flops_per_image"]
