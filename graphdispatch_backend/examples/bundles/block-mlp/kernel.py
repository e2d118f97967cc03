"""block-mlp: the DiT block MLP (fc1 -> tanh-GELU -> fc2) under bf16 autocast, as one call.

Written from the region report of `blocks.*.mlp`: inputs in the order the report lists
them, bf16 casts made explicit (artifacts run with autocast off, inside the compiled
graph). It reproduces the native ops in the native order, so it passes bitwise parity.
"""

import torch
import torch.nn.functional as F


def forward(fc1_bias, fc1_weight, x, fc2_bias, fc2_weight):
    bf16 = torch.bfloat16
    h = F.linear(x.to(bf16), fc1_weight.to(bf16), fc1_bias.to(bf16))
    h = F.gelu(h, approximate="tanh")
    return F.linear(h, fc2_weight.to(bf16), fc2_bias.to(bf16))
