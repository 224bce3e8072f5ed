# Part of _core.pyx: CUDA streams (owned or borrowed) and events, and the stream objects of
# other libraries turned into handles.

cimport cython
from libc.stdint cimport uintptr_t
from libcpp.memory cimport unique_ptr

from inferctx._decl_gpu cimport (
    CppEvent, CppStream, cudaError_t, cudaGetDevice, cudaGetLastError, cudaSetDevice,
    cudaStreamCaptureStatus,
    cudaStreamCaptureStatusNone, cudaStreamGetDevice, cudaStreamIsCapturing, cudaStreamLegacy,
    cudaStreamPerThread, cudaStream_t, cudaSuccess, stream_is_on_device, stream_was_destroyed)


cdef str _STREAM_LIKE = (
    "an inferctx.Stream, a torch.cuda.Stream, a cupy.cuda.Stream, an object with "
    "__cuda_stream__, or a stream handle (int)")


cdef uintptr_t _stream_handle(object stream, str argument) except 0:
    """The handle of a stream-like object.

    Handle 0 is CUDA's legacy default stream; it comes back as cudaStreamLegacy (0x1), which
    names the same stream explicitly (inferctx_core refuses null handles, where taking the
    legacy stream by omission is the classic bug). So 0 is never returned.
    """
    if isinstance(stream, Stream):
        if (<Stream>stream)._handle == 0:  # made by Stream.__new__ alone
            raise _ConfigError(f"{argument}: this inferctx.Stream holds no handle (made without "
                               f"__init__); pass {_STREAM_LIKE}", argument=argument)
        return (<Stream>stream)._handle
    if PyBool_Check(stream) or stream is None:
        raise _ConfigError(f"{argument}: got {_brief(stream)}; pass "
                           f"{_STREAM_LIKE}", argument=argument)
    if isinstance(stream, int):
        handle = stream
    elif hasattr(stream, "__cuda_stream__"):
        protocol = stream.__cuda_stream__
        if callable(protocol):  # a method by the protocol; early cuda.core made it a property
            protocol = protocol()
        if not isinstance(protocol, tuple) or len(protocol) != 2:
            raise _ConfigError(f"{argument}: {_type_name(stream)}.__cuda_stream__ gave "
                               f"{_brief(protocol)}; the protocol returns (version, handle)",
                               argument=argument)
        handle = protocol[1]
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        handle = stream.cuda_stream
    elif _is_cupy_stream(stream):  # cupy.cuda.Stream, ExternalStream
        handle = stream.ptr
    else:
        raise _ConfigError(f"{argument}: got a {_type_name(stream)}; pass {_STREAM_LIKE}",
                           argument=argument)
    if PyBool_Check(handle) or not isinstance(handle, int) or not 0 <= handle < (1 << 64):
        raise _ConfigError(f"{argument}: got the stream handle {_brief(handle)}; a handle is an "
                           f"integer in [0, 2**64)", argument=argument)
    if handle == 0:
        return <uintptr_t>cudaStreamLegacy
    return <uintptr_t>handle


cdef bint _is_cupy_stream(object stream):
    """Whether `stream` is one of CuPy's stream classes (or a subclass): the only objects whose
    ``.ptr`` is a stream handle. CuPy's events and memory pointers, and inferctx's own views and
    buffers, have a ``.ptr`` too, which is an event or an address."""
    for cls in type(stream).__mro__:
        if cls.__name__.endswith("Stream") and (cls.__module__ or "").startswith("cupy"):
            return True
    return False


cdef int _declared_device(object stream) except -2:
    """The device a stream-like object says it is on (an inferctx.Stream's, torch's
    .device_index, CuPy's .device_id), else -1."""
    if isinstance(stream, Stream):
        return (<Stream>stream)._device
    for attribute in ("device_index", "device_id"):
        value = getattr(stream, attribute, None)
        if isinstance(value, int) and not PyBool_Check(value) and value >= 0:
            return value
    return -1


cdef int _stream_device(object stream, uintptr_t handle, int hint, str argument) except -2:
    """The device of a stream-like object, found without disturbing a CUDA-graph capture: what
    it says (torch .device_index, CuPy .device_id; torch.cuda.default_stream(1) is the legacy
    handle, of device 1), the current device for the default-stream handles, else CUDA's answer
    for the handle (_handle_device: -1 for a capturing stream not of `hint`)."""
    cdef int declared = _declared_device(stream)
    if declared >= 0:
        return declared
    if handle <= <uintptr_t>cudaStreamPerThread:
        return _device_arg(None)
    return _handle_device(handle, hint, argument, stream)


cdef int _refuse_destroyed(uintptr_t handle, str argument, object stream) except -1:
    """ConfigError naming `argument` when `stream` is a bare int at the address of a destroyed
    inferctx.Stream: CUDA cannot be asked about, or queue on, a destroyed handle (it reads freed
    memory). Only a bare handle can outlive its stream: a stream object (torch's, CuPy's, one
    with __cuda_stream__) keeps its stream alive, and may sit at the address of a destroyed one."""
    if isinstance(stream, int) and stream_was_destroyed(<cudaStream_t>handle):
        raise _ConfigError(
            f"{argument}: {handle:#x} is the handle of an inferctx.Stream that was destroyed; pass "
            f"{_STREAM_LIKE} that exists (for a live stream of another library made at that "
            f"address since, pass its stream object)", argument=argument)
    return 0


cdef int _handle_device(uintptr_t handle, int hint, str argument, object stream) except -2:
    """The device of an explicit stream handle as CUDA tells it, without disturbing a capture:
    cudaStreamGetDevice where the stream is not being captured (asked of a capturing stream, it
    would end the capture in error); where it is, `hint` when the stream's CUDA context is
    hint's primary one, else -1. ConfigError naming `argument` for a handle that is no stream."""
    cdef cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone
    cdef cudaError_t status
    cdef int on = -1
    cdef bint ours
    _refuse_destroyed(handle, argument, stream)
    with nogil:
        status = cudaStreamIsCapturing(<cudaStream_t>handle, &capture)
        if status == cudaSuccess and capture == cudaStreamCaptureStatusNone:
            status = cudaStreamGetDevice(<cudaStream_t>handle, &on)
    if status != cudaSuccess:
        with nogil:
            cudaGetLastError()
        raise _ConfigError(
            f"{argument}: {_type_name(stream)} {handle:#x} is not a CUDA stream that exists "
            f"(destroyed, or not a stream handle); pass {_STREAM_LIKE}", argument=argument)
    if capture == cudaStreamCaptureStatusNone:
        return on
    with nogil:  # its CUDA context may be asked under capture
        ours = stream_is_on_device(<cudaStream_t>handle, hint)
    return hint if ours else -1


@cython.embedsignature(False)  # Cython writes the keyword-only marker last: (source=None, device=None, *)
cdef class Stream:
    """Stream(source=None, *, device=None)

    A CUDA stream: one this object created (destroyed with it) or one borrowed from its owner.

    ``Stream()`` creates a non-blocking stream on the current device (``device=`` to choose);
    ``Stream(s)`` wraps ``s``: a torch or CuPy stream, anything with ``__cuda_stream__``, or a
    handle (int; 0 means the legacy default stream). A borrowed stream keeps its source object
    alive. Implements ``__cuda_stream__`` so other libraries accept it.
    """

    cdef CppStream _stream
    cdef uintptr_t _handle
    cdef int _device
    cdef object _source

    def __init__(self, source=None, *, device=None):
        cdef int dev
        cdef int actual
        cdef uintptr_t handle
        if self._handle != 0:
            # A second __init__ would destroy (or drop) the stream others may be using.
            raise TypeError("Stream.__init__ called twice")
        if source is None:
            dev = _device_arg(device)
            with nogil:
                self._stream = CppStream.create(dev)
        else:
            handle = _stream_handle(source, "source")
            if device is not None:
                dev = _device_arg(device)
                actual = _stream_device(source, handle, dev, "source")
                # A bare default-stream handle names no device (it is each device's); an object
                # that says its device (torch.cuda.default_stream(1)) does.
                if actual >= 0 and actual != dev and (handle > <uintptr_t>cudaStreamPerThread
                                                      or _declared_device(source) >= 0):
                    raise _ConfigError(
                        f"device: got {dev}, but the source is a stream of cuda:{actual}; pass "
                        f"device={actual} or leave device out", argument="device")
            else:
                dev = _stream_device(source, handle, _device_arg(None), "source")
                if dev < 0:
                    raise _ConfigError(
                        f"source: {handle:#x} is being captured into a CUDA graph on another "
                        f"device than the current one; pass device=", argument="source")
            with nogil:
                self._stream = CppStream.borrow(<cudaStream_t>handle, dev)
            self._source = source
        self._handle = <uintptr_t>self._stream.handle()
        self._device = self._stream.device()

    @property
    def handle(self):
        """The cudaStream_t as an int (1: the legacy default stream, 2: per-thread)."""
        return self._handle

    @property
    def device(self):
        """Ordinal of the stream's device."""
        return self._device

    @property
    def owned(self):
        """True when this object created the stream and destroys it."""
        return self._stream.owned()

    def __cuda_stream__(self):
        """(0, handle): the CUDA stream protocol (version 0)."""
        return (0, self._handle)

    def synchronize(self):
        """Blocks until the work queued on the stream so far is done."""
        self._check()
        with nogil:
            self._stream.synchronize()

    def wait(self, other):
        """Makes this stream wait for an Event, or for the work queued so far on another stream."""
        if isinstance(other, Event):
            (<Event>other).wait(self)
            return
        self._check()
        cdef uintptr_t handle = _stream_handle(other, "other")
        # The event is recorded on `other`, so it is made on other's device (an event and the
        # stream it is recorded on share a CUDA context); a wait may take one of another device.
        # _stream_device asks in a way that leaves a capture alone (Stream.wait is how a side
        # stream joins a capture).
        cdef int source = _stream_device(other, handle, self._device, "other")
        if source < 0:
            raise _ConfigError(
                f"other: {handle:#x} is being captured into a CUDA graph on another device than "
                f"this stream's cuda:{self._device}; pass it as a torch, CuPy or inferctx Stream, "
                f"which names its device", argument="other")
        if handle == self._handle and source == self._device:
            return
        cdef uintptr_t mine = self._handle
        cdef cudaError_t asked = cudaSuccess
        cdef unsigned long long theirs = 0
        cdef unsigned long long ours = 0
        cdef int previous = -1
        if mine <= <uintptr_t>cudaStreamPerThread:
            # A default stream cannot join a capture (CUDA's fork): the wait would fail and end
            # the capture. Refused first, as a call's stream= is (_cannot_join). Asked with this
            # stream's device current: a default handle names the current device's stream.
            with nogil:
                asked = cudaGetDevice(&previous)
                if asked == cudaSuccess and previous != self._device:
                    asked = cudaSetDevice(self._device)
                if asked == cudaSuccess:
                    theirs = _capture_id(<cudaStream_t>handle, &asked)
                    ours = _capture_id(<cudaStream_t>mine, &asked)
                    if previous != self._device:
                        cudaSetDevice(previous)
                else:
                    cudaGetLastError()  # the wait below reports a device that cannot be used
            if asked == cudaSuccess and _cannot_join(theirs, ours, mine):
                raise _ConfigError(
                    f"other: {handle:#x} is capturing a CUDA graph, which this Stream, a default "
                    f"stream ({mine:#x}: legacy or per-thread), cannot join; make a stream of "
                    f"your own wait instead (inferctx.Stream(), torch.cuda.Stream())",
                    argument="other")
        cdef Event event = Event(source)
        cdef CppEvent* e = event._get()
        cdef int waiting = self._device
        with nogil:
            e.record(<cudaStream_t>handle)
            # On this stream's device: a default-stream handle names the current device's.
            e.make_wait(<cudaStream_t>mine, waiting)

    def record(self, event=None):
        """Records ``event`` (a new Event when None) on this stream and returns it."""
        if event is None:
            event = Event(self._device)
        elif not isinstance(event, Event):
            raise _ConfigError(f"event: got a {_type_name(event)}; pass an inferctx.Event or None",
                               argument="event")
        return (<Event>event).record(self)

    cdef int _check(self) except -1:
        if self._handle == 0:
            raise _ConfigError("stream: this Stream holds no handle (made without __init__)",
                               argument="stream")
        return 0

    def __eq__(self, other):
        if not isinstance(other, Stream):
            return NotImplemented
        return self._handle == (<Stream>other)._handle and self._device == (<Stream>other)._device

    def __hash__(self):
        return hash((self._handle, self._device))

    def __repr__(self):
        kind = "owned" if self._stream.owned() else "borrowed"
        return f"<inferctx.Stream handle={self._handle:#x} device={self._device} {kind}>"


cdef Stream _borrowed_stream(uintptr_t handle, int device, object source):
    """A Stream over a handle someone else owns; `source` is kept alive with it."""
    cdef Stream stream = Stream.__new__(Stream)
    with nogil:
        stream._stream = CppStream.borrow(<cudaStream_t>handle, device)
    stream._handle = handle
    stream._device = device
    stream._source = source
    return stream


@cython.embedsignature(False)  # as Stream's
cdef class Event:
    """Event(device=None, *, timing=False)

    A CUDA event on one device: record it on a stream, make streams wait for it, time with it.
    ``timing=True`` is needed for ``elapsed_ms``.
    """

    cdef unique_ptr[CppEvent] _event

    def __init__(self, device=None, *, timing=False):
        cdef bint with_timing = _bool_arg(timing, "timing")
        cdef int dev = _device_arg(device)
        with nogil:
            self._event.reset(new CppEvent(dev, with_timing))

    cdef CppEvent* _get(self) except NULL:
        if self._event.get() == NULL:
            raise _ConfigError("event: this Event holds no CUDA event (made without __init__)",
                               argument="event")
        return self._event.get()

    @property
    def handle(self):
        """The cudaEvent_t as an int."""
        return <uintptr_t>self._get().handle()

    @property
    def device(self):
        return self._get().device()

    @property
    def timing(self):
        """True when the event records timestamps (``elapsed_ms`` works)."""
        return self._get().timing()

    def record(self, stream):
        """Records the event at the current end of ``stream``; returns self."""
        cdef CppEvent* event = self._get()
        cdef uintptr_t handle = _stream_handle(stream, "stream")
        _refuse_destroyed(handle, "stream", stream)
        cdef int device = _declared_device(stream)
        if device >= 0 and device != event.device():  # a default stream would be taken for ours
            raise _ConfigError(f"stream: is a stream of cuda:{device} and this Event is of cuda:"
                               f"{event.device()}; record it on a stream of its device, or make "
                               f"the Event with device={device}", argument="stream")
        with nogil:
            event.record(<cudaStream_t>handle)
        return self

    def wait(self, stream):
        """Makes ``stream`` wait (on the GPU) until the work recorded by this event is done."""
        cdef CppEvent* event = self._get()
        cdef uintptr_t handle = _stream_handle(stream, "stream")
        _refuse_destroyed(handle, "stream", stream)
        # With the stream's device current where the object names it (a default-stream handle
        # names the current device's stream); else this event's.
        cdef int device = _declared_device(stream)
        with nogil:
            event.make_wait(<cudaStream_t>handle, device)

    def query(self):
        """True when the recorded work is done."""
        cdef CppEvent* event = self._get()
        cdef bint done
        with nogil:
            done = event.query()
        return done

    def synchronize(self):
        """Blocks until the recorded work is done."""
        cdef CppEvent* event = self._get()
        with nogil:
            event.synchronize()

    def elapsed_ms(self, start):
        """Milliseconds from ``start`` to this event (both recorded, both ``timing=True``)."""
        if not isinstance(start, Event):
            raise _ConfigError(f"start: got a {_type_name(start)}; pass the inferctx.Event "
                               f"recorded first", argument="start")
        cdef CppEvent* event = self._get()
        cdef CppEvent* first = (<Event>start)._get()
        cdef float ms
        with nogil:
            ms = event.elapsed_ms_since(first[0])
        return ms

    def __repr__(self):
        if self._event.get() == NULL:
            return "<inferctx.Event (empty)>"
        return f"<inferctx.Event device={self.device} timing={self.timing}>"
