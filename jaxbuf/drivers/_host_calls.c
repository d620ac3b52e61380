/* The CPU driver's batched copy, made from C: jaxbuf.drivers._host_calls.
 *
 * A block transfer copies hundreds of blocks between two mappings of one process. A ctypes
 * memmove per block costs about a microsecond of Python each and holds the GIL throughout;
 * copy_batch walks the whole list in C with the GIL released, so other threads (JAX's, a
 * transfer's peer) run while the bytes move.
 *
 * This module links nothing and knows nothing of devices: it checks the three uint64 arrays
 * (their shape and type, through the buffer protocol) and trusts the addresses in them as
 * the driver does (the layering of DESIGN.md: platform calls only through a driver).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_batch_arrays.h"

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#define JAXBUF_STREAMING_STORES 1
#endif

/* The arrays hold uint64 addresses and sizes, used as pointers and size_t: a 32-bit build
 * would truncate them. The extension is optional, so such a build skips it and the driver
 * falls back to ctypes. */
_Static_assert(sizeof(void *) == sizeof(uint64_t) && sizeof(size_t) == sizeof(uint64_t),
               "jaxbuf.drivers._host_calls needs 64-bit pointers and sizes");

/* A batch this large goes through streaming stores: far beyond the last-level cache, a
 * store that bypasses the cache skips the read-for-ownership of every destination line and
 * leaves the cache to the source. glibc's memcpy makes the same choice for one large copy
 * (its non-temporal threshold is a fraction of the cache), but a batch of blocks is many
 * small copies, each below that threshold: 8,192 scattered 32 KiB copies (256 MiB) took
 * 1.6x the time of one 256 MiB memcpy with plain stores. */
#define STREAMING_BATCH_BYTES ((uint64_t)32 << 20)
#define STREAMING_MIN_COPY 4096

#ifdef JAXBUF_STREAMING_STORES
/* 64 bytes from src to the 16-byte aligned dst, by streaming stores. */
static inline void stream64(char *dst, const char *src) {
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}

/* memcpy of [src, src + size) to dst, size >= STREAMING_MIN_COPY, the two not overlapping:
 * the unaligned head with memcpy, then the body as four interleaved streams of streaming
 * stores (its four quarters advanced 64 bytes at a time, as glibc's large copy walks four
 * pages at once: the memory controller keeps four rows open instead of one), then the
 * tail. Measured on 2 cores: 8,192 scattered 32 KiB copies in 23 ms, one contiguous
 * 256 MiB memcpy in 22.5 ms, a memcpy per block in 37 ms. The caller fences
 * (_mm_sfence) once at the end. */
static void copy_streaming(char *dst, const char *src, size_t size) {
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    size -= head;
    size_t quarter = size / 256 * 64; /* a multiple of 64: every stream stays aligned */
    for (size_t offset = 0; offset < quarter; offset += 64) {
        stream64(dst + offset, src + offset);
        stream64(dst + quarter + offset, src + quarter + offset);
        stream64(dst + 2 * quarter + offset, src + 2 * quarter + offset);
        stream64(dst + 3 * quarter + offset, src + 3 * quarter + offset);
    }
    memcpy(dst + 4 * quarter, src + 4 * quarter, size - 4 * quarter);
}
#endif

/* copy_batch(dsts, srcs, sizes) -> None
 *
 * memmove(dsts[i], srcs[i], sizes[i]) for every i, in order, with the GIL released: three
 * 1-D C-contiguous uint64 arrays of one length, checked here (a check in C costs a tenth of
 * reading numpy's __array_interface__ three times, on a path a 1-block transfer takes).
 * memmove rather than memcpy: a copy whose own source and destination overlap gives what
 * the ctypes fallback (ctypes.memmove) gives. A batch of STREAMING_BATCH_BYTES or more
 * copies its non-overlapping copies of STREAMING_MIN_COPY bytes or more with streaming
 * stores (x86-64), fenced before returning: the same bytes, in the same order. */
static PyObject *copy_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "copy_batch takes 3 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer views[3];
    if (get_batch_arrays(args, views) < 0) return NULL;
    Py_ssize_t count = views[0].shape[0];
    const uint64_t *dsts = views[0].buf, *srcs = views[1].buf, *sizes = views[2].buf;
    Py_BEGIN_ALLOW_THREADS
#ifdef JAXBUF_STREAMING_STORES
    uint64_t total = 0;
    for (Py_ssize_t i = 0; i < count && total < STREAMING_BATCH_BYTES; i++) total += sizes[i];
    int streaming = total >= STREAMING_BATCH_BYTES;
#endif
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t dst = dsts[i], src = srcs[i], size = sizes[i];
        if (!size) continue;
#ifdef JAXBUF_STREAMING_STORES
        if (streaming && size >= STREAMING_MIN_COPY && (dst + size <= src || src + size <= dst)) {
            copy_streaming((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, (size_t)size);
            continue;
        }
#endif
        memmove((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)size);
    }
#ifdef JAXBUF_STREAMING_STORES
    if (streaming) _mm_sfence(); /* the streamed stores are visible before we return */
#endif
    Py_END_ALLOW_THREADS
    release_batch_arrays(views, 3);
    Py_RETURN_NONE;
}

/* -- a segmentation fault that explains itself ---------------------------------------------
 *
 * The CPU driver maps every uncommitted byte of a reservation read-only (a write faults; in
 * debug mode PROT_NONE, so a read faults too) and parks a freed reservation PROT_NONE (any
 * access faults): a view or raw pointer that outlives
 * its memory ends the process with SIGSEGV. The driver tells this table about each
 * reservation as it changes; a SIGSEGV handler, installed at the first reservation, looks the
 * faulting address up and writes one line naming jaxbuf, the reservation and the likely cause
 * to stderr, then hands the signal on unchanged: to the handler that was there before it
 * (faulthandler's traceback, a runtime's own handler) or, where that was the default, to the
 * default (the process dies of SIGSEGV as before). It never swallows a fault.
 *
 * The table is fixed-size static memory; the handler only reads it and calls write(2),
 * sigaction(2) and raise(3), which are async-signal-safe. The driver writes it with the GIL
 * held; an entry is published last (its `state` stored with release order) and withdrawn first,
 * so a fault in another thread during an update reads, at worst, a stale entry: a wrong
 * hint, never a crash. A fault at an address no entry covers passes on without a word. */
#include <signal.h>
#include <ucontext.h>
#include <unistd.h>

/* WATCH_STRICT: a debug-mode reservation, PROT_NONE where uncommitted (a read faults too).
 * WATCH_READ_ONLY: a chunk imported read-only is mapped in it (PROT_READ: a write faults on
 * committed memory too). */
enum {
    WATCH_RESERVED = 1,
    WATCH_RELEASED = 2,
    WATCH_FREED = 4,
    WATCH_STRICT = 8,
    WATCH_READ_ONLY = 16
};
#define WATCH_SLOTS 4096

typedef struct {
    uintptr_t start, end;
    int state; /* 0: slot free; else WATCH_* bits, published last */
} watched_t;

static watched_t watched[WATCH_SLOTS];
static struct sigaction previous_segv;
static int segv_installed;

static void put_text(char *buffer, size_t *at, size_t cap, const char *text) {
    while (*text && *at + 1 < cap) buffer[(*at)++] = *text++;
}

static void put_hex(char *buffer, size_t *at, size_t cap, uintptr_t value) {
    char digits[2 + 2 * sizeof value];
    int n = 0;
    do {
        digits[n++] = "0123456789abcdef"[value & 15];
        value >>= 4;
    } while (value && n < (int)sizeof digits);
    put_text(buffer, at, cap, "0x");
    while (n && *at + 1 < cap) buffer[(*at)++] = digits[--n];
}

static volatile sig_atomic_t handling;
/* The line is written once per process: a handler that returns without mapping the page (a
 * Python-level handler) sends the same fault round again, and again. */
static volatile sig_atomic_t explained;

/* Whether the faulting access was a write (1), a read (0) or unknown (-1), where the signal
 * context says: on x86-64 Linux the page fault's error code (its bit 1: a write). */
#if defined(__linux__) && defined(__x86_64__) && defined(REG_ERR)
static int access_was_write(void *context) {
    if (context == NULL) return -1;
    return (((ucontext_t *)context)->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
}
#else
static int access_was_write(void *context) {
    (void)context;
    return -1;
}
#endif

static const char *access_kind(void *context) {
    int write = access_was_write(context);
    return write < 0 ? "a read or write of " : write ? "a write to " : "a read of ";
}

static void explain_segv(int signum, siginfo_t *info, void *context) {
    /* Entered again while handing a fault on (a handler we chained to restored this one
     * and raised the signal): the default, at once. */
    if (handling) {
        signal(signum, SIG_DFL);
        raise(signum);
        return;
    }
    handling = 1;
    /* si_code > 0: the kernel raised it for this access, and si_addr is the address. */
    if (!explained && info != NULL && info->si_code > 0) {
        uintptr_t address = (uintptr_t)info->si_addr;
        for (int i = 0; i < WATCH_SLOTS; i++) {
            int state = __atomic_load_n(&watched[i].state, __ATOMIC_ACQUIRE);
            if (!state || address < watched[i].start || address >= watched[i].end) continue;
            char line[512];
            size_t at = 0;
            put_text(line, &at, sizeof line, "jaxbuf: segmentation fault at ");
            put_hex(line, &at, sizeof line, address);
            put_text(line, &at, sizeof line, ", inside the jaxbuf reservation ");
            put_hex(line, &at, sizeof line, watched[i].start);
            put_text(line, &at, sizeof line, "-");
            put_hex(line, &at, sizeof line, watched[i].end);
            if (state & WATCH_FREED)
                put_text(line, &at, sizeof line,
                         " (CPU driver), freed: likely a view or raw pointer used after free()");
            else if ((state & WATCH_READ_ONLY) && access_was_write(context) != 0) {
                /* Committed read-only pages fault on a write as uncommitted ones do. */
                put_text(line, &at, sizeof line,
                         (state & WATCH_STRICT) ? " (CPU driver, debug mode): "
                                                : " (CPU driver): ");
                put_text(line, &at, sizeof line, access_kind(context));
                put_text(line, &at, sizeof line,
                         "read-only or uncommitted memory (likely a write through a view of "
                         "a buffer imported read-only, or past the committed bytes)");
            }
            else if (state & WATCH_STRICT) {
                put_text(line, &at, sizeof line, " (CPU driver, debug mode): ");
                put_text(line, &at, sizeof line, access_kind(context));
                if (state & WATCH_RELEASED)
                    put_text(line, &at, sizeof line,
                             "uncommitted or released memory (likely through a view after "
                             "release_physical(), a shrink or a defragment, or past the "
                             "committed bytes)");
                else
                    put_text(line, &at, sizeof line,
                             "uncommitted memory (likely past the committed bytes)");
            }
            else if (state & WATCH_RELEASED)
                put_text(line, &at, sizeof line,
                         " (CPU driver), not committed there: likely a write through a view "
                         "after release_physical(), a shrink or a defragment, or past the committed "
                         "bytes");
            else
                put_text(line, &at, sizeof line,
                         " (CPU driver), not committed there: likely a write past the "
                         "committed bytes (uncommitted memory reads zeros, a write faults)");
            put_text(line, &at, sizeof line, "\n");
            ssize_t written = write(2, line, at);
            (void)written;
            explained = 1;
            break;
        }
    }
    /* Hand the signal on unchanged. A handler that returns has dealt with the fault (a
     * runtime that maps its own pages in on first touch): the next fault is handled anew. */
    if (previous_segv.sa_flags & SA_SIGINFO) {
        if (previous_segv.sa_sigaction != NULL) {
            previous_segv.sa_sigaction(signum, info, context);
            handling = 0;
            return;
        }
    } else if (previous_segv.sa_handler != SIG_DFL && previous_segv.sa_handler != SIG_IGN) {
        previous_segv.sa_handler(signum);
        handling = 0;
        return;
    }
    /* The default (or SIG_IGN, which the kernel overrides for a fault): restore it; the
     * access faults again on return and the process dies of SIGSEGV as without this handler.
     * A raised signal (si_code <= 0) is not re-delivered on return: raise it again. */
    sigaction(signum, &previous_segv, NULL);
    if (info == NULL || info->si_code <= 0) raise(signum);
}

/* Installed at the first reservation, and again on top whenever another handler has taken
 * SIGSEGV since (faulthandler.enable() after the first buffer): a handler installed later
 * would run first and end the process before the hint, so each change to a reservation puts
 * this one back in front, handing on to that one. Between such a change and a fault the
 * later handler runs alone: its own report, without the line. */
static void install_segv_handler(void) {
    struct sigaction current;
    if (segv_installed && sigaction(SIGSEGV, NULL, &current) == 0 &&
        (current.sa_flags & SA_SIGINFO) && current.sa_sigaction == explain_segv)
        return;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = explain_segv;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    struct sigaction before;
    if (sigaction(SIGSEGV, &action, &before) == 0) {
        previous_segv = before;
        segv_installed = 1;
    }
}

static int parse_range(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t expected,
                       const char *name, uintptr_t *start, uintptr_t *end) {
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, expected, nargs);
        return -1;
    }
    unsigned long long ptr = PyLong_AsUnsignedLongLong(args[0]);
    if (ptr == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    unsigned long long size = PyLong_AsUnsignedLongLong(args[1]);
    if (size == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (size == 0 || ptr + size < ptr) {
        PyErr_Format(PyExc_ValueError, "%s: bad range ptr=%llu size=%llu", name, ptr, size);
        return -1;
    }
    *start = (uintptr_t)ptr;
    *end = (uintptr_t)(ptr + size);
    return 0;
}

/* watch_reservation(ptr, size) -> None: a new reservation (uncommitted: a write faults).
 * Entries it overlaps (an earlier, freed reservation at the same addresses) are dropped. A
 * full table drops the oldest freed entry; with none, the reservation goes unwatched. */
static PyObject *watch_reservation(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uintptr_t start, end;
    if (parse_range(args, nargs, 2, "watch_reservation", &start, &end) < 0) return NULL;
    int slot = -1, freed = -1;
    for (int i = 0; i < WATCH_SLOTS; i++) {
        int state = watched[i].state;
        if (state && watched[i].start < end && start < watched[i].end) {
            __atomic_store_n(&watched[i].state, 0, __ATOMIC_RELEASE);
            state = 0;
        }
        if (!state && slot < 0) slot = i;
        if ((state & WATCH_FREED) && freed < 0) freed = i;
    }
    if (slot < 0) slot = freed;
    if (slot >= 0) {
        __atomic_store_n(&watched[slot].state, 0, __ATOMIC_RELEASE);
        watched[slot].start = start;
        watched[slot].end = end;
        __atomic_store_n(&watched[slot].state, WATCH_RESERVED, __ATOMIC_RELEASE);
        install_segv_handler();
    }
    Py_RETURN_NONE;
}

/* mark_reservation(ptr, size, state) -> None: add WATCH_* bits to the reservation holding
 * [ptr, ptr + size): 2 when a range of it is unmapped, 4 when it is freed, 8 when it is a
 * debug-mode (PROT_NONE) reservation, 16 when a chunk imported read-only is mapped in it. */
static PyObject *mark_reservation(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uintptr_t start, end;
    if (parse_range(args, nargs, 3, "mark_reservation", &start, &end) < 0) return NULL;
    long bits = PyLong_AsLong(args[2]);
    if (bits == -1 && PyErr_Occurred()) return NULL;
    for (int i = 0; i < WATCH_SLOTS; i++) {
        int state = watched[i].state;
        if (state && watched[i].start <= start && end <= watched[i].end) {
            __atomic_store_n(&watched[i].state, state | (int)bits, __ATOMIC_RELEASE);
            install_segv_handler();
        }
    }
    Py_RETURN_NONE;
}

/* forget_reservation(ptr, size) -> None: drop the entries inside [ptr, ptr + size), whose
 * addresses go back to the kernel (the driver calls it before munmap): a later mapping there
 * is no longer jaxbuf's, and a fault in it passes on without a word. */
static PyObject *forget_reservation(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    uintptr_t start, end;
    if (parse_range(args, nargs, 2, "forget_reservation", &start, &end) < 0) return NULL;
    for (int i = 0; i < WATCH_SLOTS; i++) {
        if (watched[i].state && start <= watched[i].start && watched[i].end <= end)
            __atomic_store_n(&watched[i].state, 0, __ATOMIC_RELEASE);
    }
    Py_RETURN_NONE;
}

static PyMethodDef host_calls_methods[] = {
    {"watch_reservation", (PyCFunction)(void (*)(void))watch_reservation, METH_FASTCALL,
     "watch_reservation(ptr, size) -> None: a SIGSEGV inside it names jaxbuf and the cause"},
    {"mark_reservation", (PyCFunction)(void (*)(void))mark_reservation, METH_FASTCALL,
     "mark_reservation(ptr, size, bits) -> None: 2: a range of it was unmapped; 4: freed; "
     "8: debug mode; 16: a chunk imported read-only is mapped in it"},
    {"forget_reservation", (PyCFunction)(void (*)(void))forget_reservation, METH_FASTCALL,
     "forget_reservation(ptr, size) -> None: the reservations inside it are unmapped"},
    {"copy_batch", (PyCFunction)(void (*)(void))copy_batch, METH_FASTCALL,
     "copy_batch(dsts, srcs, sizes) -> None: memmove of each (dst, src, size) of three 1-D "
     "uint64 arrays, in order, with the GIL released"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef host_calls_module = {
    PyModuleDef_HEAD_INIT, "_host_calls",
    "The CPU driver's batched copy (GIL released), and the hint a SIGSEGV in a reservation prints.", -1, host_calls_methods,
};

PyMODINIT_FUNC PyInit__host_calls(void) { return PyModule_Create(&host_calls_module); }
