"""Line-art generator (ControlAR's condition/lineart.py network, weights file model.pth).

A small image-to-image ResNet: 7x7 stem, two stride-2 downsamples, three residual blocks at
256 channels, two transposed-conv upsamples, 7x7 head, sigmoid. Instance norms carry no
parameters, so the state dict holds only convolutions. Layers sit in nn.Sequential stages at
the official indices (pads, norms and ReLUs take index slots too), giving the official keys:
  model0.1                       Conv 3->64, 7x7
  model1.0, model1.3             Conv 64->128, 128->256, 3x3 stride 2
  model2.{0,1,2}.conv_block.{1,5}  Conv 256->256, 3x3
  model3.0, model3.3             ConvTranspose 256->128, 128->64, 3x3 stride 2
  model4.1                       Conv 64->1, 7x7
"""
import torch.nn as nn


def down(cin, cout):
    return [nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.InstanceNorm2d(cout), nn.ReLU()]


def up(cin, cout):
    return [nn.ConvTranspose2d(cin, cout, 3, stride=2, padding=1, output_padding=1), nn.InstanceNorm2d(cout), nn.ReLU()]


class ResidualBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv_block = nn.Sequential(
            nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c), nn.ReLU(),
            nn.ReflectionPad2d(1), nn.Conv2d(c, c, 3), nn.InstanceNorm2d(c))

    def forward(self, x):
        return x + self.conv_block(x)


class LineArt(nn.Module):
    def __init__(self, n_residual=3):
        super().__init__()
        self.model0 = nn.Sequential(nn.ReflectionPad2d(3), nn.Conv2d(3, 64, 7), nn.InstanceNorm2d(64), nn.ReLU())
        self.model1 = nn.Sequential(*down(64, 128), *down(128, 256))
        self.model2 = nn.Sequential(*[ResidualBlock(256) for _ in range(n_residual)])
        self.model3 = nn.Sequential(*up(256, 128), *up(128, 64))
        self.model4 = nn.Sequential(nn.ReflectionPad2d(3), nn.Conv2d(64, 1, 7), nn.Sigmoid())

    def forward(self, x):
        """(B, 3, H, W) RGB float in 0..255 (NOT /255, as ControlAR feeds it), H and W multiples
        of 4 -> (B, 1, H, W) in [0, 1]; lines are dark (near 0) on a light background."""
        x = x.float()
        for stage in (self.model0, self.model1, self.model2, self.model3, self.model4):
            x = stage(x)
        return x
