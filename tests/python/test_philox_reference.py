"""The NumPy Philox / cuRAND reference (philox_reference.py) against published and library values.

CPU only: no GPU, no torch, no inferctx. The GPU tests of dropout trust this reference, so it is
checked here against values that do not come from it: the Random123 known-answer vectors,
outputs of cuRAND's own curand_kernel.h code (curand_init + curand4 / curand_uniform4, compiled
for the host), float32 rounding worked out by hand, and, where the library is installed, cuRAND's
host Philox generator itself.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
import struct
import sys

import numpy as np
import pytest

import philox_reference as ref

# Random123 kat_vectors, philox4x32 with 10 rounds: (counter, key, expected output).
RANDOM123_KAT = [
    ((0x00000000, 0x00000000, 0x00000000, 0x00000000), (0x00000000, 0x00000000),
     (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF),
     (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]

# cuRAND 13 curand_kernel.h run on the host: curand_init(seed, subsequence, offset) then curand4
# (raw outputs) and, from a fresh curand_init, curand_uniform4 (float32 bit patterns).
# Offsets include counters whose low word is at 2^32 - 2, 2^32 - 1 and 2^32 (offset / 4), an
# offset that is not a multiple of 4 (the four outputs straddle two blocks) and one whose second
# block's counter carries from word 0 into word 1.
CURAND_KERNEL_VECTORS = [
    (0x0, 0x0, 0x0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8),
     (0x3ECC4FD2, 0x3F6169C6, 0x3F3C57AC, 0x3F1B00DC)),
    (0x123456789ABCDEF, 0x5, 0x8, (0x644AF2C9, 0x0AAB6850, 0x81064203, 0x05721106),
     (0x3EC895E6, 0x3D2AB685, 0x3F010642, 0x3CAE4221)),
    (0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFC,
     (0x8C5F4338, 0x4A57523D, 0x7E300CB1, 0x411FCEFD), (0x3F0C5F43, 0x3E94AEA4, 0x3EFC6019, 0x3E823F9E)),
    (0x2A, 0x0, 0x3FFFFFFF8, (0x81B97A34, 0xAC88045C, 0x962E881C, 0x41BB3828),
     (0x3F01B97A, 0x3F2C8804, 0x3F162E88, 0x3E837670)),
    (0x2A, 0x1, 0x3FFFFFFFC, (0x9D67F26D, 0x63101B92, 0x702F8C60, 0x1F83D5E9),
     (0x3F1D67F2, 0x3EC62037, 0x3EE05F19, 0x3DFC1EAF)),
    (0x2A, 0x2, 0x400000000, (0x37E0F5A2, 0x291C60E3, 0x3CFECF69, 0xB640AB01),
     (0x3E5F83D7, 0x3E247184, 0x3E73FB3E, 0x3F3640AB)),
    (0x2A, 0xFFFFFFFF, 0x4, (0x0A264676, 0x8CFF97E1, 0xC803A5AA, 0x387B9F1A),
     (0x3D226467, 0x3F0CFF98, 0x3F4803A6, 0x3E61EE7C)),
    (0x2A, 0x100000000, 0x4, (0x1F858D22, 0x5A936FF5, 0x261EF70D, 0x92DD60BF),
     (0x3DFC2C69, 0x3EB526E0, 0x3E187BDC, 0x3F12DD61)),
    (0x2A, 0x200000000, 0x400000004, (0x072E4E7F, 0x7AE0C89D, 0x38A55FE0, 0x55919560),
     (0x3CE5C9D0, 0x3EF5C191, 0x3E629580, 0x3EAB232B)),
    (0x7, 0x3, 0x6, (0x124039F2, 0x85AEABE4, 0x5F760812, 0xEAFF1270),
     (0x3D9201D0, 0x3F05AEAC, 0x3EBEEC10, 0x3F6AFF12)),
    (0x7, 0x3, 0x3FFFFFFFF, (0x5FE1F5CA, 0xFA43867A, 0x30BCECAB, 0x40122B19),
     (0x3EBFC3EC, 0x3F7A4386, 0x3E42F3B3, 0x3E802456)),
    (0x9E3779B97F4A7C15, 0x75BCD15, 0x8000000000000000, (0xDBF0DA07, 0x2F391B02, 0x91B924EF, 0x725F3914),
     (0x3F5BF0DA, 0x3E3CE46C, 0x3F11B925, 0x3EE4BE72)),
]

# _curand_uniform(r) as float32 bits, at the edges of float32 rounding (by hand: r is rounded to
# 24 significant bits first, then r * 2^-32 + 2^-33 is rounded once).
CURAND_UNIFORM_EDGES = [
    (0x00000000, 0x2F000000),  # 2^-33
    (0x00000001, 0x2FC00000),  # 1.5 * 2^-32
    (0x0000007F, 0x32FF0000),
    (0x00000080, 0x33008000),
    (0x00FFFFFF, 0x3B800000),  # 2^24 - 1 + 1/2 rounds to 2^24 in the sum
    (0x01000000, 0x3B800000),
    (0x01000001, 0x3B800000),  # 2^24 + 1 rounds to 2^24 (tie to even)
    (0x01000003, 0x3B800002),  # 2^24 + 3 rounds to 2^24 + 4
    (0x7FFFFFFF, 0x3F000000),  # 0.5
    (0x80000000, 0x3F000000),
    (0xFFFFFF7F, 0x3F7FFFFF),  # 1 - 2^-24
    (0xFFFFFF80, 0x3F800000),  # 1.0: curand_uniform includes 1
    (0xFFFFFFFF, 0x3F800000),
]


def f32(v: float) -> float:
    """v rounded to float32 (round to nearest even), as a Python float."""
    return struct.unpack("<f", struct.pack("<f", v))[0]


def scalar_philox(counter, key):
    """Philox4x32-10 with Python integers, written independently of the vectorised reference."""
    x, y, z, w = counter
    k0, k1 = key
    for r in range(10):
        if r:
            k0 = (k0 + ref.PHILOX_W0) & 0xFFFFFFFF
            k1 = (k1 + ref.PHILOX_W1) & 0xFFFFFFFF
        a = ref.PHILOX_M0 * x
        b = ref.PHILOX_M1 * z
        x, y, z, w = (b >> 32) ^ y ^ k0, b & 0xFFFFFFFF, (a >> 32) ^ w ^ k1, a & 0xFFFFFFFF
    return x, y, z, w


def scalar_keep(seed: int, offset: int, i: int, p: float) -> bool:
    """Element i's keep decision from the DESIGN.md definition, one element at a time."""
    q, sub = offset // 4, i // 4
    out = scalar_philox((q & 0xFFFFFFFF, q >> 32, sub & 0xFFFFFFFF, sub >> 32),
                        (seed & 0xFFFFFFFF, seed >> 32))
    r = out[i % 4]
    u = f32(f32(float(r)) * 2.0**-32 + 2.0**-33)  # the double sum is exact: one rounding
    return u > f32(p)


def test_philox_matches_random123_known_answers():
    for counter, key, expected in RANDOM123_KAT:
        got = ref.philox4x32(np.array(counter, dtype=np.uint64), np.array(key, dtype=np.uint64))
        assert tuple(int(v) for v in got) == expected
        assert scalar_philox(counter, key) == expected


def test_philox_vectorised_over_many_counters():
    counters = np.array([kat[0] for kat in RANDOM123_KAT], dtype=np.uint64)
    keys = np.array([kat[1] for kat in RANDOM123_KAT], dtype=np.uint64)
    got = ref.philox4x32(counters, keys)
    assert got.dtype == np.uint32 and got.shape == (3, 4)
    assert [tuple(int(v) for v in row) for row in got] == [kat[2] for kat in RANDOM123_KAT]


@pytest.mark.parametrize("seed,subsequence,offset,raw,uniform_bits", CURAND_KERNEL_VECTORS)
def test_curand_init_then_curand4_and_uniform4(seed, subsequence, offset, raw, uniform_bits):
    got = ref.curand_philox_uint4(seed, np.uint64(subsequence), offset)
    assert tuple(int(v) for v in got) == raw
    u = ref.curand_uniform4(seed, np.uint64(subsequence), offset)
    assert u.dtype == np.float32
    assert tuple(int(v) for v in u.view(np.uint32)) == uniform_bits


def test_curand_init_counter_layout():
    # offset / 4 fills counter words 0-1, the subsequence words 2-3.
    c = ref.curand_init_counter(np.uint64(0x0000000500000007), 4 * 0x0000000300000002 + 3)
    assert [int(v) for v in c] == [0x00000002, 0x00000003, 0x00000007, 0x00000005]


def test_increment_carries_through_all_words():
    c = np.array([0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0x00000001], dtype=np.uint64)
    assert [int(v) for v in ref._increment128(c)] == [0, 0, 0, 2]
    c = np.array([0xFFFFFFFE, 0x5, 0x6, 0x7], dtype=np.uint64)
    assert [int(v) for v in ref._increment128(c)] == [0xFFFFFFFF, 0x5, 0x6, 0x7]


@pytest.mark.parametrize("bits,expected", CURAND_UNIFORM_EDGES)
def test_curand_uniform_rounding(bits, expected):
    got = ref.curand_uniform_from_bits(np.array([bits], dtype=np.uint32))
    assert int(got.view(np.uint32)[0]) == expected
    assert struct.unpack("<I", struct.pack("<f", f32(f32(float(bits)) * 2.0**-32 + 2.0**-33)))[0] == expected


OFFSETS = [0, 4, 4 * (2**32 - 2), 4 * (2**32 - 1), 4 * 2**32, 4 * (2**32 + 1), 2**63, 2**64 - 4]


@pytest.mark.parametrize("offset", OFFSETS)
def test_vectorised_keep_equals_scalar_definition(offset):
    seed, p, n = 0x0123456789ABCDEF, 0.37, 203
    keep = ref.dropout_keep(seed, offset, p, n)
    assert keep.dtype == bool and keep.shape == (n,)
    assert keep.tolist() == [scalar_keep(seed, offset, i, p) for i in range(n)]


def test_keep_at_large_element_indices():
    # Elements whose subsequence i / 4 needs the high counter word (i >= 2^34).
    seed, offset, p = 99, 4 * (2**32 - 1), 0.5
    idx = np.array([0, 2**31 - 1, 2**32 + 5, 2**34 - 1, 2**34, 2**34 + 3, 2**40 + 2, 2**62 + 1], dtype=np.uint64)
    got = ref.dropout_keep(seed, offset, p, indices=idx)
    assert got.tolist() == [scalar_keep(seed, offset, int(i), p) for i in idx]


def test_indices_path_equals_prefix_path_for_millions_of_elements():
    seed, offset, p, n = 2024, 4 * (2**32 - 2), 0.1, 4_000_003
    keep = ref.dropout_keep(seed, offset, p, n)
    rng = np.random.default_rng(0)
    idx = np.concatenate([rng.integers(0, n, 5000), np.arange(n - 40, n)]).astype(np.uint64)
    assert np.array_equal(ref.dropout_keep(seed, offset, p, indices=idx), keep[idx.astype(np.int64)])
    rate = keep.mean()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma


def test_offsets_must_be_multiples_of_four():
    with pytest.raises(ValueError, match="multiples of 4"):
        ref.dropout_keep(1, 6, 0.5, 10)


@pytest.mark.parametrize(
    "p,expected",
    [
        (0.0, 0),  # u >= 2^-33 > 0: everything kept
        (2.0**-33, 1),  # u(0) == 2^-33 is not > p; u(1) is
        (0.5, 2**31 + 129),  # float(r) must reach 2^31 + 256 (2^31 + 128 ties down to 2^31)
        (f32(1 - 2.0**-24), 2**32 - 128),  # only u == 1.0 exceeds it
        (1.0, 2**32),  # nothing kept
    ],
)
def test_keep_threshold_by_hand(p, expected):
    assert ref.keep_threshold(p) == expected


@pytest.mark.parametrize("p", [0.1, 0.25, 1 / 3, 0.5, 0.9, 0.999, 1e-7, 2.0**-30])
def test_threshold_partitions_exactly_like_the_float_comparison(p):
    t = ref.keep_threshold(p)
    rng = np.random.default_rng(1)
    r = np.concatenate([
        rng.integers(0, 2**32, 200_000, dtype=np.uint64),
        np.arange(max(0, t - 600), min(2**32, t + 600), dtype=np.uint64),
    ]).astype(np.uint32)
    u = ref.curand_uniform_from_bits(r)
    assert np.array_equal(u > np.float32(p), r.astype(np.uint64) >= t)


def test_pack_bits_layout():
    keep = np.zeros(70, dtype=bool)
    keep[[0, 3, 31, 32, 63, 64, 69]] = True
    words = ref.pack_bits(keep)
    assert words.dtype == np.uint32 and words.shape == (3,)
    assert int(words[0]) == (1 << 0) | (1 << 3) | (1 << 31)
    assert int(words[1]) == (1 << 0) | (1 << 31)
    assert int(words[2]) == (1 << 0) | (1 << 5)  # bits past element 69 are 0
    assert np.array_equal(ref.unpack_bits(words, 70), keep)
    assert ref.pack_bits(np.zeros(0, dtype=bool)).shape == (0,)


def test_dropout_scale():
    assert ref.dropout_scale(0.5) == np.float32(2.0)
    assert ref.dropout_scale(0.0) == np.float32(1.0)
    assert ref.dropout_scale(1.0) == np.float32(0.0)
    p32 = float(np.float32(0.1))
    assert ref.dropout_scale(0.1) == np.float32(1.0 / (1.0 - p32))
    assert ref.dropout_scale(0.1).dtype == np.float32
    # Worked out from the double p, rounded once: 1 / (1 - 0.9) = 10.000000000000002 -> 10.0f,
    # where p rounded to float32 first (0.89999998) would give 9.999998f.
    assert ref.dropout_scale(0.9).view(np.uint32) == np.float32(10.0).view(np.uint32)
    assert np.float32(1.0 / (1.0 - float(np.float32(0.9)))) != np.float32(10.0)


def test_dropout_float32_signs_and_zeros():
    x = np.array([1.5, -2.0, -0.0, 3.0, -4.0], dtype=np.float32)
    keep = np.array([True, True, True, False, False])
    y = ref.dropout_float32(x, keep, 0.5)
    assert y.dtype == np.float32
    assert y.view(np.uint32).tolist() == np.array([3.0, -4.0, -0.0, 0.0, 0.0], dtype=np.float32).view(np.uint32).tolist()


# ---- cuRAND's host generator, where the library is installed (a CPU-only check) ----------------

def _find_libcurand():
    candidates = []
    for root in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/curand/lib", "nvidia/cu12/lib"):
            candidates += sorted(glob.glob(os.path.join(root, sub, "libcurand.so*")))
    candidates += ["libcurand.so", "libcurand.so.10"]
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


CURAND_RNG_PSEUDO_PHILOX4_32_10 = 161


@pytest.fixture(scope="module")
def libcurand():
    lib = _find_libcurand()
    if lib is None:
        pytest.skip("libcurand not found (pip install nvidia-curand)")
    return lib


def _host_generate(lib, seed: int, offset: int, n: int, uniform: bool) -> np.ndarray:
    gen = ctypes.c_void_p()
    status = lib.curandCreateGeneratorHost(ctypes.byref(gen), CURAND_RNG_PSEUDO_PHILOX4_32_10)
    if status != 0:
        pytest.skip(f"curandCreateGeneratorHost failed with status {status}")
    try:
        assert lib.curandSetPseudoRandomGeneratorSeed(gen, ctypes.c_ulonglong(seed)) == 0
        assert lib.curandSetGeneratorOffset(gen, ctypes.c_ulonglong(offset)) == 0
        out = np.zeros(n, dtype=np.float32 if uniform else np.uint32)
        fn = lib.curandGenerateUniform if uniform else lib.curandGenerate
        assert fn(gen, out.ctypes.data_as(ctypes.c_void_p), ctypes.c_size_t(n)) == 0
    finally:
        lib.curandDestroyGenerator(gen)
    return out


@pytest.mark.parametrize("seed,offset", [(0, 0), (0xDEADBEEF12345678, 4 * 65536 * 3 + 8), (7, 2**40 + 12)])
def test_against_curand_host_generator(libcurand, seed, offset):
    # The host generator lays its stream out as 65536 subsequences advanced together: output m
    # (counted from the generator offset) is word m % 4 of block k = m // 4, whose counter is
    # (k // 65536, 0, k % 65536, 0). Its uniforms use the same _curand_uniform.
    n = 1 << 20
    bits = _host_generate(libcurand, seed, offset, n, uniform=False)
    m = np.arange(n, dtype=np.uint64) + np.uint64(offset)
    k = m // np.uint64(4)
    zero = np.zeros_like(k)
    counter = np.stack([k >> np.uint64(16), zero, k & np.uint64(0xFFFF), zero], axis=-1)
    key = np.array([seed & 0xFFFFFFFF, seed >> 32], dtype=np.uint64)
    expected = ref.philox4x32(counter, key)[np.arange(n), (m % np.uint64(4)).astype(np.intp)]
    assert np.array_equal(bits, expected)
    uniforms = _host_generate(libcurand, seed, offset, n, uniform=True)
    assert np.array_equal(uniforms.view(np.uint32), ref.curand_uniform_from_bits(bits).view(np.uint32))
