/* The hot paths of staged writes, in C: staging, later-wins resolution, packing.
 *
 * A Stager holds one target's two staging buffers (bytearrays: packed write records and the
 * values' raw bytes) and its bounds. Stager.stage(row, start, values) stages the write and
 * returns True when everything is plain: row and start exact ints, values a C-contiguous 1-D
 * buffer whose format is the target's, the write in bounds. Otherwise it stages nothing and
 * returns False, and the Python path (StagedWriteTensor.stage_write in jaxbuf/staged/_tensor.py,
 * with jaxbuf/_convert.py) converts, validates and raises the precise error. So this file
 * decides nothing the Python path does not also decide; it only saves the interpreter's time on
 * the common case (a numpy array of the right dtype), which vLLM-style loops call hundreds of
 * times per step. For whole batches, all or nothing, the JAX staging object
 * (jaxbuf/staged/_jax_staging.py) has Stager.stage_many(rows, starts, values_list) (Python lists
 * of plain writes, in one C loop) and Stager.stage_columns(rows, starts, lengths, contents)
 * (int64 columns and the values' bytes, converted by numpy).
 *
 * Later wins, without sorting. Writes of one batch may overlap; where they do, the later one
 * must win, and the kernel must not depend on the order its programs run in. So the stager
 * keeps, as writes are staged (O(1) amortised each), an open-addressing hash from target row to
 * the last write to that row, a per-write link to the previous write to the same row, and the
 * list of "dirty" rows, whose writes may overlap: a write to a row seen before is checked
 * against that row's earlier writes (at most CLEAN_CHECK_LIMIT of them; a row written more often
 * is dirty regardless). resolve() walks only the dirty rows' chains, newest write to oldest,
 * keeping the element intervals already covered: an older write hidden entirely is dropped, one
 * hidden in part is split into its visible pieces (each an ordinary write-table entry: same
 * row, its own start and length, its content offset moved by as much). The writes it emits
 * never overlap, so the kernel always runs in parallel, one program per write, and the result
 * is the in-order result. A batch without overlaps costs nothing here at pack time, whether
 * rows repeat or not. (The covered intervals are a sorted array: a row with thousands of
 * disjoint writes in random order costs their memmoves, some 0.3 ms for 4,096 in one row.) Records appended by the Python paths are indexed on the next stage() or
 * resolve() (they are caught up in order). Clearing the buffers goes through reset() or
 * clear(), O(1): the hash's slots carry a generation stamp.
 *
 * pack(stagers, group_table, address, capacity) lays an apply out in a pinned staging slot:
 * the group table, the resolved write table (each write or piece with its group id and the byte
 * offset of its values filled in) and every target's values, each target's at an offset aligned
 * to its element size. It replaces some twenty numpy calls per apply; jaxbuf/_packing.py keeps a
 * numpy implementation of the same layout for builds without this extension.
 * Stager.write_columns(...) emits the same resolved writes as the int32 columns of the JAX
 * PackedWrites, their visible values packed back to back.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#define RECORD_FIELDS 5 /* group, row, start, content_offset, length: the kernel's write table */
#define RECORD_BYTES (RECORD_FIELDS * 8)
#define FATE_KEEP (-1) /* the write is emitted as staged */
#define FATE_DROP (-2) /* later writes cover it entirely */
/* Any other fate is the index of the write's first visible piece in Stager.pieces. */

/* Rows written up to this many times are checked for overlap as they are staged; a row written
 * more often is resolved at pack time whether its writes overlap or not. */
#define CLEAN_CHECK_LIMIT 8

typedef struct {
    long long row;
    Py_ssize_t last;    /* the last write to this row */
    Py_ssize_t count;   /* writes to this row in the batch */
    unsigned int stamp; /* == Stager.generation: the slot is in use */
    int dirty;          /* some of its writes may overlap: resolve() walks it */
} RowSlot;

typedef struct {
    Py_ssize_t write; /* the write this is a visible piece of */
    long long start;
    long long length;
} Piece;

typedef struct {
    long long start, end;
} Interval;

typedef struct {
    PyObject_HEAD
    PyObject *records;  /* bytearray of int64 records */
    PyObject *contents; /* bytearray of values' bytes */
    long long num_rows;
    long long row_len;
    char format[16]; /* the buffer format of the target dtype, e.g. "i"; never matched if "" */
    Py_ssize_t itemsize;
    /* Later-wins bookkeeping (see the comment at the top). */
    Py_ssize_t tracked;   /* records [0, tracked) are indexed */
    long long tracked_elements; /* the elements those records cover */
    Py_ssize_t *links;    /* per write: the previous write to its row, or -1 */
    Py_ssize_t *fates;    /* per write: FATE_KEEP, FATE_DROP or its first piece */
    Py_ssize_t link_capacity, fate_capacity;
    RowSlot *slots;       /* capacity a power of two, at most half used */
    Py_ssize_t slot_capacity, slot_used;
    unsigned int generation;
    long long *dirty;     /* rows whose writes may overlap (see RowSlot.dirty) */
    Py_ssize_t num_dirty, dirty_capacity;
    Piece *pieces;        /* visible pieces of split writes, each write's in start order */
    Py_ssize_t num_pieces, piece_capacity;
    Interval *covered;    /* the chain walk's covered intervals, sorted, disjoint */
    Py_ssize_t covered_capacity;
    Py_ssize_t resolved_for; /* records resolve() last ran over; -1: none since the reset */
    Py_ssize_t resolved;     /* writes resolve() emits */
    long long hidden;        /* elements of staged writes that later writes hide */
} Stager;

static PyTypeObject *stager_type;

/* -- small helpers --------------------------------------------------------------------------- */
static int append(PyObject *bytearray, const void *data, Py_ssize_t size) {
    Py_ssize_t old = PyByteArray_GET_SIZE(bytearray);
    /* PyByteArray_Resize over-allocates when growing: appends are amortised O(1). */
    if (PyByteArray_Resize(bytearray, old + size) < 0) return -1;
    memcpy(PyByteArray_AS_STRING(bytearray) + old, data, (size_t)size);
    return 0;
}

static int exact_index(PyObject *obj, long long *value) {
    if (!PyLong_CheckExact(obj)) return 0; /* bool, numpy ints, ...: the Python path */
    int overflow = 0;
    *value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (*value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* Grow *array (elements of elem_size) to hold at least needed, doubling; -1 with MemoryError. */
static int reserve(void **array, Py_ssize_t *capacity, Py_ssize_t needed, size_t elem_size) {
    if (needed <= *capacity) return 0;
    Py_ssize_t size = *capacity > 16 ? *capacity : 16;
    while (size < needed) size *= 2;
    void *grown = PyMem_Realloc(*array, (size_t)size * elem_size);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *array = grown;
    *capacity = size;
    return 0;
}

static inline size_t row_hash(long long row) {
    /* Fibonacci hashing: consecutive rows spread over the table. */
    uint64_t h = (uint64_t)row * 0x9E3779B97F4A7C15ull;
    return (size_t)(h ^ (h >> 29));
}

static inline const long long *record_at(Stager *s, Py_ssize_t w) {
    return (const long long *)PyByteArray_AS_STRING(s->records) + w * RECORD_FIELDS;
}

static inline Py_ssize_t num_records(Stager *s) {
    return PyByteArray_GET_SIZE(s->records) / RECORD_BYTES;
}

/* -- the row index --------------------------------------------------------------------------- */
/* Forget every indexed write: O(1), the slots' stamps go stale. */
static void reset_tracking(Stager *s) {
    s->tracked = 0;
    s->tracked_elements = 0;
    s->slot_used = 0;
    s->num_dirty = 0;
    s->num_pieces = 0;
    s->resolved_for = -1;
    if (++s->generation == 0) { /* wrapped: forget every stamp */
        if (s->slots != NULL) memset(s->slots, 0, (size_t)s->slot_capacity * sizeof(RowSlot));
        s->generation = 1;
    }
}

static RowSlot *find_slot(Stager *s, long long row) {
    size_t mask = (size_t)s->slot_capacity - 1;
    size_t i = row_hash(row) & mask;
    for (;;) {
        RowSlot *slot = &s->slots[i];
        if (slot->stamp != s->generation || slot->row == row) return slot;
        i = (i + 1) & mask;
    }
}

/* Double the hash table (at least 64 slots), keeping the live slots. */
static int grow_slots(Stager *s) {
    Py_ssize_t capacity = s->slot_capacity ? s->slot_capacity * 2 : 64;
    RowSlot *fresh = PyMem_Calloc((size_t)capacity, sizeof(RowSlot));
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    RowSlot *old = s->slots;
    Py_ssize_t old_capacity = s->slot_capacity;
    s->slots = fresh;
    s->slot_capacity = capacity;
    for (Py_ssize_t i = 0; i < old_capacity; i++) {
        if (old[i].stamp == s->generation) *find_slot(s, old[i].row) = old[i];
    }
    PyMem_Free(old);
    return 0;
}

/* Whether write w overlaps one of the writes of the chain from write `from` (its row's earlier
 * writes: fewer than CLEAN_CHECK_LIMIT). */
static int overlaps_earlier(Stager *s, Py_ssize_t w, Py_ssize_t from) {
    const long long *record = record_at(s, w);
    long long start = record[2], end = start + record[4];
    for (Py_ssize_t v = from; v >= 0; v = s->links[v]) {
        const long long *earlier = record_at(s, v);
        if (earlier[2] < end && earlier[2] + earlier[4] > start) return 1;
    }
    return 0;
}

/* Index records [tracked, n) in order: O(1) amortised per write. -1 with MemoryError (the
 * writes indexed so far stay indexed; a later call resumes), or with ValueError for a record
 * out of the stager's bounds: the records bytearray is Python's too, and every later read of
 * the contents (resolve, write_columns, pack) trusts the indexed records. */
static int track(Stager *s) {
    if (PyByteArray_GET_SIZE(s->records) % RECORD_BYTES != 0) {
        PyErr_Format(PyExc_ValueError, "the staged records hold %zd bytes, not a multiple of %d",
                     PyByteArray_GET_SIZE(s->records), RECORD_BYTES);
        return -1;
    }
    Py_ssize_t n = num_records(s);
    if (s->tracked > n) reset_tracking(s); /* the buffers were cleared behind our back */
    if (s->tracked == n) return 0;
    if (reserve((void **)&s->links, &s->link_capacity, n, sizeof(Py_ssize_t)) < 0 ||
        reserve((void **)&s->fates, &s->fate_capacity, n, sizeof(Py_ssize_t)) < 0)
        return -1;
    /* At most one new dirty row per write: reserve so the loop cannot fail half-way. */
    if (reserve((void **)&s->dirty, &s->dirty_capacity, s->num_dirty + (n - s->tracked),
                sizeof(long long)) < 0)
        return -1;
    s->resolved_for = -1;
    for (Py_ssize_t w = s->tracked; w < n; w++) {
        if ((s->slot_used + 1) * 2 > s->slot_capacity && grow_slots(s) < 0) {
            s->tracked = w;
            return -1;
        }
        const long long *record = record_at(s, w);
        long long row = record[1], start = record[2], length = record[4];
        if (row < 0 || row >= s->num_rows || start < 0 || length < 0 ||
            start > s->row_len - length || s->tracked_elements > LLONG_MAX - length) {
            PyErr_Format(PyExc_ValueError,
                         "staged record %zd (row %lld, start %lld, length %lld) is out of "
                         "bounds for %lld rows of %lld elements",
                         w, row, start, length, s->num_rows, s->row_len);
            s->tracked = w;
            return -1;
        }
        s->tracked_elements += length;
        RowSlot *slot = find_slot(s, row);
        if (slot->stamp != s->generation) {
            slot->stamp = s->generation;
            slot->row = row;
            slot->count = 1;
            slot->dirty = 0;
            s->links[w] = -1;
            s->slot_used++;
        } else {
            s->links[w] = slot->last;
            if (!slot->dirty &&
                (++slot->count > CLEAN_CHECK_LIMIT || overlaps_earlier(s, w, slot->last))) {
                slot->dirty = 1;
                s->dirty[s->num_dirty++] = row;
            }
        }
        slot->last = w;
        s->fates[w] = FATE_KEEP;
    }
    s->tracked = n;
    return 0;
}

/* -- later-wins resolution ------------------------------------------------------------------- */
static int add_piece(Stager *s, Py_ssize_t write, long long start, long long length) {
    if (reserve((void **)&s->pieces, &s->piece_capacity, s->num_pieces + 1, sizeof(Piece)) < 0)
        return -1;
    Piece *piece = &s->pieces[s->num_pieces++];
    piece->write = write;
    piece->start = start;
    piece->length = length;
    return 0;
}

/* Walk one dirty row's writes newest to oldest, setting each one's fate. *emitted changes by
 * the writes dropped and the pieces added, s->hidden by the elements hidden. */
static int resolve_row(Stager *s, long long row, Py_ssize_t *emitted) {
    RowSlot *slot = find_slot(s, row);
    Py_ssize_t m = 0; /* covered intervals */
    for (Py_ssize_t w = slot->last; w >= 0; w = s->links[w]) {
        const long long *record = record_at(s, w);
        long long start = record[2], length = record[4], end = start + length;
        if (length <= 0) {
            s->fates[w] = FATE_DROP;
            (*emitted)--;
            s->hidden += length;
            continue;
        }
        /* The first covered interval that ends at or after start: it may touch the write. */
        Py_ssize_t lo = 0, hi = m;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (s->covered[mid].end < start) lo = mid + 1;
            else hi = mid;
        }
        /* The gaps between the intervals that touch [start, end) are what stays visible. */
        Py_ssize_t first = s->num_pieces, j = lo;
        long long position = start;
        for (; j < m && s->covered[j].start <= end; j++) {
            if (s->covered[j].start > position &&
                add_piece(s, w, position, s->covered[j].start - position) < 0)
                return -1;
            if (s->covered[j].end > position) position = s->covered[j].end;
        }
        if (position < end && add_piece(s, w, position, end - position) < 0) return -1;
        Py_ssize_t count = s->num_pieces - first;
        long long visible = 0;
        for (Py_ssize_t p = first; p < s->num_pieces; p++) visible += s->pieces[p].length;
        s->hidden += length - visible;
        if (count == 0) {
            s->fates[w] = FATE_DROP;
            (*emitted)--;
        } else if (count == 1 && s->pieces[first].length == length) {
            s->fates[w] = FATE_KEEP; /* nothing newer touches it */
            s->num_pieces = first;
        } else {
            s->fates[w] = first;
            *emitted += count - 1;
        }
        /* Merge [start, end) with the intervals [lo, j) it touches. */
        Interval merged = {start, end};
        if (lo < j) {
            if (s->covered[lo].start < merged.start) merged.start = s->covered[lo].start;
            if (s->covered[j - 1].end > merged.end) merged.end = s->covered[j - 1].end;
        }
        if (lo == j) {
            if (reserve((void **)&s->covered, &s->covered_capacity, m + 1, sizeof(Interval)) < 0)
                return -1;
            memmove(&s->covered[lo + 1], &s->covered[lo], (size_t)(m - lo) * sizeof(Interval));
            m++;
        } else if (j - lo > 1) {
            memmove(&s->covered[lo + 1], &s->covered[j], (size_t)(m - j) * sizeof(Interval));
            m -= j - lo - 1;
        }
        s->covered[lo] = merged;
    }
    return 0;
}

/* Index what is staged and resolve later-wins; the number of writes emitted, -1 on error.
 * Cached until more is staged or the stager is reset. */
static Py_ssize_t resolve(Stager *s) {
    if (track(s) < 0) return -1;
    /* The contents must hold exactly the values the records cover: every read below and in
     * write_columns and pack stays inside them. */
    Py_ssize_t size = PyByteArray_GET_SIZE(s->contents);
    if (size % s->itemsize != 0 || size / s->itemsize != s->tracked_elements) {
        PyErr_Format(PyExc_ValueError,
                     "the staged records cover %lld elements of %zd bytes, but the contents "
                     "hold %zd bytes",
                     s->tracked_elements, s->itemsize, size);
        return -1;
    }
    Py_ssize_t n = s->tracked;
    if (s->resolved_for == n) return s->resolved;
    Py_ssize_t emitted = n;
    s->num_pieces = 0;
    s->hidden = 0;
    for (Py_ssize_t r = 0; r < s->num_dirty; r++) {
        if (resolve_row(s, s->dirty[r], &emitted) < 0) return -1;
    }
    s->resolved_for = n;
    s->resolved = emitted;
    return emitted;
}

/* Whether obj holds 1-D C-contiguous values of the stager's dtype. When it does, view->buf and
 * view->len (bytes) are set, and view->obj holds what PyBuffer_Release releases: NULL for an
 * exact numpy array, read through numpy's C API, because numpy's buffer protocol costs about
 * 20 ns an array, as much as the rest of a staged write. Never raises. */
static int plain_values(Stager *self, PyObject *obj, Py_buffer *view) {
    if (PyArray_CheckExact(obj)) {
        PyArrayObject *array = (PyArrayObject *)obj;
        PyArray_Descr *descr = PyArray_DESCR(array);
        if (PyArray_NDIM(array) == 1 && PyArray_IS_C_CONTIGUOUS(array) &&
            PyArray_ISNOTSWAPPED(array) && descr->type_num < NPY_USERDEF &&
            PyDataType_ELSIZE(descr) == self->itemsize && self->format[0] == descr->type &&
            self->format[1] == '\0') {
            view->obj = NULL;
            view->buf = PyArray_DATA(array);
            view->len = PyArray_NBYTES(array);
            return 1;
        }
        /* Anything else the buffer protocol decides, as for any other object. */
    }
    if (!PyObject_CheckBuffer(obj)) return 0;
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear(); /* not contiguous, or a dtype without a buffer format */
        return 0;
    }
    if (view->ndim != 1 || view->itemsize != self->itemsize || view->format == NULL ||
        strcmp(view->format, self->format) != 0) {
        PyBuffer_Release(view);
        return 0;
    }
    return 1;
}

/* -- Stager methods -------------------------------------------------------------------------- */
/* Stager.__new__ without __init__ leaves no buffers: every method that reads them refuses. */
static int check_ready(Stager *self) {
    if (self->records == NULL || self->contents == NULL) {
        PyErr_SetString(PyExc_TypeError, "the Stager is not initialized (call Stager(...))");
        return -1;
    }
    return 0;
}

static PyObject *stager_stage(Stager *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "stage(row, start, values) takes 3 arguments");
        return NULL;
    }
    if (check_ready(self) < 0) return NULL;
    long long row, start;
    if (!exact_index(args[0], &row) || !exact_index(args[1], &start)) Py_RETURN_FALSE;
    Py_buffer view;
    if (!plain_values(self, args[2], &view)) Py_RETURN_FALSE;
    long long length = (long long)(view.len / self->itemsize);
    if (row < 0 || row >= self->num_rows || start < 0 || start > self->row_len - length) {
        PyBuffer_Release(&view);
        Py_RETURN_FALSE;
    }
    if (length > 0) {
        long long record[RECORD_FIELDS] = {0, row, start, 0, length};
        Py_ssize_t old = PyByteArray_GET_SIZE(self->contents);
        if (append(self->contents, view.buf, view.len) < 0) {
            PyBuffer_Release(&view);
            return NULL;
        }
        if (append(self->records, record, sizeof(record)) < 0) {
            /* Keep the two buffers consistent: drop the contents just appended. */
            PyObject *type, *value, *traceback;
            PyErr_Fetch(&type, &value, &traceback);
            PyByteArray_Resize(self->contents, old);
            PyErr_Restore(type, value, traceback);
            PyBuffer_Release(&view);
            return NULL;
        }
        /* The write is staged; if indexing it runs out of memory, resolve() retries (and
         * raises there). */
        if (track(self) < 0) PyErr_Clear();
    }
    PyBuffer_Release(&view);
    Py_RETURN_TRUE;
}

/* A buffer's struct format past a '=', '<' or '@' byte-order prefix ("B" when it gives none),
 * so that numpy's "<q" and memoryview's "q" compare alike. */
static const char *native_format(const Py_buffer *view) {
    const char *f = view->format ? view->format : "B";
    if (*f == '=' || *f == '<' || *f == '@') f++;
    return f;
}

/* A 1-D C-contiguous integer column of itemsize 8 (int64) or 4 (int32); TypeError otherwise. */
static int int_column(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *f = native_format(view);
    int matches = itemsize == 8 ? !strcmp(f, "q") || !strcmp(f, "l") : !strcmp(f, "i");
    if (view->ndim != 1 || view->itemsize != itemsize || !matches) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D C-contiguous int%d array", name,
                     (int)(itemsize * 8));
        return -1;
    }
    return 0;
}

static int int64_column(PyObject *obj, Py_buffer *view, const char *name) {
    return int_column(obj, view, 8, name);
}

/* stage_columns(rows, starts, lengths, contents) -> -1 when every write is staged, else the
 * index of the first write that is out of bounds (then nothing is staged). rows, starts and
 * lengths: 1-D int64 arrays of one length; contents: a byte buffer holding the writes' values
 * back to back, of the target's dtype (sum(lengths) * itemsize bytes). Writes of length 0 stage
 * nothing. */
static PyObject *stager_stage_columns(Stager *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "stage_columns(rows, starts, lengths, contents) takes 4 arguments");
        return NULL;
    }
    if (check_ready(self) < 0) return NULL;
    Py_buffer rows = {0}, starts = {0}, lengths = {0}, contents = {0};
    PyObject *result = NULL;
    if (int64_column(args[0], &rows, "rows") < 0 || int64_column(args[1], &starts, "starts") < 0 ||
        int64_column(args[2], &lengths, "lengths") < 0 ||
        PyObject_GetBuffer(args[3], &contents, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    Py_ssize_t n = rows.shape[0];
    if (starts.shape[0] != n || lengths.shape[0] != n) {
        PyErr_SetString(PyExc_ValueError, "rows, starts and lengths differ in length");
        goto done;
    }
    const long long *row = rows.buf, *start = starts.buf, *length = lengths.buf;
    Py_ssize_t nonempty = 0;
    long long total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (length[i] < 0 || row[i] < 0 || row[i] >= self->num_rows || start[i] < 0 ||
            start[i] > self->row_len - length[i]) {
            result = PyLong_FromSsize_t(i);
            goto done;
        }
        if (total > PY_SSIZE_T_MAX - length[i]) {
            PyErr_SetString(PyExc_ValueError, "the writes' lengths overflow");
            goto done;
        }
        nonempty += length[i] > 0;
        total += length[i];
    }
    if (total > PY_SSIZE_T_MAX / self->itemsize || contents.len != total * self->itemsize) {
        PyErr_Format(PyExc_ValueError, "contents hold %zd bytes, the writes need %lld", contents.len,
                     total * self->itemsize);
        goto done;
    }
    Py_ssize_t old_contents = PyByteArray_GET_SIZE(self->contents);
    Py_ssize_t old_records = PyByteArray_GET_SIZE(self->records);
    if (PyByteArray_Resize(self->contents, old_contents + (Py_ssize_t)contents.len) < 0) goto done;
    if (PyByteArray_Resize(self->records, old_records + nonempty * RECORD_BYTES) < 0) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyByteArray_Resize(self->contents, old_contents);
        PyErr_Restore(type, value, traceback);
        goto done;
    }
    memcpy(PyByteArray_AS_STRING(self->contents) + old_contents, contents.buf, (size_t)contents.len);
    long long *record = (long long *)(PyByteArray_AS_STRING(self->records) + old_records);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (length[i] == 0) continue;
        record[0] = 0;
        record[1] = row[i];
        record[2] = start[i];
        record[3] = 0;
        record[4] = length[i];
        record += RECORD_FIELDS;
    }
    if (track(self) < 0) PyErr_Clear(); /* staged; resolve() retries the indexing */
    result = PyLong_FromLong(-1);
done:
    if (rows.obj != NULL) PyBuffer_Release(&rows);
    if (starts.obj != NULL) PyBuffer_Release(&starts);
    if (lengths.obj != NULL) PyBuffer_Release(&lengths);
    if (contents.obj != NULL) PyBuffer_Release(&contents);
    return result;
}

/* stage_many(rows, starts, values_list) -> -1 when every write is staged, else the index of
 * the first write that is not plain (see stage()) or not in bounds, and nothing is staged (the
 * caller's general path then converts and says why). rows, starts and values_list: lists or
 * tuples of one length (anything else: 0). All or nothing, and no Python per write. */
static PyObject *stager_stage_many(Stager *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "stage_many(rows, starts, values_list) takes 3 arguments");
        return NULL;
    }
    if (check_ready(self) < 0) return NULL;
    for (int a = 0; a < 3; a++) {
        if (!PyList_CheckExact(args[a]) && !PyTuple_CheckExact(args[a])) return PyLong_FromLong(0);
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[0]);
    if (PySequence_Fast_GET_SIZE(args[1]) != n || PySequence_Fast_GET_SIZE(args[2]) != n)
        return PyLong_FromLong(0);
    PyObject **row_items = PySequence_Fast_ITEMS(args[0]);
    PyObject **start_items = PySequence_Fast_ITEMS(args[1]);
    PyObject **value_items = PySequence_Fast_ITEMS(args[2]);
    Py_buffer *views = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    if (views == NULL) return PyErr_NoMemory();
    PyObject *result = NULL;
    Py_ssize_t held = 0, nonempty = 0, bad = -1;
    long long total = 0;
    /* Pass 1: every write plain and in bounds, holding its buffer. */
    for (; held < n; held++) {
        long long row, start;
        Py_buffer *view = &views[held];
        if (!exact_index(row_items[held], &row) || !exact_index(start_items[held], &start) ||
            !plain_values(self, value_items[held], view)) {
            bad = held;
            break;
        }
        long long length = (long long)(view->len / self->itemsize);
        if (row < 0 || row >= self->num_rows || start < 0 || start > self->row_len - length) {
            PyBuffer_Release(view);
            bad = held;
            break;
        }
        nonempty += length > 0;
        total += view->len;
    }
    if (bad >= 0) {
        result = PyLong_FromSsize_t(bad);
        goto done;
    }
    /* Pass 2: grow each buffer once, then copy. */
    Py_ssize_t old_contents = PyByteArray_GET_SIZE(self->contents);
    Py_ssize_t old_records = PyByteArray_GET_SIZE(self->records);
    if (PyByteArray_Resize(self->contents, old_contents + (Py_ssize_t)total) < 0) goto done;
    if (PyByteArray_Resize(self->records, old_records + nonempty * RECORD_BYTES) < 0) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyByteArray_Resize(self->contents, old_contents);
        PyErr_Restore(type, value, traceback);
        goto done;
    }
    char *into = PyByteArray_AS_STRING(self->contents) + old_contents;
    long long *record = (long long *)(PyByteArray_AS_STRING(self->records) + old_records);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t length = views[i].len / self->itemsize;
        if (length == 0) continue;
        memcpy(into, views[i].buf, (size_t)views[i].len);
        into += views[i].len;
        record[0] = 0;
        record[1] = PyLong_AsLongLong(row_items[i]); /* exact ints, checked in pass 1 */
        record[2] = PyLong_AsLongLong(start_items[i]);
        record[3] = 0;
        record[4] = length;
        record += RECORD_FIELDS;
    }
    if (track(self) < 0) PyErr_Clear(); /* staged; resolve() retries the indexing */
    result = PyLong_FromLong(-1);
done:
    for (Py_ssize_t i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    return result;
}

/* resolve() -> (num_writes, num_elements): what write_columns emits. */
static PyObject *stager_resolve(Stager *self, PyObject *unused) {
    if (check_ready(self) < 0) return NULL;
    Py_ssize_t emitted = resolve(self);
    if (emitted < 0) return NULL;
    long long elements = PyByteArray_GET_SIZE(self->contents) / self->itemsize - self->hidden;
    return Py_BuildValue("nL", emitted, elements);
}

static int int32_output(PyObject *obj, Py_buffer *view, Py_ssize_t needed, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = native_format(view);
    if (view->ndim != 1 || view->itemsize != 4 || strcmp(f, "i") || view->shape[0] < needed) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s must be a writable 1-D int32 array of at least %zd",
                     name, needed);
        return -1;
    }
    return 0;
}

/* write_columns(rows, starts, lengths, offsets, values) -> the number of writes emitted: the
 * resolved writes as int32 columns and their visible values packed back to back in write order
 * (offsets in elements into values, a byte buffer). Columns past that number are left alone. */
static PyObject *stager_write_columns(Stager *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "write_columns(rows, starts, lengths, offsets, values) takes 5 arguments");
        return NULL;
    }
    if (check_ready(self) < 0) return NULL;
    Py_ssize_t emitted = resolve(self);
    if (emitted < 0) return NULL;
    Py_buffer out[4] = {{0}}, values = {0};
    static const char *names[4] = {"rows", "starts", "lengths", "offsets"};
    PyObject *result = NULL;
    for (int c = 0; c < 4; c++) {
        if (int32_output(args[c], &out[c], emitted, names[c]) < 0) goto done;
    }
    if (PyObject_GetBuffer(args[4], &values, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    Py_ssize_t itemsize = self->itemsize;
    long long elements = PyByteArray_GET_SIZE(self->contents) / itemsize - self->hidden;
    if (elements > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "the staged values exceed the int32 index range");
        goto done;
    }
    if (values.len < elements * itemsize) {
        PyErr_Format(PyExc_ValueError, "values hold %zd bytes, the writes %lld", values.len,
                     elements * itemsize);
        goto done;
    }
    int32_t *rows = out[0].buf, *starts = out[1].buf, *lengths = out[2].buf, *offsets = out[3].buf;
    const char *source = PyByteArray_AS_STRING(self->contents);
    char *target = values.buf;
    Py_ssize_t n = self->tracked, k = 0;
    long long in = 0, at = 0; /* elements: read from the staged contents, written to values */
    for (Py_ssize_t w = 0; w < n; w++) {
        const long long *record = record_at(self, w);
        Py_ssize_t fate = self->fates[w];
        if (fate == FATE_KEEP) {
            rows[k] = (int32_t)record[1];
            starts[k] = (int32_t)record[2];
            lengths[k] = (int32_t)record[4];
            offsets[k] = (int32_t)at;
            memcpy(target + at * itemsize, source + in * itemsize, (size_t)(record[4] * itemsize));
            at += record[4];
            k++;
        } else if (fate >= 0) {
            for (Py_ssize_t p = fate; p < self->num_pieces && self->pieces[p].write == w; p++) {
                const Piece *piece = &self->pieces[p];
                rows[k] = (int32_t)record[1];
                starts[k] = (int32_t)piece->start;
                lengths[k] = (int32_t)piece->length;
                offsets[k] = (int32_t)at;
                memcpy(target + at * itemsize, source + (in + piece->start - record[2]) * itemsize,
                       (size_t)(piece->length * itemsize));
                at += piece->length;
                k++;
            }
        }
        in += record[4];
    }
    result = PyLong_FromSsize_t(k);
done:
    for (int c = 0; c < 4; c++) {
        if (out[c].obj != NULL) PyBuffer_Release(&out[c]);
    }
    if (values.obj != NULL) PyBuffer_Release(&values);
    return result;
}

static PyObject *stager_reset(Stager *self, PyObject *unused) {
    reset_tracking(self);
    Py_RETURN_NONE;
}

static PyObject *stager_close(Stager *self, PyObject *unused) {
    self->num_rows = 0; /* every later stage() falls back to Python, which says why */
    Py_RETURN_NONE;
}

/* Stager(records, contents, num_rows, row_len, format, itemsize) */
static int stager_init(Stager *self, PyObject *args, PyObject *kwargs) {
    PyObject *records, *contents;
    long long num_rows, row_len;
    const char *format;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "O!O!LLsn", &PyByteArray_Type, &records, &PyByteArray_Type,
                          &contents, &num_rows, &row_len, &format, &itemsize))
        return -1;
    if (strlen(format) >= sizeof(self->format) || itemsize <= 0 || num_rows < 0 || row_len < 0) {
        PyErr_SetString(PyExc_ValueError, "bad format or itemsize");
        return -1;
    }
    Py_INCREF(records);
    Py_XSETREF(self->records, records);
    Py_INCREF(contents);
    Py_XSETREF(self->contents, contents);
    self->num_rows = num_rows;
    self->row_len = row_len;
    strcpy(self->format, format);
    self->itemsize = itemsize;
    reset_tracking(self);
    return 0;
}

static void stager_dealloc(Stager *self) {
    PyMem_Free(self->links);
    PyMem_Free(self->fates);
    PyMem_Free(self->slots);
    PyMem_Free(self->dirty);
    PyMem_Free(self->pieces);
    PyMem_Free(self->covered);
    Py_XDECREF(self->records);
    Py_XDECREF(self->contents);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
    Py_DECREF(type);
}

/* -- module functions ------------------------------------------------------------------------ */
/* pack(stagers, group_table, address, capacity) -> (num_writes, contents_start, total_bytes).
 * num_writes counts the resolved writes (no two overlap). Nothing is written when total_bytes >
 * capacity (grow the slot and call again). address is the host address of a slot of capacity
 * bytes, 8-byte aligned. */
static PyObject *pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "pack(stagers, group_table, address, capacity)");
        return NULL;
    }
    PyObject *stagers = PySequence_Fast(args[0], "stagers must be a sequence");
    if (stagers == NULL) return NULL;
    PyObject *result = NULL;
    Py_buffer groups = {0};
    Py_ssize_t num_groups = PySequence_Fast_GET_SIZE(stagers);
    PyObject **items = PySequence_Fast_ITEMS(stagers);
    if (PyObject_GetBuffer(args[1], &groups, PyBUF_SIMPLE) < 0) goto done;
    if (groups.len != num_groups * 24) {
        PyErr_SetString(PyExc_ValueError, "group_table must hold 3 int64 per stager");
        goto done;
    }
    unsigned long long address = PyLong_AsUnsignedLongLong(args[2]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) goto done;
    if (address % 8) {
        PyErr_SetString(PyExc_ValueError, "address must be 8-byte aligned");
        goto done;
    }
    Py_ssize_t num_writes = 0, contents_bytes = 0;
    for (Py_ssize_t g = 0; g < num_groups; g++) {
        if (Py_TYPE(items[g]) != stager_type) {
            PyErr_SetString(PyExc_TypeError, "stagers must be Stager objects");
            goto done;
        }
        Stager *s = (Stager *)items[g];
        if (check_ready(s) < 0) goto done;
        Py_ssize_t emitted = resolve(s);
        if (emitted < 0) goto done;
        num_writes += emitted;
        contents_bytes = (contents_bytes + s->itemsize - 1) / s->itemsize * s->itemsize;
        contents_bytes += PyByteArray_GET_SIZE(s->contents);
    }
    Py_ssize_t contents_start = (num_groups * 3 + num_writes * RECORD_FIELDS) * 8;
    Py_ssize_t total = contents_start + contents_bytes;
    if (num_writes > 0 && total <= capacity) {
        char *slot = (char *)(uintptr_t)address;
        memcpy(slot, groups.buf, (size_t)groups.len);
        long long *table = (long long *)(slot + num_groups * 24);
        Py_ssize_t base = 0;
        for (Py_ssize_t g = 0; g < num_groups; g++) {
            Stager *s = (Stager *)items[g];
            Py_ssize_t n = s->tracked;
            Py_ssize_t size = PyByteArray_GET_SIZE(s->contents);
            base = (base + s->itemsize - 1) / s->itemsize * s->itemsize;
            if (n == 0) continue;
            memcpy(slot + contents_start + base, PyByteArray_AS_STRING(s->contents), (size_t)size);
            long long offset = base;
            if (s->num_dirty == 0) {
                /* No two writes overlap: the records as they are, group and offset filled. */
                memcpy(table, PyByteArray_AS_STRING(s->records), (size_t)n * RECORD_BYTES);
                for (Py_ssize_t w = 0; w < n; w++, table += RECORD_FIELDS) {
                    table[0] = g;
                    table[3] = offset;
                    offset += table[4] * s->itemsize;
                }
            } else {
                for (Py_ssize_t w = 0; w < n; w++) {
                    const long long *record = record_at(s, w);
                    Py_ssize_t fate = s->fates[w];
                    if (fate == FATE_KEEP) {
                        table[0] = g;
                        table[1] = record[1];
                        table[2] = record[2];
                        table[3] = offset;
                        table[4] = record[4];
                        table += RECORD_FIELDS;
                    } else if (fate >= 0) {
                        for (Py_ssize_t p = fate; p < s->num_pieces && s->pieces[p].write == w;
                             p++, table += RECORD_FIELDS) {
                            table[0] = g;
                            table[1] = record[1];
                            table[2] = s->pieces[p].start;
                            table[3] = offset + (s->pieces[p].start - record[2]) * s->itemsize;
                            table[4] = s->pieces[p].length;
                        }
                    }
                    offset += record[4] * s->itemsize;
                }
            }
            base += size;
        }
    }
    result = Py_BuildValue("nnn", num_writes, contents_start, total);
done:
    if (groups.obj != NULL) PyBuffer_Release(&groups);
    Py_DECREF(stagers);
    return result;
}

/* clear(stagers): drop every stager's staged writes (after a successful launch). */
static PyObject *clear(PyObject *module, PyObject *arg) {
    PyObject *stagers = PySequence_Fast(arg, "stagers must be a sequence");
    if (stagers == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(stagers);
    PyObject **items = PySequence_Fast_ITEMS(stagers);
    for (Py_ssize_t g = 0; g < count; g++) {
        if (Py_TYPE(items[g]) != stager_type) {
            Py_DECREF(stagers);
            PyErr_SetString(PyExc_TypeError, "stagers must be Stager objects");
            return NULL;
        }
        Stager *s = (Stager *)items[g];
        if (check_ready(s) < 0) {
            Py_DECREF(stagers);
            return NULL;
        }
        if (PyByteArray_Resize(s->records, 0) < 0 || PyByteArray_Resize(s->contents, 0) < 0) {
            Py_DECREF(stagers);
            return NULL;
        }
        reset_tracking(s);
    }
    Py_DECREF(stagers);
    Py_RETURN_NONE;
}

/* expand_elements(rows, starts, lengths, offsets, element_rows, element_cols) -> None: the
 * JAX PackedWrites' per-element scatter indices. Write w's element j sits at values index
 * offsets[w] + j and goes to (rows[w], starts[w] + j); every values index no write covers
 * gets row and column 2**31 - 1, out of any array's range, so the scatter drops it. The four columns
 * are int32 of one length, the two outputs writable int32 of one length; ValueError (and
 * nothing written) when a write's elements fall outside the outputs. */
static PyObject *expand_elements(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "expand_elements(rows, starts, lengths, offsets, element_rows, "
                        "element_cols) takes 6 arguments");
        return NULL;
    }
    static const char *names[6] = {"rows",    "starts",       "lengths",
                                   "offsets", "element_rows", "element_cols"};
    Py_buffer views[6] = {{0}};
    int held = 0;
    PyObject *result = NULL;
    for (; held < 6; held++) {
        int status = held < 4 ? int_column(args[held], &views[held], 4, names[held])
                              : int32_output(args[held], &views[held], 0, names[held]);
        if (status < 0) goto done;
    }
    Py_buffer *in = views, *out = views + 4;
    Py_ssize_t writes = in[0].shape[0], elements = out[0].shape[0];
    if (in[1].shape[0] != writes || in[2].shape[0] != writes || in[3].shape[0] != writes ||
        out[1].shape[0] != elements) {
        PyErr_SetString(PyExc_ValueError,
                        "rows, starts, lengths, offsets must be of one length, and "
                        "element_rows, element_cols of another");
        goto done;
    }
    const int32_t *rows = in[0].buf, *starts = in[1].buf, *lengths = in[2].buf;
    const int32_t *offsets = in[3].buf;
    /* The packer lays contents out back to back from 0 (offsets a running sum of lengths):
     * then only the tail past them needs the padding index, not every element first. */
    long long running = 0;
    int back_to_back = 1;
    for (Py_ssize_t w = 0; w < writes; w++) {
        if (lengths[w] < 0 || offsets[w] < 0 ||
            (long long)offsets[w] + lengths[w] > (long long)elements) {
            PyErr_Format(PyExc_ValueError,
                         "write %zd (offset %d, length %d) falls outside %zd elements", w,
                         (int)offsets[w], (int)lengths[w], elements);
            goto done;
        }
        back_to_back &= offsets[w] == running || lengths[w] == 0;
        running += lengths[w];
    }
    int32_t *element_rows = out[0].buf, *element_cols = out[1].buf;
    for (Py_ssize_t e = back_to_back ? (Py_ssize_t)running : 0; e < elements; e++)
        element_rows[e] = element_cols[e] = INT32_MAX;
    for (Py_ssize_t w = 0; w < writes; w++) {
        int32_t row = rows[w], start = starts[w];
        int32_t *r = element_rows + offsets[w], *c = element_cols + offsets[w];
        for (int32_t j = 0; j < lengths[w]; j++) {
            r[j] = row;
            c[j] = (int32_t)((long long)start + j > INT32_MAX ? INT32_MAX : start + j);
        }
    }
    result = Py_NewRef(Py_None);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    return result;
}

static PyMethodDef module_methods[] = {
    {"expand_elements", (PyCFunction)(void (*)(void))expand_elements, METH_FASTCALL,
     "expand_elements(rows, starts, lengths, offsets, element_rows, element_cols): the "
     "per-element scatter indices of the JAX PackedWrites"},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(stagers, group_table, address, capacity) -> (num_writes, contents_start, "
     "total_bytes): the resolved writes (no two overlap) laid out in a slot"},
    {"clear", (PyCFunction)clear, METH_O, "clear(stagers): drop their staged writes"},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef stager_methods[] = {
    {"stage", (PyCFunction)(void (*)(void))stager_stage, METH_FASTCALL,
     "stage(row, start, values) -> bool: True when staged, False to take the Python path"},
    {"stage_columns", (PyCFunction)(void (*)(void))stager_stage_columns, METH_FASTCALL,
     "stage_columns(rows, starts, lengths, contents) -> -1 when all are staged, else the index "
     "of the first write out of bounds (nothing staged)"},
    {"stage_many", (PyCFunction)(void (*)(void))stager_stage_many, METH_FASTCALL,
     "stage_many(rows, starts, values_list) -> -1 when all are staged, else the index of the "
     "first write to take the general path (nothing staged)"},
    {"resolve", (PyCFunction)stager_resolve, METH_NOARGS,
     "resolve() -> (num_writes, num_elements) left once later writes hide earlier ones"},
    {"write_columns", (PyCFunction)(void (*)(void))stager_write_columns, METH_FASTCALL,
     "write_columns(rows, starts, lengths, offsets, values) -> the resolved writes as int32 "
     "columns, their visible values packed into values"},
    {"reset", (PyCFunction)stager_reset, METH_NOARGS,
     "forget the indexed writes (call after clearing the buffers)"},
    {"close", (PyCFunction)stager_close, METH_NOARGS, "refuse every later stage()"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot stager_slots[] = {
    {Py_tp_init, stager_init},
    {Py_tp_dealloc, stager_dealloc},
    {Py_tp_methods, stager_methods},
    {Py_tp_new, PyType_GenericNew},
    {Py_tp_doc, "The C fast path of staged writes: staging, later-wins resolution, packing."},
    {0, NULL},
};

static PyType_Spec stager_spec = {
    "jaxbuf._staging.Stager", sizeof(Stager), 0, Py_TPFLAGS_DEFAULT, stager_slots,
};

static struct PyModuleDef staging_module = {
    PyModuleDef_HEAD_INIT, "_staging",
    "The C fast paths of staged writes: staging, later-wins resolution, packing.", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__staging(void) {
    import_array(); /* numpy's C API (plain_values); returns NULL when numpy cannot be imported */
    PyObject *module = PyModule_Create(&staging_module);
    if (module == NULL) return NULL;
    PyObject *type = PyType_FromSpec(&stager_spec);
    if (type == NULL || PyModule_AddObject(module, "Stager", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(module);
        return NULL;
    }
    stager_type = (PyTypeObject *)type; /* the module keeps the reference */
    return module;
}
