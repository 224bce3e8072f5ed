"""inferctx's fused elementwise kernels for the decoder's GPU step, each used only where it gives
the bits of the torch sequence it replaces on this torch build and device.

The step is written with transformers' elementwise operations one for one (``_layers``), so that
its bits equal transformers'. Three of those sequences are many small kernels per layer: GELU's
eight, RoPE's five per projection, SiLU and the product with the up projection. The kernels in
``cuda/src/decoder_ops.cu`` compute each sequence in one pass, rounding every intermediate where
torch's kernels do. Whether torch computes them that way is a property of the torch build (how its
``pow`` rounds ``x**3``, which ``tanhf`` and ``expf`` it calls), so before the first use on a
device and dtype, ``fused_ops`` runs both and keeps a kernel only if every result's bits match
(NaN matching NaN): GELU and SiLU over every 16-bit pattern (float16, bfloat16) or a million
values with the edge cases (float32), RoPE over random rows in the decoder's layouts (a prompt's
rows, and one decode row broadcast). A kernel that does not match is not used: the decoder then
runs torch's sequence for it, and ``ReferenceDecoder.fused_kernels`` says which are in use.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _core
from ..dtypes import BFLOAT16, FLOAT16, FLOAT32
from . import _layers as L

__all__ = ["FusedOps", "fused_ops"]

_CODES = {torch.float32: FLOAT32, torch.float16: FLOAT16, torch.bfloat16: BFLOAT16}  # inferctx::DType
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_CUBE_MODES = (0, 1, 2)  # decoder_ops.hpp CubeRounding, most likely first

_verified: dict[tuple[int, torch.dtype], "FusedOps"] = {}


class FusedOps:
    """The fused kernels verified for one device and dtype. ``cube`` is the x**3 rounding that
    matched torch's (None: GELU is not fused); ``has_silu_mul`` and ``has_rope`` whether those
    matched."""

    def __init__(self, device: int, dtype: torch.dtype, cube: int | None, silu_mul: bool, rope: bool) -> None:
        self.device = device
        self.dtype = dtype
        self.code = _CODES[dtype]
        self.cube = cube
        self.has_silu_mul = silu_mul
        self.has_rope = rope

    @property
    def names(self) -> tuple[str, ...]:
        """The fused kernels in use, by the sequence each replaces."""
        return tuple(name for name, on in (("gelu_new", self.cube is not None), ("silu_mul", self.has_silu_mul),
                                           ("rope", self.has_rope)) if on)

    def gelu_new_(self, x: torch.Tensor, scratch: torch.Tensor) -> None:
        """L.gelu_new_(x, scratch), in one kernel when verified (x contiguous)."""
        if self.cube is None or x.dtype != self.dtype or not x.is_contiguous():
            L.gelu_new_(x, scratch)
            return
        _core._fused_gelu_new(x.data_ptr(), x.numel(), self.code, self.cube, None, self.device)

    def silu_mul_(self, gate: torch.Tensor, up: torch.Tensor) -> None:
        """gate <- silu(gate) * up (F.silu in place, then mul_), gate and up [rows, cols] with unit
        column strides."""
        if not (self.has_silu_mul and gate.dim() == 2 and gate.shape == up.shape and gate.stride(1) == 1
                and up.stride(1) == 1 and gate.dtype == self.dtype and up.dtype == self.dtype):
            F.silu(gate, inplace=True)
            gate.mul_(up)
            return
        rows, cols = gate.shape
        _core._fused_silu_mul(gate.data_ptr(), up.data_ptr(), rows, cols, gate.stride(0), up.stride(0), self.code,
                              None, self.device)

    def rope(self, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, a: torch.Tensor,
             b: torch.Tensor) -> None:
        """L.rope(src, cos, sin, dst, a, b): src, dst [batch, tokens, heads, head_dim] with unit last
        strides; cos, sin [1, tokens or 1, 1, head_dim] views of contiguous rows."""
        if not (self.has_rope and all(t.dtype == self.dtype for t in (src, cos, sin, dst)) and src.dim() == 4 and src.shape == dst.shape and src.stride(3) == 1
                and dst.stride(3) == 1 and cos.dim() == 4 and cos.shape == sin.shape
                and cos.stride() == sin.stride() and cos.shape[-1] == src.shape[-1] and cos.stride(-1) == 1
                and cos.shape[0] == 1 and cos.shape[2] == 1 and cos.shape[1] in (1, src.shape[1])):
            L.rope(src, cos, sin, dst, a, b)
            return
        _rope_kernel(src, cos, sin, dst, self.code, self.device)


def _rope_kernel(src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dst: torch.Tensor, code: int,
                 device: int) -> None:
    """The fused RoPE of src [batch, tokens, heads, head_dim] into dst with cos / sin views
    [1, tokens or 1, 1, head_dim] of contiguous rows (one row: broadcast)."""
    batch, tokens, heads, head_dim = src.shape
    cs = cos.stride(1) if cos.shape[1] > 1 else 0
    _core._fused_rope(src.data_ptr(), dst.data_ptr(), cos.data_ptr(), sin.data_ptr(), batch, tokens, heads,
                      head_dim, tuple(src.stride()[:3]), tuple(dst.stride()[:3]), cs, code, None, device)


def _bits_equal(got: torch.Tensor, want: torch.Tensor) -> bool:
    same = got.view(_INT_VIEW[got.dtype]) == want.view(_INT_VIEW[want.dtype])
    return bool((same | (torch.isnan(got) & torch.isnan(want))).all())


def _samples(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Every bit pattern of a 16-bit type; for float32 a million values over many magnitudes and
    the edge cases (zeros, infinities, NaN, subnormals, the largest finite values)."""
    if dtype != torch.float32:
        return torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(dtype)
    g = torch.Generator(device=device).manual_seed(20261203)
    x = torch.randn(1 << 20, generator=g, device=device)
    x = x * torch.pow(10.0, torch.randint(-8, 9, (1 << 20,), generator=g, device=device).float())
    info = torch.finfo(torch.float32)
    edge = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny, -info.tiny,
                         info.tiny / 8, info.max, -info.max, 1.0, -1.0, 0.5], device=device)
    return torch.cat([x, edge])


def _check_gelu(x: torch.Tensor, device: int) -> int | None:
    want = x.clone()
    L.gelu_new_(want, torch.empty_like(want))
    for cube in _CUBE_MODES:
        got = x.clone()
        _core._fused_gelu_new(got.data_ptr(), got.numel(), _CODES[x.dtype], cube, None, device)
        if _bits_equal(got, want):
            return cube
    return None


def _check_silu_mul(x: torch.Tensor, device: int) -> bool:
    cols = 256
    rows = -(-x.numel() // cols)
    g = torch.Generator(device=x.device).manual_seed(7)
    m = torch.randn(rows, 2 * cols, generator=g, device=x.device).to(x.dtype)
    pad = torch.zeros(rows * cols - x.numel(), dtype=x.dtype, device=x.device)
    m[:, :cols] = torch.cat([x, pad]).view(rows, cols)
    want = m.clone()
    F.silu(want[:, :cols], inplace=True)
    want[:, :cols].mul_(want[:, cols:])
    _core._fused_silu_mul(m.data_ptr(), m[:, cols:].data_ptr(), rows, cols, 2 * cols, 2 * cols, _CODES[x.dtype],
                          None, device)
    return _bits_equal(m, want)


def _check_rope(dtype: torch.dtype, device: int) -> bool:
    dev = torch.device("cuda", device)
    g = torch.Generator(device=dev).manual_seed(11)
    batch, tokens, heads, kv, hd = 3, 5, 4, 2, 64
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=dev).float() / hd))
    cos_t, sin_t = L.rope_tables(inv_freq, 4096, dtype)
    ok = True
    for n, first in ((tokens, 0), (1, 4000)):  # a prompt's rows, and one decode position (broadcast)
        row = (heads + 2 * kv) * hd
        qkv = (torch.randn(batch * n, row, generator=g, device=dev) * 4).to(dtype)
        src = qkv[:, :heads * hd].view(batch, n, heads, hd)
        cos = cos_t[first:first + n].view(1, n, 1, hd)
        sin = sin_t[first:first + n].view(1, n, 1, hd)
        want = torch.empty(batch, heads, n, hd, dtype=dtype, device=dev).transpose(1, 2)
        L.rope(src, cos, sin, want, torch.empty_like(src, memory_format=torch.contiguous_format),
               torch.empty_like(src, memory_format=torch.contiguous_format))
        got = torch.empty(batch, heads, n, hd, dtype=dtype, device=dev).transpose(1, 2)
        _rope_kernel(src, cos, sin, got, _CODES[dtype], device)
        ok = ok and _bits_equal(got, want)
    return ok


def fused_ops(device: int, dtype: torch.dtype) -> FusedOps:
    """The fused kernels that reproduce torch's sequences bit for bit on ``device`` in ``dtype``
    (worked out once per device and dtype, on the current stream, then kept)."""
    key = (device, dtype)
    found = _verified.get(key)
    if found is None:
        with torch.cuda.device(device):
            x = _samples(dtype, torch.device("cuda", device))
            found = FusedOps(device, dtype, _check_gelu(x, device), _check_silu_mul(x, device),
                             _check_rope(dtype, device))
        _verified[key] = found
    return found


def unfused(device: int, dtype: torch.dtype) -> FusedOps:
    """No fused kernel: torch's sequences (ReferenceDecoder(fused=False))."""
    return FusedOps(device, dtype, None, False, False)
