import torch

from lab_utils.learn.flops import count_flops
from lab_utils.learn.models import ResNet18, count_parameters


def test_resnet18_parameter_count_and_shape():
    model = ResNet18()
    assert count_parameters(model) == 11_173_962
    # 44.7 MB of fp32 gradients
    assert count_parameters(model) * 4 == 44_695_848
    out = model(torch.randn(3, 3, 32, 32))
    assert out.shape == (3, 10)


def test_resnet18_structure():
    model = ResNet18()
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())
    strides = [model.layer1[0].conv1.stride, model.layer2[0].conv1.stride,
               model.layer3[0].conv1.stride, model.layer4[0].conv1.stride]
    assert strides == [(1, 1), (2, 2), (2, 2), (2, 2)]
    # 1x1 conv + BN shortcut only where the shape changes
    assert isinstance(model.layer1[0].shortcut, torch.nn.Identity)
    assert isinstance(model.layer2[0].shortcut[0], torch.nn.Conv2d)
    assert model.layer2[0].shortcut[0].kernel_size == (1, 1)
    assert model.linear.in_features == 512 and model.linear.out_features == 10


def test_narrow_resnet_same_family():
    small = ResNet18(width=8)
    assert small(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    assert count_parameters(small) < count_parameters(ResNet18()) / 50


def test_resnet18_flops_per_image():
    # 0.556 GMAC per 32x32 image forward (2 FLOPs per MAC); backward ~2x forward
    c = count_flops(ResNet18(), torch.randn(2, 3, 32, 32))
    assert abs(c.forward_flops_per_sample - 2 * 0.556e9) / (2 * 0.556e9) < 0.02
    assert 1.9 < c.backward_flops / c.forward_flops < 2.1
