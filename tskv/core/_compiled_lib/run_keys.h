/* The keys of a run of stored events: plain_run from their token ids, read_run from the content
hashes read_plain made of them.

Filing keys a run of a worker's stored events block by block; here a run whose events are all
plain (no tier, no identity, no lookahead) is keyed without a tuple a block. Nothing here runs
Python code: an event is read only if it is exactly the event class (its fields are slots, read
in C), its hashes, size and parent only if they are exact ints, its token ids only if they are
exact ints in a list or tuple, its root only from the `roots` dict filing keeps by (LoRA name,
cache salt), strings or None, and its parent's key only from a BlockMap that holds plain ids
alone (block_map.h). A run with anything else is declined, having changed nothing, and filing
keys it in Python.
*/

/* Whether `blocks` is a BlockMap whose lookups of an exact int run no Python code. */
static int
plain_blocks(const State *state, PyObject *blocks)
{
    return Py_IS_TYPE(blocks, state->block_map) && !((BlockMap *)blocks)->exotic;
}

/* The key `parent` has earlier in the run (its last store there), or NULL (borrowed). The ids
   and `parent` are exact ints. */
static PyObject *
key_in_run(PyObject *ids, PyObject *keys, PyObject *parent)
{
    for (Py_ssize_t i = PyList_GET_SIZE(ids) - 1; i >= 0; i--) {
        if (PyObject_RichCompareBool(PyList_GET_ITEM(ids, i), parent, Py_EQ) > 0) {
            return PyList_GET_ITEM(keys, i); /* exact ints: no error, no Python code */
        }
    }
    return NULL;
}

/* The key of an untiered block `parent` (an exact int): held already in `blocks` (a plain
   BlockMap), or stored earlier in the run; a new reference (None for an orphan), or NULL. */
static PyObject *
parent_key(PyObject *parent, PyObject *blocks, PyObject *ids, PyObject *keys)
{
    PyObject *held = block_get((BlockMap *)blocks, parent, Py_Ellipsis);
    if (held != Py_Ellipsis) {
        return held;
    }
    Py_DECREF(held);
    PyObject *earlier = key_in_run(ids, keys, parent);
    return Py_NewRef(earlier != NULL ? earlier : Py_None);
}

/* The key a run's next untiered event hangs from, its parent being `parent` (an exact int):
   the run's last key if the event before ends where it starts, else its parent's
   (parent_key). A new reference (None for an orphan), or NULL. */
static PyObject *
run_key(PyObject *parent, PyObject *blocks, PyObject *ids, PyObject *keys)
{
    Py_ssize_t stored = PyList_GET_SIZE(ids);
    if (stored && PyObject_RichCompareBool(PyList_GET_ITEM(ids, stored - 1), parent, Py_EQ) > 0) {
        return Py_NewRef(PyList_GET_ITEM(keys, stored - 1));
    }
    return parent_key(parent, blocks, ids, keys);
}

/* Whether every item of a list or tuple is an exact int. */
static int
exact_ints(PyObject *items)
{
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(items); i++) {
        if (!PyLong_CheckExact(PySequence_Fast_GET_ITEM(items, i))) {
            return 0;
        }
    }
    return 1;
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

/* plain_run(run, size, blocks, roots, event_type): what filing.run_keys's loop makes of a run
   of stored events, (ids, keys, mismatched), for a run whose every event is exactly
   `event_type`, names no tier and no identity (no extra keys, media or lookahead), is uncut yet
   (its contents None), has its root in `roots` ((lora_name, cache_salt) -> key) and its token
   ids all exact ints; None, having changed nothing, for any other run, which that loop then
   files. It keys each block straight from its token ids: no tuple a block, no call an event. */
static PyObject *
plain_run(PyObject *module, PyObject *args)
{
    PyObject *run, *blocks, *roots, *event_type;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "O!nOO!O!:plain_run", &PyList_Type, &run, &size, &blocks,
                          &PyDict_Type, &roots, &PyType_Type, &event_type)) {
        return NULL;
    }
    const State *state = state_of(module);
    if (size <= 0) {
        PyErr_Format(PyExc_ValueError, "plain_run: size = %zd must be at least 1", size);
        return NULL;
    }
    if (!plain_blocks(state, blocks)) {
        Py_RETURN_NONE;
    }
    PyObject *field[NAMES] = {NULL};
    PyObject *key = NULL, *made = NULL;
    PyObject *ids = PyList_New(0), *keys = PyList_New(0);
    Py_ssize_t mismatched = 0;
    if (ids == NULL || keys == NULL) {
        goto done;
    }
    for (Py_ssize_t n = 0; n < PyList_GET_SIZE(run); n++) {
        PyObject *pair = PyList_GET_ITEM(run, n);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2 ||
            PyTuple_GET_ITEM(pair, 1) != Py_None ||
            !Py_IS_TYPE(PyTuple_GET_ITEM(pair, 0), (PyTypeObject *)event_type)) {
            goto decline; /* cut already (it has an identity), or an event of another class */
        }
        PyObject *event = PyTuple_GET_ITEM(pair, 0);
        for (int f = 0; f < NAMES; f++) { /* the class's own slots: read in C */
            Py_XSETREF(field[f], PyObject_GetAttr(event, state->name[f]));
            if (field[f] == NULL) {
                goto done;
            }
        }
        PyObject *tokens = field[TOKENS], *hashes = field[HASHES], *parent = field[PARENT];
        if (field[MEDIUM] != Py_None || field[GROUP] != Py_None || field[EXTRA] != Py_None ||
            field[MEDIA] != Py_None || field[LOOKAHEAD] != Py_None ||
            !(PyList_CheckExact(tokens) || PyTuple_CheckExact(tokens)) ||
            !(PyList_CheckExact(hashes) || PyTuple_CheckExact(hashes)) ||
            !PyLong_CheckExact(field[SIZE]) || !(parent == Py_None || PyLong_CheckExact(parent)) ||
            !exact_ints(hashes) || !exact_ints(tokens)) {
            goto decline; /* a string token id: block_keys.contents digests it */
        }
        Py_ssize_t block_size = PyLong_AsSsize_t(field[SIZE]);
        if (block_size == -1 && PyErr_Occurred()) {
            PyErr_Clear(); /* past Py_ssize_t: not the index's size either */
        }
        mismatched += block_size != size;
        if (parent == Py_None) {
            if (!plain_id(field[LORA], 0) || !plain_id(field[SALT], 0)) {
                goto decline;
            }
            PyObject *named = PyTuple_Pack(2, field[LORA], field[SALT]);
            PyObject *root = named == NULL ? NULL : PyDict_GetItemWithError(roots, named);
            Py_XDECREF(named);
            if (root == NULL || !PyLong_CheckExact(root)) {
                if (PyErr_Occurred()) {
                    goto done;
                }
                goto decline; /* a root filing has not keyed yet */
            }
            Py_XSETREF(key, Py_NewRef(root));
        } else {
            Py_XSETREF(key, run_key(parent, blocks, ids, keys));
        }
        if (key == NULL) {
            goto done;
        }
        if (append_keys(keys, key, tokens_hash, PySequence_Fast_ITEMS(tokens),
                        PySequence_Fast_GET_SIZE(tokens) / size,
                        PySequence_Fast_GET_SIZE(hashes), size) < 0) {
            goto done;
        }
        Py_ssize_t stored = PyList_GET_SIZE(ids);
        if (PyList_SetSlice(ids, stored, stored, hashes) < 0) {
            goto done;
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
    Py_XDECREF(key);
    Py_XDECREF(ids);
    Py_XDECREF(keys);
    return made;
}

/* read_run(run, size, blocks, root) -> (ids, keys, mismatched, orphans): plain_run for a run
   of read_plain's stored steps, each block keyed from its content hash; `root` is the key an
   event with no parent hangs from (read_plain's events name no LoRA and no salt). `orphans`
   counts the None keys, which list.count(None) does by comparing each int key with None.
   None, having changed nothing, when `blocks` is not a BlockMap of plain ids alone. */
static PyObject *
read_run(PyObject *module, PyObject *args)
{
    PyObject *run, *blocks, *root;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "O!nOO:read_run", &PyList_Type, &run, &size, &blocks, &root)) {
        return NULL;
    }
    if (!plain_blocks(state_of(module), blocks) || !PyLong_CheckExact(root)) {
        Py_RETURN_NONE;
    }
    PyObject *ids = PyList_New(0), *keys = PyList_New(0), *key = NULL, *made = NULL;
    Py_ssize_t mismatched = 0;
    if (ids == NULL || keys == NULL) {
        goto done;
    }
    for (Py_ssize_t n = 0; n < PyList_GET_SIZE(run); n++) {
        PyObject *step = PyList_GET_ITEM(run, n);
        if (!PyTuple_CheckExact(step) || PyTuple_GET_SIZE(step) != 5 ||
            !PyList_CheckExact(PyTuple_GET_ITEM(step, 1)) ||
            !exact_ints(PyTuple_GET_ITEM(step, 1)) ||
            !(PyTuple_GET_ITEM(step, 2) == Py_None || PyLong_CheckExact(PyTuple_GET_ITEM(step, 2))) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(step, 3))) {
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
