"""The decoder's fused elementwise kernels (cuda/src/decoder_ops.cu, decoder/_fused.py).

- Any machine: every argument the C++ side checks is refused with ConfigError naming it, before
  anything is queued (no GPU is touched).
- GPU: each kernel gives the bits of the torch sequence it replaces (_layers.py), over every
  16-bit pattern for GELU and SiLU, on the decoder's own layouts (RoPE into a transposed
  destination and a contiguous one, a prompt's rows and one broadcast decode row; SiLU on the
  two halves of one matrix), eagerly and replayed from a CUDA graph; the decoder with and without
  them gives identical logits.
"""

from __future__ import annotations

import pytest

import inferctx
from inferctx import _core

F16 = 1  # DType codes: float32 0, float16 1, bfloat16 2
ADDR = 1 << 20  # a well-aligned address; never dereferenced: every call below is refused first


def refused(call, argument):
    with pytest.raises(inferctx.ConfigError) as e:
        call()
    assert e.value.argument == argument, (e.value.argument, str(e.value))
    return str(e.value)


@pytest.mark.parametrize("kwargs, argument, words", [
    (dict(n=-1), "n", "-1"),
    (dict(dtype=7), "dtype", "7"),
    (dict(cube=3), "cube", "valid: 0"),
    (dict(x=0), "x", "null"),
    (dict(x=ADDR + 1), "x", "not aligned"),
])
def test_gelu_arguments(kwargs, argument, words):
    args = dict(x=ADDR, n=16, dtype=F16, cube=0, stream=0, device=-1)
    args.update(kwargs)
    message = refused(lambda: _core._fused_gelu_new(args["x"], args["n"], args["dtype"], args["cube"],
                                                    args["stream"], args["device"]), argument)
    assert words in message


def test_gelu_of_nothing_queues_nothing():
    _core._fused_gelu_new(0, 0, F16, 0, 0, -1)  # n == 0: no pointer needed, no device touched


@pytest.mark.parametrize("kwargs, argument", [
    (dict(rows=-1), "rows"),
    (dict(cols=2**31), "cols"),
    (dict(ld_gate=4), "ld_gate"),            # < cols with two rows
    (dict(ld_up=-8), "ld_up"),
    (dict(up=ADDR + 2), "up"),               # one element over: shares elements with gate
    (dict(up=ADDR + 8, ld_up=12), "up"),     # overlapping spans with another row stride
    (dict(gate=0), "gate"),
    (dict(up=ADDR + 4096 + 1), "up"),        # misaligned
    (dict(dtype=3), "dtype"),
    (dict(rows=2**31 - 1, ld_gate=2**40), "ld_gate"),   # a span past 2^63 bytes
])
def test_silu_mul_arguments(kwargs, argument):
    args = dict(gate=ADDR, up=ADDR + 4096, rows=2, cols=8, ld_gate=16, ld_up=16, dtype=F16)
    args.update(kwargs)
    refused(lambda: _core._fused_silu_mul(args["gate"], args["up"], args["rows"], args["cols"], args["ld_gate"],
                                          args["ld_up"], args["dtype"], 0, -1), argument)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(head_dim=63), "head_dim"),
    (dict(batch=-2), "batch"),
    (dict(src_strides=(1, 2)), "src_strides"),
    (dict(dst_strides=[512, 64, 8]), "dst_strides"),
    (dict(src_strides=(4096, -64, 64)), "src_strides[1]"),
    (dict(cs=-64), "cs_token_stride"),
    (dict(dst=ADDR + 64), "dst"),            # inside src
    (dict(dst=ADDR + 2 ** 16), "dst"),       # on cos
    (dict(sin=0), "sin"),
    (dict(dtype=-1), "dtype"),
    (dict(batch=2**31 - 1, tokens=2**31 - 1), "batch"),  # batch * tokens * heads past 2^63
    (dict(batch=2**28, heads=2, src_strides=(2**40, 64, 64)), "src_strides"),  # a span past 2^63 bytes
    # dst rows sharing elements (threads would race for them): heads 32 apart with head_dim 64,
    # every head one row, every token one row
    (dict(dst_strides=(768, 256, 32)), "dst_strides"),
    (dict(dst_strides=(768, 256, 0)), "dst_strides"),
    (dict(dst_strides=(768, 0, 64)), "dst_strides"),
    # head-major, the decoder's queries: rows distinct, so refused only for lying on cos
    (dict(dst=ADDR + 2 ** 16, dst_strides=(768, 64, 192)), "dst"),
])
def test_rope_arguments(kwargs, argument):
    # src [2, 3, 4, 64] contiguous at ADDR (3 KiB of fp16); cos and sin rows elsewhere.
    args = dict(src=ADDR, dst=ADDR + 2 ** 15, cos=ADDR + 2 ** 16, sin=ADDR + 2 ** 17, batch=2, tokens=3, heads=4,
                head_dim=64, src_strides=(768, 256, 64), dst_strides=(768, 256, 64), cs=64, dtype=F16)
    args.update(kwargs)
    refused(lambda: _core._fused_rope(args["src"], args["dst"], args["cos"], args["sin"], args["batch"],
                                      args["tokens"], args["heads"], args["head_dim"], args["src_strides"],
                                      args["dst_strides"], args["cs"], args["dtype"], 0, -1), argument)


# -- on the GPU ------------------------------------------------------------------------------------

DTYPES = ["float16", "bfloat16", "float32"]


@pytest.fixture
def gpu(torch):
    from inferctx.decoder import _fused

    return torch, _fused


def verified(gpu, dtype):
    """torch, the dtype, and the fused kernels for it, every one of them verified (otherwise the
    calls below would run torch's own sequences and compare them with themselves)."""
    torch, F = gpu
    dt = getattr(torch, dtype)
    ops = F.fused_ops(torch.cuda.current_device(), dt)
    assert ops.names == ("gelu_new", "silu_mul", "rope"), ops.names
    return torch, dt, ops


def bits_equal(torch, got, want):
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[got.dtype]
    same = got.view(view) == want.view(view)
    return bool((same | (torch.isnan(got) & torch.isnan(want))).all())


def every_value(torch, dtype):
    """Every bit pattern of a 16-bit type; float32: 2^18 values from 1e-6 to 1e6 and both signs."""
    if dtype != torch.float32:
        return torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype).clone()
    g = torch.Generator(device="cuda").manual_seed(3)
    mag = torch.pow(10.0, torch.rand(1 << 18, generator=g, device="cuda") * 12 - 6)
    return mag * torch.where(torch.rand(1 << 18, generator=g, device="cuda") < 0.5, -1.0, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_is_verified_on_this_torch(gpu, dtype):
    torch, dt, ops = verified(gpu, dtype)
    assert ops.cube in (0, 1, 2) and ops.dtype == dt


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_gives_the_sequences_bits_for_every_value(gpu, dtype):
    from inferctx.decoder import _layers as L

    torch, dt, ops = verified(gpu, dtype)
    x = every_value(torch, dt).view(64, -1)  # 2-D, as the decoder's MLP rows
    want = x.clone()
    L.gelu_new_(want, torch.empty_like(want))
    got = x.clone()
    ops.gelu_new_(got, torch.empty_like(got))
    assert bits_equal(torch, got, want)
    assert not bits_equal(torch, got, x)  # it did run


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_the_two_halves_of_one_matrix(gpu, dtype):
    torch, dt, ops = verified(gpu, dtype)
    x = every_value(torch, dt)
    cols = 512
    rows = x.numel() // cols
    m = (torch.randn(rows, 2 * cols, device="cuda") * 3).to(dt)
    m[:, :cols] = x[:rows * cols].view(rows, cols)
    want = m.clone()
    torch.nn.functional.silu(want[:, :cols], inplace=True)
    want[:, :cols].mul_(want[:, cols:])
    ops.silu_mul_(m[:, :cols], m[:, cols:])
    assert bits_equal(torch, m, want)  # the up half untouched as well


def rope_case(torch, dtype, n, first, g):
    from inferctx.decoder import _layers as L

    b, heads, kv, hd = 2, 8, 2, 64
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    cos_t, sin_t = L.rope_tables(inv_freq, 8192, dtype)
    qkv = (torch.randn(b * n, (heads + 2 * kv) * hd, generator=g, device="cuda") * 2).to(dtype)
    q = qkv[:, :heads * hd].view(b, n, heads, hd)
    k = qkv[:, heads * hd:(heads + kv) * hd].view(b, n, kv, hd)
    if n > 1:
        cos, sin = cos_t[first:first + n].view(1, n, 1, hd), sin_t[first:first + n].view(1, n, 1, hd)
    else:  # the decode step's one row, gathered into its own buffer
        cos, sin = cos_t[first].clone().view(1, 1, 1, hd), sin_t[first].clone().view(1, 1, 1, hd)
    return q, k, cos, sin


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n, first", [(7, 0), (1, 5000)])
def test_rope_into_the_decoders_destinations(gpu, dtype, n, first):
    from inferctx.decoder import _layers as L

    torch, dt, ops = verified(gpu, dtype)
    g = torch.Generator(device="cuda").manual_seed(n)
    q, k, cos, sin = rope_case(torch, dt, n, first, g)
    b, _, heads, hd = q.shape
    for src, dst_of in ((q, lambda: torch.empty(b, heads, n, hd, dtype=dt, device="cuda").transpose(1, 2)),
                        (k, lambda: torch.empty(b, n, k.shape[2], hd, dtype=dt, device="cuda"))):
        want, got = dst_of(), dst_of()
        L.rope(src, cos, sin, want, torch.empty(src.shape, dtype=dt, device="cuda"),
               torch.empty(src.shape, dtype=dt, device="cuda"))
        ops.rope(src, cos, sin, got, torch.empty(src.shape, dtype=dt, device="cuda"),
                 torch.empty(src.shape, dtype=dt, device="cuda"))
        assert bits_equal(torch, got, want)


@pytest.mark.gpu
def test_the_kernels_replay_from_a_cuda_graph(gpu):
    from inferctx.decoder import _layers as L

    torch, dt, ops = verified(gpu, "float16")
    g = torch.Generator(device="cuda").manual_seed(5)
    q, _, cos, sin = rope_case(torch, dt, 1, 100, g)
    x = torch.randn(8, 3072, device="cuda").to(dt)
    m = torch.randn(8, 2 * 2816, device="cuda").to(dt)
    work = [x.clone(), m.clone(), torch.empty(q.shape[0], q.shape[2], 1, q.shape[3], dtype=dt,
                                              device="cuda").transpose(1, 2)]
    scratch = [torch.empty_like(x), torch.empty(q.shape, dtype=dt, device="cuda"),
               torch.empty(q.shape, dtype=dt, device="cuda")]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            ops.gelu_new_(work[0], scratch[0])
            ops.silu_mul_(work[1][:, :2816], work[1][:, 2816:])
            ops.rope(q, cos, sin, work[2], scratch[1], scratch[2])
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        work[0].copy_(x)
        work[1].copy_(m)
        work[2].zero_()
        graph.replay()
        want_x = x.clone()
        L.gelu_new_(want_x, torch.empty_like(want_x))
        want_m = m.clone()
        torch.nn.functional.silu(want_m[:, :2816], inplace=True)
        want_m[:, :2816].mul_(want_m[:, 2816:])
        want_q = torch.empty_like(work[2])
        L.rope(q, cos, sin, want_q, torch.empty(q.shape, dtype=dt, device="cuda"),
               torch.empty(q.shape, dtype=dt, device="cuda"))
        assert bits_equal(torch, work[0], want_x)
        assert bits_equal(torch, work[1], want_m)
        assert bits_equal(torch, work[2], want_q)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_decoder_gives_the_same_logits_with_and_without_them(gpu, arch):
    torch, _ = gpu
    pytest.importorskip("transformers")
    from inferctx.decoder import ReferenceDecoder, build_hf_model, model_spec

    spec = model_spec(f"{arch}-tiny", num_layers=2, vocab_size=1024)
    hf = build_hf_model(spec, seed=1)
    prompt = torch.randint(0, spec.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2)).cuda()
    outs = []
    for fused in (True, False):
        dec = ReferenceDecoder(hf, batch_size=3, prompt_len=12, max_new_tokens=20, dtype="float16", fused=fused)
        assert dec.fused_kernels == (("gelu_new", "silu_mul", "rope") if fused else ())
        outs.append(dec.generate(prompt, return_logits=True))
        del dec
    assert torch.equal(outs[0].logits, outs[1].logits) and torch.equal(outs[0].tokens, outs[1].tokens)


def test_on_the_cpu_the_decoder_runs_torchs_sequences():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from inferctx.decoder import CpuContext, ReferenceDecoder, build_hf_model, model_spec
    from inferctx.decoder import _fused

    hf = build_hf_model(model_spec("llama-tiny", num_layers=1, vocab_size=256), seed=0)
    dec = ReferenceDecoder(hf, batch_size=1, prompt_len=4, max_new_tokens=2, dtype="float32", ctx=CpuContext())
    assert dec.fused_kernels == ()
    ops = _fused.unfused(-1, torch.float32)
    assert ops.names == () and ops.cube is None
    x = torch.randn(4, 64)
    # The reference is transformers' own GELU (NewGELUActivation), whose operations the sequence
    # repeats one for one: the same bits, not the package's sequence compared with itself.
    from transformers.activations import NewGELUActivation

    with torch.no_grad():
        want = NewGELUActivation()(x.clone())
    ops.gelu_new_(x, torch.empty_like(x))  # no GPU kernel is reached: torch's sequence
    assert torch.equal(x, want)


@pytest.mark.gpu
def test_generate_with_the_prompt_written_late_on_the_callers_stream(gpu):
    """As a user calls it: the prompt written on the current stream behind a long sleep kernel,
    generate() with its defaults (fused kernels, CUDA graph), the tokens read on the current
    stream right after, with no synchronize: the same tokens as an unhurried run."""
    torch, _ = gpu
    pytest.importorskip("transformers")
    from inferctx.decoder import ReferenceDecoder, build_hf_model, model_spec

    spec = model_spec("gpt2-tiny", num_layers=2, vocab_size=1024)
    dec = ReferenceDecoder(build_hf_model(spec, seed=3), batch_size=2, prompt_len=8, max_new_tokens=6)
    prompt = torch.randint(0, spec.vocab_size, (2, 8), generator=torch.Generator().manual_seed(4)).cuda()
    want = dec.generate(prompt).tokens.cpu()
    torch.cuda.synchronize()
    for trial in range(3):
        late = torch.empty_like(prompt)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time before the prompt exists
        late.copy_(prompt)
        got = dec.generate(late).tokens.cpu()  # .cpu() reads on the current stream
        assert torch.equal(got, want), trial
