/* The keys of a run of stored events: plain_run from their token ids, read_run from the content
hashes read_plain made of them.

Filing keys a run of a worker's stored events block by block; here a run whose events are all
plain (no tier, no identity, no lookahead) is keyed without a tuple a block. Each event's fields
are read and its parent found (which may call into Python: an attribute, a parent's lookup in
the worker's blocks, the root key's function) before its token ids are read, and the token
ids are then read as exact ints only: a run with anything else is declined, having changed
nothing, and filing keys it in Python.
*/

/* The key `parent` has earlier in the run (its last store there), or NULL (borrowed). */
static PyObject *
key_in_run(PyObject *ids, PyObject *keys, PyObject *parent, int *error)
{
    for (Py_ssize_t i = PyList_GET_SIZE(ids) - 1; i >= 0; i--) {
        int same = PyObject_RichCompareBool(PyList_GET_ITEM(ids, i), parent, Py_EQ);
        if (same != 0) {
            *error = same < 0;
            return same < 0 ? NULL : PyList_GET_ITEM(keys, i);
        }
    }
    return NULL;
}

/* The key of an untiered block `parent` (not None): held already, or stored earlier in the
   run; a new reference (None for an orphan), or NULL. */
static PyObject *
parent_key(PyObject *parent, PyObject *blocks, PyObject *ids, PyObject *keys)
{
    PyObject *held = PyObject_GetItem(blocks, parent);
    if (held != NULL || !PyErr_ExceptionMatches(PyExc_KeyError)) {
        return held;
    }
    PyErr_Clear();
    int error = 0;
    PyObject *earlier = key_in_run(ids, keys, parent, &error);
    return error ? NULL : Py_NewRef(earlier != NULL ? earlier : Py_None);
}

/* The key a run's next untiered event hangs from, its parent being `parent` (not None): the
   run's last key if the event before ends where it starts, else its parent's (parent_key).
   A new reference (None for an orphan), or NULL. */
static PyObject *
run_key(PyObject *parent, PyObject *blocks, PyObject *ids, PyObject *keys)
{
    Py_ssize_t stored = PyList_GET_SIZE(ids);
    if (stored) {
        int follows = PyObject_RichCompareBool(PyList_GET_ITEM(ids, stored - 1), parent, Py_EQ);
        if (follows != 0) {
            return follows < 0 ? NULL : Py_NewRef(PyList_GET_ITEM(keys, stored - 1));
        }
    }
    return parent_key(parent, blocks, ids, keys);
}

/* Where a run's blocks' content hashes come from: a block's token ids, or read_plain's hashes. */
typedef Py_hash_t (*ContentHash)(const void *source, Py_ssize_t block, Py_ssize_t size);

static Py_hash_t
tokens_hash(const void *tokens, Py_ssize_t block, Py_ssize_t size)
{
    return items_hash((PyObject *const *)tokens + block * size, size); /* exact ints only */
}

static Py_hash_t
read_hash(const void *contents, Py_ssize_t block, Py_ssize_t size)
{
    Py_hash_t content_hash; /* 8 bytes a block, unaligned; a tuple hash, never -1 */
    memcpy(&content_hash, (const char *)contents + block * (Py_ssize_t)sizeof content_hash,
           sizeof content_hash);
    return content_hash;
}

/* Append the keys of `count` blocks under `key`: the first `whole` chained from it, each from
   its content's hash (-1: an exception set), the rest None (as all are for a None key). */
static int
append_keys(PyObject *keys, PyObject *key, ContentHash content, const void *source,
            Py_ssize_t whole, Py_ssize_t count, Py_ssize_t size)
{
    whole = key == Py_None ? 0 : whole;
    Py_hash_t parent_hash = whole ? PyObject_Hash(key) : 0;
    if (parent_hash == -1) {
        return -1;
    }
    for (Py_ssize_t block = 0; block < count; block++) {
        if (block >= whole) {
            if (PyList_Append(keys, Py_None) < 0) {
                return -1;
            }
            continue;
        }
        Py_hash_t content_hash = content(source, block, size);
        if (content_hash == -1) {
            return -1;
        }
        Py_hash_t made = pair_hash(parent_hash, content_hash);
        parent_hash = int_hash(made);
        PyObject *as_int = PyLong_FromSsize_t(made);
        if (as_int == NULL || PyList_Append(keys, as_int) < 0) {
            Py_XDECREF(as_int);
            return -1;
        }
        Py_DECREF(as_int);
    }
    return 0;
}

/* plain_run(run, size, blocks, root_key): what filing.run_keys's loop makes of a run of stored
   events, (ids, keys, mismatched), for a run whose every event names no tier and no identity
   (no extra keys, media or lookahead) and is uncut yet (its contents None), its token ids all
   ints; None, having changed nothing, for any other run, which that loop then files. It keys
   each block straight from its token ids: no tuple a block, no call an event. */
static PyObject *
plain_run(PyObject *module, PyObject *args)
{
    PyObject *run, *blocks, *root_key;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "OnOO:plain_run", &run, &size, &blocks, &root_key)) {
        return NULL;
    }
    const State *state = state_of(module);
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "plain_run: size = %zd must be at least 1", size);
        return NULL;
    }
    PyObject *fast = PySequence_Fast(run, "plain_run: run must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    PyObject *field[NAMES] = {NULL};
    PyObject *hashes = NULL, *tokens = NULL, *key = NULL, *made = NULL;
    PyObject *ids = PyList_New(0), *keys = PyList_New(0);
    Py_ssize_t mismatched = 0;
    if (ids == NULL || keys == NULL) {
        goto done;
    }
    for (Py_ssize_t n = 0; n < PySequence_Fast_GET_SIZE(fast); n++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(fast, n);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            PyTuple_GET_ITEM(pair, 1) != Py_None) {
            goto decline; /* cut already: it has an identity */
        }
        PyObject *event = PyTuple_GET_ITEM(pair, 0);
        for (int f = 0; f < NAMES; f++) {
            Py_XSETREF(field[f], PyObject_GetAttr(event, state->name[f]));
            if (field[f] == NULL) {
                goto done;
            }
        }
        int lookahead = PyObject_IsTrue(field[LOOKAHEAD]);
        if (lookahead < 0) {
            goto done;
        }
        if (field[MEDIUM] != Py_None || field[GROUP] != Py_None || field[EXTRA] != Py_None ||
            field[MEDIA] != Py_None || lookahead) {
            goto decline;
        }
        Py_XSETREF(tokens, PySequence_Fast(field[TOKENS], "plain_run: token_ids"));
        Py_XSETREF(hashes, PySequence_Fast(field[HASHES], "plain_run: block_hashes"));
        if (tokens == NULL || hashes == NULL) {
            goto done;
        }
        PyObject *size_obj = PyLong_FromSsize_t(size);
        int other = size_obj == NULL ? -1 : PyObject_RichCompareBool(field[SIZE], size_obj, Py_NE);
        Py_XDECREF(size_obj);
        if (other < 0) {
            goto done;
        }
        mismatched += other;
        Py_XSETREF(key, field[PARENT] == Py_None
                            ? PyObject_CallFunctionObjArgs(root_key, field[LORA], field[SALT], NULL)
                            : run_key(field[PARENT], blocks, ids, keys));
        if (key == NULL) {
            goto done;
        }
        /* the token ids read last: the calls above may run Python code, which may change them */
        Py_ssize_t length = PySequence_Fast_GET_SIZE(tokens);
        PyObject **items = PySequence_Fast_ITEMS(tokens);
        for (Py_ssize_t i = 0; i < length; i++) {
            if (!PyLong_CheckExact(items[i])) {
                goto decline; /* a string: block_keys.contents digests it */
            }
        }
        if (append_keys(keys, key, tokens_hash, items, length / size,
                        PySequence_Fast_GET_SIZE(hashes), size) < 0) {
            goto done;
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(hashes); i++) {
            if (PyList_Append(ids, PySequence_Fast_GET_ITEM(hashes, i)) < 0) {
                goto done;
            }
        }
    }
    made = Py_BuildValue("(OOn)", ids, keys, mismatched);
    goto done;
decline:
    made = Py_NewRef(Py_None);
done:
    for (int f = 0; f < NAMES; f++) {
        Py_XDECREF(field[f]);
    }
    Py_XDECREF(hashes);
    Py_XDECREF(tokens);
    Py_XDECREF(key);
    Py_XDECREF(ids);
    Py_XDECREF(keys);
    Py_DECREF(fast);
    return made;
}

/* read_run(run, size, blocks, root) -> (ids, keys, mismatched, orphans): plain_run for a run
   of read_plain's stored steps, each block keyed from its content hash; `root` is the key an
   event with no parent hangs from (read_plain's events name no LoRA and no salt). `orphans`
   counts the None keys, which list.count(None) does by comparing each int key with None. */
static PyObject *
read_run(PyObject *module, PyObject *args)
{
    PyObject *run, *blocks, *root;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "O!nOO:read_run", &PyList_Type, &run, &size, &blocks, &root)) {
        return NULL;
    }
    PyObject *ids = PyList_New(0), *keys = PyList_New(0), *key = NULL, *made = NULL;
    Py_ssize_t mismatched = 0;
    if (ids == NULL || keys == NULL) {
        goto done;
    }
    for (Py_ssize_t n = 0; n < PyList_GET_SIZE(run); n++) {
        PyObject *step = PyList_GET_ITEM(run, n);
        if (!PyTuple_Check(step) || PyTuple_GET_SIZE(step) != 5 ||
            !PyList_Check(PyTuple_GET_ITEM(step, 1)) || !PyBytes_Check(PyTuple_GET_ITEM(step, 3))) {
            PyErr_SetString(PyExc_TypeError, "read_run takes read_plain's stored steps");
            goto done;
        }
        PyObject *hashes = PyTuple_GET_ITEM(step, 1), *parent = PyTuple_GET_ITEM(step, 2);
        PyObject *contents = PyTuple_GET_ITEM(step, 3);
        Py_ssize_t block_size = PyLong_AsSsize_t(PyTuple_GET_ITEM(step, 4));
        if (block_size == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* past Py_ssize_t: not the index's size either */
        }
        mismatched += block_size != size;
        Py_XSETREF(key, parent == Py_None ? Py_NewRef(root) : run_key(parent, blocks, ids, keys));
        Py_ssize_t whole = PyBytes_GET_SIZE(contents) / (Py_ssize_t)sizeof(Py_hash_t);
        Py_ssize_t stored = PyList_GET_SIZE(ids);
        if (key == NULL || append_keys(keys, key, read_hash, PyBytes_AS_STRING(contents), whole,
                                       PyList_GET_SIZE(hashes), size) < 0 ||
            PyList_SetSlice(ids, stored, stored, hashes) < 0) {
            goto done;
        }
    }
    Py_ssize_t orphans = 0;
    for (Py_ssize_t n = 0; n < PyList_GET_SIZE(keys); n++) {
        orphans += PyList_GET_ITEM(keys, n) == Py_None;
    }
    made = Py_BuildValue("(OOnn)", ids, keys, mismatched, orphans);
done:
    Py_XDECREF(key);
    Py_XDECREF(ids);
    Py_XDECREF(keys);
    return made;
}
