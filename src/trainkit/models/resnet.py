"""model=resnet18: torchvision's ResNet-18, with a CIFAR stem for small images."""

from torch import nn

from trainkit.recompute import Staged


def resnet18(
    in_channels: int, num_classes: int, small_input: bool = False, activation_checkpointing: bool = False
) -> nn.Module:
    """torchvision's ResNet-18 (random init; weights would need a download). `small_input`: the
    CIFAR stem, a 3x3 stride-1 conv and no max-pool; the ImageNet stem (7x7 stride 2, max-pool)
    would shrink a 32x32 image to 8x8 before the first block. `activation_checkpointing`: each of
    layer1..layer4 is a checkpointed segment (a Staged with the same children, so the same
    parameter names)."""
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=num_classes)
    if small_input:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if activation_checkpointing:
        for name in ("layer1", "layer2", "layer3", "layer4"):
            setattr(model, name, Staged(*getattr(model, name)))
    return model
