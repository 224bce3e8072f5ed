"""The `inferctx` command: `inferctx plan ...`, `inferctx presets` and `inferctx demo` (demo.py).

Every failure is one line on stderr in the command's own terms (flag names, GiB for the
flags given in GiB) and exit status 2; a bare `inferctx` prints the usage on stderr and exits
2 as well. Output cut short by the reader (`inferctx presets --json | head`) ends quietly
with status 0; Ctrl-C ends with one line and status 130.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import secrets
import sys
import textwrap
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from . import __version__, presets
from .demo import DemoError, _whole_parts, add_demo_parser, run_demo
from .dtypes import VALID, dtype_name
from .errors import ConfigError, InferCtxError, NoCudaDeviceError, WorkspaceOOMError, _brief
from .planning import (ModelShape, WorkspacePlan, human_bytes, max_batch_size, max_out_tokens_for,
                       plan_workspace)

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

GIB = 1 << 30
INT64_MAX = (1 << 63) - 1
MAX_SWEEP = 4096  # rows of --sweep-batch

_EPILOG = f"""\
memory: --gpu PRESET plans against the preset's total less {presets.CUDA_OVERHEAD_MIB} MiB (the CUDA driver's
reservation, a context and cuBLAS, measured on an H200) less the model's weights, which
--weights auto (the default with --preset and --gpu) works out from the preset's parameter
count (parameters x dtype size / --mp-size). --free-gb and the real device (--device, or no
memory flag) give free memory as it is now: the weights are taken as loaded unless --weights
auto or --weights-gb says they are still to come. Use --gpu before loading a model, the
device once it is loaded (as gen_workspace does).
"""


class _UsageError(Exception):
    pass


# What argparse is to take for a flag's value rather than a flag: a token that starts like a
# negative number as float() reads it (-5, -.5, -1e3, -inf, -nan), which the flag's own check
# then judges. argparse's own pattern takes plain decimals only (-5, -1.5), so `--free-gb -inf`
# was "expected one argument". Flags are matched first: a real flag is never taken for a value.
_NEGATIVE_NUMBER = re.compile(r"^-(?:\.?\d|inf|nan)", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        self._given = list(sys.argv[1:] if args is None else args)  # for error()'s hint
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:  # one line, exit code 2, no usage dump
        ambiguous = re.fullmatch(r"ambiguous option: (.*) could match (.*)", message, re.DOTALL)
        if ambiguous:  # the option as typed, with any value after its "="
            message = f"ambiguous option: {_as_typed(ambiguous.group(1))} could match {ambiguous.group(2)}"
        missing = re.fullmatch(r"argument (--[\w-]+): expected one argument", message)
        if missing:
            message += self._dash_value_hint(missing.group(1))
        raise _UsageError(_one_line(message))

    def _dash_value_hint(self, flag: str) -> str:
        """Where the flag was followed by a value that starts with '-' (`--plot -x.png`) and that
        no flag of the command's matches: argparse took it for a flag; how to give it."""
        given = getattr(self, "_given", [])
        for typed, value in zip(given, given[1:]):
            if len(typed) > 2 and flag.startswith(typed) and value.startswith("-") and value != "--":
                head = value.split("=", 1)[0]
                if not any(option.startswith(head) for option in self._option_string_actions):
                    return (f"; {_as_typed(value)} starts with '-', so it was taken for a flag: give it as "
                            f"{_as_typed(f'{flag}={value}')}")
        return ""

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check, with the value clipped: a long value with spaces in it is no one
        # long word that _clip_words would clip
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            raise argparse.ArgumentError(action, f"invalid choice: {_brief(value)} (choose from {choices})")

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        # argparse drops a failed write (--help, --version into a full disk) and exits 0; on
        # stdout it is raised here, and main reports it as it does the commands' own output.
        if file is None and sys.stdout is None and message:
            # Meant for a standard output that was closed at start (`inferctx --version >&-`):
            # argparse would print it on stderr and exit 0; it is a failed write, as for a command.
            raise OSError(errno.EBADF, "standard output is closed")
        to_stdout = file is not None and file is sys.stdout
        if not to_stdout:
            super()._print_message(message, file)
        elif message:
            sys.stdout.write(message)
            sys.stdout.flush()


def _as_typed(arg: str) -> str:
    """An argument in a message: as typed where it is one short printable word, else quoted and
    clipped (a newline in it, or thousands of characters, would not be one line)."""
    return arg if arg.isprintable() and arg.split() == [arg] and len(arg) <= 60 else _brief(arg)


# Unrecognized arguments shown in an error, at most.
_MOST_UNRECOGNIZED = 5


def _unrecognized(extra: Sequence[str]) -> str:
    """Arguments no flag took, on one line: the first few of many."""
    more = f" ... ({len(extra):,} in all)" if len(extra) > _MOST_UNRECOGNIZED else ""
    return f"unrecognized arguments: {' '.join(map(_as_typed, extra[:_MOST_UNRECOGNIZED]))}{more}"


# Past this many characters, an argparse message (which echoes what was typed) is clipped.
_MOST_MESSAGE = 400


def _one_line(message: str) -> str:
    """An argparse message on one line and of bounded length: characters that are not printable
    (a newline) escaped, long words clipped, and a long message clipped."""
    text = _clip_words("".join(c if c.isprintable() else repr(c)[1:-1] for c in message))
    return text if len(text) <= _MOST_MESSAGE else f"{text[:_MOST_MESSAGE]}... ({len(text):,} characters)"


def _clip_words(message: str, limit: int = 60) -> str:
    """Long words (a 10^6-character value echoed back) clipped to `limit` characters; a word
    already clipped with its length given (the errors' own "'xxx'... (N characters)") is left."""
    return re.sub(r"\S{%d,}(?!\S)(?! \([\d,]+ characters\))" % (limit + 1),
                  lambda m: f"{m.group(0)[:limit]}... ({len(m.group(0)):,} characters)", message)


# A byte that was not UTF-8 on the command line reaches Python as a surrogate (U+DC80..U+DCFF,
# os.fsencode's round trip); repr() shows it as \\udcff. Both are shown as the byte, \\xff, where
# the backslash before them is not itself escaped (a typed "\\udcff" is the user's own text).
_SURROGATE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\udc([89a-f][0-9a-f])")


def _bytes_as_typed(text: str) -> str:
    """Text with the bytes that were not UTF-8 on the command line shown as the bytes typed."""
    text = "".join(f"\\x{ord(c) - 0xDC00:02x}" if "\udc80" <= c <= "\udcff" else c for c in text)
    return _SURROGATE_ESCAPE.sub(lambda m: f"{m.group(1)}\\x{m.group(2)}", text)


def _writable(text: str, stream: Any) -> str:
    """Text as `stream` can write it: unchanged where its encoding has every character; else the
    bytes not UTF-8 shown as \\xff and other characters it lacks escaped (\\xe9 for an e-acute on an
    ASCII terminal)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding, getattr(stream, "errors", None) or "strict")
        return text
    except UnicodeError:
        pass
    except LookupError:  # an encoding Python does not know: ASCII is in every one
        encoding = "ascii"
    return _bytes_as_typed(text).encode(encoding, "backslashreplace").decode(encoding)


def _say(line: str) -> None:
    """One line on stderr. Where stderr is closed (`2>&-`) or cannot be written (`2>/dev/full`) the
    line is dropped: the exit status still tells, and stdout (where print() would put it with stderr
    closed) keeps the output alone."""
    stream = sys.stderr
    if stream is None:
        return
    try:
        stream.write(_writable(_bytes_as_typed(line), stream) + "\n")
        stream.flush()
    except (OSError, ValueError):
        _silence(stream)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="inferctx", description="Plan and inspect inference workspaces (no GPU needed).")
    p.add_argument("--version", action="version", version=f"inferctx {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{plan,presets,demo}")

    plan = sub.add_parser("plan", help="plan a workspace (works without a GPU)", epilog=_EPILOG,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    model = plan.add_argument_group("model (a preset or explicit shape)")
    model.add_argument("--preset", help="model preset, e.g. llama-2-7b (see `inferctx presets`)")
    model.add_argument("--layers", metavar="N", help="number of layers")
    model.add_argument("--heads", metavar="N", help="number of attention heads")
    model.add_argument("--hidden", metavar="N", help="hidden size")
    model.add_argument("--kv-heads", metavar="N",
                       help="KV heads (GQA/MQA; exact policy); default: the preset's, or --heads")
    model.add_argument("--head-dim", metavar="N",
                       help="size of one head (exact policy); default: the preset's, or --hidden / --heads")
    mem = plan.add_argument_group("memory (a GPU preset, explicit figures, or the real device)")
    mem.add_argument("--gpu", help="GPU preset, e.g. h100-80gb, h200")
    mem.add_argument("--free-gb", metavar="GIB", help="free memory now, in GiB")
    mem.add_argument("--total-gb", metavar="GIB", help="total memory in GiB (default: --free-gb)")
    mem.add_argument("--device", metavar="N", help="read free memory from this CUDA device now")
    mem.add_argument("--weights", choices=("auto", "none"),
                     help="auto: subtract the preset's weights (default with --preset and --gpu); "
                          "none: free memory already excludes them")
    mem.add_argument("--weights-gb", metavar="GIB", help="weights still to load on this GPU, in GiB")
    mem.add_argument("--reserve-gb", metavar="GIB", help="memory kept free (exact policy)")
    mem.add_argument("--memory-limit-gb", metavar="GIB", help="cap on the workspace budget (exact policy)")
    mem.add_argument("--memory-fraction", metavar="F",
                     help="cap as a fraction of free memory after the weights (exact policy)")
    req = plan.add_argument_group("request")
    req.add_argument("--batch", metavar="N", help="batch size (default 1)")
    req.add_argument("--prompt-len", metavar="N", help="prompt length (default 1)")
    req.add_argument("--max-tokens", metavar="N", help="max_out_tokens, prompt included (default 2048)")
    req.add_argument("--min-tokens", metavar="N", help="min_out_tokens (default 1)")
    req.add_argument("--dtype", default="float16", help="float16 (default), bfloat16 or float32")
    req.add_argument("--mp-size", metavar="N", help="model-parallel size (default 1)")
    req.add_argument("--rank", metavar="N", help="model-parallel rank (default 0)")
    req.add_argument("--external-cache", action="store_true", help="KV cache managed elsewhere")
    req.add_argument("--policy", default="exact", choices=("exact", "deepspeed"), help="sizing policy")
    ask = plan.add_argument_group("answers")
    ask.add_argument("--max-batch", action="store_true",
                     help="the largest --batch that holds all --max-tokens tokens")
    ask.add_argument("--most-tokens", action="store_true",
                     help="the largest --max-tokens a batch of --batch holds in full")
    out = plan.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--sweep-batch", metavar="N",
                     help=f"print max tokens for batch 1..N (N <= {MAX_SWEEP})")
    out.add_argument("--plot", metavar="FILE.png", help="with --sweep-batch: draw max tokens against batch")

    ls = sub.add_parser("presets", help="list the built-in model and GPU presets")
    ls.add_argument("--json", action="store_true", help="print as JSON")
    add_demo_parser(sub)
    return p


# -- flag values ---------------------------------------------------------------------------

def _int(text: str | None, flag: str, *, minimum: int = 1, default: int | None = None) -> int | None:
    if text is None:
        return default
    parts = _whole_parts(text)  # leading zeros dropped: they count towards Python's digit limit
    if parts is None:
        raise _UsageError(f"{flag}: got {_brief(text)}; it must be a whole number")
    sign, digits = parts
    if len(digits) > 40:  # past int64, and past Python's digit limit
        if sign == "-":  # far below the minimum, not above 2**63
            raise _UsageError(f"{flag}: got {_brief(text)}; it must be >= {minimum}")
        raise _UsageError(f"{flag}: got {_brief(text)}; it must be below 2**63 = {1 << 63:,}")
    value = int(sign + digits, 10)
    if value < minimum:
        raise _UsageError(f"{flag}: got {value}; it must be >= {minimum}")
    if value > INT64_MAX:
        raise _UsageError(f"{flag}: got {_brief(value)}; it must be below 2**63 = {1 << 63:,}")
    return value


def _float(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _UsageError(f"{flag}: got {_brief(text)}; it must be a number") from None
    if not math.isfinite(value):
        raise _UsageError(f"{flag}: got {_brief(text)}; it must be a finite number")
    return value


_MAX_GIB = INT64_MAX / GIB
_ONE_BYTE_GIB = f"{1 / GIB:.3g}"


def _gib(text: str | None, flag: str, *, zero_ok: bool = False) -> int | None:
    """A GiB flag as bytes (None when absent)."""
    if text is None:
        return None
    value = _float(text, flag)
    if value < 0 or (value == 0 and not zero_ok):
        raise _UsageError(f"{flag}: got {_brief(text)}; it must be a {'' if zero_ok else 'positive '}number "
                          f"of GiB{' (>= 0)' if zero_ok else ''}")
    if value >= _MAX_GIB:
        raise _UsageError(f"{flag}: got {_brief(text)}; it must be below {_MAX_GIB:,.0f} GiB (2**63 bytes)")
    n = int(value * GIB)
    if n == 0 and value > 0 and not zero_ok:
        raise _UsageError(f"{flag}: got {_brief(text)}, under one byte; it must be at least {_ONE_BYTE_GIB} GiB "
                          f"(one byte)")
    return n


# -- planner names in the command's terms --------------------------------------------------

_FLAGS = {
    "batch_size": "--batch", "prompt_len": "--prompt-len", "max_out_tokens": "--max-tokens",
    "min_out_tokens": "--min-tokens", "mp_size": "--mp-size", "rank": "--rank", "dtype": "--dtype",
    "policy": "--policy", "external_cache": "--external-cache", "preset": "--preset", "gpu": "--gpu",
    "memory_fraction": "--memory-fraction", "memory_limit_bytes": "--memory-limit-gb",
    "memory_limit": "--memory-limit-gb",
    "reserve_bytes": "--reserve-gb", "weights_bytes": "--weights-gb", "free_bytes": "--free-gb",
    "total_bytes": "--total-gb", "device": "--device",
}
_SHAPE_FLAGS = {"num_layers": "--layers", "num_heads": "--heads", "hidden_dim": "--hidden",
                "num_kv_heads": "--kv-heads", "head_dim": "--head-dim"}


def _given_shape_names(args: argparse.Namespace) -> set[str]:
    """The shape's keywords that flags of the command gave: all without --preset (the figures
    are the user's), else only those overridden (--kv-heads, --head-dim); the preset's others
    keep their keyword names."""
    if args.preset is None:
        return set(_SHAPE_FLAGS)
    return {name for name, given in (("num_kv_heads", args.kv_heads), ("head_dim", args.head_dim))
            if given is not None}


def _cli_terms(message: str, shape_names: Collection[str] = ()) -> str:
    """A planner message with the keywords of the flags given replaced by those flags."""
    names = dict(_FLAGS)
    names.update({k: v for k, v in _SHAPE_FLAGS.items() if k in shape_names})
    # Keyword names with an underscore are replaced wherever they appear; one-word names (dtype,
    # rank, preset, ...) only where they name an argument ("rank: ...", "rank=2"), not in prose.
    words = sorted(names, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(words) + r")(?![\w])")

    def rename(m: re.Match[str]) -> str:
        name = m.group(1)
        follows = m.string[m.end():m.end() + 1]
        return names[name] if "_" in name or follows in (":", "=") else name

    # The odd pieces are values quoted as the user typed them ('prompt_len' given to --dtype):
    # they are echoed unchanged.
    pieces = _QUOTED.split(message)
    return _clip_words("".join(piece if i % 2 else pattern.sub(rename, piece) for i, piece in enumerate(pieces)))


# A quoted value in a message, as repr() quotes it; an apostrophe inside a word (the card's) starts none.
_QUOTED = re.compile(r"""(?<!\w)('(?:[^'\\\n]|\\.)*'|"(?:[^"\\\n]|\\.)*")(?!\w)""")


# -- plan ------------------------------------------------------------------------------------

def _shape(args: argparse.Namespace) -> tuple[ModelShape, str]:
    """The shape and a name for it (the preset's, or the figures)."""
    explicit = {"--layers": args.layers, "--heads": args.heads, "--hidden": args.hidden}
    kv = _int(args.kv_heads, "--kv-heads")
    head = _int(args.head_dim, "--head-dim")
    if args.preset is not None:
        given = [f for f, v in explicit.items() if v is not None]
        if given:
            raise _UsageError(f"give either --preset or --layers/--heads/--hidden, not both (got --preset "
                              f"and {', '.join(given)})")
        info = presets._model_info(args.preset, "preset")
        shape = info.shape
        changes: dict[str, Any] = {}
        if kv is not None:
            changes["num_kv_heads"] = kv
        if head is not None:
            changes["head_dim"] = head
        return (shape.replace(**changes) if changes else shape), info.name
    missing = [f for f, v in explicit.items() if v is None]
    if missing:
        raise _UsageError(f"give --preset NAME, or all of --layers, --heads and --hidden (missing "
                          f"{', '.join(missing)})")
    layers = _int(args.layers, "--layers")
    heads = _int(args.heads, "--heads")
    hidden = _int(args.hidden, "--hidden")
    assert layers is not None and heads is not None and hidden is not None
    shape = ModelShape(layers, heads, hidden, kv, head_dim=head)
    return shape, f"{layers} layers x {heads} heads, hidden {hidden}"


def _memory(args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """plan_workspace's memory arguments and a name for the memory planned against."""
    figures = [f for f, v in (("--free-gb", args.free_gb), ("--total-gb", args.total_gb)) if v is not None]
    if args.gpu is not None and args.device is not None:
        raise _UsageError("give either --gpu (a preset) or --device (a real GPU), not both")
    if args.gpu is not None and figures:
        raise _UsageError(f"give either --gpu or --free-gb/--total-gb, not both (got --gpu and "
                          f"{', '.join(figures)})")
    if args.device is not None and figures:
        raise _UsageError(f"give either --device or --free-gb/--total-gb, not both (got --device and "
                          f"{', '.join(figures)})")
    if args.gpu is not None:
        g = presets._gpu_preset(args.gpu, "gpu")
        return {"gpu": g}, g.name
    if figures:
        if args.free_gb is None:
            raise _UsageError("--total-gb needs --free-gb")
        free = _gib(args.free_gb, "--free-gb", zero_ok=True)
        total = _gib(args.total_gb, "--total-gb") if args.total_gb is not None else free
        assert free is not None and total is not None
        if total == 0:  # only without --total-gb, which refuses 0
            under = ", under one byte," if float(args.free_gb) > 0 else ""
            raise _UsageError(f"--free-gb: got {_brief(args.free_gb)}{under} and --total-gb, not given, defaults "
                              f"to it; give --total-gb too (a positive number of GiB)")
        if free > total:
            raise _UsageError(f"--free-gb: got {_brief(args.free_gb)}; it must be at most --total-gb "
                              f"{_brief(args.total_gb)}")
        return {"free_bytes": free, "total_bytes": total}, f"{human_bytes(free)} free"
    device = _int(args.device, "--device", minimum=0)
    return {"device": device}, "device " + ("current" if device is None else str(device))


def _weights(args: argparse.Namespace, has_preset: bool, memory: dict[str, Any]) -> int | str:
    if args.weights is not None and args.weights_gb is not None:
        raise _UsageError("give either --weights or --weights-gb, not both")
    if args.weights_gb is not None:
        w = _gib(args.weights_gb, "--weights-gb", zero_ok=True)
        assert w is not None
        return w
    if args.weights == "none":
        return 0
    if args.weights == "auto":
        if not has_preset:
            raise _UsageError("--weights auto needs --preset (its parameter count); give --weights-gb N instead")
        return "auto"
    if "gpu" in memory:
        if not has_preset:
            raise _UsageError("--gpu plans against the card's whole memory, so the weights must be counted: "
                              "give --weights-gb N (the weights on this GPU; 0 if they live elsewhere), or "
                              "--preset NAME for its parameter count")
        return "auto"
    return 0


def _cli_dtype(text: str) -> str:
    """--dtype's name, or a ConfigError offering the names a command line can give (the planner's
    own message offers NumPy and torch dtypes too)."""
    try:
        return dtype_name(text, "--dtype")
    except ConfigError:
        raise ConfigError(f"--dtype: got {_brief(text)}; valid: {VALID}", argument="--dtype") from None


def _plan_kwargs(args: argparse.Namespace) -> tuple[ModelShape, dict[str, Any], dict[str, str]]:
    shape, model_name = _shape(args)
    if args.policy == "deepspeed":  # DeepSpeed's sizing has no such figures: the flag would change nothing
        for flag, given in (("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
            if given is not None:
                raise ConfigError(f"{flag}: applies to the exact policy only; the deepspeed policy sizes as "
                                  f"DeepSpeed does: the KV cache by the query heads, and each head as the hidden "
                                  f"size / the heads", argument=flag)
    memory, memory_name = _memory(args)
    kw: dict[str, Any] = dict(
        batch_size=_int(args.batch, "--batch", default=1),
        prompt_len=_int(args.prompt_len, "--prompt-len", default=1),
        max_out_tokens=_int(args.max_tokens, "--max-tokens", default=2048),
        min_out_tokens=_int(args.min_tokens, "--min-tokens", default=1),
        dtype=_cli_dtype(args.dtype), mp_size=_int(args.mp_size, "--mp-size", default=1),
        rank=_int(args.rank, "--rank", minimum=0, default=0),
        external_cache=args.external_cache, policy=args.policy,
        weights_bytes=_weights(args, args.preset is not None, memory),
        reserve_bytes=_gib(args.reserve_gb, "--reserve-gb", zero_ok=True),
        memory_limit_bytes=_gib(args.memory_limit_gb, "--memory-limit-gb"),
        memory_fraction=None if args.memory_fraction is None else _float(args.memory_fraction,
                                                                          "--memory-fraction"),
    )
    if kw["memory_fraction"] is not None and not 0 < kw["memory_fraction"] <= 1:
        raise _UsageError(f"--memory-fraction: got {_brief(args.memory_fraction)}; it must be in (0, 1], a "
                          f"fraction of free memory")
    kw.update(memory)
    return shape, kw, {"model": model_name, "memory": memory_name}


def _check_plot(path: str) -> None:
    """Refuses, before anything is planned or printed, a --plot that cannot be written for a
    reason known beforehand (no matplotlib, a format it does not write, a folder, a missing or
    unwritable folder, a read-only file). What shows only as the figure is drawn or written (a
    full disk, a path the system refuses, a writer or a text.usetex setting that needs LaTeX) is
    one line naming --plot after the table, in _plot."""
    # matplotlib is optional (inferctx[plot]): its imports are unknown to a type checker without it
    # The plot is drawn with Agg whatever MPLBACKEND says; matplotlib refuses to load at all with
    # a backend it does not know there, so it is not shown that variable while it loads.
    backend = os.environ.pop("MPLBACKEND", None) if "matplotlib" not in sys.modules else None
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        from matplotlib.figure import Figure  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        raise _UsageError("--plot needs matplotlib: pip install 'inferctx[plot]'") from None
    except Exception as exc:  # a broken installation or settings file
        reason = _clip_words(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise _UsageError(f"--plot: matplotlib could not be loaded: {reason}") from None
    finally:
        if backend is not None:
            os.environ["MPLBACKEND"] = backend
    if os.path.isdir(path):
        raise _UsageError(f"--plot: {_brief(path)} is a folder; give a file name, e.g. "
                          f"{_brief(os.path.join(path, 'sweep.png'))}")
    try:
        folder = os.path.dirname(os.path.abspath(path))
    except OSError:  # a relative name, and the current folder was deleted
        raise _UsageError(f"--plot: {_brief(path)} is relative to the current folder, which no longer exists; "
                          f"give a full path") from None
    if not os.path.isdir(folder):
        raise _UsageError(f"--plot: the folder {_brief(folder)} does not exist")
    if not os.access(folder, os.W_OK):
        raise _UsageError(f"--plot: the folder {_brief(folder)} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise _UsageError(f"--plot: {_brief(path)} exists and is not writable")
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    kinds = Figure().canvas.get_supported_filetypes()
    if ext not in kinds:
        raise _UsageError(f"--plot: {_brief(path)} has {'no extension' if not ext else f'extension .{ext}'}; "
                          f"valid: {', '.join('.' + k for k in sorted(kinds))}")


def _sweep(shape: ModelShape, kw: dict[str, Any], n: int, as_json: bool, plot: str | None,
           names: dict[str, str]) -> None:
    rows = []
    fits = True
    for b in range(1, n + 1):
        if fits:  # a larger batch never holds more tokens: after the first miss, none fits
            request = {**kw, "batch_size": b}
            try:
                p = plan_workspace(shape, **request)
                rows.append((b, p.max_tokens, p.workspace_bytes, p.bound_by))
                continue
            except WorkspaceOOMError as exc:
                if b == 1:  # nothing fits: the planner's reason and hints, not a table of misses
                    raise _prefixed("--sweep-batch: not even a batch of 1 fits", exc) from None
                fits = False
            except ConfigError:
                if b == 1:
                    raise
                # Only the batch changed since the last row: its byte count passes 2**63, which no
                # device holds.
                fits = False
        rows.append((b, 0, 0, "does not fit"))
    cut_short = None
    try:
        if as_json:
            print(json.dumps([dict(batch_size=b, max_tokens=t, workspace_bytes=w, bound_by=why)
                              for b, t, w, why in rows], indent=2))
        else:
            print(f"{'batch':>6}{'max tokens':>12}{'workspace':>14}  bound by")
            for b, t, w, why in rows:
                print(f"{b:>6}{t:>12}{human_bytes(w):>14}  {why}")
    except BrokenPipeError as exc:  # the reader took what it wanted (`| head`): the plot is still asked for
        if not plot:
            raise
        cut_short = exc
    if plot:
        _plot(rows, plot, kw, names)
        # stdout holds the JSON document alone; the note goes beside it, as errors do
        if as_json:
            _say(f"wrote {plot}")
        elif cut_short is None:
            print(_writable(f"wrote {plot}", sys.stdout))
    if cut_short is not None:
        raise cut_short


def _plot(rows: list[tuple[int, int, int, str]], path: str, kw: dict[str, Any], names: dict[str, str]) -> None:
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o")
    ax.set_xlabel("batch size")
    ax.set_ylabel("max tokens")
    ax.locator_params(axis="both", integer=True)  # batch sizes and token counts are whole
    # Two lines at most of the figure's width: a model given as a shape has a long name.
    ax.set_title("\n".join(textwrap.wrap(
        f"{names['model']} on {names['memory']}, {dtype_name(kw['dtype'])}: max tokens by batch size "
        f"(policy {kw['policy']})", 72)), fontsize="medium")
    ax.grid(True, alpha=0.3)
    temporary = None
    try:
        fig.tight_layout()  # draws the text: a matplotlibrc's text.usetex without LaTeX fails here
        # Drawn into a new file beside the target and renamed over it once whole: a failure, a full
        # disk or Ctrl-C midway leaves no half-written file, and an earlier plot there as it was.
        target = os.path.realpath(path)  # through a link, the file it names is replaced
        if not os.path.exists(target) or os.path.isfile(target):
            temporary = _new_file_beside(target)
        fig.savefig(temporary or path)  # the temporary file keeps the extension: matplotlib's format
        if temporary is not None:
            os.replace(temporary, target)
            temporary = None
    except OSError as exc:  # what _check_plot could not foresee: a full disk, a file made meanwhile
        raise _UsageError(f"--plot: could not write {_brief(path)}: {exc.strerror or exc}") from None
    except Exception as exc:  # a format whose writer needs a program not installed (.pgf: LaTeX)
        reason = _clip_words(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        if getattr(matplotlib, "rcParams", {}).get("text.usetex"):  # the user's matplotlibrc: LaTeX for all text
            remedy = ("text.usetex is on in your matplotlib settings: turn it off (matplotlibrc, "
                      "MATPLOTLIBRC) or install LaTeX")
        else:
            remedy = "choose another extension, such as .png, .svg or .pdf"
        raise _UsageError(f"--plot: matplotlib could not write {_brief(path)}: {reason}; {remedy}") from None
    finally:
        plt.close(fig)
        if temporary is not None:
            try:
                os.unlink(temporary)
            except OSError:
                pass


def _new_file_beside(target: str) -> str:
    """A new empty file in target's folder, named after it with its extension, with the
    permissions that target has (a new file's, as the umask gives them, where there is none)."""
    folder, name = os.path.split(target)
    stem, ext = os.path.splitext(name)
    while True:
        temporary = os.path.join(folder, f".{stem}.{secrets.token_hex(4)}{ext}")
        try:  # mode 0666 less the umask, as any new file gets, without touching the umask
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
            break
        except FileExistsError:
            continue
    try:
        os.fchmod(fd, os.stat(target).st_mode & 0o7777)
    except FileNotFoundError:
        pass  # a new plot: the mode it was made with
    except BaseException:
        os.close(fd)
        os.unlink(temporary)
        raise
    os.close(fd)
    return temporary


def _print_plan(p: WorkspacePlan, as_json: bool, extra: dict[str, Any] | None = None, line: str = "") -> None:
    if as_json:
        print(json.dumps({**(extra or {}), **p.to_dict()}, indent=2))
    else:
        if line:
            print(line)
        print(p)


def _without(kw: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in kw.items() if k != key}


# The answers' misses, in the flags given (their planner requests are not the user's: a request
# forced to hold every token would blame --min-tokens, and its hints would be about it).

_TOKEN_FLAGS = (("--prompt-len", "prompt_len"), ("--min-tokens", "min_out_tokens"))


def _budget(p: WorkspacePlan, fraction: float | None) -> str:
    """A plan's budget and what set it, in the command's terms."""
    free = f"free {human_bytes(p.planned_free_bytes)}" + (" after the weights" if p.weights_bytes else "")
    why = {"reserve": f"{free} - reserve {human_bytes(p.reserve_bytes)}{p._deepspeed_temp_note()}",
           "memory_limit": "--memory-limit-gb",
           "memory_fraction": f"--memory-fraction {fraction} of {free}"}
    return f"a budget of {human_bytes(p.budget_bytes)} ({why.get(p.budget_limit, p.budget_limit)})"


def _bytes_for(shape: ModelShape, kw: dict[str, Any], tokens: int) -> str:
    """The workspace that `tokens` tokens take under kw's request and policy, with memory set
    aside: what the budget beside it in the answer is to hold. (The planner's refusal counts
    DeepSpeed's minimum, its reserve and temp term, in what the request needs, while the budget
    has it taken off already.)"""
    aside = ("gpu", "device", "free_bytes", "total_bytes", "weights_bytes", "reserve_bytes",
             "memory_limit_bytes", "memory_fraction")
    request = {k: v for k, v in kw.items() if k not in aside}
    try:
        p = plan_workspace(shape, **{**request, "max_out_tokens": tokens, "min_out_tokens": tokens},
                           free_bytes=(1 << 63) - 1, total_bytes=(1 << 63) - 1, weights_bytes=0)
    except (ConfigError, WorkspaceOOMError):  # the byte count overflows
        return "more than 2**63 bytes"
    return human_bytes(p.workspace_bytes)


def _prefixed(answer: str, exc: WorkspaceOOMError) -> WorkspaceOOMError:
    """The planner's refusal (its reason and hints) after the command's own answer."""
    return WorkspaceOOMError(f"{answer}: {exc.message}", requested_bytes=exc.requested_bytes,
                             free_bytes=exc.free_bytes, total_bytes=exc.total_bytes,
                             budget_bytes=exc.budget_bytes, max_batch_size=exc.max_batch_size,
                             max_out_tokens=exc.max_out_tokens)


def _first_fit_prefixed(answer: str, shape: ModelShape, kw: dict[str, Any]) -> None:
    """When not even the smallest request fits: the planner's own reason (memory, weights) and hints."""
    try:
        plan_workspace(shape, **kw)
    except WorkspaceOOMError as exc:
        raise _prefixed(answer, exc) from None


def _no_batch_holds_all(shape: ModelShape, kw: dict[str, Any]) -> NoReturn:
    """--max-batch found none: what a batch of 1 holds, and the --max-tokens that it holds in full."""
    tokens = kw["max_out_tokens"]
    one = {**kw, "batch_size": 1}
    most = max_out_tokens_for(shape, **{**_without(one, "max_out_tokens"), "prompt_len": 1, "min_out_tokens": 1})
    if most == 0:
        _first_fit_prefixed("--max-batch: not even a batch of 1 fits", shape, one)
    fit = plan_workspace(shape, **{**one, "max_out_tokens": max(most, 1), "prompt_len": 1, "min_out_tokens": 1})
    also = [f"{flag} <= {most}" for flag, key in _TOKEN_FLAGS if kw[key] > most]  # --max-tokens >= both
    advice = f"--max-tokens <= {most}" + (f" with {' and '.join(also)}" if also else "")
    raise WorkspaceOOMError(
        f"--max-batch: not even a batch of 1 holds all --max-tokens={tokens} tokens: they need "
        f"{_bytes_for(shape, one, tokens)}, and {_budget(fit, kw['memory_fraction'])} holds {most} at most; "
        f"would fit: {advice}",
        free_bytes=fit.free_bytes, total_bytes=fit.total_bytes, budget_bytes=fit.budget_bytes,
        max_batch_size=None, max_out_tokens=most)


def _batch_holds_too_few(shape: ModelShape, kw: dict[str, Any]) -> NoReturn:
    """--most-tokens found none: the prompt (or --min-tokens) is more than the batch holds; what would fit."""
    batch, need = kw["batch_size"], max(kw["prompt_len"], kw["min_out_tokens"])
    at_need = {**kw, "max_out_tokens": need}
    most = max_out_tokens_for(shape, **{**_without(kw, "max_out_tokens"), "prompt_len": 1, "min_out_tokens": 1})
    smaller = max_batch_size(shape, **_without(at_need, "batch_size")) if batch > 1 else 0
    alone = 0  # where neither a smaller batch nor fewer tokens alone fits: what a batch of 1 holds
    if most == 0 and smaller == 0 and batch > 1:
        alone = max_out_tokens_for(shape, **{**_without(kw, "max_out_tokens"), "batch_size": 1, "prompt_len": 1,
                                             "min_out_tokens": 1})
    if most == 0 and smaller == 0 and alone == 0:
        _first_fit_prefixed("--most-tokens", shape, at_need)
    fit = (plan_workspace(shape, **{**kw, "max_out_tokens": most, "prompt_len": 1, "min_out_tokens": 1})
           if most else plan_workspace(shape, **{**at_need, "batch_size": max(smaller, 1)}) if smaller
           else plan_workspace(shape, **{**kw, "batch_size": 1, "max_out_tokens": alone, "prompt_len": 1,
                                         "min_out_tokens": 1}))
    over = [(flag, kw[key]) for flag, key in _TOKEN_FLAGS if kw[key] > most]
    advice = [" and ".join(f"{flag} <= {most}" for flag, _ in over)] if most else []
    advice += [f"--batch <= {smaller}"] if smaller else []
    if alone:
        shorter = [flag for flag, key in _TOKEN_FLAGS if kw[key] > alone]
        advice += ["--batch 1 with " + " and ".join(f"{flag} <= {alone}" for flag in shorter)]
    asked = " and ".join(f"{flag}={value}" for flag, value in over if value == need)
    raise WorkspaceOOMError(
        f"--most-tokens: a batch of {batch} cannot hold {asked} tokens: they need {_bytes_for(shape, kw, need)}, "
        f"and {_budget(fit, kw['memory_fraction'])} holds {f'{most} at most' if most else 'none'}; would fit: "
        f"{' or '.join(advice)}",
        free_bytes=fit.free_bytes, total_bytes=fit.total_bytes, budget_bytes=fit.budget_bytes,
        max_batch_size=smaller or None, max_out_tokens=None)


def _cmd_plan(args: argparse.Namespace) -> int:
    if args.batch is not None and args.sweep_batch is not None:
        raise _UsageError("give either --batch or --sweep-batch, not both")
    if args.max_batch and args.most_tokens:
        raise _UsageError("give either --max-batch or --most-tokens, not both")
    if args.max_batch and args.batch is not None:
        raise _UsageError("--max-batch finds the batch size: drop --batch")
    if args.most_tokens and args.max_tokens is not None:
        raise _UsageError("--most-tokens finds --max-tokens: drop --max-tokens")
    if (args.max_batch or args.most_tokens) and args.sweep_batch is not None:
        raise _UsageError(f"give either --sweep-batch or {'--max-batch' if args.max_batch else '--most-tokens'}, "
                          f"not both")
    if args.plot is not None and args.sweep_batch is None:
        raise _UsageError("--plot needs --sweep-batch N")
    sweep = _int(args.sweep_batch, "--sweep-batch")
    if sweep is not None and sweep > MAX_SWEEP:
        raise _UsageError(f"--sweep-batch: got {sweep}; it must be at most {MAX_SWEEP} (one plan per batch size)")
    if args.plot is not None:
        _check_plot(args.plot)
    shape, kw, names = _plan_kwargs(args)
    if sweep is not None:
        _sweep(shape, {k: v for k, v in kw.items() if k != "batch_size"}, sweep, args.json, args.plot, names)
        return 0
    if args.max_batch:
        b = max_batch_size(shape, **_without(kw, "batch_size"))
        if b == 0:
            _no_batch_holds_all(shape, kw)
        p = plan_workspace(shape, **{**kw, "batch_size": b})
        _print_plan(p, args.json, {"max_batch_size": b},
                    f"largest batch holding all {kw['max_out_tokens']} tokens: {b}\n")
        return 0
    if args.most_tokens:
        m = max_out_tokens_for(shape, **_without(kw, "max_out_tokens"))
        if m == 0:
            _batch_holds_too_few(shape, kw)
        p = plan_workspace(shape, **{**kw, "max_out_tokens": m})
        _print_plan(p, args.json, {"max_out_tokens": m},
                    f"most tokens a batch of {kw['batch_size']} holds: {m}\n")
        return 0
    _print_plan(plan_workspace(shape, **kw), args.json)
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    models = {n: presets.model_info(n) for n in presets.MODEL_PRESETS}
    gpus = {n: presets.gpu_preset(n) for n in presets.GPU_PRESETS}
    if args.json:
        print(json.dumps({
            "models": {n: dict(num_layers=m.num_layers, num_heads=m.num_heads, hidden_dim=m.hidden_dim,
                               num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, vocab_size=m.vocab_size,
                               intermediate_size=m.intermediate_size, num_experts=m.num_experts,
                               tied_embeddings=m.tied_embeddings, num_params=m.num_params, source=m.source)
                       for n, m in models.items()},
            "gpus": {n: dict(total_bytes=g.total_bytes, free_bytes=g.free_bytes, description=g.description)
                     for n, g in gpus.items()},
            "cuda_overhead_bytes": presets.CUDA_OVERHEAD_BYTES,
        }, indent=2))
        return 0
    print("models:")
    print(f"  {'name':<16}{'layers':>7}{'heads':>7}{'kv':>5}{'head':>6}{'hidden':>8}{'params':>10}  source")
    for n, m in models.items():
        print(f"  {n:<16}{m.num_layers:>7}{m.num_heads:>7}{m.num_kv_heads:>5}{m.head_dim:>6}{m.hidden_dim:>8}"
              f"{m.num_params / 1e9:>9.2f}B  {m.source}")
    print(f"gpus (free: what planning on the card counts, the total less {presets.CUDA_OVERHEAD_MIB} MiB of CUDA "
          f"overhead):")
    print(f"  {'name':<16}{'total':>12}{'free':>12}  description")
    for n, g in gpus.items():
        print(f"  {n:<16}{human_bytes(g.total_bytes):>12}{human_bytes(g.free_bytes):>12}  {g.description}")
    return 0


def _silence(stream: Any) -> None:
    # Further writes (the interpreter's flush at exit) go nowhere instead of raising again.
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


# What writing the output can fail with when stdout is a file: the disk or quota full, the file
# too large, an I/O error, a closed descriptor.
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF})


def _command(parser: argparse.ArgumentParser, argv: Sequence[str] | None, shape_names: set[str]) -> int:
    args, extra = parser.parse_known_args(argv)
    if extra:
        raise _UsageError(_unrecognized(extra))
    if args.command is None:
        _say(parser.format_usage().rstrip("\n"))
        _say("inferctx: error: give a command: plan, presets or demo (inferctx plan --help for its flags)")
        return 2
    if args.command == "demo":
        return run_demo(args)
    if args.command == "plan":
        shape_names.update(_given_shape_names(args))
        return _cmd_plan(args)
    return _cmd_presets(args)


def _blocking_output() -> list[int]:
    """Makes stdout and stderr blocking where they are not (a pipe its reader made non-blocking):
    Python's writes drop what such a pipe cannot take at once, and say nothing. Returns the
    descriptors changed, for _restore_non_blocking."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if fd not in changed and not os.get_blocking(fd):
                os.set_blocking(fd, True)
                changed.append(fd)
        except (AttributeError, OSError, ValueError):
            pass
    return changed


def _restore_non_blocking(changed: list[int]) -> None:
    """The descriptors left non-blocking, as found, once what was written to them is out."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and stream.fileno() in changed:
                stream.flush()
        except (OSError, ValueError):
            _silence(stream)
    for fd in changed:
        try:
            os.set_blocking(fd, False)
        except OSError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `inferctx` console script; returns the exit code."""
    changed = _blocking_output()
    try:
        return _main(argv)
    finally:
        _restore_non_blocking(changed)


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    shape_names: set[str] = set()
    try:
        code = _command(parser, argv, shape_names)
        if sys.stdout is None:  # started with descriptor 1 closed: print() dropped the output
            if code == 0:
                _say("inferctx: could not write the output: standard output is closed")
                return 2
            return code
        sys.stdout.flush()  # a failed write shows here, where it is handled, not at the exit's flush
        return code
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, 128 + 2
        _say("inferctx: interrupted")
        code = 130
    except _UsageError as exc:
        _say(f"inferctx: error: {exc}")
        code = 2
    except DemoError as exc:
        _say(f"inferctx demo: {_clip_words(str(exc))}")
        code = 2
    except NoCudaDeviceError as exc:
        _say(f"inferctx: no CUDA device to read free memory from ({exc.name}): give --gpu PRESET (see "
             f"`inferctx presets`) or --free-gb N to plan without a GPU")
        code = 2
    except (ConfigError, WorkspaceOOMError) as exc:
        _say(f"inferctx: {type(exc).__name__}: {_cli_terms(str(exc), shape_names)}")
        code = 2
    except InferCtxError as exc:
        _say(f"inferctx: {type(exc).__name__}: {_clip_words(str(exc))}")
        code = 2
    except BrokenPipeError:
        _silence(sys.stdout)
        return 0
    except OSError as exc:
        if exc.errno not in _WRITE_ERRNOS or exc.filename is not None:
            raise
        _silence(sys.stdout)  # what is left unwritten goes nowhere, and the exit's flush stays quiet
        _say(f"inferctx: could not write the output: {exc.strerror or exc}")
        return 2
    # Output printed before the failure (a sweep's table before its --plot failed) goes out now;
    # where stdout cannot take it, the failure already said is what is reported.
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except (OSError, ValueError):
        _silence(sys.stdout)
    return code


if __name__ == "__main__":  # python -m inferctx.cli, as python -m inferctx
    sys.exit(main())
