"""End-to-end decoding: the inferctx reference decoder (decode steps replayed from one CUDA graph)
against transformers' ``model.generate`` on the same model, in one run.

For each model (GPT-2 small and the small Llama-architecture model with grouped-query attention,
random weights under a fixed seed) and batch size (1 and 8), fp16, a random prompt of
``--prompt-len`` tokens and ``--new-tokens`` new tokens (greedy, KV cache on both sides):

* **generate**: the whole call timed between CUDA events on the caller's stream (the same
  measurement for both): tokens/s = batch x new tokens / that time. Median of ``--repeats`` calls
  after one warm-up call (ours: the warm-up captures the graph).
* **per step** (ms/step): the same arithmetic for both, (generate time - one prefill's time) /
  (new tokens - 1), each a median: transformers' prefill forward timed alone with events, with
  the arguments its generate gives it (``hf_prefill_kwargs``: cache, mask, the last position's
  logits only), since its generate has no per-step hook; ours the prefill that
  ``generate(timing=True)`` times. Ours also by itself (replayed step ms): the median CUDA-event
  time between consecutive replays.
* **replay vs kernels**: the replayed step's time against the sum of the GPU time of the kernels
  (and memsets / copies) that the same step runs eagerly, from ``torch.profiler`` (CUDA activity,
  each device event's own duration, summed, divided by the number of steps profiled); also the
  kernels of the profiled replays where the profiler sees into the graph. The gap is what the
  graph still spends between kernels; the eager step's time shows what launching from Python costs.
* **peak memory**: the model's weights, plus the rise of ``torch.cuda.max_memory_allocated`` over
  what was allocated before the call (ours: the first call, which captures the graph), plus (ours)
  the inferctx workspace, which is not torch's memory. Our weights are counted as the decoder holds them (GPT-2's are shared with the model,
  Llama's q/k/v and gate/up are stacked copies).

Prints a markdown table; ``--json`` writes the figures.

    python bench/decoder.py [--models gpt2-small llama-small] [--batches 1 8] [--new-tokens 128]
                            [--prompt-len 32] [--repeats 5] [--json decoder.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

from _cli import at_least, json_path  # bench/, the script's folder

MIB = 1 << 20


def parse_args(argv=None):
    from inferctx.decoder import ALIASES, PRESETS  # no torch: the names only

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-small", "llama-small"], choices=[*ALIASES, *PRESETS])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--no-fused", action="store_true",
                    help="torch's elementwise sequences instead of the fused kernels (ReferenceDecoder(fused=False))")
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)
    at_least(ap, "--batches", args.batches, 1)
    at_least(ap, "--prompt-len", args.prompt_len, 1)
    at_least(ap, "--new-tokens", args.new_tokens, 2)  # the first token is the prefill's; steps need one more
    at_least(ap, "--repeats", args.repeats, 1)
    at_least(ap, "--profile-steps", args.profile_steps, 1)
    json_path(ap, args.json)
    return args


def timed(torch, fn, repeats):
    """Median ms of fn() between CUDA events on the current stream, after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def peak_rise(torch, fn):
    """Bytes by which torch's allocated memory rose above its level before fn() at its peak."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def device_ms(torch, fn, steps):
    """Sum of the device events' own times (kernels, memsets, copies) of fn(), per step, in ms."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return us / 1e3 / steps


def unique_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def decoder_weights(dec):
    w = dec.weights
    ts = [w.embed, w.positions, w.norm_w, w.norm_b, w.lm_head]
    for lw in w.layers:
        ts += [getattr(lw, f) for f in lw.__dataclass_fields__]
    return unique_bytes(ts)


def bench_one(torch, args, name, batch, hf):
    from inferctx.decoder import ReferenceDecoder

    n, length = args.new_tokens, args.prompt_len
    spec_vocab = hf.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed + batch)
    prompt = torch.randint(0, spec_vocab, (batch, length), generator=gen).cuda()
    dec = ReferenceDecoder(hf, batch_size=batch, prompt_len=length, max_new_tokens=n, dtype=args.dtype,
                           fused=not args.no_fused)
    if batch == args.batches[0]:
        print(f"{name}: fused kernels in use: {', '.join(dec.fused_kernels) or 'none'}")
    # the first generation: its first decode step runs eagerly and is captured (the capture's
    # temporaries count; they stay in the graph's pool)
    ours_rise = peak_rise(torch, lambda: dec.generate(prompt))
    ours_ms = timed(torch, lambda: dec.generate(prompt), args.repeats)
    steps = []
    for _ in range(args.repeats):
        steps += dec.generate(prompt, timing=True).step_ms
    ours_step = statistics.median(steps)
    ours_prefill = statistics.median([dec.generate(prompt, 2, timing=True).prefill_ms for _ in range(args.repeats)])
    k = min(args.profile_steps, n - 1)

    def eager_steps():
        dec.prefill(prompt)
        for _ in range(k):
            dec.step(use_graph=False)

    def replays():
        dec.prefill(prompt)
        for _ in range(k):
            dec.step(use_graph=True)

    dec.prefill(prompt)
    eager = []
    for _ in range(k):  # eager steps timed one by one with events on the decoder's stream
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(dec._stream)
        dec.step(use_graph=False)
        e.record(dec._stream)
        eager.append((s, e))
    torch.cuda.synchronize()
    eager_step = statistics.median(s.elapsed_time(e) for s, e in eager)
    prefill_kernels = device_ms(torch, lambda: dec.prefill(prompt), 1)
    kernel_step = device_ms(torch, eager_steps, k) - prefill_kernels / k
    replay_kernels = device_ms(torch, replays, k) - prefill_kernels / k
    ours_weights = decoder_weights(dec)
    ours = dict(method="inferctx graph", generate_ms=ours_ms, tokens_per_s=batch * n / (ours_ms / 1e3),
                step_ms=(ours_ms - ours_prefill) / max(1, n - 1), replay_step_ms=ours_step,
                prefill_ms=ours_prefill, eager_step_ms=eager_step, kernel_step_ms=kernel_step,
                replay_kernel_step_ms=replay_kernels if replay_kernels > 0.05 * kernel_step else None,
                peak_bytes=ours_weights + ours_rise + dec.workspace_bytes, weights_bytes=ours_weights,
                workspace_bytes=dec.workspace_bytes, extra_bytes=dec.extra_bytes)
    ours_tokens = dec.generate(prompt).tokens
    del dec, steps, eager
    torch.cuda.empty_cache()

    from inferctx.decoder._models import _hf_generate_kwargs

    kwargs = _hf_generate_kwargs(prompt, n)  # every prompt token real, token 0 included
    with torch.no_grad():
        hf_ms = timed(torch, lambda: hf.generate(prompt, **kwargs), args.repeats)
        hf_prefill = timed(torch, lambda: hf(prompt, **hf_prefill_kwargs(hf, kwargs)), args.repeats)
        hf_rise = peak_rise(torch, lambda: hf.generate(prompt, **kwargs))
        hf_tokens = hf.generate(prompt, **kwargs)[:, length:]
    hf_weights = unique_bytes(list(hf.parameters()) + list(hf.buffers()))
    theirs = dict(method="transformers generate", generate_ms=hf_ms, tokens_per_s=batch * n / (hf_ms / 1e3),
                  step_ms=(hf_ms - hf_prefill) / max(1, n - 1), prefill_ms=hf_prefill,
                  peak_bytes=hf_weights + hf_rise, weights_bytes=hf_weights)
    same = bool((hf_tokens == ours_tokens).all()) if hf_tokens.shape == ours_tokens.shape else False
    return [dict(model=name, batch=batch, tokens_equal=same, **r) for r in (ours, theirs)]


def hf_prefill_kwargs(hf, generate_kwargs: dict) -> dict:
    """The arguments of the prefill forward that transformers' generate runs: the cache on, the
    same attention mask, and, where the model takes ``logits_to_keep``, the last position's logits
    only (generate asks for 1; the whole prompt's logits would make the prefill timed here
    longer than generate's, and so the per-step figure derived from it shorter)."""
    import inspect

    forward = inspect.signature(hf.forward).parameters
    out = dict(use_cache=True, attention_mask=generate_kwargs["attention_mask"])
    if "logits_to_keep" in forward:
        out["logits_to_keep"] = 1
    elif "num_logits_to_keep" in forward:  # its earlier name in transformers
        out["num_logits_to_keep"] = 1
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError:
        print("decoder.py needs torch and transformers: pip install 'inferctx[demo]'", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("decoder.py needs a CUDA device", file=sys.stderr)
        return 2
    from inferctx.decoder import build_hf_model, model_spec

    torch.cuda.set_device(args.device)
    props = torch.cuda.get_device_properties(args.device)
    print(f"device {args.device}: {props.name}; torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.dtype}, prompt {args.prompt_len}, {args.new_tokens} new tokens, median of {args.repeats}")
    rows = []
    for name in args.models:
        spec = model_spec(name)
        hf = build_hf_model(spec, seed=args.seed).to(device="cuda", dtype=getattr(torch, args.dtype))
        for batch in args.batches:
            rows += bench_one(torch, args, name, batch, hf)
        del hf
        torch.cuda.empty_cache()

    print("\n| model | batch | method | generate ms | tokens/s | ms/step | prefill ms | peak MiB | tokens equal |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['method']} | {r['generate_ms']:.2f} | {r['tokens_per_s']:,.0f} | "
              f"{r['step_ms']:.3f} | {r['prefill_ms']:.2f} | {r['peak_bytes'] / MIB:,.1f} | "
              f"{'yes' if r['tokens_equal'] else 'no'} |")
    print("\n| model | batch | replayed step ms | eager step ms | kernels of the eager step ms | "
          "kernels of a replay ms | replay / kernels |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r["method"] != "inferctx graph":
            continue
        replay_k = r["replay_kernel_step_ms"]
        print(f"| {r['model']} | {r['batch']} | {r['replay_step_ms']:.3f} | {r['eager_step_ms']:.3f} | "
              f"{r['kernel_step_ms']:.3f} | {'—' if replay_k is None else f'{replay_k:.3f}'} | "
              f"{r['replay_step_ms'] / r['kernel_step_ms']:.2f} |")
    print("\ntokens equal: the greedy tokens of both methods agree at every step (in fp16 a near tie "
          "may flip one, after which the sequences part)")
    if args.json:
        meta = dict(device=props.name, torch=torch.__version__, transformers=transformers.__version__,
                    python=platform.python_version(), args=vars(args))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
