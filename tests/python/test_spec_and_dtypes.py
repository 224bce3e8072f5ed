"""Dtype names, how error messages show the values they name, and the reference decoder's model
specs: what each takes, what each refuses and which argument a refusal names. No GPU needed."""

import pytest

from inferctx import errors
from inferctx.decoder import ModelSpec, model_spec
from inferctx.dtypes import BFLOAT16, FLOAT16, FLOAT32, dtype_code, dtype_name
from inferctx.errors import ConfigError

# ---------------------------------------------------------------------------------------
# Dtypes


@pytest.mark.parametrize("given, code", [(" FP16\n", FLOAT16), ("\tBFloat16 ", BFLOAT16), (" float32", FLOAT32),
                                         ("Half", FLOAT16)])
def test_dtype_names_are_read_whatever_their_case_and_surrounding_blanks(given, code):
    assert dtype_code(given) == code
    assert dtype_name(given) == {FLOAT32: "float32", FLOAT16: "float16", BFLOAT16: "bfloat16"}[code]


@pytest.mark.parametrize("call", [dtype_code, dtype_name])
def test_a_dtype_refusal_names_the_callers_argument(call):
    # The demo reads its --dtype flag through dtype_name: the error names the flag, not "dtype".
    with pytest.raises(ConfigError) as info:
        call("int8", "--dtype")
    assert info.value.argument == "--dtype"
    assert str(info.value).startswith("--dtype: got 'int8'; valid: 'float32' ('fp32')"), str(info.value)
    with pytest.raises(ConfigError) as info:
        call("int8")
    assert info.value.argument == "dtype" and str(info.value).startswith("dtype: got 'int8'")


# ---------------------------------------------------------------------------------------
# Values as error messages show them


def test_a_long_string_is_clipped_and_its_length_given_in_characters():
    assert errors._brief("a" * 58) == repr("a" * 58)  # 60 characters with its quotes: shown whole
    assert errors._brief("a" * 100) == f"{'a' * 60!r}... (100 characters)"


def test_a_long_repr_is_clipped_to_the_limit():
    assert errors._brief(list(range(17))) == repr(list(range(17)))  # 58 characters
    assert errors._brief(list(range(40))) == f"{repr(list(range(40)))[:60]}... (150 characters)"
    assert errors._brief(list(range(40)), limit=200) == repr(list(range(40)))


def test_a_huge_list_whose_repr_fails_is_shown_by_its_first_items_only():
    # Its items are not all described: a message about a list of a million values stays short
    # and quick to make.
    got = errors._brief([10 ** 5000] * 1_000_000)
    assert got == "[an integer of 16610 bits, an integer of 16610 bits, an inte... (83 characters)"


# ---------------------------------------------------------------------------------------
# Model specs

_TINY_GPT2 = dict(arch="gpt2", num_layers=2, hidden=128, num_heads=4, num_kv_heads=4, vocab_size=512,
                  intermediate=512, max_positions=256)


@pytest.mark.parametrize("field", ["num_layers", "hidden", "num_heads", "num_kv_heads", "vocab_size",
                                   "intermediate", "max_positions"])
def test_a_spec_count_must_be_at_least_1_and_below_2_63(field):
    for bad in (0, -1):
        with pytest.raises(ConfigError) as info:
            ModelSpec(**dict(_TINY_GPT2, **{field: bad}))
        assert info.value.argument == field
        assert str(info.value) == f"{field}: got {bad}; it must be a positive integer", str(info.value)
    with pytest.raises(ConfigError) as info:
        ModelSpec(**dict(_TINY_GPT2, **{field: 2 ** 63}))
    assert info.value.argument == field and "below 2**63" in str(info.value), str(info.value)


def test_a_hidden_size_the_heads_do_not_divide_is_refused_without_a_head_dim():
    with pytest.raises(ConfigError) as info:
        ModelSpec("llama", 2, 100, 8, 2, 512, 256, 512)
    assert info.value.argument == "hidden" and "not divisible by num_heads=8" in str(info.value)
    # With a head size given, the hidden size need not be a multiple of it (Llama).
    assert ModelSpec("llama", 2, 100, 8, 2, 512, 256, 512, head_dim=16).head_dim == 16


def test_gpt2_has_as_many_kv_heads_as_query_heads():
    with pytest.raises(ConfigError) as info:
        ModelSpec(**dict(_TINY_GPT2, num_kv_heads=2))
    assert info.value.argument == "num_kv_heads" and "GPT-2 has multi-head attention" in str(info.value)
    with pytest.raises(ConfigError) as info:
        model_spec("gpt2-tiny", num_kv_heads=2)
    assert info.value.argument == "num_kv_heads"


def test_gpt2s_head_size_is_hidden_over_num_heads():
    with pytest.raises(ConfigError) as info:
        ModelSpec(**dict(_TINY_GPT2, head_dim=16))
    assert info.value.argument == "head_dim" and "hidden / num_heads" in str(info.value)
    assert ModelSpec(**dict(_TINY_GPT2, head_dim=32)).head_dim == 32


# Shapes Hugging Face builds from a spec: the presets, Llama with fewer KV heads and a head size
# of its own, GPT-2 without an intermediate size given.
_HF_SHAPES = [
    ("gpt2-tiny", {}),
    ("llama-tiny", {}),
    ("llama-tiny", dict(num_kv_heads=4, head_dim=48, intermediate=200)),
    ("gpt2-tiny", dict(hidden=96, num_heads=3, num_layers=1)),
]


@pytest.mark.parametrize("name, overrides", _HF_SHAPES)
def test_num_params_is_the_hugging_face_models_parameter_count(name, overrides):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    spec = model_spec(name, **overrides)
    cls = transformers.GPT2LMHeadModel if spec.arch == "gpt2" else transformers.LlamaForCausalLM
    with torch.device("meta"):  # shapes only: nothing allocated
        model = cls(spec.hf_config())
    assert spec.num_params == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, overrides", _HF_SHAPES)
def test_a_spec_comes_back_from_its_hugging_face_config(name, overrides):
    pytest.importorskip("transformers")
    spec = model_spec(name, **overrides)
    assert ModelSpec.from_hf_config(spec.hf_config()) == spec


def test_the_planned_shape_keeps_a_head_size_of_the_specs_own():
    # A workspace planned for hidden / num_heads-sized heads would be too small for wider ones.
    from inferctx.planning import ModelShape

    wide = model_spec("llama-tiny", head_dim=48)
    assert wide.model_shape() == ModelShape(2, 8, 256, num_kv_heads=2, head_dim=48)
    assert model_spec("llama-tiny").model_shape() == ModelShape(2, 8, 256, num_kv_heads=2, head_dim=32)
    assert model_spec("gpt2-tiny").model_shape() == ModelShape(2, 4, 128, num_kv_heads=4, head_dim=32)


def test_describe_names_the_kv_heads_where_fewer():
    assert model_spec("llama-tiny").describe() == ("llama: 2 layers, 8 heads (2 KV) of 32, hidden 256, "
                                                   "intermediate 688, vocab 512")
    assert model_spec("gpt2-tiny").describe() == "gpt2: 2 layers, 4 heads of 32, hidden 128, intermediate 512, vocab 512"


def test_a_gpt2_config_without_n_inner_has_an_mlp_of_4_x_hidden():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    assert config.n_inner is None
    spec = ModelSpec.from_hf_config(config)
    assert (spec.intermediate, spec.hidden, spec.num_heads, spec.num_kv_heads) == (256, 64, 4, 4)


@pytest.mark.parametrize("option", [dict(scale_attn_by_inverse_layer_idx=True), dict(reorder_and_upcast_attn=True),
                                    dict(add_cross_attention=True), dict(scale_attn_weights=False),
                                    dict(activation_function="relu")])
def test_gpt2_options_the_reference_decoder_lacks_are_refused(option):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64, **option)
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_hf_config(config)
    assert info.value.argument == "model" and "GPT-2" in str(info.value), str(info.value)


def _llama_config(**options):
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=128, vocab_size=100, max_position_embeddings=64, **options)


def test_a_plain_llama_config_is_taken():
    spec = ModelSpec.from_hf_config(_llama_config())
    assert (spec.arch, spec.hidden, spec.num_heads, spec.num_kv_heads, spec.head_dim) == ("llama", 64, 4, 2, 16)


@pytest.mark.parametrize("option", [dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
                                    dict(hidden_act="gelu"), dict(pretraining_tp=2)])
def test_llama_options_the_reference_decoder_lacks_are_refused(option):
    config = _llama_config(**option)
    with pytest.raises(ConfigError) as info:
        ModelSpec.from_hf_config(config)
    assert info.value.argument == "model" and "only Llama with default RoPE" in str(info.value), str(info.value)


def test_model_spec_names_an_override_that_is_no_field():
    with pytest.raises(ConfigError) as info:
        model_spec("llama", layers=2)
    assert info.value.argument == "layers"
    assert str(info.value).startswith("layers: not a field of the model; valid: num_layers, hidden"), str(info.value)


@pytest.mark.parametrize("overrides, field", [(dict(hidden=2 ** 60, num_heads=2, num_kv_heads=2), "hidden"),
                                              (dict(head_dim=2 ** 58), "head_dim"),
                                              (dict(num_layers=2 ** 62), "num_layers")])
def test_a_model_size_whose_workspace_overflows_is_named_by_the_specs_field(overrides, field):
    # The planner names its own fields (hidden_dim); the refusal names the spec's (hidden).
    from inferctx.decoder._spec import _check_request

    spec = model_spec("llama-tiny", **overrides)
    with pytest.raises(ConfigError) as info:
        _check_request(spec, 1, 16, 16, "float32")
    assert info.value.argument == "model"
    assert str(info.value).startswith(f"model: the model's {field}={getattr(spec, field)} makes the workspace's "
                                      f"byte count overflow 64 bits"), str(info.value)
    assert str(info.value).endswith(f"reduce {field}")


@pytest.mark.parametrize("max_new_tokens", [2 ** 63 - 1, 2 ** 63 - 2])
def test_a_token_count_from_2_63_is_refused_as_past_int64(max_new_tokens):
    from inferctx.decoder._spec import _check_request

    with pytest.raises(ConfigError) as info:
        _check_request(model_spec("llama-tiny"), 1, 2 ** 63 - max_new_tokens, max_new_tokens, "float32")
    assert info.value.argument == "max_new_tokens"
    assert str(info.value) == (f"max_new_tokens: prompt_len + max_new_tokens = {2 ** 63} tokens; it must be "
                               f"below 2**63"), str(info.value)


def test_a_workspace_past_any_memory_but_within_64_bits_is_left_to_the_contexts_plan():
    # Larger than 2**63 bytes yet countable: no ConfigError of the request's; the context's own
    # plan says that no device holds it.
    from inferctx.decoder._spec import _check_request
    from inferctx.errors import WorkspaceOOMError
    from inferctx.planning import plan_workspace

    def planned(num_layers):
        spec = model_spec("llama-tiny", num_layers=num_layers)
        try:
            plan_workspace(spec.model_shape(), batch_size=1, prompt_len=16, max_out_tokens=32, min_out_tokens=32,
                           dtype="float32", free_bytes=2 ** 63 - 1, total_bytes=2 ** 63 - 1)
        except WorkspaceOOMError:
            return "too large"
        except ConfigError:
            return "overflows"
        return "fits"

    fits, overflows = 1, 2 ** 62
    assert planned(fits) == "fits" and planned(overflows) == "overflows"
    while overflows - fits > 1:  # the first layer count that no longer fits
        middle = (fits + overflows) // 2
        if planned(middle) == "fits":
            fits = middle
        else:
            overflows = middle
    assert planned(overflows) == "too large"
    assert _check_request(model_spec("llama-tiny", num_layers=overflows), 1, 16, 16, "float32") is None


def test_a_prompt_that_leaves_no_room_for_one_new_token_is_blamed_on_prompt_len():
    # At the 64-bit edge: a prompt whose own tokens fit, but not one more, is the prompt's fault,
    # however few new tokens are asked for.
    from inferctx.decoder._spec import _check_request

    spec = model_spec("llama-tiny")

    def overflows(tokens):
        try:
            _check_request(spec, 1, 1, tokens - 1, "float32")
        except ConfigError:
            return True
        return False

    fits, too_many = 1, 2 ** 63 - 1
    assert not overflows(fits) and overflows(too_many)
    while too_many - fits > 1:  # the most tokens whose workspace can be counted
        middle = (fits + too_many) // 2
        if overflows(middle):
            too_many = middle
        else:
            fits = middle
    _check_request(spec, 1, fits, 0, "float32")  # the prompt alone is countable
    for new_tokens in (1, 5):
        with pytest.raises(ConfigError) as info:
            _check_request(spec, 1, fits, new_tokens, "float32")
        assert info.value.argument == "prompt_len", str(info.value)
        assert "with any max_new_tokens; reduce prompt_len" in str(info.value)
    with pytest.raises(ConfigError) as info:
        _check_request(spec, 1, fits - 1, 5, "float32")
    assert info.value.argument == "max_new_tokens", str(info.value)
