"""inferctx.dropout and inferctx.apply_mask on the GPU, against the NumPy Philox reference.

The reference (philox_reference.py, itself checked in test_philox_reference.py) gives the keep
decision of every element for (seed, offset, p); the GPU mask must equal it bit for bit. y must
equal the defined arithmetic exactly: to_dtype(float32(x) * scale) where kept, +0 elsewhere, with
scale = float32(1 / (1 - p)) (see cuda/include/inferctx/dropout.hpp); for fp16 / bf16 that is also
within one rounding of x / (1 - p).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import inferctx
import philox_reference as ref
from inferctx.errors import ConfigError

pytestmark = pytest.mark.gpu

SIZES = [0, 1, 3, 4, 31, 32, 33, 1000, 1023, 1024, 1025, 4099, 65537, 1_000_003]
OFFSETS = [0, 4, 4 * (2**32 - 2), 4 * (2**32 - 1), 4 * 2**32, 4 * (2**32 + 1), 2**63, 2**64 - 4]
DTYPES = ["float32", "float16", "bfloat16"]
PS = [0.1, 0.5, 0.9, 0.25, 1e-6, 0.999]


def tdtype(torch, name):
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def to_torch(torch, view):
    return torch.from_dlpack(view)


def host_words(torch, view) -> np.ndarray:
    """A bits mask (uint32 words; int32 when dropout returned a torch tensor) on the host as a
    NumPy uint32 array."""
    t = to_torch(torch, view)
    assert t.dtype in (torch.uint32, torch.int32)
    return t.view(torch.int32).cpu().numpy().view(np.uint32)


def raw_bits(torch, t) -> np.ndarray:
    """Element bit patterns of a float tensor (uint32 for fp32, uint16 for 16-bit types)."""
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32).cpu().numpy().view(np.uint32)
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def expected_y(torch, x, keep, p):
    """The defined result: one float32 product x * scale where kept, then round to x's dtype."""
    x32 = x.float().cpu().numpy()
    y32 = ref.dropout_float32(x32, keep.reshape(x32.shape), p)
    return torch.from_numpy(y32).to(x.dtype)  # CPU rounding: nearest even


def assert_same_bits(torch, got, want):
    g, w = raw_bits(torch, got.cpu()), raw_bits(torch, want.cpu())
    if not np.array_equal(g, w):
        bad = np.flatnonzero(g.reshape(-1) != w.reshape(-1))
        raise AssertionError(f"{bad.size} elements differ, first at {bad[:5].tolist()}: "
                             f"{g.reshape(-1)[bad[:5]].tolist()} vs {w.reshape(-1)[bad[:5]].tolist()}")


def ulp(values: np.ndarray, dtype: str) -> np.ndarray:
    """Unit in the last place of |values| in fp16 / bf16 (subnormal spacing below the normals)."""
    mant, min_exp = {"float16": (10, -14), "bfloat16": (7, -126)}[dtype]
    a = np.abs(values.astype(np.float64))
    e = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    return np.exp2(np.maximum(e, min_exp) - mant)


def random_input(torch, n, dtype, shape=None, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(n if shape is None else shape, generator=g, device="cuda", dtype=torch.float32) * 3
    return x.to(tdtype(torch, dtype))


def run(x, p, **kw):
    y, mask = inferctx.dropout(x, p, **kw)
    return y, mask


# ---- bit-exact against the reference -----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_bits_mask_and_y_equal_the_reference(torch, n, dtype):
    i = SIZES.index(n) + DTYPES.index(dtype)
    offset, p, seed = OFFSETS[i % len(OFFSETS)], PS[i % len(PS)], 0x9E3779B97F4A7C15 ^ (i * 7919)
    x = random_input(torch, n, dtype, seed=i)
    torch.cuda.synchronize()
    y, mask = run(x, p, mask="bits", seed=seed, offset=offset)
    words = host_words(torch, mask)
    assert words.shape == (math.ceil(n / 32),)
    keep = ref.dropout_keep(seed, offset, p, n)
    assert np.array_equal(words, ref.pack_bits(keep))
    yt = to_torch(torch, y)
    assert yt.shape == x.shape and yt.dtype == x.dtype
    assert_same_bits(torch, yt, expected_y(torch, x, keep, p))


@pytest.mark.parametrize("offset", OFFSETS)
def test_offsets_whose_counter_carries_past_2_32(torch, offset):
    n, p, seed = 100_003, 0.3, 2**64 - 1
    x = random_input(torch, n, "float16", seed=5)
    torch.cuda.synchronize()
    y, mask = run(x, p, mask="bits", seed=seed, offset=offset)
    keep = ref.dropout_keep(seed, offset, p, n)
    assert np.array_equal(host_words(torch, mask), ref.pack_bits(keep))
    assert_same_bits(torch, to_torch(torch, y), expected_y(torch, x, keep, p))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bytes_mask_has_the_shape_of_x(torch, dtype):
    shape, p, seed, offset = (7, 3, 129), 0.4, 11, 4 * (2**32 - 1)
    n = math.prod(shape)
    x = random_input(torch, n, dtype, shape=shape, seed=1)
    torch.cuda.synchronize()
    y, mask = run(x, p, mask="bytes", seed=seed, offset=offset)
    m = to_torch(torch, mask)
    assert m.dtype == torch.uint8 and tuple(m.shape) == shape
    keep = ref.dropout_keep(seed, offset, p, n).reshape(shape)
    assert np.array_equal(m.cpu().numpy(), keep.astype(np.uint8))
    yt = to_torch(torch, y)
    assert tuple(yt.shape) == shape
    assert_same_bits(torch, yt, expected_y(torch, x, keep, p))


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_mask(torch, dtype):
    n, p, seed, offset = 5000, 0.6, 3, 8
    x = random_input(torch, n, dtype, seed=2)
    torch.cuda.synchronize()
    y, mask = run(x, p, mask=None, seed=seed, offset=offset)
    assert mask is None
    keep = ref.dropout_keep(seed, offset, p, n)
    assert_same_bits(torch, to_torch(torch, y), expected_y(torch, x, keep, p))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_results_within_one_rounding_of_x_over_1_minus_p(torch, dtype):
    n, p, seed, offset = 200_003, 0.3, 77, 12
    x = random_input(torch, n, dtype, seed=3)
    torch.cuda.synchronize()
    y, mask = run(x, p, mask="bits", seed=seed, offset=offset)
    keep = ref.unpack_bits(host_words(torch, mask), n)
    got = to_torch(torch, y).double().cpu().numpy()
    exact = np.where(keep, x.double().cpu().numpy() / (1.0 - float(np.float32(p))), 0.0)
    assert np.all(np.abs(got - exact) <= ulp(exact, dtype))
    assert np.all(got[~keep] == 0.0)


def test_float32_y_is_x_times_scale_exactly(torch):
    n, p = 300_007, 1 / 3
    x = random_input(torch, n, "float32", seed=4)
    torch.cuda.synchronize()
    y, mask = run(x, p, mask="bytes", seed=1, offset=0)
    keep = to_torch(torch, mask).cpu().numpy().astype(bool)
    scale = np.float32(1.0 / (1.0 - float(np.float32(p))))
    want = np.where(keep, x.cpu().numpy() * scale, np.float32(0)).astype(np.float32)
    assert np.array_equal(to_torch(torch, y).cpu().numpy().view(np.uint32), want.view(np.uint32))


# ---- p = 0, p = 1, out=, in place ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_p_zero_is_a_bitwise_copy_with_a_full_mask(torch, dtype):
    n = 1037
    x = random_input(torch, n, dtype, seed=6)
    if dtype == "float32":
        x.view(torch.int32)[0] = 0x7F800001  # signalling NaN with a payload
    x[1] = -0.0
    torch.cuda.synchronize()
    y, mask = run(x, 0.0, mask="bits", seed=5, offset=0)
    assert_same_bits(torch, to_torch(torch, y), x)
    assert np.array_equal(host_words(torch, mask), ref.pack_bits(np.ones(n, dtype=bool)))
    y, mask = run(x, 0.0, mask="bytes", seed=5, offset=0)
    assert bool((to_torch(torch, mask) == 1).all())


def test_empty_arrays_are_contiguous_whatever_their_strides(torch):
    # An empty array's strides address nothing: torch, NumPy and CuPy call (0, 3) with strides
    # (6, 2) contiguous, and so does inferctx, for x, out, the mask and grad alike. mask="bytes"
    # and out= take the general path (the import of the operands), not torch's fast path.
    x = torch.empty_strided((0, 3), (6, 2), device="cuda")
    assert x.is_contiguous()
    y, mask = inferctx.dropout(x, 0.5, mask="bytes")
    assert tuple(y.shape) == (0, 3) and tuple(mask.shape) == (0, 3)
    out = torch.empty_strided((0, 3), (6, 2), device="cuda")
    assert inferctx.dropout(torch.empty(0, 3, device="cuda"), 0.5, out=out)[0] is out
    bits = inferctx.dropout(x, 0.5)[1]
    assert bits.numel() == 0
    for m in (mask, bits):
        g = inferctx.apply_mask(x, m, 0.5)
        assert tuple(g.shape) == (0, 3)
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype", DTYPES)
def test_p_one_gives_zeros_and_an_empty_mask(torch, dtype):
    n = 1037
    x = random_input(torch, n, dtype, seed=7)
    torch.cuda.synchronize()
    y, mask = run(x, 1.0, mask="bits", seed=5, offset=0)
    yt = to_torch(torch, y)
    assert not bool(raw_bits(torch, yt).any())  # +0 everywhere
    assert not host_words(torch, mask).any()
    # Into outputs that hold other values (NaN, all bits set), so a call that wrote nothing fails.
    out = torch.full_like(x, float("nan"))
    words = torch.full(((n + 31) // 32,), -1, dtype=torch.int32, device="cuda")
    run(x, 1.0, out=out, mask_out=words, mask="bits", seed=5, offset=0)
    torch.cuda.synchronize()
    assert not bool(raw_bits(torch, out).any())
    assert not host_words(torch, words).any()


def test_out_and_in_place(torch):
    n, p = 50_001, 0.2
    x = random_input(torch, n, "bfloat16", seed=8)
    x_copy = x.clone()
    torch.cuda.synchronize()
    y_ref, m_ref = run(x, p, mask="bits", seed=9, offset=16)
    out = torch.empty_like(x)
    y_out, m_out = run(x, p, out=out, mask="bits", seed=9, offset=16)
    assert to_torch(torch, y_out).data_ptr() == out.data_ptr()
    torch.cuda.synchronize()
    assert_same_bits(torch, out, to_torch(torch, y_ref))
    y_in, m_in = run(x, p, out=x, mask="bits", seed=9, offset=16)
    assert to_torch(torch, y_in).data_ptr() == x.data_ptr()
    torch.cuda.synchronize()
    assert_same_bits(torch, x, to_torch(torch, y_ref))
    assert np.array_equal(host_words(torch, m_in), host_words(torch, m_ref))
    keep = ref.dropout_keep(9, 16, p, n)
    assert_same_bits(torch, x, expected_y(torch, x_copy, keep, p))


def test_stream_argument(torch):
    n, p = 70_001, 0.5
    x = random_input(torch, n, "float16", seed=10)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y, mask = run(x, p, mask="bits", seed=1, offset=4, stream=s)
        words = to_torch(torch, mask).view(torch.int32).cpu().numpy().view(np.uint32)
    assert np.array_equal(words, ref.pack_bits(ref.dropout_keep(1, 4, p, n)))


def test_input_written_just_before_the_call_is_seen(torch):
    # No synchronisation: the DLPack / CUDA-array-interface handshake must order the kernel after
    # torch's writes on its own stream.
    n = 1 << 26
    x = torch.full((n,), 2.0, device="cuda", dtype=torch.float16)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000)  # the producer's stream busy first, then its write
    x.mul_(3.0)
    y, _ = run(x, 0.5, mask=None, seed=3, offset=0)
    yt = to_torch(torch, y)
    assert bool(((yt == 0) | (yt == 12)).all())
    assert bool((yt == 12).any())


# ---- the context's random state -----------------------------------------------------------------

def test_consecutive_calls_differ_and_set_seed_repeats_them(torch):
    n, p = 100_003, 0.5
    x = random_input(torch, n, "float16", seed=11)
    torch.cuda.synchronize()
    ctx = inferctx.InferenceContext.instance(x.device.index)
    ctx.set_seed(1234)
    y1, m1 = run(x, p, mask="bits")
    y2, m2 = run(x, p, mask="bits", ctx=ctx)
    w1, w2 = host_words(torch, m1), host_words(torch, m2)
    assert not np.array_equal(w1, w2)
    # Each call took increment_offset(4): offsets 0 and 4 under seed 1234.
    assert np.array_equal(w1, ref.pack_bits(ref.dropout_keep(1234, 0, p, n)))
    assert np.array_equal(w2, ref.pack_bits(ref.dropout_keep(1234, 4, p, n)))
    # An explicit (seed, offset) bypasses the context's state.
    run(x, p, mask="bits", seed=99, offset=400)
    assert ctx.increment_offset(4) == (1234, 8)
    ctx.set_seed(1234)
    r1 = host_words(torch, run(x, p, mask="bits")[1])
    r2 = host_words(torch, run(x, p, mask="bits")[1])
    assert np.array_equal(r1, w1) and np.array_equal(r2, w2)
    ya = to_torch(torch, y1)
    ctx.set_seed(1234)
    yb = to_torch(torch, run(x, p, mask="bits")[0])
    assert_same_bits(torch, ya, yb)


def test_keep_rate_over_1e8_elements_within_5_sigma(torch):
    n, p = 10**8, 0.3
    x = torch.ones(n, device="cuda", dtype=torch.float16)
    _, mask = run(x, p, mask="bits", out=x, seed=2024, offset=0)
    words = host_words(torch, mask)
    kept = int(np.unpackbits(words.view(np.uint8)).sum())
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(kept - n * (1 - p)) < 5 * sigma
    # The surviving values are exactly 1 / (1 - p) in fp16, the dropped ones 0.
    y = x.float()
    scale16 = float(torch.tensor(float(ref.dropout_scale(p)), dtype=torch.float16))
    assert int((y == scale16).sum()) == kept
    assert int((y == 0).sum()) == n - kept


# ---- apply_mask ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mask_format", ["bits", "bytes"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_apply_mask_equals_its_reference(torch, dtype, mask_format):
    n, p = 65_539, 0.35
    x = random_input(torch, n, dtype, seed=12)
    grad = random_input(torch, n, dtype, seed=13)
    torch.cuda.synchronize()
    y, mask = run(x, p, mask=mask_format, seed=21, offset=4 * 2**32)
    keep = ref.dropout_keep(21, 4 * 2**32, p, n)
    out = inferctx.apply_mask(grad, mask, p)
    assert_same_bits(torch, to_torch(torch, out), expected_y(torch, grad, keep, p))
    # The backward of the forward: apply_mask(x, mask) reproduces y.
    assert_same_bits(torch, to_torch(torch, inferctx.apply_mask(x, mask, p)), to_torch(torch, y))
    # In place.
    g2 = grad.clone()
    res = inferctx.apply_mask(g2, mask, p, out=g2)
    assert to_torch(torch, res).data_ptr() == g2.data_ptr()
    torch.cuda.synchronize()
    assert_same_bits(torch, g2, expected_y(torch, grad, keep, p))


def test_apply_mask_takes_a_torch_byte_mask(torch):
    n, p = 4099, 0.5
    grad = random_input(torch, n, "float32", seed=14)
    keep = np.random.default_rng(0).random(n) < 0.5
    mask = torch.from_numpy(keep.astype(np.uint8)).cuda()
    torch.cuda.synchronize()
    out = inferctx.apply_mask(grad, mask, p)
    assert_same_bits(torch, to_torch(torch, out), expected_y(torch, grad, keep, p))


# ---- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("p", [-0.1, 1.1, float("nan"), float("inf"), True, np.True_, np.False_])
def test_p_outside_0_1_is_refused(torch, p):
    # A flag is no probability: True, numpy's True_ (which has __float__) and False are refused.
    x = torch.ones(10, device="cuda")
    with pytest.raises(ConfigError) as e:
        inferctx.dropout(x, p)
    assert e.value.argument == "p"
    with pytest.raises(ConfigError):
        inferctx.apply_mask(x, torch.ones(10, device="cuda", dtype=torch.uint8), p)


def test_non_cuda_inputs_are_refused(torch):
    with pytest.raises(ConfigError):
        inferctx.dropout(np.ones(10, dtype=np.float32), 0.5)
    with pytest.raises(ConfigError):
        inferctx.dropout(torch.ones(10), 0.5)  # CPU tensor


def test_non_contiguous_inputs_are_refused(torch):
    x = torch.ones(64, 64, device="cuda", dtype=torch.float16)
    with pytest.raises(ConfigError):
        inferctx.dropout(x.t(), 0.5)
    with pytest.raises(ConfigError):
        inferctx.dropout(x[:, ::2], 0.5)
    # Each message names the keyword, the shape and strides, and a remedy in that keyword's terms.
    bits = torch.zeros(128, device="cuda", dtype=torch.int32)  # 4096 bits: x's elements
    narrow = torch.ones(64, 32, device="cuda", dtype=torch.float16)
    for call, message in [
            (lambda: inferctx.apply_mask(x[:, ::2], bits, 0.5),
             "grad: shape [64, 32] with strides [64, 2] (elements) is not contiguous; pass a contiguous "
             "copy (grad.contiguous() in torch, cupy.ascontiguousarray(grad) in CuPy)"),
            (lambda: inferctx.dropout(narrow, 0.5, out=torch.empty(64, 64, device="cuda",
                                                                       dtype=torch.float16)[:, ::2]),
             "out: shape [64, 32] with strides [64, 2] (elements) is not contiguous; pass a contiguous "
             "array of that shape, or no out= for a new result"),
            (lambda: inferctx.dropout(x, 0.5, mask_out=bits.repeat(2)[::2]),
             "mask_out: shape [128] with strides [2] (elements) is not contiguous; pass a contiguous "
             "array, or no mask_out= for a new one"),
            (lambda: inferctx.apply_mask(x, bits.repeat(2)[::2], 0.5),
             "mask: shape [128] with strides [2] (elements) is not contiguous; pass a contiguous array")]:
        with pytest.raises(ConfigError) as refused:
            call()
        assert str(refused.value).startswith(message), str(refused.value)


def test_unsupported_dtypes_are_refused(torch):
    for dt in (torch.float64, torch.int32, torch.uint8):
        with pytest.raises(ConfigError):
            inferctx.dropout(torch.ones(10, device="cuda", dtype=dt), 0.5)


def test_bad_out_is_refused(torch):
    x = torch.ones(100, device="cuda", dtype=torch.float16)
    for out in (torch.empty(99, device="cuda", dtype=torch.float16),
                torch.empty(100, device="cuda", dtype=torch.float32),
                torch.empty(100, dtype=torch.float16),
                torch.empty(200, device="cuda", dtype=torch.float16)[::2]):
        with pytest.raises(ConfigError):
            inferctx.dropout(x, 0.5, out=out)


def test_bad_mask_mode_and_offset_are_refused(torch):
    x = torch.ones(100, device="cuda", dtype=torch.float16)
    with pytest.raises(ConfigError):
        inferctx.dropout(x, 0.5, mask="words")
    with pytest.raises(ConfigError):
        inferctx.dropout(x, 0.5, seed=1, offset=6)


def test_apply_mask_with_a_mismatched_mask_is_refused(torch):
    grad = torch.ones(100, device="cuda", dtype=torch.float16)
    _, bits_of_other = inferctx.dropout(torch.ones(1000, device="cuda", dtype=torch.float16), 0.5, mask="bits")
    with pytest.raises(ConfigError):
        inferctx.apply_mask(grad, bits_of_other, 0.5)
    with pytest.raises(ConfigError):
        inferctx.apply_mask(grad, torch.ones(99, device="cuda", dtype=torch.uint8), 0.5)
    with pytest.raises(ConfigError):
        inferctx.apply_mask(grad, torch.ones(100, device="cuda", dtype=torch.float32), 0.5)
    with pytest.raises(ConfigError):
        inferctx.apply_mask(grad, torch.ones(100, dtype=torch.uint8), 0.5)  # CPU mask


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["bits", "bytes"])
def test_mask_out_reuses_a_buffer(mode):
    torch = pytest.importorskip("torch")
    n = 1000
    x = torch.randn(n, device="cuda", dtype=torch.float16)
    words = (n + 31) // 32
    buf = (torch.empty(words, dtype=torch.int32, device="cuda") if mode == "bits"
           else torch.empty(n, dtype=torch.uint8, device="cuda"))
    y, m = inferctx.dropout(x, 0.3, mask=mode, mask_out=buf, seed=3, offset=8)
    assert m is buf
    y2, m2 = inferctx.dropout(x, 0.3, mask=mode, seed=3, offset=8)
    torch.cuda.synchronize()
    same = torch.from_dlpack(m2)
    assert torch.equal(buf.view(same.dtype) if mode == "bits" else buf, same)
    assert torch.equal(torch.from_dlpack(y), torch.from_dlpack(y2))
    keep = ref.dropout_keep(3, 8, 0.3, n)  # and both are the independent reference's
    if mode == "bits":
        assert np.array_equal(buf.cpu().numpy().view(np.uint32), ref.pack_bits(keep))
    else:
        assert np.array_equal(buf.cpu().numpy(), keep.astype(np.uint8))


@pytest.mark.gpu
def test_mask_out_errors():
    torch = pytest.importorskip("torch")
    x = torch.randn(100, device="cuda", dtype=torch.float32)
    for mode, buf in (("bits", torch.empty(3, dtype=torch.int32, device="cuda")),      # needs 4
                      ("bits", torch.empty(4, dtype=torch.float32, device="cuda")),
                      ("bytes", torch.empty(99, dtype=torch.uint8, device="cuda")),
                      (None, torch.empty(4, dtype=torch.int32, device="cuda"))):
        with pytest.raises(ConfigError) as info:
            inferctx.dropout(x, 0.5, mask=mode, mask_out=buf)
        assert info.value.argument == "mask_out"


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [["bits"], {}, {"bits": 1}, 2, True, b"bits"])
def test_a_mask_that_is_no_mask_name_is_a_config_error_naming_mask(torch, mask):
    x = torch.ones(100, device="cuda", dtype=torch.float16)
    with pytest.raises(ConfigError) as info:  # a list or dict is unhashable: no TypeError
        inferctx.dropout(x, 0.5, mask=mask)
    assert info.value.argument == "mask"
    assert "'bits' (default), 'bytes' or None" in str(info.value)


@pytest.mark.gpu
def test_a_refused_call_takes_no_philox_offset(torch):
    """Refused for an out= or mask_out= that overlaps x: the context's offset is where it was,
    and the next call draws what it would have drawn without the refused one."""
    ctx = inferctx.InferenceContext.instance()
    n = 1000
    buf = torch.randn(n + 1, device="cuda", dtype=torch.float32)
    x = buf[:n]
    refused = [dict(out=buf[1:]),                                          # y shifted by one
               dict(mask_out=x.view(torch.int32)[:(n + 31) // 32]),        # bits inside x
               dict(mask="bytes", mask_out=x.view(torch.uint8)[8:8 + n])]  # bytes inside x
    for kw in refused:
        before = ctx.rng_state
        with pytest.raises(ConfigError):
            inferctx.dropout(x, 0.5, **kw)
        assert ctx.rng_state == before, kw
    seed, offset = ctx.rng_state
    torch.cuda._sleep(100_000)  # the producer's stream busy: the reads below must wait for it
    y, mask = inferctx.dropout(x, 0.5)
    y_ref, mask_ref = inferctx.dropout(x, 0.5, seed=seed, offset=offset)
    assert torch.equal(mask, mask_ref) and torch.equal(y, y_ref)  # read at once, no synchronize
    assert ctx.rng_state == (seed, offset + 4)
    keep = ref.dropout_keep(seed, offset, 0.5, n)  # what it would have drawn, from the reference
    assert np.array_equal(host_words(torch, mask), ref.pack_bits(keep))
    assert_same_bits(torch, y, expected_y(torch, x, keep, 0.5))


SUBCLASS_FIRST_SCRIPT = """
import torch
import inferctx

class Tagged(torch.Tensor):
    pass

x = torch.randn(1000, device="cuda").as_subclass(Tagged)
plain = torch.randn(1000, device="cuda")
inferctx.InferenceContext.instance()       # the fast path runs once the device's context exists
y0, m0 = inferctx.dropout(x, 0.5)          # the process's first fast-path dropout: a subclass
y1, m1 = inferctx.dropout(plain, 0.5)      # then a plain tensor on the same device
torch.cuda.synchronize()
print(type(m0).__name__, type(y1).__name__, type(m1).__name__)
"""


def test_a_subclass_first_leaves_the_masks_of_later_plain_tensors_plain():
    # In a child: the process's first fast-path dropout on the device (its context made first:
    # without one the general path runs) must be the subclass's. The mask of
    # a subclass's x is made by its own new_empty (as the general path's results are); before,
    # the first x's new_empty made the template of every later mask on the device.
    pytest.importorskip("torch")
    import subprocess
    import sys
    run = subprocess.run([sys.executable, "-c", SUBCLASS_FIRST_SCRIPT], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["Tagged", "Tensor", "Tensor"], run.stdout
