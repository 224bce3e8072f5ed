# Part of _core.pyx: CUDA streams (owned or borrowed) and events, and the stream objects of
# other libraries turned into handles.

from libc.stdint cimport uintptr_t
from libcpp.memory cimport unique_ptr

from inferctx._decl_gpu cimport (
    CppEvent, CppStream, cudaStreamLegacy, cudaStreamPerThread, cudaStream_t)


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
        return (<Stream>stream)._handle
    if PyBool_Check(stream) or stream is None:
        raise _ConfigError(f"{argument}: got {stream!r}; pass {_STREAM_LIKE}", argument=argument)
    if isinstance(stream, int):
        handle = stream
    elif hasattr(stream, "__cuda_stream__"):
        protocol = stream.__cuda_stream__
        if callable(protocol):  # a method by the protocol; early cuda.core made it a property
            protocol = protocol()
        if not isinstance(protocol, tuple) or len(protocol) != 2:
            raise _ConfigError(f"{argument}: {_type_name(stream)}.__cuda_stream__ gave "
                               f"{protocol!r}; the protocol returns (version, handle)",
                               argument=argument)
        handle = protocol[1]
    elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        handle = stream.cuda_stream
    elif hasattr(stream, "ptr"):  # cupy.cuda.Stream
        handle = stream.ptr
    else:
        raise _ConfigError(f"{argument}: got a {_type_name(stream)}; pass {_STREAM_LIKE}",
                           argument=argument)
    if PyBool_Check(handle) or not isinstance(handle, int) or not 0 <= handle < (1 << 64):
        raise _ConfigError(f"{argument}: got the stream handle {handle!r}; a handle is an "
                           f"integer in [0, 2**64)", argument=argument)
    if handle == 0:
        return <uintptr_t>cudaStreamLegacy
    return <uintptr_t>handle


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


cdef int _stream_device(object stream, uintptr_t handle) except -2:
    """The device of a stream-like object: what it says (torch .device_index, cupy
    .device_id; torch.cuda.default_stream(1) is the legacy handle, of device 1), the current
    device for the special handles, else -1 (CUDA is asked)."""
    cdef int declared = _declared_device(stream)
    if declared >= 0:
        return declared
    if handle <= <uintptr_t>cudaStreamPerThread:
        return _device_arg(None)
    return -1


cdef class Stream:
    """A CUDA stream: one this object created (destroyed with it) or one borrowed from its owner.

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
        cdef uintptr_t handle
        if source is None:
            dev = _device_arg(device)
            with nogil:
                self._stream = CppStream.create(dev)
        else:
            handle = _stream_handle(source, "source")
            dev = _device_arg(device) if device is not None else _stream_device(source, handle)
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
        cdef uintptr_t handle = _stream_handle(other, "other")
        if handle == self._handle:
            return
        # The event is recorded on `other`, so it is made on other's device (an event and the
        # stream it is recorded on share a CUDA context); a wait may take one of another device.
        # Stream(other) says which: what the object says, else CUDA's answer for the handle.
        cdef Stream source = <Stream>other if isinstance(other, Stream) else Stream(other)
        Event(source._device).record(source).wait(self)

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


cdef class Event:
    """A CUDA event on one device: record it on a stream, make streams wait for it, time with it.

    ``Event(device=None, *, timing=False)``; ``timing=True`` is needed for ``elapsed_ms``.
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
        with nogil:
            event.record(<cudaStream_t>handle)
        return self

    def wait(self, stream):
        """Makes ``stream`` wait (on the GPU) until the work recorded by this event is done."""
        cdef CppEvent* event = self._get()
        cdef uintptr_t handle = _stream_handle(stream, "stream")
        with nogil:
            event.make_wait(<cudaStream_t>handle)

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
