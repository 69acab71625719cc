"""HED soft-edge detector: ControlNet's Apache-2 HED network (weights file ControlNetHED.pth).

Parameter names match the official ControlNetHED_Apache2 so that file loads strictly:
  norm (1, 3, 1, 1)
  block{1..5}.convs.{i}.weight / .bias   3x3 convs, padding 1
  block{1..5}.projection.weight / .bias  1x1 conv to one channel
The published file stores fp16 tensors; loading copies them into this fp32 module.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

# (in channels, out channels, number of 3x3 convs) for block1..block5.
BLOCKS = ((3, 64, 2), (64, 128, 2), (128, 256, 3), (256, 512, 3), (512, 512, 3))


class Block(nn.Module):
    """A VGG stage: 3x3 conv + ReLU, n times; also returns a 1-channel side output."""

    def __init__(self, cin, cout, n):
        super().__init__()
        self.convs = nn.Sequential(*[nn.Conv2d(cin if i == 0 else cout, cout, 3, padding=1) for i in range(n)])
        self.projection = nn.Conv2d(cout, 1, 1)

    def forward(self, x):
        for conv in self.convs:
            x = F.relu(conv(x))
        return x, self.projection(x)


class HED(nn.Module):
    def __init__(self):
        super().__init__()
        # Input is raw RGB 0..255; this learned offset stands in for mean subtraction.
        self.norm = nn.Parameter(torch.zeros(1, 3, 1, 1))
        for i, (cin, cout, n) in enumerate(BLOCKS, start=1):
            self.add_module(f"block{i}", Block(cin, cout, n))

    def side_outputs(self, x):
        """The five 1-channel logit maps, at 1, 1/2, 1/4, 1/8 and 1/16 resolution."""
        h = x.float() - self.norm
        outs = []
        for i in range(1, len(BLOCKS) + 1):
            if i > 1:
                h = F.max_pool2d(h, 2)
            h, side = getattr(self, f"block{i}")(h)
            outs.append(side)
        return outs

    def forward(self, x):
        """(B, 3, H, W) RGB in 0..255 (any dtype) -> (B, 1, H, W) edge probability in [0, 1]."""
        H, W = x.shape[-2:]
        sides = [F.interpolate(s, size=(H, W), mode="bilinear", align_corners=False) for s in self.side_outputs(x)]
        logit = torch.cat(sides, dim=1).mean(dim=1, keepdim=True)
        # Written as 1/(1+exp(-x)) rather than torch.sigmoid to match the official float rounding.
        return 1 / (1 + torch.exp(-logit))
