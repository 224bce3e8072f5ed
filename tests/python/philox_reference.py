"""Independent NumPy reference of the dropout random stream (DESIGN.md, "Kernels").

Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11) and the way
cuRAND's device API uses it:

* ``curand_init(seed, subsequence, offset)`` on a ``curandStatePhilox4_32_10`` sets the key to
  ``(lo32(seed), hi32(seed))`` and the 128-bit counter to
  ``(lo32(offset // 4), hi32(offset // 4), lo32(subsequence), hi32(subsequence))``, and starts at
  output ``offset % 4`` of that counter's block.
* ``curand_uniform4`` returns the next four 32-bit outputs (continuing into the block of counter+1,
  with a carry through all 128 bits, when ``offset % 4 != 0``), each mapped to a float32 by
  ``_curand_uniform(r) = r * 2**-32 + 2**-33`` evaluated in float32: ``r`` is first rounded to
  float32 (round to nearest even), the product is exact, the sum is rounded once. So u lies in
  (0, 1] and is 1.0 for r >= 2**32 - 128.

Dropout keeps element ``i`` iff ``u_i > p`` (``p`` as float32), where ``u_i`` is output ``i % 4``
of ``curand_uniform4`` after ``curand_init(seed, i // 4, offset)``; kept elements are scaled by
``dropout_scale(p)``.

Everything is vectorised (uint64 arithmetic on arrays, processed in slices to bound memory), so
masks of 10**7..10**8 elements take seconds. Nothing here imports inferctx or needs a GPU.
"""

from __future__ import annotations

import math

import numpy as np

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)

TWO_POW_M32 = np.float32(2.0**-32)
TWO_POW_M33 = np.float32(2.0**-33)

# Philox blocks computed per slice in the vectorised helpers (4 uint64 arrays of this length).
_SLICE = 1 << 21


def philox4x32(counter, key, rounds: int = 10) -> np.ndarray:
    """Philox4x32-R of ``counter`` (shape (..., 4)) under ``key`` (shape (2,) or (..., 2)).

    Returns uint32 of shape (..., 4). ``rounds`` is 10 for Philox4x32-10 (the one cuRAND uses).
    """
    c = np.asarray(counter, dtype=np.uint64)
    k = np.asarray(key, dtype=np.uint64)
    if c.shape[-1:] != (4,) or k.shape[-1:] != (2,):
        raise ValueError("counter must have shape (..., 4) and key shape (..., 2)")
    x, y, z, w = (c[..., i] & _MASK32 for i in range(4))
    k0, k1 = k[..., 0] & _MASK32, k[..., 1] & _MASK32
    m0, m1 = np.uint64(PHILOX_M0), np.uint64(PHILOX_M1)
    w0, w1 = np.uint64(PHILOX_W0), np.uint64(PHILOX_W1)
    for r in range(rounds):
        if r:
            k0 = (k0 + w0) & _MASK32
            k1 = (k1 + w1) & _MASK32
        p0 = x * m0  # 32 x 32 -> 64 bits: exact in uint64
        p1 = z * m1
        x, y, z, w = (p1 >> _SHIFT32) ^ y ^ k0, p1 & _MASK32, (p0 >> _SHIFT32) ^ w ^ k1, p0 & _MASK32
    return np.stack(np.broadcast_arrays(x, y, z, w), axis=-1).astype(np.uint32)


def _split64(v) -> tuple[np.ndarray, np.ndarray]:
    v = np.asarray(v, dtype=np.uint64)
    return v & _MASK32, v >> _SHIFT32


def curand_init_counter(subsequence, offset: int) -> np.ndarray:
    """The counter block curand_init(seed, subsequence, offset) starts in: shape (..., 4), uint64.

    Its first output used is number ``offset % 4`` of that block.
    """
    if not 0 <= int(offset) < 2**64:
        raise ValueError("offset must be in [0, 2**64)")
    q_lo, q_hi = _split64(np.uint64(int(offset) // 4))
    s_lo, s_hi = _split64(subsequence)
    q_lo, q_hi, s_lo, s_hi = np.broadcast_arrays(q_lo, q_hi, s_lo, s_hi)
    return np.stack([q_lo, q_hi, s_lo, s_hi], axis=-1)


def _increment128(counter: np.ndarray) -> np.ndarray:
    """counter + 1 modulo 2**128 (words least significant first), as cuRAND's Philox_State_Incr."""
    out = counter.copy()
    carry = np.ones(out.shape[:-1], dtype=bool)
    for i in range(4):
        word = (out[..., i] + carry.astype(np.uint64)) & _MASK32
        carry = carry & (word == 0)
        out[..., i] = word
    return out


def curand_philox_uint4(seed: int, subsequence, offset: int) -> np.ndarray:
    """curand4() right after curand_init(seed, subsequence, offset): uint32 array (..., 4)."""
    key = np.array(_split64(np.uint64(int(seed))), dtype=np.uint64)
    counter = curand_init_counter(subsequence, offset)
    first = philox4x32(counter, key)
    s = int(offset) % 4
    if s == 0:
        return first
    second = philox4x32(_increment128(counter), key)
    return np.concatenate([first[..., s:], second[..., :s]], axis=-1)


def curand_uniform_from_bits(bits) -> np.ndarray:
    """cuRAND's _curand_uniform in float32: fl(fl(float32(r)) * 2**-32 + 2**-33)."""
    r = np.asarray(bits, dtype=np.uint32).astype(np.float32)  # round to nearest even
    return (r * TWO_POW_M32 + TWO_POW_M33).astype(np.float32)


def curand_uniform4(seed: int, subsequence, offset: int) -> np.ndarray:
    """curand_uniform4 right after curand_init(seed, subsequence, offset): float32 (..., 4)."""
    return curand_uniform_from_bits(curand_philox_uint4(seed, subsequence, offset))


def dropout_scale(p: float) -> np.float32:
    """The factor applied to kept elements: float32(1 / (1 - p)) worked out in double from the
    double p (one rounding, as torch rounds a Python float scalar), 0 for p == 1."""
    p = float(p)
    if p == 1.0:
        return np.float32(0.0)
    return np.float32(1.0 / (1.0 - p))


def keep_threshold(p: float) -> int:
    """Smallest 32-bit output r whose uniform exceeds p (2**32 when none does): keep iff r >= it."""
    p32 = np.float32(p)
    lo, hi = 0, 2**32
    while lo < hi:
        mid = (lo + hi) // 2
        if curand_uniform_from_bits(np.uint32(mid)) > p32:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _check_offset(offset: int) -> None:
    if int(offset) % 4 != 0:
        raise ValueError("dropout offsets are multiples of 4 (they come from increment_offset(4))")


def dropout_uniforms(seed: int, offset: int, n: int | None = None, *, indices=None) -> np.ndarray:
    """u_i for elements 0..n-1 (or the given element indices): float32 array."""
    _check_offset(offset)
    if (n is None) == (indices is None):
        raise ValueError("give exactly one of n and indices")
    key = np.array(_split64(np.uint64(int(seed))), dtype=np.uint64)
    if indices is None:
        n = int(n)
        blocks = math.ceil(n / 4)
        out = np.empty(blocks * 4, dtype=np.float32)
        for start in range(0, blocks, _SLICE):
            stop = min(blocks, start + _SLICE)
            sub = np.arange(start, stop, dtype=np.uint64)
            bits = philox4x32(curand_init_counter(sub, offset), key)
            out[start * 4 : stop * 4] = curand_uniform_from_bits(bits).reshape(-1)
        return out[:n]
    idx = np.asarray(indices, dtype=np.uint64).reshape(-1)
    out = np.empty(idx.shape, dtype=np.float32)
    for start in range(0, idx.size, _SLICE):
        part = idx[start : start + _SLICE]
        bits = philox4x32(curand_init_counter(part // np.uint64(4), offset), key)
        lane = (part % np.uint64(4)).astype(np.intp)
        out[start : start + part.size] = curand_uniform_from_bits(bits[np.arange(part.size), lane])
    return out


def dropout_keep(seed: int, offset: int, p: float, n: int | None = None, *, indices=None) -> np.ndarray:
    """Keep decisions (bool) of elements 0..n-1, or of the given element indices."""
    return dropout_uniforms(seed, offset, n, indices=indices) > np.float32(p)


def pack_bits(keep) -> np.ndarray:
    """The "bits" mask layout: bit i % 32 of uint32 word i // 32, zero past the end."""
    keep = np.asarray(keep, dtype=bool).reshape(-1)
    words = math.ceil(keep.size / 32)
    packed = np.packbits(keep, bitorder="little")
    buf = np.zeros(words * 4, dtype=np.uint8)
    buf[: packed.size] = packed
    return buf.view("<u4").astype(np.uint32)


def unpack_bits(words, n: int) -> np.ndarray:
    """Inverse of pack_bits: the first n keep decisions of a "bits" mask."""
    raw = np.asarray(words, dtype="<u4").view(np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(bool)


def dropout_float32(x32, keep, p: float) -> np.ndarray:
    """y in float32 before the final rounding: x * scale where kept (one float32 product), else +0."""
    x32 = np.asarray(x32, dtype=np.float32)
    keep = np.asarray(keep, dtype=bool).reshape(x32.shape)
    scale = dropout_scale(p)
    return np.where(keep, x32 * scale, np.float32(0.0)).astype(np.float32)
