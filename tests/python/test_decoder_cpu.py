"""The reference decoder's argument checks and `inferctx demo`'s flags, on any machine: GPT-2's
position bound named by the argument that breaks it, the demo's --dtype read as `inferctx plan`
reads it, build_hf_model's RNG and device, and hf_reference_logits' arguments."""

from __future__ import annotations

import pytest

import inferctx
from inferctx.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cpu():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return torch


def _demo_args(monkeypatch, *argv):
    """The arguments `inferctx demo ARGV` goes on with once its flags are read: stopped at its
    first check of the model's sizes, before anything is built."""
    from inferctx import demo

    seen = []

    class Stop(Exception):
        pass

    def checked(spec, args):
        seen.append(args)
        raise Stop

    monkeypatch.setattr(demo, "_check_sizes", checked)
    with pytest.raises(Stop):
        main(["demo", *argv])
    return seen[0]


def _tiny_llama_on_the_cpu(max_new_tokens):
    """(spec, ctx, dec): llama-tiny's decoder for 2 prompts of 4 tokens, float32, on a CpuContext."""
    from inferctx.decoder import CpuContext, ReferenceDecoder, build_hf_model, model_spec

    spec = model_spec("llama-tiny")
    ctx = CpuContext()
    dec = ReferenceDecoder(build_hf_model(spec, seed=0), batch_size=2, prompt_len=4, max_new_tokens=max_new_tokens,
                           dtype="float32", ctx=ctx)
    return spec, ctx, dec


# -- GPT-2's positions ------------------------------------------------------------------------------

def test_cpu_gpt2s_positions_bound_what_a_generation_feeds_as_hugging_face_does(cpu):
    # n_positions=8: a prompt of 8 and 1 new token feed 8 positions (the new token is not fed
    # back), which transformers' generate takes; it was refused, as was any prompt_len of 8. A
    # prompt past the positions is blamed on prompt_len, too many new tokens on max_new_tokens.
    torch = cpu
    from inferctx.decoder import CpuContext, ReferenceDecoder, build_hf_model, model_spec

    hf = build_hf_model(model_spec("gpt2-tiny", max_positions=8), seed=0)
    with pytest.raises(inferctx.ConfigError) as info:
        ReferenceDecoder(hf, batch_size=1, prompt_len=9, max_new_tokens=1, dtype="float32", ctx=CpuContext())
    assert info.value.argument == "prompt_len"
    assert str(info.value) == "prompt_len: got 9; GPT-2's n_positions=8 must hold the prompt: prompt_len <= 8"
    with pytest.raises(inferctx.ConfigError) as info:  # room left: the new tokens, and how many fit
        ReferenceDecoder(hf, batch_size=1, prompt_len=6, max_new_tokens=4, dtype="float32", ctx=CpuContext())
    assert info.value.argument == "max_new_tokens"
    assert str(info.value) == ("max_new_tokens: prompt_len + max_new_tokens - 1 = 9 positions fed (the last new "
                               "token is not fed back) pass GPT-2's n_positions=8; max_new_tokens <= 3 fits")
    prompt = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(3))
    expected = hf.generate(prompt, max_new_tokens=1, do_sample=False, attention_mask=torch.ones_like(prompt),
                           pad_token_id=0)[:, 8:]
    dec = ReferenceDecoder(hf, batch_size=1, prompt_len=8, max_new_tokens=1, dtype="float32", ctx=CpuContext())
    assert torch.equal(dec.generate(prompt).tokens, expected)
    # The plan holds 9 positions, one more than GPT-2 has: step refuses the ninth before it runs.
    with pytest.raises(inferctx.TokenLimitError) as info:
        dec.step()
    assert str(info.value) == ("step: GPT-2's learned positions end at n_positions=8, and this decoder's sequences "
                               "have fed all 8; call prefill(prompt) or generate() for new ones")
    assert (info.value.current, info.value.limit) == (8, 8)
    dec = ReferenceDecoder(hf, batch_size=1, prompt_len=6, max_new_tokens=3, dtype="float32", ctx=CpuContext())
    prompt = prompt[:, :6]
    expected = hf.generate(prompt, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(prompt),
                           pad_token_id=0)[:, 6:]
    assert dec.max_tokens == 9 and torch.equal(dec.generate(prompt).tokens, expected)


def test_demo_gpt2s_positions_in_the_demos_flags(capsys):
    code, out, err = run(capsys, "demo", "--model", "gpt2-tiny", "--prompt-len", "257", "--new-tokens", "1")
    assert code == 2 and out == ""
    assert err == ("inferctx demo: --prompt-len: got 257; GPT-2's n_positions=256 must hold the prompt: "
                   "--prompt-len <= 256\n"), err
    code, out, err = run(capsys, "demo", "--model", "gpt2-tiny", "--prompt-len", "200", "--new-tokens", "100")
    assert code == 2 and out == ""
    assert err == ("inferctx demo: --new-tokens: --prompt-len + --new-tokens - 1 = 299 positions fed (the last new "
                   "token is not fed back) pass GPT-2's n_positions=256; --new-tokens <= 57 fits\n"), err


# -- the demo's flags -----------------------------------------------------------------------------

@pytest.mark.parametrize("given,name", [("GPT2", "gpt2"), ("Llama-Tiny", "llama-tiny"), ("GPT2_SMALL", "gpt2-small"),
                                        (" gpt2-tiny", "gpt2-tiny")])
def test_demo_model_takes_names_as_plan_preset_does(capsys, monkeypatch, given, name):
    # `inferctx plan --preset LLAMA_2_7B` was taken and `inferctx demo --model GPT2` refused.
    assert _demo_args(monkeypatch, "--model", given).model == name
    code, out, err = run(capsys, "demo", "--model", "gpt3")
    assert code == 2 and out == "" and "argument --model: invalid choice: 'gpt3'" in err


@pytest.mark.parametrize("given,name", [("half", "float16"), ("f16", "float16"), ("FP16", "float16"),
                                        ("single", "float32"), ("f32", "float32"), ("BF16", "bfloat16"),
                                        ("float16", "float16"), ("bf16", "bfloat16")])
def test_demo_dtype_takes_the_names_inferctx_plan_takes(capsys, monkeypatch, given, name):
    # The demo's --dtype had a list of six spellings of its own: `inferctx plan --dtype half` (and
    # the decoder's dtype="half") was taken, `inferctx demo --dtype half` refused.
    from inferctx.dtypes import dtype_name

    assert dtype_name(given) == name  # the planner's reading
    assert _demo_args(monkeypatch, "--model", "gpt2-tiny", "--dtype", given).dtype == name


def test_demo_dtype_refusal_lists_the_valid_names(capsys):
    code, out, err = run(capsys, "demo", "--dtype", "fp8")
    assert code == 2 and out == ""
    assert err == ("inferctx: error: argument --dtype: got 'fp8'; valid: 'float32' ('fp32'), 'float16' ('fp16', "
                   "'half') or 'bfloat16' ('bf16')\n"), err


def test_demo_an_odd_llama_head_size_names_the_flags_that_make_it(capsys):
    # The head size is no flag of the demo: the error said "the head size: got 9" and named none.
    code, out, err = run(capsys, "demo", "--model", "llama-tiny", "--hidden", "36", "--heads", "4", "--kv-heads", "4")
    assert code == 2 and out == ""
    assert err == "inferctx demo: the head size (--hidden / --heads): got 9; Llama's RoPE needs it even\n", err


# -- build_hf_model ---------------------------------------------------------------------------------

def test_cpu_build_hf_model_leaves_the_accelerators_generators_alone(cpu, monkeypatch):
    # torch.manual_seed seeds every CUDA device's generator too, and fork_rng(devices=[]) restores
    # only the CPU's: the caller's CUDA RNG was reseeded with the model's seed.
    torch = cpu
    from inferctx.decoder import build_hf_model, model_spec

    seeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: seeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: seeded.append(seed))
    before = torch.random.get_rng_state()
    model = build_hf_model(model_spec("gpt2-tiny"), seed=5)
    assert seeded == [] and torch.equal(torch.random.get_rng_state(), before)
    # the weights are those the CPU generator seeded with 5 gives, as before
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(5)
        import transformers

        ref = transformers.GPT2LMHeadModel(model_spec("gpt2-tiny").hf_config())
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.equal(ours, theirs), name


def test_cpu_build_hf_model_builds_on_the_cpu_whatever_the_default_device(cpu):
    # Under torch.set_default_device("meta") the model came out on the meta device (no values),
    # which the decoder then refused; the docstring says the CPU.
    torch = cpu
    from inferctx.decoder import build_hf_model, model_spec

    reference = build_hf_model(model_spec("llama-tiny"), seed=3)
    torch.set_default_device("meta")
    try:
        model = build_hf_model(model_spec("llama-tiny"), seed=3)
    finally:
        torch.set_default_device(None)
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    for (name, ours), (_, theirs) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(ours, theirs), name


# -- hf_reference_logits ----------------------------------------------------------------------------

def test_cpu_hf_reference_logits_names_its_bad_arguments(cpu):
    # Each of these gave a bare RuntimeError, IndexError or AttributeError from torch or
    # transformers; new tokens of zero columns gave one row of logits where [n, ...] is promised.
    torch = cpu
    from inferctx.decoder import build_hf_model, hf_reference_logits, model_spec

    hf = build_hf_model(model_spec("llama-tiny"), seed=0)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 512, (2, 4), generator=gen)
    new = torch.randint(0, 512, (2, 3), generator=gen)
    assert hf_reference_logits(hf, prompt, new).shape == (3, 2, 512)
    cases = [
        ((None, prompt, new), "model", "model: got None (NoneType); it must be a transformers"),
        ((hf, prompt.float(), new), "prompt", "prompt: got a (2, 4) float32 tensor; it must be a 2-D integer tensor"),
        ((hf, prompt[0], new), "prompt", "prompt: got a (4,) int64 tensor"),
        ((hf, prompt, new.float()), "new_tokens",
         "new_tokens: got a (2, 3) float32 tensor; it must be a 2-D integer tensor [batch, n] of token ids"),
        ((hf, prompt, new[0]), "new_tokens", "new_tokens: got a (3,) int64 tensor"),
        ((hf, prompt, new[:1]), "new_tokens", "new_tokens: got shape (1, 3); it must be [2, n] with n >= 1"),
        ((hf, prompt, new[:, :0]), "new_tokens", "new_tokens: got shape (2, 0); it must be [2, n] with n >= 1"),
        ((hf, prompt[:, :0], new), "prompt", "prompt: got a (2, 0) tensor; it needs at least one sequence"),
        ((hf, prompt + 512, new), "prompt", "prompt: token ids must be in 0..511; got "),
        ((hf, prompt, new - 600), "new_tokens", "new_tokens: token ids must be in 0..511; got "),
        ((hf, prompt.to("meta"), new), "prompt", "prompt: got a (2, 4) int64 tensor on the meta device"),
    ]
    meta = build_hf_model(model_spec("llama-tiny"), seed=0).to("meta")
    cases.append(((meta, prompt, new), "model", "model: a LlamaForCausalLM whose weights are on the meta device"))
    for args, argument, words in cases:
        with pytest.raises(inferctx.ConfigError) as info:
            hf_reference_logits(*args)
        assert info.value.argument == argument and str(info.value).startswith(words), (argument, str(info.value))


def test_cpu_hf_reference_logits_checks_gpt2s_positions(cpu):
    torch = cpu
    from inferctx.decoder import build_hf_model, hf_reference_logits, model_spec

    hf = build_hf_model(model_spec("gpt2-tiny", max_positions=8), seed=0)
    prompt = torch.zeros(1, 6, dtype=torch.int64)
    assert hf_reference_logits(hf, prompt, torch.zeros(1, 3, dtype=torch.int64)).shape == (3, 1, 512)  # 8 fed
    with pytest.raises(inferctx.ConfigError) as info:  # was an IndexError from the position embedding
        hf_reference_logits(hf, prompt, torch.zeros(1, 4, dtype=torch.int64))
    assert info.value.argument == "new_tokens" and str(info.value) == (
        "new_tokens: a prompt of 6 tokens and 4 new tokens feed 9 positions, past GPT-2's n_positions=8")


# -- weights a fresh initialisation leaves at zero or one -------------------------------------------

def _perturbed(torch, model, seed):
    """`model` with every parameter moved off its initial value (fresh models have zero biases and
    norm weights of one, which hide a bias or a norm weight that is dropped or taken from elsewhere)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() == 1 else 0.02))
    return model


def _equals_hugging_face(torch, hf, vocab, batch=2, prompt_len=6, new=5, tol=1e-4):
    from inferctx.decoder import CpuContext, ReferenceDecoder, hf_reference_logits

    dec = ReferenceDecoder(hf, batch_size=batch, prompt_len=prompt_len, max_new_tokens=new, dtype="float32",
                           ctx=CpuContext())
    prompt = torch.randint(0, vocab, (batch, prompt_len), generator=torch.Generator().manual_seed(7))
    out = dec.generate(prompt, return_logits=True)
    ref = hf_reference_logits(hf, prompt, out.tokens)
    assert out.logits.shape == ref.shape == (new, batch, vocab)
    for step in range(new):
        err = float((out.logits[step] - ref[step]).abs().max() / ref[step].abs().max())
        assert err <= tol, (step, err)
    assert torch.equal(out.logits.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_cpu_decoder_equals_hugging_face_with_trained_like_biases_and_norm_weights(cpu, name):
    torch = cpu
    from inferctx.decoder import build_hf_model, model_spec

    spec = model_spec(name)
    hf = _perturbed(torch, build_hf_model(spec, seed=0), seed=11)
    _equals_hugging_face(torch, hf, spec.vocab_size)


def test_cpu_llama_with_projection_biases_equals_hugging_face(cpu):
    # Llama-architecture models with q/k/v (and MLP) biases, as Qwen2-style checkpoints have them.
    torch = cpu
    import transformers
    from inferctx.decoder import model_spec

    spec = model_spec("llama-tiny")
    config = spec.hf_config()
    config.attention_bias = True
    config.mlp_bias = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(config).eval()
    _perturbed(torch, hf, seed=12)
    assert hf.model.layers[0].self_attn.k_proj.bias is not None
    _equals_hugging_face(torch, hf, spec.vocab_size)


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny"])
def test_cpu_decoder_reads_the_norm_epsilon_from_the_models_config(cpu, name):
    # A large epsilon makes the norms' epsilon visible in the logits.
    torch = cpu
    import transformers
    from inferctx.decoder import model_spec

    spec = model_spec(name)
    config = spec.hf_config()
    if name == "gpt2-tiny":
        config.layer_norm_epsilon = 0.5
        cls = transformers.GPT2LMHeadModel
    else:
        config.rms_norm_eps = 0.5
        cls = transformers.LlamaForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        hf = cls(config).eval()
    _equals_hugging_face(torch, hf, spec.vocab_size)


@pytest.mark.parametrize("name,fields", [("gpt2-tiny", dict(hidden=64, num_heads=4)),
                                         ("llama-tiny", dict(hidden=256, num_heads=4, num_kv_heads=2))])
def test_cpu_decoder_with_a_head_size_of_a_power_of_four_equals_hugging_face(cpu, name, fields):
    # Heads of 16 or 64: the attention scale 1 / sqrt(head size) is a power of two, applied inside
    # the product rather than after it.
    torch = cpu
    from inferctx.decoder import build_hf_model, model_spec

    spec = model_spec(name, **fields)
    assert spec.head_dim in (16, 64)
    _equals_hugging_face(torch, build_hf_model(spec, seed=0), spec.vocab_size)


# -- the demo's checks of the device, and its report ----------------------------------------------

def test_demo_device_ordinal_must_be_below_the_device_count(monkeypatch):
    import types

    from inferctx import _core, demo

    monkeypatch.setattr(_core, "_device_count", lambda: 2)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    demo._require_gpu(fake_torch, 0)
    demo._require_gpu(fake_torch, 1)
    for device in (2, 3):
        with pytest.raises(demo.DemoError) as info:
            demo._require_gpu(fake_torch, device)
        assert str(info.value) == f"--device: got {device}; valid: 0..1"


@pytest.mark.parametrize("dtype,hint", [("float32", ", or --dtype float16"), ("float16", "")])
def test_demo_refuses_weights_that_take_all_the_free_memory(cpu, dtype, hint):
    # (_check_device plans with the decoder, which needs torch)
    import argparse

    from inferctx import demo
    from inferctx.decoder import model_spec
    from inferctx.planning import human_bytes

    spec = model_spec("gpt2-tiny")
    args = argparse.Namespace(dtype=dtype, device=1, batch=1, prompt_len=8, new_tokens=8)
    free = 3 << 20
    for weights in (free, free + 1):  # nothing left for the workspace
        with pytest.raises(demo.DemoError) as info:
            demo._check_device(spec, args, weights, free, 8 << 30, 0)
        assert str(info.value) == (f"the model's weights need {human_bytes(weights)} in {dtype}, and cuda:1 has "
                                   f"{human_bytes(free)} free; give a smaller --layers, --hidden, --vocab or "
                                   f"--intermediate{hint}")
    demo._check_device(spec, args, 1 << 20, 1 << 30, 8 << 30, 0)  # room for both: no error


def _figures(new_tokens):
    return {"model": "gpt2-tiny", "spec": "gpt2", "dtype": "float16", "seed": 0, "batch": 1, "prompt_len": 4,
            "new_tokens": new_tokens, "graph": True, "workspace_bytes": 1 << 20, "max_tokens": 4 + new_tokens,
            "extra_bytes": 0, "prefill_ms": 1.0, "step_ms_median": 0.5, "tokens_per_s": 2000.0,
            "peak_bytes": 3 << 20, "peak_torch_bytes": 2 << 20, "first_tokens": list(range(min(16, new_tokens)))}


def test_demo_report_marks_tokens_left_out_of_the_first_16(capsys):
    from inferctx import demo

    for new_tokens, tail in ((15, ""), (16, ""), (17, " ...")):
        demo._print(_figures(new_tokens))
        out = capsys.readouterr().out
        line = next(l for l in out.splitlines() if l.startswith("  tokens"))
        assert line == f"  tokens     {list(range(min(16, new_tokens)))}{tail}", line


# -- timing on the CPU ------------------------------------------------------------------------------

def test_cpu_generate_times_the_prefill_and_each_step_in_milliseconds(cpu):
    import time

    torch = cpu
    from inferctx.decoder import CpuContext, ReferenceDecoder, build_hf_model, model_spec

    spec = model_spec("gpt2-tiny")
    dec = ReferenceDecoder(build_hf_model(spec, seed=0), batch_size=1, prompt_len=4, max_new_tokens=5,
                           dtype="float32", ctx=CpuContext())
    prompt = torch.randint(0, spec.vocab_size, (1, 4), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    out = dec.generate(prompt, timing=True)
    wall_ms = (time.perf_counter() - start) * 1e3
    assert out.tokens.shape == (1, 5) and out.graph is False
    assert isinstance(out.prefill_ms, float) and len(out.step_ms) == 4  # one per decode step
    assert all(t > 0 for t in [out.prefill_ms, *out.step_ms])
    assert out.prefill_ms + sum(out.step_ms) <= wall_ms


def test_cpu_prompt_token_ids_outside_the_vocabulary_are_refused(cpu):
    torch = cpu
    spec, ctx, dec = _tiny_llama_on_the_cpu(max_new_tokens=3)
    last = spec.vocab_size - 1
    good = torch.tensor([[0, 1, 2, 3], [last, last, 0, 0]])
    first = dec.generate(good).tokens
    for bad, (lo, hi) in ((good + 1, (1, last + 1)), (good - 1, (-1, last - 1))):
        with pytest.raises(inferctx.ConfigError) as info:
            dec.generate(bad)
        assert info.value.argument == "prompt"
        assert str(info.value) == f"prompt: token ids must be in 0..{last}; got {lo}..{hi}"
        with pytest.raises(inferctx.ConfigError):
            dec.prefill(bad)
    assert torch.equal(dec.generate(good).tokens, first)


# -- the CPU path's graph flag, and a workspace the decoder no longer holds -------------------------

def test_cpu_use_graph_runs_every_step_eagerly(cpu):
    # No CUDA graph exists on the CPU: asking for one runs the same steps eagerly.
    torch = cpu
    from inferctx.decoder import CpuContext, ReferenceDecoder, build_hf_model, model_spec

    spec = model_spec("gpt2-tiny")
    dec = ReferenceDecoder(build_hf_model(spec, seed=0), batch_size=2, prompt_len=4, max_new_tokens=4,
                           dtype="float32", ctx=CpuContext(), use_graph=True)
    assert dec.use_graph is False
    prompt = torch.randint(0, spec.vocab_size, (2, 4), generator=torch.Generator().manual_seed(5))
    want = dec.generate(prompt, use_graph=False).tokens
    out = dec.generate(prompt, use_graph=True)
    assert out.graph is False and torch.equal(out.tokens, want)
    dec.prefill(prompt)
    for _ in range(3):
        dec.step(use_graph=True)
    assert torch.equal(dec.out_ids[:, 4:8], want)


def test_cpu_generate_on_a_workspace_planned_again_or_released_is_refused_before_it_runs(cpu):
    torch = cpu
    spec, ctx, dec = _tiny_llama_on_the_cpu(max_new_tokens=3)
    prompt = torch.randint(0, spec.vocab_size, (2, 4), generator=torch.Generator().manual_seed(6))
    want = dec.generate(prompt).tokens
    tokens = ctx.current_tokens
    dec.release()
    for call, name in ((dec.generate, "generate"), (dec.prefill, "prefill")):
        with pytest.raises(inferctx.WorkspaceStateError) as info:
            call(prompt)
        assert str(info.value) == f"{name}: the workspace is released; call retake() (or ctx.retake_workspace()) first"
    assert ctx.current_tokens == tokens and ctx.released
    dec.retake()
    assert torch.equal(dec.generate(prompt).tokens, want)
    ctx.gen_workspace(spec.model_shape(), batch_size=1, prompt_len=4, max_out_tokens=16, dtype="float32")
    tokens = ctx.current_tokens
    for call, name in ((dec.generate, "generate"), (dec.prefill, "prefill")):
        with pytest.raises(inferctx.WorkspaceStateError) as info:
            call(prompt)
        assert str(info.value) == (f"{name}: the context's workspace was planned again (gen_workspace) since this "
                                   "decoder planned it; make a new ReferenceDecoder")
    assert ctx.current_tokens == tokens


def test_cpu_generate_after_another_decoder_planned_a_smaller_cache_says_to_make_a_new_decoder(cpu):
    # The token limit in force is the other decoder's: checked first, it advised a smaller
    # max_new_tokens that the next call refused all the same (the plan is not this decoder's).
    torch = cpu
    from inferctx.decoder import ReferenceDecoder, build_hf_model

    spec, ctx, first = _tiny_llama_on_the_cpu(max_new_tokens=32)
    ReferenceDecoder(build_hf_model(spec, seed=0), batch_size=2, prompt_len=4, max_new_tokens=2,
                     dtype="float32", ctx=ctx)  # plans a cache of 5 tokens
    prompt = torch.randint(0, spec.vocab_size, (2, 4), generator=torch.Generator().manual_seed(7))
    for n in (None, 2):
        with pytest.raises(inferctx.WorkspaceStateError) as info:
            first.generate(prompt, n)
        assert str(info.value) == ("generate: the context's workspace was planned again (gen_workspace) since "
                                   "this decoder planned it; make a new ReferenceDecoder")


# -- the CPU products hold to inferctx.gemm's contract ------------------------------------------------

def test_cpu_products_scale_accumulate_and_refuse_what_inferctx_gemm_refuses(cpu):
    # The CPU run stands in for the GPU's: an operand the GPU products refuse must be refused here
    # too, or a layout error would pass on the CPU.
    torch = cpu
    from inferctx.decoder import CpuContext
    from inferctx.decoder._backend import CpuBackend

    be = CpuBackend(CpuContext())
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, generator=gen), torch.randn(5, 4, generator=gen)
    out = torch.randn(3, 5, generator=gen)
    want = 0.5 * (a @ b.T) + 0.25 * out
    be.gemm(a, b, out, trans_b=True, alpha=0.5, beta=0.25)
    assert torch.allclose(out, want, rtol=1e-6, atol=1e-6)
    q, k = torch.randn(2, 3, 4, generator=gen), torch.randn(2, 6, 4, generator=gen)
    scores = torch.empty(2, 3, 6)
    be.bmm(q, k, scores, trans_b=True, alpha=0.125)
    assert torch.allclose(scores, 0.125 * (q @ k.transpose(1, 2)), rtol=1e-6, atol=1e-6)

    buf = torch.randn(40, generator=gen)
    cases = [
        ((a, b.double(), torch.empty(3, 5)), "b", "gemm: b is torch.float64, a is torch.float32"),
        ((a, b, torch.empty(3, 5, dtype=torch.float16)), "out", "gemm: out is torch.float16, a is torch.float32"),
        ((buf[:12].view(3, 4), b, buf[6:21].view(3, 5)), "out", "gemm: out shares memory with a"),
        ((a, buf[:20].view(5, 4), buf[19:34].view(3, 5)), "out", "gemm: out shares memory with b"),
        ((torch.randn(3, 8, generator=gen)[:, ::2], b, torch.empty(3, 5)), "a", "gemm: a of shape (3, 4) has strides"),
        ((a, b, torch.empty(3, 4)), "out", "gemm: out has shape (3, 4), expected (3, 5)"),
        ((torch.randn(12, generator=gen).as_strided((3, 4), (2, 1)), b, torch.empty(3, 5)), "a",
         "gemm: a of shape (3, 4) has strides (2, 1)"),  # rows overlapping each other
    ]
    for (x, y, o), argument, words in cases:
        with pytest.raises(inferctx.ConfigError) as info:
            be.gemm(x, y, o, trans_b=True)
        assert info.value.argument == argument and str(info.value).startswith(words), str(info.value)
    be.gemm(buf[:12].view(3, 4), b, buf[12:27].view(3, 5), trans_b=True)  # adjacent, not overlapping


def test_cpu_dropout_zeroes_a_share_p_and_scales_the_rest_by_1_over_1_minus_p(cpu):
    torch = cpu
    from inferctx.decoder import CpuContext
    from inferctx.decoder._backend import CpuBackend

    be = CpuBackend(CpuContext())
    x = torch.ones(256, 64)
    torch.manual_seed(0)
    be.dropout(x, 0.25, torch.zeros(1, dtype=torch.int32))
    kept = x[x != 0]
    assert torch.equal(kept, torch.full_like(kept, 1 / 0.75))
    assert abs(kept.numel() / x.numel() - 0.75) < 0.02 and abs(float(x.mean()) - 1.0) < 0.03


# -- a kept copy given up while released ----------------------------------------------------------

def test_cpu_giving_up_the_kept_contents_while_released_ends_the_sequence(cpu):
    # release(keep_contents=True) then release() gives the kept copy up: the retaken workspace holds
    # no KV cache, and a step must be refused rather than decode from undefined memory.
    torch = cpu
    dec, ctx, prompt, _ = _cpu_decoder_llama(torch)
    for release_kept, release_all, retake in (
            (lambda: dec.release(keep_contents=True), dec.release, dec.retake),
            (lambda: ctx.release_workspace(keep_contents=True), ctx.release_workspace, ctx.retake_workspace)):
        dec.prefill(prompt)
        release_kept()
        release_all()
        retake()
        with pytest.raises(inferctx.WorkspaceStateError, match="^step: "):
            dec.step()
        with pytest.raises(inferctx.WorkspaceStateError, match="^logits: "):
            dec.logits


def _cpu_decoder_llama(torch):
    spec, ctx, dec = _tiny_llama_on_the_cpu(max_new_tokens=3)
    prompt = torch.randint(0, spec.vocab_size, (2, 4), generator=torch.Generator().manual_seed(8))
    return dec, ctx, prompt, spec


def test_cpu_hf_reference_logits_refuses_the_first_id_past_the_vocabulary(cpu):
    torch = cpu
    from inferctx.decoder import build_hf_model, hf_reference_logits, model_spec

    hf = build_hf_model(model_spec("gpt2-tiny"), seed=0)
    prompt = torch.tensor([[0, 511, 3]])
    new = torch.tensor([[511, 0]])
    assert hf_reference_logits(hf, prompt, new).shape == (2, 1, 512)
    for args, name in (((prompt + 1, new), "prompt"), ((prompt, new + 1), "new_tokens")):
        with pytest.raises(inferctx.ConfigError) as info:
            hf_reference_logits(hf, *args)
        assert info.value.argument == name and str(info.value).startswith(f"{name}: token ids must be in 0..511; got ")


def test_demo_seed_is_below_2_63_and_long_numbers_are_described_by_their_size(capsys, monkeypatch):
    code, out, err = run(capsys, "demo", "--seed", str(2 ** 63))
    assert code == 2 and out == ""
    assert err == f"inferctx: error: argument --seed: got {2 ** 63}; it is too large: it must be in 0..2**63-1\n", err
    code, out, err = run(capsys, "demo", "--batch", "9" * 100)
    assert err == ("inferctx: error: argument --batch: got a 100-digit number; it is too large: it must be below "
                   "2**63 = 9,223,372,036,854,775,808\n"), err
    assert _demo_args(monkeypatch, "--model", "gpt2-tiny", "--seed", str(2 ** 63 - 1)).seed == 2 ** 63 - 1


# -- the wording of a plan that does not fit ---------------------------------------------------------

def test_cpu_too_long_offers_only_hints_that_fit_and_leaves_fitting_requests_alone(cpu):
    from inferctx.decoder import model_spec
    from inferctx.decoder._decoder import _too_long
    from inferctx.planning import _context_max_out_tokens

    spec = model_spec("llama-tiny")

    def most(free):
        return _context_max_out_tokens(spec.model_shape(), batch_size=4, prompt_len=32, dtype="float16",
                                       free_bytes=free, total_bytes=free, allocation_granularity=0)

    def refusal(free):
        return inferctx.WorkspaceOOMError("planner", requested_bytes=1 << 40, free_bytes=free, total_bytes=free,
                                          budget_bytes=None, max_batch_size=None)

    lo, hi = 1, 1 << 32  # the least memory that holds the prompt alone
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if most(mid) >= 32 else (mid + 1, hi)
    assert most(lo) == 32
    exc = refusal(lo)
    worded = _too_long(exc, spec, 4, 32, 8, "float16", 0)
    assert worded is not exc and worded.max_out_tokens is None
    assert str(worded).endswith("holds 32 tokens per row; no smaller batch_size or max_new_tokens fits"), str(worded)
    free = 1 << 28
    fit = most(free) - 32
    assert fit > 1
    exc = refusal(free)
    assert _too_long(exc, spec, 4, 32, fit, "float16", 0) is exc  # it fits: the memory went elsewhere
    worded = _too_long(exc, spec, 4, 32, fit + 1, "float16", 0)
    assert str(worded).endswith(f"would fit: max_new_tokens <= {fit}") and worded.max_out_tokens == fit + 32


def test_cpu_context_reset_tokens_takes_the_full_length(cpu):
    torch = cpu
    dec, ctx, _, _ = _cpu_decoder_llama(torch)
    limit = ctx.max_token_length
    assert limit == 7
    ctx.reset_tokens(limit)  # a sequence that fills the KV cache
    assert ctx.current_tokens == limit
    with pytest.raises(inferctx.TokenLimitError):
        ctx.advance_tokens(1)
    with pytest.raises(inferctx.ConfigError) as info:
        ctx.reset_tokens(limit + 1)
    assert info.value.argument == "initial" and str(info.value) == (
        f"initial: reset_tokens got {limit + 1}; valid: 0..{limit} (max_token_length)")


def test_cpu_context_retake_without_kept_contents_gives_undefined_bytes(cpu):
    # Memory given back may hold anything when it comes back: the CPU context refills it with NaN
    # bytes, so a decoder that read stale contents would show it.
    from inferctx.decoder import CpuContext, model_spec

    ctx = CpuContext()
    ctx.gen_workspace(model_spec("llama-tiny").model_shape(), batch_size=1, prompt_len=4, max_out_tokens=8,
                      dtype="float32")
    ctx.workspace.fill_(7)
    ctx.release_workspace(keep_contents=True)
    ctx.retake_workspace()
    assert bool((ctx.workspace == 7).all())
    ctx.release_workspace()
    ctx.retake_workspace()
    assert bool((ctx.workspace == 0xFF).all()) and bool(ctx.activations.isnan().all())


def test_cpu_hf_reference_logits_refuses_a_prompt_of_no_sequences(cpu):
    torch = cpu
    from inferctx.decoder import build_hf_model, hf_reference_logits, model_spec

    hf = build_hf_model(model_spec("gpt2-tiny"), seed=0)
    with pytest.raises(inferctx.ConfigError) as info:
        hf_reference_logits(hf, torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64))
    assert info.value.argument == "prompt" and str(info.value).startswith(
        "prompt: got a (0, 4) tensor; it needs at least one sequence of at least one token")


def test_demo_dropout_takes_zero(capsys, monkeypatch):
    from inferctx import demo

    seen = []

    class Stop(Exception):
        pass

    def checked(spec, args):
        seen.append(args.dropout)
        raise Stop

    monkeypatch.setattr(demo, "_check_sizes", checked)
    for given in ("0", "0.0", "0.5"):
        with pytest.raises(Stop):
            main(["demo", "--model", "gpt2-tiny", "--dropout", given])
    assert seen == [0.0, 0.0, 0.5]


def test_demo_with_no_device_counted_says_so(monkeypatch):
    import types

    from inferctx import _core, demo

    monkeypatch.setattr(_core, "_device_count", lambda: 0)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    with pytest.raises(demo.DemoError) as info:
        demo._require_gpu(fake_torch, 0)
    assert str(info.value) == ("no CUDA device: the demo decodes on a GPU (torch sees none); `inferctx plan --gpu "
                               "PRESET` plans for one without it (`inferctx presets` lists them)")


def test_demo_without_a_cuda_driver_says_what_works_without_one(monkeypatch, capsys):
    # The demo's refusal said only that it decodes on a GPU; it names what works without one.
    from inferctx import _core
    from inferctx.errors import NoCudaDeviceError

    def no_driver():
        raise NoCudaDeviceError("cudaErrorInsufficientDriver: no usable CUDA device or driver.",
                                call="cudaGetDeviceCount", code=35, name="cudaErrorInsufficientDriver")

    monkeypatch.setattr(_core, "_device_count", no_driver)
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out, err = run(capsys, "demo", "--model", "gpt2-tiny")
    assert code == 2 and out == ""
    assert err == ("inferctx demo: no CUDA device (cudaErrorInsufficientDriver): the demo decodes on a GPU; "
                   "`inferctx plan --gpu PRESET` plans for one without it (`inferctx presets` lists them)\n")


def test_cpu_decoder_without_a_gpu_and_no_ctx_names_the_cpu_context(cpu, monkeypatch):
    # ReferenceDecoder(model) with ctx=None on a machine without a GPU said only that no device
    # was found; the decoder runs on the CPU with ctx=CpuContext(), which it names now.
    from inferctx.context import InferenceContext
    from inferctx.decoder import ReferenceDecoder, build_hf_model, model_spec
    from inferctx.errors import NoCudaDeviceError

    def no_device(device=None):
        raise NoCudaDeviceError("cudaErrorNoDevice: no usable CUDA device or driver.", call="cudaGetDeviceCount",
                                code=100, name="cudaErrorNoDevice")

    monkeypatch.setattr(InferenceContext, "instance", staticmethod(no_device))
    hf = build_hf_model(model_spec("gpt2-tiny"), seed=0)
    with pytest.raises(NoCudaDeviceError) as info:
        ReferenceDecoder(hf, batch_size=1, prompt_len=4, max_new_tokens=2, dtype="float32")
    assert info.value.message == ("cudaErrorNoDevice: no usable CUDA device or driver. ReferenceDecoder decodes on "
                                  "the CPU with ctx=CpuContext() (inferctx.decoder.CpuContext).")
    assert (info.value.call, info.value.code, info.value.name) == ("cudaGetDeviceCount", 100, "cudaErrorNoDevice")
