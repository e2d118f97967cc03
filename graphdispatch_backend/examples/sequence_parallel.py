"""A sequence-parallel DiT block: the model the multi-rank tests and bench/sequence_parallel.py share.

Each rank holds its shard of the sequence. Ulysses attention trades it for a shard of the
heads around attention (`seq_to_heads`, `heads_to_seq`), through whichever all-to-all the
caller writes (functional, `dist.all_to_all_single(out, x)` into `empty_like`, with
`async_op=True`, ...): the forms people write are what the tests compare. `SPBlock` is a
pre-norm block (attention, then an MLP) whose attention is a method a test may replace with
another parallel form (K/V all-gathered, a ring).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

AllToAll = Callable[[torch.Tensor], torch.Tensor]  # chunk p of dim 0 goes to rank p


def seq_to_heads(x: torch.Tensor, all_to_all: AllToAll, world: int) -> torch.Tensor:
    """Ulysses: [B, S/P, H, D] -> [B, S, H/P, D]."""
    b, s, h, d = x.shape
    y = all_to_all(x.reshape(b, s, world, h // world, d).permute(2, 0, 1, 3, 4).contiguous())
    return y.permute(1, 0, 2, 3, 4).reshape(b, world * s, h // world, d)  # chunk p came from rank p


def heads_to_seq(x: torch.Tensor, all_to_all: AllToAll, world: int) -> torch.Tensor:
    """Ulysses back: [B, S, H/P, D] -> [B, S/P, H, D]."""
    b, s, h, d = x.shape
    y = all_to_all(x.reshape(b, world, s // world, h, d).permute(1, 0, 2, 3, 4).contiguous())
    return y.permute(1, 2, 0, 3, 4).reshape(b, s // world, world * h, d)  # the heads of rank p


class SPBlock(nn.Module):
    """x + proj(attention(norm1(x))), then x + mlp(norm2(x)); the attention Ulysses through
    `all_to_all` over `world` ranks."""

    def __init__(self, dim: int, heads: int, world: int, all_to_all: AllToAll | None = None, mlp_ratio: int = 4,
                 gelu: str = "none") -> None:
        super().__init__()
        self.dim, self.heads, self.world, self.all_to_all, self.gelu = dim, heads, world, all_to_all, gelu
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, mlp_ratio * dim), nn.Linear(mlp_ratio * dim, dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """[B, S/P, H, D] each -> [B, S/P, H * D]."""
        b, s = q.shape[:2]
        a2a, world = self.all_to_all, self.world
        assert a2a is not None, "an all-to-all, or an attend of another form"
        q, k, v = seq_to_heads(q, a2a, world), seq_to_heads(k, a2a, world), seq_to_heads(v, a2a, world)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return heads_to_seq(y.transpose(1, 2).contiguous(), a2a, world).reshape(b, s, self.dim)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(self.norm2(x)), approximate=self.gelu))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, self.dim // self.heads).unbind(2)
        x = x + self.proj(self.attend(q, k, v))
        return x + self.mlp(x)
