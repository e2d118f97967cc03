"""A small DiT-like denoiser: the built-in example the demo, tests and benchmarks share.

Patch embedding, sinusoidal timestep embedding with an MLP, a stack of transformer blocks
with adaLN modulation (shift/scale/gate from the conditioning), attention through
`scaled_dot_product_attention`, and an MLP with tanh-approximated GELU, as in DiT.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class DiTConfig:
    image_size: int = 16
    patch: int = 2
    in_channels: int = 4
    dim: int = 64
    heads: int = 4
    depth: int = 4
    mlp_ratio: int = 4
    freq_dim: int = 64


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, dim: int, freq_dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.freq_dim // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DiTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, dim * mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate1.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift1, scale1))
        return x + gate2.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift2, scale2))


class FinalLayer(nn.Module):
    def __init__(self, dim: int, out: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm(x), shift, scale))


class TinyDiT(nn.Module):
    def __init__(self, cfg: DiTConfig = DiTConfig()) -> None:
        super().__init__()
        self.cfg = cfg
        tokens = (cfg.image_size // cfg.patch) ** 2
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.dim, kernel_size=cfg.patch, stride=cfg.patch)
        self.t_embedder = TimestepEmbedder(cfg.dim, cfg.freq_dim)
        self.register_buffer("pos_embed", torch.randn(1, tokens, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(DiTBlock(cfg.dim, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.final_layer = FinalLayer(cfg.dim, cfg.patch * cfg.patch * cfg.in_channels)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.cfg.patch
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2) + self.pos_embed
        cond = self.t_embedder(t)
        for block in self.blocks:
            tokens = block(tokens, cond)
        out = self.final_layer(tokens, cond)
        out = out.reshape(b, h // p, w // p, p, p, c).permute(0, 5, 1, 3, 2, 4)
        return out.reshape(b, c, h, w)


def make_model(seed: int = 0, cfg: DiTConfig = DiTConfig()) -> TinyDiT:
    torch.manual_seed(seed)
    return TinyDiT(cfg).eval()


def example_inputs(batch: int = 2, seed: int = 1, cfg: DiTConfig = DiTConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, cfg.image_size, cfg.image_size, generator=gen)
    return x, torch.full((batch,), 999.0)


def denoise(model: nn.Module, x: torch.Tensor, steps: int = 4) -> list[torch.Tensor]:
    """A few Euler-like steps; returns the latent after each step."""
    out = []
    for i in range(steps):
        t = torch.full((x.shape[0],), 999.0 * (1 - i / steps))
        x = x - model(x, t) / steps
        out.append(x)
    return out


class AdaBlock(nn.Module):
    """One DiT block in small: modulation, norm, MLP, gated residual (the fusion tests' and
    benches' model: mul and add fused under the exact recipe, all of it under a tolerance)."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.mod = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.mod(c).chunk(2, dim=-1)
        h = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        return x + 0.5 * self.fc2(F.gelu(self.fc1(h), approximate="tanh"))


def ada_block() -> AdaBlock:
    torch.manual_seed(0)
    return AdaBlock().eval()


def ada_inputs(i: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Call `i`'s (x, conditioning): fresh values per `i`, the conditioning times `scale`."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(2, 8, 16, generator=g), torch.randn(2, 16, generator=g) * scale
