# Part of _core.pyx: the test-only failure injection of cuda/include/inferctx/fault.hpp, for the
# Python tests of the error paths (tests/python/test_fault_injection.py). Present in every build;
# only a build configured with -DINFERCTX_FAULT_INJECTION=ON (tools/gpu-suite's `faults` step)
# can arm a site, and in any other build _fault_arm refuses and nothing is counted.

from libc.stdint cimport int64_t

cdef extern from *:
    """
    #include "inferctx/fault.hpp"
    static inline int inferctx_fault_compiled_in() { return inferctx::fault::kCompiledIn ? 1 : 0; }
    #if defined(INFERCTX_FAULT_INJECTION) && INFERCTX_FAULT_INJECTION
    static inline void inferctx_fault_arm(int site, int64_t nth, int code) {
      inferctx::fault::arm(static_cast<inferctx::fault::Site>(site), nth, code);
    }
    static inline void inferctx_fault_disarm_all() { inferctx::fault::disarm_all(); }
    static inline int64_t inferctx_fault_calls(int site) {
      return inferctx::fault::calls(static_cast<inferctx::fault::Site>(site));
    }
    #else
    static inline void inferctx_fault_arm(int, int64_t, int) {}
    static inline void inferctx_fault_disarm_all() {}
    static inline int64_t inferctx_fault_calls(int) { return 0; }
    #endif
    """
    int inferctx_fault_compiled_in() nogil
    void inferctx_fault_arm(int site, int64_t nth, int code) nogil
    void inferctx_fault_disarm_all() nogil
    int64_t inferctx_fault_calls(int site) nogil


# fault::Site, by name (the order of the enum).
_FAULT_SITES = ("device_alloc", "pinned_alloc", "virtual_memory", "event", "stream", "cublas",
                "synchronize", "handshake", "copy")


cdef int _fault_site(site) except -1:
    if not isinstance(site, str) or site not in _FAULT_SITES:
        raise _ConfigError(f"site: got {_brief(site)}; the sites are {', '.join(_FAULT_SITES)}",
                           argument="site")
    return _FAULT_SITES.index(site)


def _fault_compiled_in():
    """True in a build configured with -DINFERCTX_FAULT_INJECTION=ON (never a release wheel)."""
    return inferctx_fault_compiled_in() != 0


def _fault_arm(site, nth, code):
    """From now, the nth call (1: the next) at ``site`` fails with ``code`` (a cudaError_t,
    CUresult or cublasStatus_t value, as the site's calls return); nth <= 0 disarms the site.
    Resets the site's count. Only in a fault-injection build."""
    if not inferctx_fault_compiled_in():
        raise _ConfigError("site: this build has no failure injection (configure with "
                           "-DINFERCTX_FAULT_INJECTION=ON)", argument="site")
    cdef int s = _fault_site(site)
    cdef int64_t n = _int_arg(nth, "nth")
    cdef int c = <int>_int_arg(code, "code")
    inferctx_fault_arm(s, n, c)


def _fault_disarm_all():
    """Disarms every site and resets the counts (nothing to do in other builds)."""
    inferctx_fault_disarm_all()


def _fault_calls(site):
    """Calls counted at ``site`` since it was last armed or reset (0 in other builds)."""
    return inferctx_fault_calls(_fault_site(site))
