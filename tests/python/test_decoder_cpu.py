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


# -- GPT-2's positions ------------------------------------------------------------------------------

def test_cpu_a_prompt_that_fills_gpt2s_positions_is_blamed_on_prompt_len(cpu):
    # prompt_len=8 on n_positions=8 leaves no position for any new token: the error named
    # max_new_tokens, which no value could satisfy.
    from inferctx.decoder import CpuContext, ReferenceDecoder, build_hf_model, model_spec

    hf = build_hf_model(model_spec("gpt2-tiny", max_positions=8), seed=0)
    for prompt_len in (8, 9):
        with pytest.raises(inferctx.ConfigError) as info:
            ReferenceDecoder(hf, batch_size=1, prompt_len=prompt_len, max_new_tokens=1, dtype="float32",
                             ctx=CpuContext())
        assert info.value.argument == "prompt_len"
        assert str(info.value) == (f"prompt_len: got {prompt_len}; GPT-2's n_positions=8 must hold the prompt and at "
                                   f"least one new token: prompt_len <= 7")
    with pytest.raises(inferctx.ConfigError) as info:  # room left: the new tokens, and how many fit
        ReferenceDecoder(hf, batch_size=1, prompt_len=6, max_new_tokens=3, dtype="float32", ctx=CpuContext())
    assert info.value.argument == "max_new_tokens"
    assert str(info.value) == ("max_new_tokens: prompt_len + max_new_tokens = 9 passes GPT-2's n_positions=8; "
                               "max_new_tokens <= 2 fits")
    assert ReferenceDecoder(hf, batch_size=1, prompt_len=6, max_new_tokens=2, dtype="float32",
                            ctx=CpuContext()).max_tokens == 8


def test_demo_a_prompt_that_fills_gpt2s_positions_is_blamed_on_prompt_len(capsys):
    code, out, err = run(capsys, "demo", "--model", "gpt2-tiny", "--prompt-len", "256", "--new-tokens", "1")
    assert code == 2 and out == ""
    assert err == ("inferctx demo: --prompt-len: got 256; GPT-2's n_positions=256 must hold the prompt and at least "
                   "one new token: --prompt-len <= 255\n"), err
    code, out, err = run(capsys, "demo", "--model", "gpt2-tiny", "--prompt-len", "200", "--new-tokens", "100")
    assert code == 2 and out == ""
    assert err == ("inferctx demo: --new-tokens: --prompt-len + --new-tokens = 300 passes GPT-2's n_positions=256; "
                   "--new-tokens <= 56 fits\n"), err


# -- the demo's flags -----------------------------------------------------------------------------

@pytest.mark.parametrize("given,name", [("half", "float16"), ("f16", "float16"), ("FP16", "float16"),
                                        ("single", "float32"), ("f32", "float32"), ("BF16", "bfloat16"),
                                        ("float16", "float16"), ("bf16", "bfloat16")])
def test_demo_dtype_takes_the_names_inferctx_plan_takes(capsys, monkeypatch, given, name):
    # The demo's --dtype had a list of six spellings of its own: `inferctx plan --dtype half` (and
    # the decoder's dtype="half") was taken, `inferctx demo --dtype half` refused.
    from inferctx import demo
    from inferctx.dtypes import dtype_name

    assert dtype_name(given) == name  # the planner's reading

    seen = []

    class Stop(Exception):
        pass

    def checked(spec, args):
        seen.append(args.dtype)
        raise Stop

    monkeypatch.setattr(demo, "_check_sizes", checked)
    with pytest.raises(Stop):
        main(["demo", "--model", "gpt2-tiny", "--dtype", given])
    assert seen == [name]


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
