"""Small convolutional networks the tests train: a ResNet (conv-bn-relu, strided convs, residual
adds, max pooling, adaptive average pooling, a linear head) and a UNet (down convs, max and
average pooling, upsampling, skip connections by concatenation, a depthwise grouped conv)."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, channels=(8, 16), classes=10):
        super().__init__()
        c0, c1 = channels
        self.stem = nn.Sequential(nn.Conv2d(3, c0, 3, 1, 1, bias=False), nn.BatchNorm2d(c0), nn.ReLU(),
                                  nn.MaxPool2d(2))
        self.layer1 = BasicBlock(c0, c0)
        self.layer2 = BasicBlock(c0, c1, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c1, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def conv_bn_relu(cin, cout):
    # no conv bias before a batch norm: the norm removes it, so its gradient is rounding noise
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, cin=3, c=8, classes=2):
        super().__init__()
        self.enc1 = conv_bn_relu(cin, c)
        self.enc2 = conv_bn_relu(c, 2 * c)
        self.mid = nn.Sequential(nn.Conv2d(2 * c, 2 * c, 3, padding=1, groups=2 * c), nn.ReLU(),  # depthwise
                                 nn.Conv2d(2 * c, 2 * c, 1))
        self.dec2 = conv_bn_relu(4 * c, c)
        self.dec1 = conv_bn_relu(2 * c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)                                    # H
        e2 = self.enc2(F.max_pool2d(e1, 2))                  # H/2
        m = self.mid(F.avg_pool2d(e2, 2))                    # H/4
        d2 = self.dec2(torch.cat([F.interpolate(m, scale_factor=2.0, mode="nearest"), e2], dim=1))
        d1 = self.dec1(torch.cat([F.interpolate(d2, scale_factor=2.0, mode="bilinear"), e1], dim=1))
        return self.head(d1)


# tensor parallel: the first conv of each pair splits its output channels, the second its input
# channels (a partial sum, reduced before the next batch norm): Megatron's pattern for convs
RESNET_TP = {"stem.0.weight": ("S(0)",), "layer1.conv1.weight": ("S(0)",), "layer1.conv2.weight": ("S(1)",),
             "layer2.conv1.weight": ("S(0)",), "layer2.conv2.weight": ("S(1)",)}
UNET_TP = {"enc1.0.weight": ("S(0)",), "enc2.0.weight": ("S(1)",), "mid.0.weight": ("S(0)",),
           "mid.2.weight": ("S(1)",), "dec2.0.weight": ("S(0)",), "dec1.0.weight": ("S(1)",)}
