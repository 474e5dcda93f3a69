/* read_plain: a TokenSpeed-wire batch of plain events, read and keyed from its bytes.

The watcher's subscribers hand every payload here first (tskv/core/read_batch.py). A batch of
plain events on TokenSpeed's wire ([ts, [[tag, fields...], ...], rank], each BlockStored with
exactly its four fields, each BlockRemoved with its hashes alone) is read straight from the
bytes: each stored event's blocks become content hashes (the tuple hash of their token ids, as
items_hash makes it) with no token id int and no event object made. Anything else, or anything
the general decoder would refuse or read otherwise, is declined (None), and that decoder reads
it: this reader accepts a subset of what codec.decode_batch accepts, never more. */

#define TOKEN_MIN (-((int64_t)1 << 31)) /* events.TOKEN_MIN */
#define TOKEN_LIMIT ((int64_t)1 << 31)  /* events.TOKEN_LIMIT */

static PyObject *
int_object(int64_t value, int wide)
{
    return wide ? PyLong_FromUnsignedLongLong((uint64_t)value) : PyLong_FromLongLong(value);
}

/* The read outcomes below: 1 read, 0 declined, -1 an exception set (no memory). */

/* An array of hashes, as a new list of ints in *out. */
static int
read_hashes(Cursor *c, PyObject **out)
{
    Py_ssize_t count;
    if (read_array(c, &count) < 0) {
        return 0;
    }
    PyObject *hashes = PyList_New(count);
    if (hashes == NULL) {
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t value;
        int wide;
        if (read_int(c, &value, &wide) < 0) {
            Py_DECREF(hashes);
            return 0;
        }
        PyObject *item = int_object(value, wide);
        if (item == NULL) {
            Py_DECREF(hashes);
            return -1;
        }
        PyList_SET_ITEM(hashes, i, item);
    }
    *out = hashes;
    return 1;
}

/* The token ids, every one checked to be an int the wire allows, as the content hashes of the
   first min(count, length / size) blocks of `size` ids: a bytes of 8-byte hashes in *out. */
static int
read_contents(Cursor *c, Py_ssize_t count, Py_ssize_t size, PyObject **out)
{
    Py_ssize_t length;
    if (read_array(c, &length) < 0) {
        return 0;
    }
    Py_ssize_t whole = Py_MIN(count, length / size);
    PyObject *contents = PyBytes_FromStringAndSize(NULL, whole * (Py_ssize_t)sizeof(Py_hash_t));
    if (contents == NULL) {
        return -1;
    }
    char *into = PyBytes_AS_STRING(contents);
    Py_uhash_t acc = XXPRIME_5;
    Py_ssize_t hashed = whole * size, in_block = 0; /* ids past `hashed` are only checked */
    for (Py_ssize_t i = 0; i < length; i++) {
        int64_t token;
        int wide;
        if (read_int(c, &token, &wide) < 0 || wide || token < TOKEN_MIN || token >= TOKEN_LIMIT) {
            Py_DECREF(contents);
            return 0;
        }
        if (i < hashed) { /* an int of 32 bits is its own hash, but -1's is -2: int_hash */
            acc = tuple_round(acc, (Py_uhash_t)(token == -1 ? -2 : token));
            if (++in_block == size) {
                Py_hash_t content_hash = tuple_end(acc, size);
                memcpy(into, &content_hash, sizeof content_hash);
                into += sizeof content_hash;
                acc = XXPRIME_5;
                in_block = 0;
            }
        }
    }
    *out = contents;
    return 1;
}

/* One event as a step: (STORED, hashes, parent, contents, block_size), (REMOVED, hashes) or
   (CLEARED,). */
static int
read_event(Cursor *c, Py_ssize_t size, const State *state, PyObject **out)
{
    Py_ssize_t fields, length;
    const unsigned char *tag;
    if (read_array(c, &fields) < 0 || fields < 1 || read_str(c, &tag, &length) < 0) {
        return 0;
    }
    int stored = is_tag(tag, length, "BlockStored"), removed = is_tag(tag, length, "BlockRemoved");
    if (is_tag(tag, length, "AllBlocksCleared") && fields == 1) {
        *out = PyTuple_Pack(1, state->step[STEP_CLEARED]);
        return *out == NULL ? -1 : 1;
    }
    PyObject *hashes = NULL, *parent = NULL, *contents = NULL, *block_size = NULL;
    int got = (stored && fields == 5) || (removed && fields == 2) ? read_hashes(c, &hashes) : 0;
    if (got == 1 && removed) {
        *out = PyTuple_Pack(2, state->step[STEP_REMOVED], hashes);
        Py_DECREF(hashes);
        return *out == NULL ? -1 : 1;
    }
    int64_t value;
    int wide;
    if (got == 1) {
        got = read_nil(c) ? 1 : read_int(c, &value, &wide) < 0 ? 0 : 2;
        parent = got == 2 ? int_object(value, wide) : got == 1 ? Py_NewRef(Py_None) : NULL;
        got = got == 0 ? 0 : parent == NULL ? -1 : 1;
    }
    if (got == 1) {
        got = read_contents(c, PyList_GET_SIZE(hashes), size, &contents);
    }
    if (got == 1) {
        got = read_int(c, &value, &wide) < 0 || wide || value < 1 ? 0 : 1;
        block_size = got == 1 ? PyLong_FromLongLong(value) : NULL;
        got = got == 1 && block_size == NULL ? -1 : got;
    }
    if (got == 1) {
        *out = PyTuple_Pack(5, state->step[STEP_STORED], hashes, parent, contents, block_size);
        got = *out == NULL ? -1 : 1;
    }
    Py_XDECREF(hashes);
    Py_XDECREF(parent);
    Py_XDECREF(contents);
    Py_XDECREF(block_size);
    return got;
}

/* [ts, events, rank?] into (ts, rank, steps). */
static int
read_batch(Cursor *c, Py_ssize_t size, const State *state, PyObject **out)
{
    Py_ssize_t fields, events;
    double ts;
    if (read_array(c, &fields) < 0 || (fields != 2 && fields != 3) ||
        read_number(c, &ts) < 0 || !isfinite(ts) || read_array(c, &events) < 0) {
        return 0;
    }
    PyObject *steps = PyList_New(events), *rank = NULL;
    if (steps == NULL) {
        return -1;
    }
    int got = 1;
    for (Py_ssize_t n = 0; got == 1 && n < events; n++) {
        PyObject *step = NULL;
        got = read_event(c, size, state, &step);
        if (got == 1) {
            PyList_SET_ITEM(steps, n, step);
        }
    }
    if (got == 1 && fields == 3 && !read_nil(c)) {
        int64_t value;
        int wide;
        got = read_int(c, &value, &wide) < 0 || (!wide && value < 0) ? 0 : 1;
        rank = got == 1 ? int_object(value, wide) : NULL;
        got = got == 1 && rank == NULL ? -1 : got;
    }
    if (got == 1 && c->at != c->end) {
        got = 0; /* bytes after the batch: the decoders refuse them */
    }
    if (got == 1) {
        *out = Py_BuildValue("(dOO)", ts, rank != NULL ? rank : Py_None, steps);
        got = *out == NULL ? -1 : 1;
    }
    Py_XDECREF(rank);
    Py_DECREF(steps);
    return got;
}

/* read_plain(payload, size) -> (ts, rank, steps) | None: see the section's comment; `size`
   is the index's block size, which cuts the token ids into blocks. */
static PyObject *
read_plain(PyObject *module, PyObject *args)
{
    PyObject *payload;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "On:read_plain", &payload, &size)) {
        return NULL;
    }
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "read_plain: size = %zd must be at least 1", size);
        return NULL;
    }
    Py_buffer bytes;
    if (PyObject_GetBuffer(payload, &bytes, PyBUF_SIMPLE) < 0) {
        PyErr_Clear(); /* not bytes: the general decoder says so */
        Py_RETURN_NONE;
    }
    Cursor cursor = {bytes.buf, (const unsigned char *)bytes.buf + bytes.len};
    PyObject *made = NULL;
    int got = read_batch(&cursor, size, state_of(module), &made);
    PyBuffer_Release(&bytes);
    if (got < 0) {
        return NULL;
    }
    return got == 1 ? made : Py_NewRef(Py_None);
}
