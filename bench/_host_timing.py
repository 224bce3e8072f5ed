"""Host time per call of several callables, measured in turns so that a drift of the host's speed
(clocks, other tenants) falls on all of them alike."""

import statistics
import time


def host_us_interleaved(torch, fns, calls=200, reps=21, keep=False, slack_us=80.0, rounds=None):
    """Median host time per call (µs) of each callable in `fns` (a dict name -> fn).

    With `rounds` (a dict), each callable's time per call in every round is stored there too,
    in round order, for ratio_spread.

    Each of `reps` rounds runs `calls` calls of every callable, in an order that rotates from
    round to round; before each loop a sleep kernel keeps the GPU busy for longer than the loop
    takes, so the loop measures issuing, not completion. With `keep` the results stay alive until
    the loop ends (as a caller who keeps them); else each is dropped at once.
    """
    # SM clock, kHz; a torch built for CUDA 13 may report 0 (the runtime dropped clockRate), and
    # a sleep of 0 cycles would not hold the GPU at all.
    khz = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "clock_rate", 0) or 2_000_000
    cycles = int(khz * 1e3 * calls * slack_us * 1e-6)
    names = list(fns)
    for name in names:  # warm-up: first calls, allocator blocks, layout caches
        for _ in range(20):
            fns[name]()
    samples = {name: [] for name in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            fn = fns[name]
            torch.cuda.synchronize()
            torch.cuda._sleep(cycles)
            kept = []
            t0 = time.perf_counter_ns()
            if keep:
                for _ in range(calls):
                    kept.append(fn())
            else:
                for _ in range(calls):
                    fn()
            samples[name].append((time.perf_counter_ns() - t0) / calls / 1e3)
            del kept
    torch.cuda.synchronize()
    if rounds is not None:
        rounds.update(samples)
    return {name: statistics.median(s) for name, s in samples.items()}


def ratio_spread(ours, theirs):
    """(lower quartile, median, upper quartile) of the ratios ours[i] / theirs[i] of the rounds
    of host_us_interleaved: what one round to the next makes of the ratio. Quartiles by
    statistics.quantiles' 'inclusive' method (on 21 rounds: the 6th and 16th of the ratios in
    order)."""
    if len(ours) != len(theirs) or len(ours) < 2:
        raise ValueError("ratio_spread: two lists of the same length, at least 2, one time per round")
    ratios = [o / t for o, t in zip(ours, theirs)]
    low, mid, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return low, mid, high
