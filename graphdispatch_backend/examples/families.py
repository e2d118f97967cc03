"""Third-party model families from tiny random configs, as a new user builds them (no hub
downloads), with input makers: the fusion tests and bench/fusion.py share them.

Each builder returns `(model, inputs)`, where `inputs(i, dtype)` makes the keyword arguments
of call `i` (fresh values per `i`; floating inputs in `dtype`). The six families of
bench/fusion.py take `scale`, which multiplies their widths and their latents' sides (the
LLMs': sequence and vocabulary), for figures where fixed per-call costs weigh less.
diffusers and transformers are imported when a builder runs (they are test dependencies,
not the package's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphdispatch_backend.examples import dit

Inputs = Callable[[int, torch.dtype], dict[str, Any]]
Family = Callable[..., tuple[torch.nn.Module, Inputs]]


def _g(i: int) -> torch.Generator:
    return torch.Generator().manual_seed(i)


def demo(depth: int = 4) -> tuple[torch.nn.Module, Inputs]:
    """The built-in TinyDiT (its timestep embedding is fp32: run it bf16 under autocast)."""
    return dit.TinyDiT(dit.DiTConfig(depth=depth)), lambda i, dt: {
        "x": torch.randn(2, 4, 16, 16, generator=_g(i)), "t": torch.full((2,), 999.0 - i)}


def ltx() -> tuple[torch.nn.Module, Inputs]:
    """diffusers' LTX-Video transformer: a video DiT."""
    import diffusers

    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=16)
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 32, 8, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=_g(i + 100)).to(dt), "timestep": torch.tensor([3]),
        "encoder_attention_mask": torch.ones(1, 5), "num_frames": 2, "height": 4, "width": 4, "return_dict": False}


def sd3() -> tuple[torch.nn.Module, Inputs]:
    """diffusers' SD3 transformer: an image DiT with joint attention."""
    import diffusers

    model = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=16)
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=_g(i + 100)).to(dt),
        "pooled_projections": torch.randn(1, 16, generator=_g(i + 200)).to(dt), "timestep": torch.tensor([3]),
        "return_dict": False}


def llama() -> tuple[torch.nn.Module, Inputs]:
    """transformers' Llama: an LLM forward over a batch of token ids."""
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaModel(cfg), lambda i, dt: {"input_ids": torch.randint(0, 64, (2, 8), generator=_g(i))}


def cogvideox(scale: int = 1) -> tuple[torch.nn.Module, Inputs]:
    """diffusers' CogVideoX transformer: a video DiT (3D patches, expert adaLN). `scale`
    multiplies its widths and its latent's height and width (bench/fusion.py `--scale`)."""
    import diffusers

    s = scale
    model = diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=8 * s, in_channels=4, out_channels=4, time_embed_dim=8 * s,
        text_embed_dim=16 * s, num_layers=2, sample_width=8 * s, sample_height=8 * s, sample_frames=5, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8)
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 2, 4, 8 * s, 8 * s, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 8, 16 * s, generator=_g(i + 100)).to(dt),
        "timestep": torch.tensor([3]), "return_dict": False}


def hunyuan_video(scale: int = 1) -> tuple[torch.nn.Module, Inputs]:
    """diffusers' HunyuanVideo transformer: dual- and single-stream blocks, a token refiner, 3D
    RoPE. `scale` multiplies its widths and its latent's height and width."""
    import diffusers

    s = scale
    model = diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8 * s, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1, text_embed_dim=16 * s,
        pooled_projection_dim=8 * s, rope_axes_dim=(2 * s, 2 * s, 4 * s))
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 4, 1, 4 * s, 4 * s, generator=_g(i)).to(dt), "timestep": torch.tensor([3]),
        "encoder_hidden_states": torch.randn(1, 6, 16 * s, generator=_g(i + 100)).to(dt),
        "encoder_attention_mask": torch.ones(1, 6),
        "pooled_projections": torch.randn(1, 8 * s, generator=_g(i + 200)).to(dt),
        "guidance": torch.tensor([3.0]).to(dt), "return_dict": False}


def pixart(scale: int = 1) -> tuple[torch.nn.Module, Inputs]:
    """diffusers' PixArt transformer: an image DiT with adaLN-single and cross-attention.
    `scale` multiplies its widths and its latent's height and width."""
    import diffusers

    s = scale
    model = diffusers.PixArtTransformer2DModel(
        sample_size=8 * s, num_layers=2, patch_size=2, attention_head_dim=8 * s, num_attention_heads=2,
        in_channels=4, out_channels=8, cross_attention_dim=16 * s, caption_channels=16 * s,
        norm_type="ada_norm_single")
    return model, lambda i, dt: {
        "hidden_states": torch.randn(1, 4, 8 * s, 8 * s, generator=_g(i)).to(dt),
        "encoder_hidden_states": torch.randn(1, 6, 16 * s, generator=_g(i + 100)).to(dt),
        "timestep": torch.tensor([3]), "added_cond_kwargs": {"resolution": None, "aspect_ratio": None},
        "return_dict": False}


def _llm(config: str, model: str, scale: int = 1, **extra: Any) -> tuple[torch.nn.Module, Inputs]:
    """`scale` multiplies the widths, the vocabulary and the sequence."""
    import transformers

    s = scale
    cfg = getattr(transformers, config)(vocab_size=64 * s, hidden_size=32 * s, intermediate_size=64 * s,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=32 * s, **extra)
    return getattr(transformers, model)(cfg), lambda i, dt: {
        "input_ids": torch.randint(0, 64 * s, (2, 8 * s), generator=_g(i))}


def phi3(scale: int = 1) -> tuple[torch.nn.Module, Inputs]:
    """transformers' Phi3: fused qkv and gate-up projections, RMSNorm."""
    return _llm("Phi3Config", "Phi3Model", scale, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def mistral(scale: int = 1) -> tuple[torch.nn.Module, Inputs]:
    """transformers' Mistral: grouped-query attention, SwiGLU, RMSNorm."""
    return _llm("MistralConfig", "MistralModel", scale)


def gemma2(scale: int = 1) -> tuple[torch.nn.Module, Inputs]:
    """transformers' Gemma 2: logit soft-capping, sliding-window layers, GELU-tanh MLP."""
    return _llm("Gemma2Config", "Gemma2Model", scale, head_dim=8 * scale)


FAMILIES: dict[str, Family] = {"demo": demo, "ltx": ltx, "sd3": sd3, "llama": llama, "cogvideox": cogvideox,
                               "hunyuan_video": hunyuan_video, "pixart": pixart, "phi3": phi3, "mistral": mistral,
                               "gemma2": gemma2}
DIT = ("cogvideox", "hunyuan_video", "pixart")  # the families of issue 45 (bench/fusion.py)
LLM = ("phi3", "mistral", "gemma2")


def pixart_pipeline(steps: int = 6) -> tuple[Any, Callable[[int], dict[str, Any]]]:
    """diffusers' PixArt-Sigma pipeline, whole, from tiny random components (no tokenizer or
    text encoder: each request brings its prompt embeddings and attention masks, new
    tensors per request, as the encoder would make them), and `request(i)`: the keyword
    arguments of request `i` (`steps` denoising steps with classifier-free guidance, latents
    out). The pipeline concatenates the negative and positive embeddings and masks anew for
    each request: a compiled transformer sees new tensors of one layout per request."""
    import diffusers

    transformer = diffusers.PixArtTransformer2DModel(
        sample_size=8, num_layers=2, num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
        cross_attention_dim=16, caption_channels=32, patch_size=2, norm_type="ada_norm_single",
        use_additional_conditions=False)
    vae = diffusers.AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                                  up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=8,
                                  layers_per_block=1)
    pipe = diffusers.PixArtSigmaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                                         scheduler=diffusers.DPMSolverMultistepScheduler())
    pipe.set_progress_bar_config(disable=True)

    def request(i: int) -> dict[str, Any]:
        g = _g(i)
        return {"prompt_embeds": torch.randn(1, 5, 32, generator=g), "negative_prompt": None,
                "prompt_attention_mask": torch.ones(1, 5, dtype=torch.long),
                "negative_prompt_embeds": torch.randn(1, 5, 32, generator=g),
                "negative_prompt_attention_mask": torch.ones(1, 5, dtype=torch.long),
                "num_inference_steps": steps, "guidance_scale": 4.5, "height": 16, "width": 16,
                "output_type": "latent", "use_resolution_binning": False, "generator": _g(100 + i)}

    return pipe, request


def first_tensor(out: Any) -> torch.Tensor:
    """A model's first output tensor (through tuples and transformers' output classes)."""
    while not isinstance(out, torch.Tensor):
        out = out.to_tuple()[0] if hasattr(out, "to_tuple") else out[0]
    return out
