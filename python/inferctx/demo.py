"""`inferctx demo`: greedy generation with the reference decoder (inferctx.decoder) on a GPU.

A GPT-2 or Llama-architecture model with random weights (seeded; nothing downloaded) decodes a
random prompt inside an inferctx workspace, each decode step replayed from a CUDA graph. It
prints the plan, the prefill time, the per-step time and tokens/s of the decode steps, and the
peak memory (torch's peak allocation plus the workspace); ``--compare-hf`` runs transformers'
``generate`` on the same model too and compares the tokens.

Needs torch and transformers (``pip install 'inferctx[demo]'``) and a CUDA device. Without them
it says so in one line on stderr and exits with status 2, as for any bad flag. Nothing here
imports torch until the flags are checked.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from typing import Any

from .errors import _brief

__all__ = ["add_demo_parser", "run_demo", "DemoError"]

INSTALL = "pip install 'inferctx[demo]'"
# the decoder's argument names as the demo's flags
_FLAGS = {"num_layers": "--layers", "hidden": "--hidden", "num_heads": "--heads", "num_kv_heads": "--kv-heads",
          "vocab_size": "--vocab", "intermediate": "--intermediate", "max_new_tokens": "--new-tokens",
          "batch_size": "--batch", "prompt_len": "--prompt-len", "max_positions": "the model's positions",
          "head_dim": "the head size (--hidden / --heads)"}


class DemoError(Exception):
    """The demo cannot run: a missing package or GPU, or flags the model does not take (one line)."""


def _flag_terms(message: str) -> str:
    names = sorted(_FLAGS, key=len, reverse=True)
    return re.sub(r"(?<![\w-])(" + "|".join(names) + r")(?![\w])", lambda m: _FLAGS[m.group(1)], message)


# A whole number as typed: its sign, and its digits from the first that is not a leading zero.
_DIGITS = re.compile(r"([+-]?)0*(\d+)")


def _whole_parts(text: str) -> tuple[str, str] | None:
    """The sign ('', '+' or '-') and the digits, leading zeros dropped, of a whole number as a flag
    takes it (spaces around it and '_' between digits allowed: what int() reads); None for text
    that is none. The flags' parsers all read numbers through it."""
    number = _DIGITS.fullmatch(text.strip().replace("_", ""))
    return None if number is None else (number.group(1), number.group(2))


def _whole(text: str, low: int, high: int, valid: str) -> int:
    """A whole number in [low, high]; ArgumentTypeError saying `valid` otherwise. A number too long
    for int() (over 4300 digits) is described by its size, not taken for a non-number."""
    parts = _whole_parts(text)
    if parts is None:
        raise argparse.ArgumentTypeError(f"got {_brief(text)}; it must be a whole number")
    sign, digits = parts
    if len(digits) > 40:  # past int64, and maybe past int()'s limit
        size = f"{len(digits):,}-digit number"
        if sign == "-":
            raise argparse.ArgumentTypeError(f"got a negative {size}; it must be >= {low}")
        raise argparse.ArgumentTypeError(f"got a {size}; it is too large: {valid}")
    value = int(sign + digits, 10)
    if value < low:
        raise argparse.ArgumentTypeError(f"got {value}; it must be >= {low}")
    if value > high:
        raise argparse.ArgumentTypeError(f"got {value}; it is too large: {valid}")
    return value


def _positive(text: str) -> int:
    return _whole(text, 1, (1 << 63) - 1, "it must be below 2**63 = 9,223,372,036,854,775,808")


def _device(text: str) -> int:
    return _whole(text, 0, (1 << 31) - 1, "it must be a device ordinal below 2**31")


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"got {_brief(text)}; it must be a number in [0, 1)") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"got {_brief(text.strip())}; it must be in [0, 1)")
    return value


def _seed(text: str) -> int:
    return _whole(text, 0, (1 << 63) - 1, "it must be in 0..2**63-1")


def _dtype(text: str) -> str:
    """The canonical dtype name of a name or alias, as `inferctx plan --dtype` and the decoder read it
    (the package's one alias table: case and spaces aside, 'fp16', 'half', 'bf16', 'fp32', ...)."""
    from .dtypes import VALID, dtype_name
    from .errors import ConfigError

    try:
        return dtype_name(text, "--dtype")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"got {_brief(text)}; valid: {VALID}") from None


def add_demo_parser(sub: Any) -> None:
    """Adds the `demo` subcommand to the CLI's subparsers."""
    from .decoder import ALIASES, PRESETS

    models = [*ALIASES, *PRESETS]
    d = sub.add_parser("demo", help="greedy decoding in the workspace with CUDA graphs (needs a GPU, torch, "
                       "transformers)", description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""))
    # Names as `plan --preset` reads them: any case, '_' for '-'.
    d.add_argument("--model", default="gpt2", choices=models, metavar="NAME",
                   type=lambda text: text.strip().lower().replace("_", "-"),
                   help=f"{', '.join(models)} (default gpt2 = gpt2-small; any case)")
    for flag, what in (("--layers", "layers"), ("--hidden", "hidden size"), ("--heads", "attention heads"),
                       ("--kv-heads", "KV heads (llama)"), ("--vocab", "vocabulary size"),
                       ("--intermediate", "MLP size")):
        d.add_argument(flag, type=_positive, metavar="N", help=f"override the preset's {what}")
    d.add_argument("--batch", type=_positive, default=1, metavar="N", help="sequences (default 1)")
    d.add_argument("--prompt-len", type=_positive, default=32, metavar="N", help="prompt tokens (default 32)")
    d.add_argument("--new-tokens", type=_positive, default=128, metavar="N",
                   help="tokens to generate (default 128)")
    d.add_argument("--dtype", type=_dtype, default="float16", metavar="DTYPE",
                   help="float16 (default), bfloat16 or float32 (or an alias: fp16, half, bf16, fp32)")
    d.add_argument("--seed", type=_seed, default=0, metavar="N", help="weights' and prompt's seed (default 0)")
    d.add_argument("--dropout", type=_probability, default=0.0, metavar="P",
                   help="MC-dropout probability on each block's output (default 0: none)")
    d.add_argument("--device", type=_device, default=0, metavar="N", help="CUDA device (default 0)")
    d.add_argument("--no-graph", action="store_true", help="run every decode step eagerly")
    d.add_argument("--compare-hf", action="store_true", help="also run transformers' generate and compare")
    d.add_argument("--json", action="store_true", help="print the figures as JSON")


def _requirements() -> tuple[Any, Any]:
    """torch and transformers, or DemoError saying how to install them (looked for before either
    is imported: transformers without torch would print a warning of its own)."""
    import importlib
    import importlib.util

    missing = []
    for name in ("torch", "transformers"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module set to None, or without a spec
            found = False
        if not found:
            missing.append(name)
    if missing:
        raise DemoError(f"the demo needs {' and '.join(missing)}: {INSTALL}")
    return importlib.import_module("torch"), importlib.import_module("transformers")


def _require_gpu(torch: Any, device: int) -> None:
    from . import _core
    from .errors import NoCudaDeviceError

    # What works without one: planning for a GPU by its preset.
    instead = "; `inferctx plan --gpu PRESET` plans for one without it (`inferctx presets` lists them)"
    try:
        count = int(_core._device_count())
    except NoCudaDeviceError as exc:
        raise DemoError(f"no CUDA device ({exc.name}): the demo decodes on a GPU{instead}") from None
    if count == 0 or not torch.cuda.is_available():
        raise DemoError(f"no CUDA device: the demo decodes on a GPU (torch sees none){instead}")
    if not 0 <= device < count:
        raise DemoError(f"--device: got {device}; valid: 0..{count - 1}")


def _check_sizes(spec: Any, args: argparse.Namespace) -> int:
    """What can be checked without a GPU, before anything is imported or built: the request's
    token and byte counts fit 64 bits (ConfigError in the decoder's terms), and the model's
    weights and workspace fit them too (DemoError). Returns the weights' bytes in the dtype."""
    from ._plan_args import INT64_MAX
    from .decoder._spec import _check_request, dtype_name
    from .dtypes import ITEMSIZE, dtype_code
    from .errors import WorkspaceOOMError
    from .planning import human_bytes, plan_workspace

    dtype = dtype_name(args.dtype)
    _check_request(spec, args.batch, args.prompt_len, args.new_tokens, dtype)
    weights = int(spec.num_params) * ITEMSIZE[dtype_code(dtype)]
    sizes = "--layers, --hidden, --vocab or --intermediate"
    if weights > INT64_MAX:
        raise DemoError(f"the model has {spec.num_params:,} parameters: in {dtype} its weights need more than "
                        f"2**63 bytes; give a smaller {sizes}")
    total = args.prompt_len + args.new_tokens
    try:
        plan_workspace(spec.model_shape(), batch_size=args.batch, prompt_len=args.prompt_len, max_out_tokens=total,
                       min_out_tokens=total, dtype=dtype, free_bytes=INT64_MAX, total_bytes=INT64_MAX,
                       weights_bytes=weights)
    except WorkspaceOOMError:
        raise DemoError(f"the model's weights ({human_bytes(weights)} in {dtype}) and its workspace need more than "
                        f"2**63 bytes; give a smaller {sizes}, --batch or --new-tokens") from None
    return weights


def _device_memory(device: int) -> tuple[Any, int, int]:
    """The device's context (made first: its own memory is then taken), and free and total memory."""
    from .context import InferenceContext
    from .planning import _device_memory as memory

    ctx = InferenceContext.instance(device)
    free, total = memory(device)
    return ctx, free, total


def _check_device(spec: Any, args: argparse.Namespace, weights: int, free: int, total: int,
                  granularity: int) -> None:
    """The plan ReferenceDecoder will make, made before the model is built: the weights (in the
    dtype) taken from the free memory, the rest for the workspace; DemoError in the flags' terms
    where it does not fit (a model too large for the device is never built)."""
    from .decoder._decoder import _too_long
    from .decoder._spec import dtype_name
    from .errors import WorkspaceOOMError
    from .planning import human_bytes, plan_workspace

    dtype = dtype_name(args.dtype)
    if weights >= free:
        smaller = ", or --dtype float16" if dtype == "float32" else ""
        raise DemoError(f"the model's weights need {human_bytes(weights)} in {dtype}, and cuda:{args.device} has "
                        f"{human_bytes(free)} free; give a smaller --layers, --hidden, --vocab or "
                        f"--intermediate{smaller}")
    n = args.prompt_len + args.new_tokens
    try:
        plan_workspace(spec.model_shape(), batch_size=args.batch, prompt_len=args.prompt_len, max_out_tokens=n,
                       min_out_tokens=n, dtype=dtype, free_bytes=free - weights, total_bytes=total)
    except WorkspaceOOMError as exc:
        worded = _too_long(exc, spec, args.batch, args.prompt_len, args.new_tokens, dtype, granularity)
        raise DemoError(_flag_terms(str(worded))) from None


def run_demo(args: argparse.Namespace) -> int:
    """Runs `inferctx demo`; DemoError (status 2) when torch, transformers or a GPU is missing."""
    from .decoder import model_spec
    from .decoder._spec import _check_positions
    from .errors import ConfigError, WorkspaceOOMError

    try:
        spec = model_spec(args.model, num_layers=args.layers, hidden=args.hidden, num_heads=args.heads,
                          num_kv_heads=args.kv_heads, vocab_size=args.vocab, intermediate=args.intermediate)
        _check_positions(spec, args.prompt_len, args.new_tokens)
        weights = _check_sizes(spec, args)
    except ConfigError as exc:
        raise DemoError(_flag_terms(str(exc))) from None
    torch, _ = _requirements()
    _require_gpu(torch, args.device)
    from .decoder import ReferenceDecoder, build_hf_model

    torch.cuda.set_device(args.device)
    device = torch.device("cuda", args.device)
    ctx, free, total = _device_memory(args.device)
    _check_device(spec, args, weights, free, total, int(getattr(ctx, "allocation_granularity", 0)))
    hf = build_hf_model(spec, seed=args.seed)
    try:
        dec = ReferenceDecoder(hf, batch_size=args.batch, prompt_len=args.prompt_len,
                               max_new_tokens=args.new_tokens, dtype=args.dtype, ctx=ctx, dropout=args.dropout,
                               use_graph=not args.no_graph)
    except (ConfigError, WorkspaceOOMError) as exc:
        raise DemoError(_flag_terms(str(exc))) from None
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, spec.vocab_size, (args.batch, args.prompt_len), generator=gen).to(device)
    dec.generate(prompt)  # warm-up: the first decode step runs eagerly and is captured
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = dec.generate(prompt, timing=True)
    steps = out.step_ms
    decode_s = sum(steps) / 1e3
    figures: dict[str, Any] = {
        "model": args.model, "spec": spec.describe(), "dtype": dec.dtype_name, "batch": args.batch,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "seed": args.seed,
        "graph": out.graph, "max_tokens": dec.max_tokens, "workspace_bytes": dec.workspace_bytes,
        "extra_bytes": dec.extra_bytes, "prefill_ms": out.prefill_ms,
        "step_ms_median": statistics.median(steps) if steps else None,
        "tokens_per_s": args.batch * len(steps) / decode_s if decode_s > 0 else None,
        "peak_torch_bytes": int(torch.cuda.max_memory_allocated(device)),
        "first_tokens": out.tokens[0, :16].tolist(),
    }
    figures["peak_bytes"] = figures["peak_torch_bytes"] + dec.workspace_bytes
    if args.compare_hf:
        figures.update(_compare(torch, hf, dec, prompt, out.tokens, args.new_tokens, device))
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        _print(figures)
    return 0


def _whole_ms(torch: Any, run: Any) -> float:
    """CUDA-event time of one whole call (prefill and every step), on the caller's stream, which
    the decoder joins at its start and end."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def _compare(torch: Any, hf: Any, dec: Any, prompt: Any, tokens: Any, n: int, device: Any) -> dict[str, Any]:
    """transformers' greedy generate on the same model and dtype: its time and whether its tokens
    agree; and ours timed the same way (the whole generate, prefill included)."""
    model = hf.to(device=device, dtype=dec.dtype)
    from .decoder._models import _hf_generate_kwargs

    kwargs = _hf_generate_kwargs(prompt, n)
    with torch.no_grad():
        model.generate(prompt, **kwargs)  # warm-up
        torch.cuda.synchronize(device)
        theirs = None

        def hf_generate() -> None:
            nonlocal theirs
            theirs = model.generate(prompt, **kwargs)[:, prompt.shape[1]:]

        ms = _whole_ms(torch, hf_generate)
    ours_ms = _whole_ms(torch, lambda: dec.generate(prompt))
    assert theirs is not None
    equal = theirs.shape == tokens.shape and bool((theirs == tokens).all())
    first = None
    if not equal:
        differs = (theirs != tokens).any(0).nonzero()
        first = int(differs[0]) if len(differs) else None
    rows = prompt.shape[0]
    return {"hf_generate_ms": ms, "hf_tokens_per_s": rows * n / (ms / 1e3),
            "generate_ms": ours_ms, "generate_tokens_per_s": rows * n / (ours_ms / 1e3),
            "hf_tokens_equal": equal, "hf_first_difference": first}


def _print(f: dict[str, Any]) -> None:
    mib = 1 << 20
    print(f"inferctx demo: {f['model']} ({f['spec']}), {f['dtype']}, seed {f['seed']}")
    print(f"  request    batch {f['batch']}, prompt {f['prompt_len']}, {f['new_tokens']} new tokens; "
          f"{'decode steps replayed from one CUDA graph' if f['graph'] else 'decode steps eager'}")
    extra = f", {f['extra_bytes'] / mib:.2f} MiB outside it" if f["extra_bytes"] else ""
    print(f"  workspace  {f['workspace_bytes'] / mib:.2f} MiB for {f['max_tokens']} tokens{extra}")
    print(f"  prefill    {f['prefill_ms']:.3f} ms")
    if f["step_ms_median"] is not None:
        print(f"  decode     {f['step_ms_median']:.3f} ms/step (median), {f['tokens_per_s']:,.0f} tokens/s")
    print(f"  memory     peak {f['peak_bytes'] / mib:.1f} MiB = torch {f['peak_torch_bytes'] / mib:.1f} MiB "
          f"+ workspace {f['workspace_bytes'] / mib:.1f} MiB")
    print(f"  tokens     {f['first_tokens']}{' ...' if f['new_tokens'] > 16 else ''}")
    if "hf_tokens_equal" in f:
        same = "equal" if f["hf_tokens_equal"] else f"differ from step {f['hf_first_difference']}"
        # Both whole generate calls, prefill included (the decode line above counts steps alone).
        print(f"  generate   {f['generate_ms'] / max(1, f['new_tokens']):.3f} ms/token, "
              f"{f['generate_tokens_per_s']:,.0f} tokens/s (prefill and steps)")
        print(f"  transformers generate: {f['hf_generate_ms'] / max(1, f['new_tokens']):.3f} ms/token, "
              f"{f['hf_tokens_per_s']:,.0f} tokens/s; tokens {same}")


def main(argv: list[str] | None = None) -> int:  # `python -m inferctx.demo ...`
    from .cli import main as cli_main

    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
