"""The elementwise parts of the two architectures, written as Hugging Face computes them (the same
operations in the same order and dtypes, so the same roundings) but into given buffers.

Every function writes into tensors it is handed (views of the workspace) or in place; only
LayerNorm's output and RMSNorm's float32 intermediates are torch's own (torch has no ``out=``
LayerNorm), and under CUDA-graph capture those live in the graph's private memory pool.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["gelu_new_", "rope", "rms_norm", "layer_norm", "rope_tables", "softmax"]

_GELU_C = math.sqrt(2.0 / math.pi)


def gelu_new_(x: torch.Tensor, t: torch.Tensor) -> None:
    """x <- 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3))), in place, with ``t`` (x's
    shape) as scratch. The operations of transformers' NewGELUActivation, one for one (each
    reordering used is an exact commutation), so the bits are the same."""
    torch.pow(x, 3.0, out=t)
    t.mul_(0.044715)
    t.add_(x)
    t.mul_(_GELU_C)
    t.tanh_()
    t.add_(1.0)
    x.mul_(0.5)
    x.mul_(t)


def rope(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, a: torch.Tensor,
         b: torch.Tensor) -> None:
    """dst <- src * cos + rotate_half(src) * sin (Llama's RoPE, rotate_half(x) = cat(-x2, x1)).

    src, dst, a, b: [..., head_dim] of one shape (a, b scratch); cos, sin broadcast to it. The
    first half is src1 * cos1 - src2 * sin1 and the second src2 * cos2 + src1 * sin2, each product
    and sum rounded as transformers' apply_rotary_pos_emb rounds it (a + (-b) is a - b exactly).
    """
    half = src.shape[-1] // 2
    torch.mul(src, cos, out=a)
    torch.mul(src[..., half:], sin[..., :half], out=b[..., :half])
    torch.mul(src[..., :half], sin[..., half:], out=b[..., half:])
    torch.sub(a[..., :half], b[..., :half], out=dst[..., :half])
    torch.add(a[..., half:], b[..., half:], out=dst[..., half:])


def rope_tables(inv_freq: torch.Tensor, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [length, head_dim] for positions 0..length-1, as LlamaRotaryEmbedding makes them:
    float32 position x inv_freq, the halves repeated, cos / sin (attention scaling 1), cast."""
    positions = torch.arange(length, device=inv_freq.device)
    freqs = positions[:, None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """out <- weight * (x * rsqrt(mean(x**2) + eps)) with the statistics in float32, as
    LlamaRMSNorm computes it; returns out."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    torch.mul(weight, h.to(x.dtype), out=out)
    return out


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """nn.LayerNorm's output (a torch tensor: there is no out= LayerNorm)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def softmax(scores: torch.Tensor, out: torch.Tensor, float32_first: bool) -> None:
    """out <- softmax over the last dimension. ``float32_first``: in float32 then cast (Llama's
    softmax(dtype=float32).to(dtype)); otherwise in the scores' dtype (GPT-2's)."""
    if not float32_first or scores.dtype == torch.float32:
        torch.softmax(scores, -1, out=out)
    else:
        out.copy_(torch.softmax(scores, -1, dtype=torch.float32))
