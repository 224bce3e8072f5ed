"""Result checks the benchmarks run on what they time, before timing it: a kernel that writes
nothing, or the wrong thing, must not be timed as a fast one.

Torch is passed in (the scripts import it late, after their arguments are read).
"""

from __future__ import annotations

import math


def keep_from_bits(torch, words, count):
    """The keep flags of the first `count` elements of a bit mask: bit ``i % 32`` of 32-bit word
    ``i // 32`` (inferctx.dropout's "bits" layout; int32 words in torch)."""
    used = words.reshape(-1)[:math.ceil(count / 32)].to(torch.int64)
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    return ((used[:, None] >> shifts) & 1).reshape(-1)[:count].bool()


def dropout_mismatch(torch, x, y, keep, p):
    """None when ``y`` is inferctx.dropout's result for ``x`` under ``keep`` (``x * (1 / (1 - p))``
    where kept, 0 where dropped, as torch rounds ``x * scale``) and ``keep`` drops about a
    fraction ``p`` (within five standard deviations); else what is wrong, in words."""
    count = keep.numel()
    x, y = x.reshape(-1)[:count], y.reshape(-1)[:count]
    want = torch.where(keep, x * (1.0 / (1.0 - p)), torch.zeros((), dtype=x.dtype, device=x.device))
    if not torch.equal(y, want):  # a NaN left in y never equals
        wrong = int((y != want).sum().item())
        return f"{wrong} of {count} elements differ from x * mask * 1/(1-p)"
    kept = keep.float().mean().item()
    slack = 5 * math.sqrt(p * (1 - p) / count) + 3 / count  # three elements more, for tiny p
    if abs(kept - (1 - p)) > slack:
        return f"the mask keeps {kept:.4f} of the elements, not about {1 - p:.4f}"
    return None
