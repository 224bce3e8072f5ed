"""How a GEMM call's operands are laid out: the stored-matrix problem worked out from shapes and
strides (the table the compiled torch path reads too), the bytes each operand spans, the overlap
rule for out, and the errors for what cannot be run. Internal to inferctx.gemm."""

from __future__ import annotations

from .dtypes import ITEMSIZE, NAMES
from .errors import ConfigError

# Problems worked out from (ndim, transposes, dtypes, shapes, strides): what a call needs
# beyond its pointers. Bounded; cleared when full.
_plans: dict = {}
_PLAN_LIMIT = 4096


def _misaligned(name, size, pointers):
    argument, ptr = next((arg, p) for arg, p in pointers if p % size)
    raise ConfigError(f"{name}: {argument} starts at {ptr:#x}, which is not a multiple of its "
                      f"{size}-byte elements; cuBLAS needs element-aligned operands (an array that "
                      f"starts at a byte offset inside another must start at a whole element)",
                      argument=argument)


def _new_plan(name, key, a, b, out, dtypes):
    """Works out the stored-matrix problem of a call (ConfigError for what cannot be run) and
    remembers it under `key`."""
    (ndim, trans_a, trans_b, code, a_shape, a_strides, b_code, b_shape, b_strides, c_code,
     c_shape, c_strides) = key
    if len(a_shape) != ndim or len(b_shape) != ndim:
        bad, shape = ("a", a_shape) if len(a_shape) != ndim else ("b", b_shape)
        raise ConfigError(f"{name}: {bad} must be {ndim}-D ({'(m, k)' if ndim == 2 else '(batch, m, k)'}"
                          f" and so on); got a of shape {_shape(a_shape)} and b of shape "
                          f"{_shape(b_shape)}" + ("; use bmm for batches" if ndim == 2 and
                                                   len(shape) == 3 else ""), argument=bad)
    if code is None or b_code is None or code != b_code:
        _dtype_error(name, a, b, (a_shape, code), (b_shape, b_code), dtypes)

    la = _layout(a_shape, a_strides)
    if la is None:
        _layout_error(name, "a", a_shape, a_strides)
    lb = _layout(b_shape, b_strides)
    if lb is None:
        _layout_error(name, "b", b_shape, b_strides)
    a_batch, stride_a, a_rows, a_cols, lda, a_flip = la
    b_batch, stride_b, b_rows, b_cols, ldb, b_flip = lb
    # Logical op(a) is m x k; the stored matrix is a's transpose when a_flip.
    if a_flip:
        m, k = (a_rows, a_cols) if trans_a else (a_cols, a_rows)
    else:
        m, k = (a_cols, a_rows) if trans_a else (a_rows, a_cols)
    if b_flip:
        kb, n = (b_rows, b_cols) if trans_b else (b_cols, b_rows)
    else:
        kb, n = (b_cols, b_rows) if trans_b else (b_rows, b_cols)
    if kb != k:
        raise ConfigError(
            f"{name}: a of shape {_shape(a_shape)}{' (trans_a)' if trans_a else ''} and b of shape "
            f"{_shape(b_shape)}{' (trans_b)' if trans_b else ''} do not multiply: op(a) has "
            f"{k} columns but op(b) has {kb} rows", argument="b")
    ta = trans_a != a_flip
    tb = trans_b != b_flip
    batch = a_batch if a_batch >= b_batch else b_batch
    if (a_batch != batch and a_batch != 1) or (b_batch != batch and b_batch != 1):
        raise ConfigError(f"{name}: a of shape {_shape(a_shape)} and b of shape {_shape(b_shape)} "
                          f"have batch sizes {a_batch} and {b_batch}; they must be equal (or one "
                          f"of them 1, to broadcast)", argument="b")
    if a_batch == 1:
        stride_a = 0
    if b_batch == 1:
        stride_b = 0
    expected = (m, n) if ndim == 2 else (batch, m, n)
    size = ITEMSIZE[code]
    swap = False
    if c_shape is None:
        ldc = n if n > 0 else 1
        stride_c = m * n
        c_layout = (batch, stride_c, m, n, ldc)
    else:
        if tuple(c_shape) != expected:
            raise ConfigError(f"{name}: out has shape {_shape(c_shape)}, but a of shape "
                              f"{_shape(a_shape)} and b of shape {_shape(b_shape)} give "
                              f"{_shape(expected)}", argument="out")
        if c_code != code:
            _out_dtype_error(name, out, code, (c_shape, c_code), dtypes)
        lc = _layout(c_shape, c_strides)
        if lc is None:
            _layout_error(name, "out", c_shape, c_strides)
        _, stride_c, c_rows, c_cols, ldc, swap = lc
        if batch == 1:
            stride_c = 0
        c_layout = (batch, stride_c, c_rows, c_cols, ldc)
    spans = ((batch if stride_a else 1, stride_a, a_rows, a_cols, lda),
             (batch if stride_b else 1, stride_b, b_rows, b_cols, ldb), c_layout)
    span_a, span_b, span_c = (_span_bytes(*layout, size) for layout in spans)
    if swap:
        # out is column-major: out^T = op(b)^T op(a)^T, written row-major.
        ta, tb = not tb, not ta
        lda, ldb = ldb, lda
        stride_a, stride_b = stride_b, stride_a
        m, n = n, m
    plan = (code, m, n, k, batch, lda, ldb, ldc, stride_a, stride_b, stride_c, ta, tb, swap,
            expected, span_a, span_b, span_c, spans, (a_shape, b_shape, c_shape))
    if len(_plans) >= _PLAN_LIMIT:
        _plans.clear()
    _plans[key] = plan
    return plan


def _span_bytes(batch, stride, rows, cols, ld, size):
    """Bytes from an operand's first element to just past its last (0 when it is empty)."""
    if batch == 0 or rows == 0 or cols == 0:
        return 0
    return ((batch - 1) * stride + (rows - 1) * ld + cols) * size


def _device_error(name, shapes, a_device, b_device, c_device):
    a_shape, b_shape, c_shape = shapes
    if b_device != a_device:
        raise ConfigError(f"{name}: a {_shape(a_shape)} is on cuda:{a_device} but b "
                          f"{_shape(b_shape)} is on cuda:{b_device}; both must be on one device",
                          argument="b")
    raise ConfigError(f"{name}: out {_shape(c_shape)} is on cuda:{c_device} but a and b are on "
                      f"cuda:{a_device}", argument="out")


def _ctx_device_error(name, device, ctx_device):
    raise ConfigError(f"{name}: the operands are on cuda:{device} but ctx is the context of "
                      f"cuda:{ctx_device}; pass ctx=InferenceContext.instance({device}) or leave "
                      f"ctx=None", argument="ctx")


def _layout(shape, strides):
    """(batch, batch_stride, rows, cols, ld, flipped) of a 2-D or 3-D array as stored row-major
    matrices: flipped when its last two dimensions are column-major (its transpose is stored
    row-major). None when neither of the last two dimensions has unit stride."""
    if len(shape) == 3:
        batch, r, c = shape
        sb, sr, sc = strides
        if sb < 0:
            return None
    else:
        r, c = shape
        sr, sc = strides
        batch, sb = 1, 0
    ld = _row_major_ld(r, c, sr, sc)
    if ld is not None:
        return batch, sb, r, c, ld, False
    ld = _row_major_ld(c, r, sc, sr)
    if ld is not None:
        return batch, sb, c, r, ld, True
    return None


def _row_major_ld(r, c, sr, sc):
    """The leading dimension of an r x c matrix with strides (sr, sc) read row-major, or None."""
    if r == 0 or c == 0 or r == 1:
        return c if c > 0 else 1
    if c != 1 and sc != 1:
        return None
    return sr if sr >= c else None


def _check_no_overlap(name, a_ptr, b_ptr, c_ptr, spans, size):
    """ConfigError when out shares memory with an input (the product would read what it writes).

    Called when their spans intersect; they may still be disjoint when, with one leading
    dimension, they take disjoint column ranges of the same rows (out and an input side by side
    in one buffer): seen as positions modulo ld, the input takes [0, cols) and out must fit in
    [cols, ld)."""
    c_batch, _, _, c_cols, ldc = spans[2]
    c_span = _span_bytes(*spans[2], size)
    for operand, ptr, layout in (("a", a_ptr, spans[0]), ("b", b_ptr, spans[1])):
        batch, _, _, cols, ld = layout
        if not (ptr < c_ptr + c_span and c_ptr < ptr + _span_bytes(*layout, size)):
            continue
        if ld == ldc and batch == 1 and c_batch == 1 and (c_ptr - ptr) % size == 0:
            column = ((c_ptr - ptr) // size) % ld
            if cols <= column and column + c_cols <= ld:
                continue
        raise ConfigError(f"{name}: out shares memory with {operand}; the product would overwrite "
                          f"its own input. Write into a separate array", argument="out")


def _dtype_error(name, a, b, a_desc, b_desc, dtypes):
    """a_desc / b_desc: (shape, dtype code or None)."""
    a_name = _dtype_label(a, a_desc[1], dtypes and dtypes[0])
    b_name = _dtype_label(b, b_desc[1], dtypes and dtypes[1])
    shapes = f"a of shape {_shape(a_desc[0])} ({a_name}) and b of shape {_shape(b_desc[0])} ({b_name})"
    if a_desc[1] is None or b_desc[1] is None:
        bad = "a" if a_desc[1] is None else "b"
        raise ConfigError(f"{name}: {shapes}: {bad} has a dtype gemm does not take; valid: "
                          f"float32, float16, bfloat16", argument=bad)
    raise ConfigError(f"{name}: {shapes} have different dtypes; both must be one of float32, "
                      f"float16, bfloat16", argument="b")


def _out_dtype_error(name, out, code, c_desc, dtypes):
    c_name = _dtype_label(out, c_desc[1], dtypes and dtypes[2])
    raise ConfigError(f"{name}: out of shape {_shape(c_desc[0])} is {c_name} but a and b are "
                      f"{NAMES[code]}; out must have their dtype", argument="out")


def _dtype_label(obj, code, given):
    if given:
        return given
    if code is not None:
        return NAMES[code]
    dtype = getattr(obj, "dtype", None)
    return str(dtype).rpartition(".")[2] if dtype is not None else "unknown dtype"


def _layout_error(name, argument, shape, strides):
    raise ConfigError(f"{name}: {argument} of shape {_shape(shape)} has strides "
                      f"{tuple(strides)} (in elements); one of its last two dimensions must have "
                      f"stride 1 and the other a stride at least its length (call .contiguous() "
                      f"first)", argument=argument)


def _shape(shape) -> str:
    return "(" + ", ".join(str(int(s)) for s in shape) + ("," if len(shape) == 1 else "") + ")"
