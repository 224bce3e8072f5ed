# Part of _core.pyx: InferenceContext, the Python face of inferctx::InferenceContext (made and
# kept one per device by _context_registry.pxi).

from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp.memory cimport shared_ptr, unique_ptr
from libcpp.mutex cimport mutex
from libcpp.utility cimport pair

from inferctx._decl_gpu cimport (
    CppEvent, CppInferenceContext, DeviceAllocation, check_cuda, cudaError_t, cudaEventRecord,
    cudaErrorStreamCaptureImplicit, cudaEvent_t, cudaGetDevice, cudaGetLastError, cudaSetDevice,
    cudaStreamCaptureStatus, cudaStreamCaptureStatusNone, cudaStreamGetCaptureInfo,
    cudaStreamWaitEvent, cudaStream_t, cudaSuccess)
from inferctx._decl_planner cimport PlanRequest, WorkspacePlan

cdef extern from *:
    """
    #include "inferctx/fault.hpp"
    // The failure injection's `handshake` site (fault::Site::handshake): the armed stream join
    // fails with the armed code; 0 otherwise, and always in a build without the hook.
    static inline int inferctx_fault_handshake() {
      return inferctx::fault::injected(inferctx::fault::Site::handshake);
    }
    """
    int inferctx_fault_handshake() nogil


cdef unsigned long long _capture_id(cudaStream_t stream, cudaError_t* error) noexcept nogil:
    """0 for a stream that is not being captured into a CUDA graph, else its capture's id (never
    0); -1 when CUDA will not say: the legacy stream asked while a blocking stream captures, or
    an error, which goes to `error` (a stream that does not exist, say)."""
    cdef cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone
    cdef unsigned long long capture_id = 0
    cdef cudaError_t status = cudaStreamGetCaptureInfo(stream, &capture, &capture_id)
    if status != cudaSuccess:
        cudaGetLastError()
        if status != cudaErrorStreamCaptureImplicit and error[0] == cudaSuccess:
            error[0] = status
        return <unsigned long long>-1
    if capture == cudaStreamCaptureStatusNone:
        return 0
    return capture_id if capture_id != 0 else <unsigned long long>-1


cdef bint _capturing(uintptr_t stream) noexcept:
    """Whether `stream` is capturing a CUDA graph (False where CUDA will not say: a stream that
    does not exist fails at its first use instead)."""
    cdef cudaError_t error = cudaSuccess
    cdef unsigned long long capture
    with nogil:
        capture = _capture_id(<cudaStream_t>stream, &error)
    return capture != 0 and error == cudaSuccess


cdef bint _cannot_join(unsigned long long producer_capture, unsigned long long consumer_capture,
                       uintptr_t consumer) noexcept nogil:
    """Whether `consumer`, a default stream (legacy 1, per-thread 2) not in the capture its
    producer makes (ids from _capture_id), would have to join it, which CUDA refuses (the work
    queued would end the capture). That includes the legacy stream while a blocking stream
    captures, of which CUDA will not say whether it captures (its id is `unknown`)."""
    return (producer_capture != 0 and producer_capture != <unsigned long long>-1
            and consumer_capture != producer_capture and consumer <= 2)


cdef cudaError_t _record_then_wait(int device, cudaEvent_t event, cudaStream_t producer,
                                   cudaStream_t consumer, bint fork) noexcept nogil:
    # On `device`, which the special handles (legacy, per-thread) refer to; the caller's device
    # is restored.
    cdef int previous = -1
    cdef cudaError_t status = cudaGetDevice(&previous)
    if status != cudaSuccess:
        return status
    if previous != device:
        status = cudaSetDevice(device)
        if status != cudaSuccess:
            return status
    # Under CUDA-graph capture only some edges are allowed (anything else invalidates the
    # capture): between streams of one capture; and, with `fork`, from a capturing stream to one
    # that is not, which then joins the capture (CUDA's fork pattern: the caller joins it back
    # once the work is queued). A capture never waits for work outside it: that work is ordered
    # by where the graph is launched.
    cdef unsigned long long unknown = <unsigned long long>-1
    cdef unsigned long long p = _capture_id(producer, &status)
    cdef unsigned long long c = _capture_id(consumer, &status)
    cdef bint joins_capture = fork and c == 0 and p != 0 and p != unknown
    if status != cudaSuccess:
        pass  # a stream that does not exist: reported by _order
    elif fork and _cannot_join(p, c, <uintptr_t>consumer):
        status = cudaErrorStreamCaptureImplicit  # _order says so
    elif joins_capture or (p == c and p != unknown):
        status = <cudaError_t>inferctx_fault_handshake()
        if status == cudaSuccess:
            status = cudaEventRecord(event, producer)
        if status == cudaSuccess:
            status = cudaStreamWaitEvent(consumer, event, 0)
    # else the edge cannot be made (see above): status stays cudaSuccess
    if previous != device:
        cudaSetDevice(previous)
    return status


cdef bint _released_now(InferenceContext ctx):
    """ctx._c.released() without the GIL: it waits for the context's mutex, which a release or
    retake holds while it copies and (un)maps, and other Python threads go on meanwhile (a host
    callback queued before the release may need the GIL to finish)."""
    cdef bint released
    with nogil:
        released = ctx._c.released()
    return released


cdef bint _settled(object x):
    """Whether `x` cannot have changed since it was last seen: a value of an immutable kind. A
    mutable one (a 0-d NumPy array, a one-element tensor: both index as ints) may have been
    written in place, the same object with another value."""
    t = type(x)
    if t is int or t is str or t is float or t is bool or x is None:
        return True
    return t.__hash__ is not None and not hasattr(x, "__dlpack__")


cdef bint _same_arguments(tuple a, tuple b):
    """Equal values of equal types (True is not 1), none of them mutable: the coerced request
    would be the same."""
    for x, y in zip(a, b):
        if not _settled(x):
            return False  # coerced again: its value now is what counts
        if x is not y and (type(x) is not type(y) or x != y):
            return False
    return True


cdef class _PlanMade:
    """A plan the C++ context made and put in force, with its request and result as dicts."""

    cdef WorkspacePlan plan
    cdef uint64_t generation  # the C++ context's plan_generation() with it in force
    cdef tuple args  # the arguments of the request it was made from (the context's _last_args)
    cdef readonly dict request
    cdef readonly dict result

    def __init__(self, *args, **kwargs):
        raise TypeError("_PlanMade objects are made by InferenceContext._gen_workspace")


cdef class InferenceContext:
    """The GPU resources of one device for transformer inference (DeepSpeed's InferenceContext).

    One per device, from ``InferenceContext.instance(device=None)``. It plans and owns the
    workspace (activations, KV cache, attention scores), the cuBLAS handle, the compute and
    communication streams, the generated-token counter and the Philox (seed, offset) state.
    """

    cdef shared_ptr[CppInferenceContext] _owner
    cdef CppInferenceContext* _c
    cdef readonly int device
    # Stream handshakes of DLPack exports and imports: record on the producer, wait on the
    # consumer. The lock keeps each record/wait pair together across threads.
    cdef unique_ptr[CppEvent] _handshake
    cdef mutex _handshake_lock
    # The plan as last set through gen_workspace, and the layout the view accessors use.
    cdef object _plan
    cdef tuple _last_args  # arguments of the last request (coerced into _last_request)
    cdef tuple _plan_args  # _last_args when the plan in force was made from it
    cdef uint64_t _adopted_generation  # the C++ plan_generation() of the plan adopted
    cdef PlanRequest _last_request
    cdef tuple _logged
    cdef int _dtype
    cdef int64_t _num_layers
    cdef bint _external_cache
    cdef tuple _kv_shape
    cdef int64_t _kv_size, _kv_offset, _kv_layer_stride, _kv_value_offset
    cdef int64_t _workspace_bytes
    cdef int64_t _activations_offset, _activations_bytes
    cdef int64_t _scores_offset, _scores_bytes
    # Python Stream objects handed out, and the external stream object use_stream adopted.
    cdef Stream _stream_obj
    cdef Stream _own_stream_obj
    cdef Stream _comm_stream_obj
    cdef object _adopted
    cdef int _served  # what ctx.stream last followed (SERVED_*, _contract.pxi), to join a move
    # gen_workspace's compiled and Python halves (the plan made, then the layout and plan adopted
    # for the view accessors) under one lock, so that concurrent calls cannot interleave them;
    # use_stream's C++ stream and the Python object it keeps alive likewise.
    cdef readonly object _workspace_lock
    cdef object _stream_lock
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        # InferenceContext.__new__(InferenceContext) from Python would have no C++ context.
        if kwargs or len(args) != 1 or args[0] is not _MAKE:
            raise TypeError("use InferenceContext.instance(device=None): there is one context "
                            "per device")

    @classmethod
    def instance(cls, device=None):
        """The context of ``device`` (None: the current device), created on first use.

        Raises NoCudaDeviceError without a GPU (planning with ``plan_workspace`` still works),
        ConfigError for an ordinal that is not a visible device.
        """
        return _context_of(device)

    # -- the workspace -------------------------------------------------------------------------
    def _created(self, fallback_reason):
        """Called once, on the context stored for its device; `fallback_reason` says why the
        workspace is a cudaMalloc allocation (None when it is CUDA virtual memory)."""

    def _gen_workspace(self, tuple args, fields):
        """gen_workspace's compiled part: plans against the free memory read now and allocates.

        `args` are gen_workspace's arguments in order and `fields` the request coerced from
        them (the dict make_request takes), or None to plan the last request again, which is
        done only when `args` are its arguments (equal values of equal types): else nothing is
        done and None returned, for the caller to coerce `args`. Returns the plan in force when
        it stands (the same request and memory figures), else a _PlanMade for ``_adopt_plan``.
        """
        cdef bint same = fields is None
        if same:
            if self._last_args is None or not _same_arguments(args, self._last_args):
                return None
        else:
            self._last_request = make_request(fields)
            self._last_args = args
        cdef PlanRequest request = self._last_request
        cdef WorkspacePlan p
        cdef uint64_t generation
        with nogil:
            p = self._c.gen_workspace(request)
            generation = self._c.plan_generation()
        _note_released(self)
        old = self._plan
        if (same and self._plan_args is self._last_args and p.request.free_bytes == old.free_bytes
                and p.request.total_bytes == old.total_bytes):
            self._adopted_generation = generation  # put in force again: the plan adopted stands
            return old  # the plan is a function of the request and the memory figures
        return self._made(p, generation)

    cdef _PlanMade _made(self, const WorkspacePlan& p, uint64_t generation):
        cdef _PlanMade made = _PlanMade.__new__(_PlanMade)
        made.plan = p
        made.generation = generation
        made.args = self._last_args
        made.request = request_to_dict(p.request)
        made.result = plan_to_dict(p)
        return made

    def _unadopted_plan(self):
        """The plan C++ put in force that was not adopted (a _PlanMade), else None: where
        gen_workspace was interrupted (Ctrl-C raises its KeyboardInterrupt at the first Python
        instruction after the compiled call, with the new plan already in force) between the
        two halves. Called under the workspace lock, as gen_workspace's halves are."""
        cdef uint64_t generation
        cdef WorkspacePlan p
        with nogil:  # (the C++ mutex, which a release may hold while it copies)
            generation = self._c.plan_generation()
        if generation == self._adopted_generation:  # 0 too: no plan was ever put in force
            return None
        with nogil:
            p = self._c.plan()
        return self._made(p, generation)

    def _adopt_plan(self, plan, _PlanMade made not None):
        """Puts `plan` (the WorkspacePlan of `made`) in force for the view accessors.

        Returns whether it differs from the plan last logged (arguments, tokens or bytes).
        """
        self._set_layout(made.plan, plan)
        self._plan_args = made.args
        self._adopted_generation = made.generation
        logged = (made.args, made.plan.max_tokens, made.plan.workspace_bytes)
        if self._logged is None or not _same_arguments(logged, self._logged):
            self._logged = logged
            return True
        return False

    cdef int _set_layout(self, const WorkspacePlan& p, object plan) except -1:
        self._plan = plan
        self._dtype = p.request.dtype
        self._num_layers = p.request.shape.num_layers
        self._external_cache = p.request.external_cache
        self._kv_shape = (p.request.batch_size, p.kv_heads_per_rank, p.max_tokens,
                          p.head_dim_padded)
        self._kv_size = p.request.batch_size * p.kv_heads_per_rank * p.max_tokens * p.head_dim_padded
        self._kv_offset = p.kv_cache_offset
        self._kv_layer_stride = p.kv_layer_stride
        self._kv_value_offset = p.kv_value_offset
        self._workspace_bytes = p.workspace_bytes
        self._activations_offset = p.activations_offset
        self._activations_bytes = p.activations_bytes
        self._scores_offset = p.attention_scores_offset
        self._scores_bytes = p.attention_scores_bytes
        return 0

    cdef int _require_plan(self, str what) except -1:
        if self._plan is None:
            raise _WorkspaceStateError(f"{what}: no workspace is planned on device {self.device}; "
                                       f"call gen_workspace(...) first")
        return 0

    cdef DeviceView _region(self, int region, str what):
        """Region 0 (the whole workspace, bytes), 1 (activations) or 2 (attention scores) as a
        1-D view. The layout and the allocation are read under the lock gen_workspace holds from
        its plan to the layout, so they are of one plan."""
        cdef shared_ptr[DeviceAllocation] ws
        cdef int64_t offset, nbytes
        cdef int dtype
        with self._workspace_lock:
            self._require_plan(what)
            if region == 0:
                offset, nbytes, dtype = 0, self._workspace_bytes, DT_UINT8
            elif region == 1:
                offset, nbytes, dtype = self._activations_offset, self._activations_bytes, self._dtype
            else:
                offset, nbytes, dtype = self._scores_offset, self._scores_bytes, self._dtype
            with nogil:  # waits for mutex_, which a release holds while it copies and unmaps
                ws = self._c.workspace()
        cdef int64_t n = nbytes // _DTYPE_ITEMSIZE[dtype]
        return _make_view(ws, offset, (n,), n, dtype, self)

    @property
    def plan(self):
        """The WorkspacePlan in force (WorkspaceStateError before gen_workspace)."""
        self._require_plan("plan")
        return self._plan

    @property
    def workspace(self):
        """The whole workspace as a 1-D uint8 DeviceView of ``workspace_bytes``."""
        return self._region(0, "workspace")

    @property
    def workspace_bytes(self):
        """Bytes of the planned workspace (0 before gen_workspace)."""
        return self._workspace_bytes if self._plan is not None else 0

    @property
    def activations(self):
        """The activations region as a 1-D DeviceView in the plan's dtype."""
        return self._region(1, "activations")

    @property
    def attention_scores(self):
        """The attention-scores region (DeepSpeed's unfused attention workspace), 1-D, in the
        plan's dtype."""
        return self._region(2, "attention_scores")

    def kv_cache(self, layer):
        """(K, V) of ``layer``: 4-D DeviceViews [batch, kv_heads/mp, max_tokens, head_dim_padded]
        in the plan's dtype."""
        cdef int64_t l = _int_arg(layer, "layer")
        cdef shared_ptr[DeviceAllocation] ws
        cdef int64_t key, value_offset, size
        cdef int dtype
        with self._workspace_lock:  # the layout and the allocation of one plan (see _region)
            self._require_plan("kv_cache")
            if self._external_cache:
                raise _WorkspaceStateError(
                    "kv_cache: the plan in force has external_cache=True, so the workspace holds no "
                    "KV cache; plan with external_cache=False to have one")
            if l < 0 or l >= self._num_layers:
                raise _ConfigError(f"layer: got {l}; valid: 0..{self._num_layers - 1} (the plan's "
                                   f"num_layers is {self._num_layers})", argument="layer")
            with nogil:
                ws = self._c.workspace()
            key = self._kv_offset + l * self._kv_layer_stride
            value_offset, shape, size, dtype = self._kv_value_offset, self._kv_shape, self._kv_size, self._dtype
        return (_make_view(ws, key, shape, size, dtype, self),
                _make_view(ws, key + value_offset, shape, size, dtype, self))

    @property
    def max_token_length(self):
        """Tokens the KV cache holds (the plan's max_tokens; 0 before gen_workspace)."""
        return self._c.max_token_length()

    @property
    def released(self):
        """True after release_workspace, until retake_workspace or gen_workspace."""
        return _released_now(self)

    @property
    def views_alive(self):
        """DeviceView objects of the workspace alive now: a view counts once however many capsules
        or arrays were made from it, and keeps counting while they keep it."""
        cdef int64_t n
        with nogil:
            n = self._c.views_alive()
        return n

    @property
    def addresses_stable(self):
        """True when the workspace keeps its addresses across release and retake.

        That is the case where the device supports CUDA virtual memory management: the
        workspace lives in an address range reserved for the context's lifetime, and release
        returns only the memory behind it. False under the cudaMalloc fallback (no support, or
        ``INFERCTX_DISABLE_VMM=1`` in the environment when the context was created; logged
        once on logger "inferctx"), where each retake gets a new address.
        """
        return self._c.addresses_stable()

    @property
    def allocation_granularity(self):
        """Bytes the workspace's memory is mapped in (2 MiB on current GPUs; 0 under the
        cudaMalloc fallback). The exact policy's ``workspace_bytes`` are a multiple of it."""
        return self._c.allocation_granularity()

    @property
    def held_bytes(self):
        """Device memory the workspace holds now: at least ``workspace_bytes`` while held (a
        larger allocation kept for a smaller plan counts whole), 0 while released."""
        cdef int64_t n
        with nogil:
            n = self._c.held_bytes()
        return n

    @property
    def _contents_epoch(self):
        """How many times the workspace's contents have been given up (InferenceContext::
        contents_epoch): a user of them (the reference decoder's KV cache) notes it, and sees them
        gone when it moves."""
        cdef uint64_t n
        with nogil:
            n = self._c.contents_epoch()
        return n

    @property
    def host_copy_bytes(self):
        """Page-locked host memory held for ``release_workspace(keep_contents=True)`` (0: none)."""
        cdef int64_t n
        with nogil:
            n = self._c.host_copy_bytes()
        return n

    def release_workspace(self, force=False, *, keep_contents=False):
        """Gives the workspace's device memory back, keeping the plan.

        It first waits for all work queued on the device (``cudaDeviceSynchronize``, as
        ``cudaFree`` does), since any stream or captured graph may still use the workspace.
        Nothing to do when no workspace is held (none planned, or already released), except that
        a release without ``keep_contents`` of a released workspace frees the host copy, and the
        contents kept in it.

        When ``addresses_stable``, the memory is unmapped and its addresses stay reserved:
        views, DLPack capsules, tensors made from them and CUDA graphs captured on them stay
        alive and are valid again after ``retake_workspace()``. Until then nothing may touch
        those addresses (an illegal memory access, fatal to the process's CUDA context): new
        exports of the views and kernel launches on them raise WorkspaceStateError, and a
        consumer holding an old pointer (a torch tensor, a CuPy array, a graph) must not use
        it. Views alive are no obstacle, and ``force`` changes nothing.

        Under the cudaMalloc fallback the memory is freed: with views alive this raises
        WorkspaceInUseError, unless ``force=True``, which detaches the allocation (the last view
        frees it) and the retake gets a new one.

        Parameters
        ----------
        force : bool
            Under the cudaMalloc fallback, release although views are alive.
        keep_contents : bool
            Copy the workspace's bytes to page-locked host memory first, and back at the retake
            (byte for byte; a KV cache survives). The host memory is kept for the next such
            release (pinning it costs more than the copy) until a release without
            ``keep_contents``; ``host_copy_bytes`` says how much it is.
        """
        cdef bint f = _bool_arg(force, "force")
        cdef bint keep = _bool_arg(keep_contents, "keep_contents")
        try:
            with nogil:
                self._c.release_workspace(f, keep)
        finally:
            _note_released(self)

    def retake_workspace(self):
        """Takes the released workspace back for the plan in force; returns True.

        When ``addresses_stable``, memory is mapped at the same addresses as before, so every
        view, capsule, tensor and graph made before the release is valid again; under the
        cudaMalloc fallback it is a new allocation. Contents kept by
        ``release_workspace(keep_contents=True)`` are back when this returns. Raises
        WorkspaceOOMError when the device memory cannot be had; the context then stays
        released with its plan (and the kept contents), and a later call may succeed.
        Nothing to do when the workspace is held; WorkspaceStateError before any gen_workspace.
        """
        try:
            with nogil:
                self._c.retake_workspace()
        finally:
            _note_released(self)
        return True

    # -- tokens and the Philox state -------------------------------------------------------
    @property
    def current_tokens(self):
        """Tokens generated so far in the current sequence."""
        return self._c.current_tokens()

    def advance_tokens(self, n=1):
        """Counts ``n`` more tokens; TokenLimitError if that would pass ``max_token_length``."""
        self._c.advance_tokens(_int_arg(n, "n"))

    def reset_tokens(self, initial=1):
        """Starts a new sequence at ``initial`` tokens (0..max_token_length)."""
        self._c.reset_tokens(_int_arg(initial, "initial"))

    def increment_offset(self, increment):
        """Returns (seed, offset) to use now and advances the Philox offset by ``increment``
        rounded up to a multiple of 4. Thread-safe: concurrent callers get disjoint ranges."""
        cdef pair[uint64_t, uint64_t] state = self._c.increment_offset(
            _uint64_arg(increment, "increment"))
        return (state.first, state.second)

    def set_seed(self, seed):
        """Sets the Philox seed and resets the offset to 0; CUDA graphs that hold dropout call
        sites restart at replay 0 with the new seed (the device state is rewritten on
        ``ctx.stream``, in order with replays there; docs/graphs.md)."""
        cdef uint64_t s = _uint64_arg(seed, "seed")
        cdef uintptr_t stream = _ctx_stream(self)
        with nogil:
            self._c.set_seed(s, <cudaStream_t>stream)

    @property
    def rng_state(self):
        """(seed, next eager offset) of the Philox state now. Eager draws take offsets below
        2**63; draws captured into CUDA graphs use offsets from 2**63 in subsequence bands of
        their own (``_core.graph_rng_state(ctx)``; docs/graphs.md)."""
        cdef pair[uint64_t, uint64_t] state = self._c.philox().state()
        return (state.first, state.second)

    # -- streams and cuBLAS --------------------------------------------------------------------
    @property
    def stream(self):
        """The compute stream: the one ``use_stream`` adopted, or else the current stream (as
        DeepSpeed's GetCurrentStream): torch's ``current_stream(device)`` once torch is
        imported, else CuPy's current stream once CuPy is imported, else the context's own
        (``own_stream``). Kernels on operands of no package, ``sync_comp`` / ``sync_comm`` and
        DeviceView exports use it."""
        cdef uintptr_t handle
        cdef object source
        cdef Stream made
        # The handle and the object that keeps it alive are read under use_stream's lock: use_stream
        # switches the C++ stream before it stores the object, and a Stream made in between would
        # have the new handle but keep the old object alive (the new stream could then be
        # destroyed under it by a later use_stream).
        with self._stream_lock:
            handle = _ctx_stream(self)
            made = self._stream_obj
            if (made is None or made._handle != handle
                    or (self._adopted is not None and made._source is not self._adopted)):
                source = self if self._adopted is None else self._adopted
                if self._adopted is None and _torch_tensor is None and _cupy_ndarray is not None:
                    # CuPy destroys a stream with its object: the Stream returned keeps it alive,
                    # as a borrowed stream keeps its source.
                    current = _cupy_current_stream(self.device)
                    ptr = current.ptr  # 0: the legacy stream, whose handle _ctx_stream gives as 1
                    if (ptr if ptr != 0 else <uintptr_t>cudaStreamLegacy) == handle:
                        source = current
                made = _borrowed_stream(handle, self.device, source)
                self._stream_obj = made
        return made

    @property
    def own_stream(self):
        """The non-blocking stream the context created (ctx.stream without torch or CuPy)."""
        cdef uintptr_t handle = <uintptr_t>self._c.own_stream()
        if self._own_stream_obj is None:
            self._own_stream_obj = _borrowed_stream(handle, self.device, self)
        return self._own_stream_obj

    @property
    def memory_pool(self):
        """The device's stream-ordered pool (MemoryPool: reserved, in use, peak; ``trim()``)."""
        return _memory_pool(self.device)

    @property
    def comm_stream(self):
        """The communication stream."""
        if self._comm_stream_obj is None:
            self._comm_stream_obj = _borrowed_stream(<uintptr_t>self._c.comm_stream(), self.device,
                                                     self)
        return self._comm_stream_obj

    def use_stream(self, stream):
        """Makes ``stream`` the compute stream; None goes back to following the current stream.

        ``stream``: an inferctx.Stream, a torch.cuda.Stream (``.cuda_stream``), a cupy stream
        (``.ptr``), anything with ``__cuda_stream__``, or a handle (int; 0 is the legacy default
        stream). It must be a stream of this context's device; the object is kept alive while
        it is in use. Kernels on torch or CuPy operands still run on their package's current
        stream unless given ``stream=``; the adopted stream serves operands of no package,
        ``sync_comp`` / ``sync_comm`` and DeviceView exports.
        """
        cdef uintptr_t handle = 0
        if stream is not None:
            handle = _checked_stream(stream, self.device, "stream")
        with self._stream_lock:
            with nogil:
                self._c.use_stream(<cudaStream_t>handle)
            self._adopted = stream

    def sync_comp(self):
        """The comm stream waits (on the GPU) for the work queued so far on ``ctx.stream``.

        In a program that imported both torch and CuPy, and adopted no stream, also for the
        work on CuPy's current stream (where a CuPy caller's kernels ran)."""
        cdef uintptr_t compute = _ctx_stream(self)
        cdef uintptr_t cupy_stream = _cupy_stream_too(self, compute)
        with nogil:
            self._c.sync_comp(<cudaStream_t>compute)
            if cupy_stream != 0:
                self._c.sync_comp(<cudaStream_t>cupy_stream)

    def sync_comm(self):
        """``ctx.stream`` waits (on the GPU) for the work queued so far on the comm stream; with
        torch and CuPy both imported and no stream adopted, CuPy's current stream waits too."""
        cdef uintptr_t compute = _ctx_stream(self)
        cdef uintptr_t cupy_stream = _cupy_stream_too(self, compute)
        with nogil:
            self._c.sync_comm(<cudaStream_t>compute)
            if cupy_stream != 0:
                self._c.sync_comm(<cudaStream_t>cupy_stream)

    @property
    def cublas_handle(self):
        """The cublasHandle_t as an int, bound to the stream of the last gemm on it (bind it
        with cublasSetStream, then restore, to call cuBLAS on it directly)."""
        return <uintptr_t>self._c.cublas().get()

    @property
    def multiprocessor_count(self):
        return self._c.multiprocessor_count()

    @property
    def compute_capability(self):
        """(major, minor), e.g. (9, 0) on an H100/H200."""
        cdef int cc = self._c.compute_capability()
        return (cc // 10, cc % 10)

    cdef int _order(self, uintptr_t producer, uintptr_t consumer, bint fork=False) except -1:
        """Makes `consumer` wait on the GPU for the work queued so far on `producer`. Under
        CUDA-graph capture, only where CUDA allows it (_record_then_wait); `fork` lets a stream
        that is not capturing join a capturing `producer`, for a caller that joins it back."""
        if producer == consumer:
            return 0
        cdef cudaError_t status
        cdef CppEvent* event = self._handshake.get()
        with nogil:
            self._handshake_lock.lock()
            status = _record_then_wait(self.device, event.handle(), <cudaStream_t>producer,
                                       <cudaStream_t>consumer, fork)
            self._handshake_lock.unlock()
        if status == cudaErrorStreamCaptureImplicit and fork:
            # The default stream may be the call's stream= or, with none given, the current
            # stream of an operand's package (CuPy's null stream, say): the remedy is stream=.
            raise _ConfigError(
                f"stream: the call would run on a default stream ({consumer:#x}: legacy or "
                "per-thread), which cannot join the CUDA graph capture its inputs are being "
                "captured in; pass stream= the capturing stream, or a stream made for it "
                "(torch.cuda.Stream(), inferctx.Stream())", argument="stream")
        if status != cudaSuccess:
            check_cuda(status, "cudaEventRecord + cudaStreamWaitEvent (stream handshake)",
                       self.device)
        return 0

    def __repr__(self):
        if self._plan is None:
            state = "no workspace"
        elif _released_now(self):
            state = f"workspace released ({self._plan.max_tokens} tokens planned)"
        else:
            state = f"workspace {self._workspace_bytes} bytes, {self._plan.max_tokens} tokens"
        return f"<inferctx.InferenceContext device={self.device}: {state}>"
