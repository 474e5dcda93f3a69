/* BlockMap: a worker's blocks, engine hash -> content key, as a dict would keep them.

The usual entry, an engine hash within 0..2**64 - 2 and a key from hash() (never -1), is a
16-byte slot of the same table KeyTable uses (the hash's bits as its key, the key's bits as its
mask); anything else (a tiered block's tuple, a negative hash, a None key: an orphan) goes in a
dict beside it (`other`). An id is in one place or the other, never both. Iteration follows the
slots, not the order of insertion: nothing the index does with a worker's blocks depends on it.

Every id tskv makes is plain: an exact int, or an exact tuple of exact ints, strings and None
(a tier's medium, group and hash); hashing or comparing a plain id runs no Python code. The
map's loops (add_new, pop_many) run only over plain ids, and only while the dict beside the
slots holds none but plain ids (`exotic` is 0): an id of any other kind (an int subclass, an
object with its own __hash__) is stored and found one call at a time, as a dict would, and
once the dict holds one the loops decline (None) and filing does their work in Python. No
Python code runs inside a loop of this file's.
*/

typedef struct {
    PyObject_HEAD
    Slots table;
    PyObject *other; /* id -> key for what no slot holds (a dict, made when first needed) */
    int exotic;      /* `other` holds an id that is not plain: the loops decline */
} BlockMap;

/* Whether hashing and comparing `obj` runs no Python code (see above); `depth` bounds the
   tuples within tuples looked into. */
static int
plain_id(PyObject *obj, int depth)
{
    if (PyLong_CheckExact(obj) || PyUnicode_CheckExact(obj) || PyBytes_CheckExact(obj) ||
        obj == Py_None) {
        return 1;
    }
    if (!PyTuple_CheckExact(obj) || depth == 0) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++) {
        if (!plain_id(PyTuple_GET_ITEM(obj, i), depth - 1)) {
            return 0;
        }
    }
    return 1;
}

/* Whether every id of `ids` is plain and the dict beside the slots holds only plain ids: a
   loop over `ids` may then look each one up with no Python code run. */
static int
loop_is_plain(const BlockMap *t, PyObject *const *ids, Py_ssize_t count)
{
    if (t->exotic) {
        return 0;
    }
    for (Py_ssize_t n = 0; n < count; n++) {
        if (!plain_id(ids[n], 2)) {
            return 0;
        }
    }
    return 1;
}

/* BlockMap(): empty. */
static PyObject *
BlockMap_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) || PyTuple_GET_SIZE(args)) {
        return PyErr_Format(PyExc_TypeError, "BlockMap() takes no arguments");
    }
    BlockMap *t = (BlockMap *)type->tp_alloc(type, 0); /* zeroed: no slots, no dict */
    return (PyObject *)t;
}

static void
BlockMap_dealloc(BlockMap *t)
{
    slots_free(t->table.slots, t->table.capacity);
    Py_XDECREF(t->other);
    free_instance((PyObject *)t);
}

/* The dict beside the slots goes once it is empty (a tiered block, an orphan were removed). */
static void
drop_other_if_empty(BlockMap *t)
{
    if (t->other != NULL && PyDict_GET_SIZE(t->other) == 0) {
        Py_CLEAR(t->other);
        t->exotic = 0;
    }
}

/* keys(): the map is its own keys view (in, len, iteration). */
static PyObject *
BlockMap_keys(BlockMap *t, PyObject *unused)
{
    return Py_NewRef(t);
}

static PyObject *
BlockMap_clear(BlockMap *t, PyObject *unused)
{
    slots_free(t->table.slots, t->table.capacity);
    t->table = (Slots){NULL, 0, 0};
    Py_CLEAR(t->other);
    t->exotic = 0;
    Py_RETURN_NONE;
}

static PyObject *
BlockMap_sizeof(BlockMap *t, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(BlockMap) + t->table.capacity * sizeof(Slot));
}

/* 1 and the id's bits if `obj` is an int a slot can hold; 0 if not; -1 on an error. */
static int
id_of(PyObject *obj, int64_t *out)
{
    if (!PyLong_CheckExact(obj)) {
        return 0;
    }
    if (fits_in(obj, 64, 0)) {
        unsigned long long fast = PyLong_AsUnsignedLongLongMask(obj);
        *out = (int64_t)fast;
        return fast != (unsigned long long)-1; /* 2**64 - 1: its bits are EMPTY's */
    }
    unsigned long long bits = PyLong_AsUnsignedLongLong(obj);
    if (bits == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear(); /* negative, or past 64 bits */
        return 0;
    }
    if (bits == (unsigned long long)-1) {
        return 0; /* 2**64 - 1: its bits are EMPTY's */
    }
    *out = (int64_t)bits;
    return 1;
}

static PyObject *
id_object(int64_t bits)
{
    return PyLong_FromUnsignedLongLong((unsigned long long)bits);
}

/* The value of `key` (a new reference), or NULL: with KeyError set when missing and `missing`
   is NULL, else `missing` itself (a new reference). */
static PyObject *
block_get(BlockMap *t, PyObject *key, PyObject *missing)
{
    int64_t id;
    int fits = id_of(key, &id);
    if (fits < 0) {
        return NULL;
    }
    if (fits) {
        Py_ssize_t i = slot_of_id(&t->table, id);
        if (i >= 0) {
            return PyLong_FromLongLong((long long)t->table.slots[i].mask);
        }
    }
    if (t->other != NULL) {
        PyObject *high = Py_NewRef(t->other); /* held: the lookup may run an id's __eq__ */
        PyObject *found = PyDict_GetItemWithError(high, key);
        Py_XINCREF(found); /* before the dict may go, with what it holds */
        Py_DECREF(high);
        if (found != NULL) {
            return found;
        }
        if (PyErr_Occurred()) {
            return NULL;
        }
    }
    if (missing == NULL) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return Py_NewRef(missing);
}

static int
other_delete(BlockMap *t, PyObject *key, int must)
{
    if (t->other == NULL) {
        if (must) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        return 0;
    }
    PyObject *high = Py_NewRef(t->other); /* held: the lookup may run an id's __eq__ */
    int deleted = PyDict_DelItem(high, key);
    Py_DECREF(high);
    if (deleted == 0) {
        drop_other_if_empty(t);
        return 0;
    }
    if (!must && PyErr_ExceptionMatches(PyExc_KeyError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

static int
block_set(BlockMap *t, PyObject *key, PyObject *value)
{
    int64_t id, stored;
    int fits = id_of(key, &id);
    if (fits < 0) {
        return -1;
    }
    int holds = fits ? key_of(value, &stored) : 0; /* a value is a key from hash() */
    if (holds < 0) {
        return -1;
    }
    if (holds) {
        /* Room first: an allocation that fails leaves the block where it was (in the dict
           beside the slots, say). Then the dict, whose lookup may run an id's __eq__, which
           may empty the map: room is made again for what is left. */
        if (make_room(&t->table) < 0) {
            return -1;
        }
        if (t->other != NULL && PyDict_GET_SIZE(t->other) && other_delete(t, key, 0) < 0) {
            return -1;
        }
        if (make_room(&t->table) < 0) {
            return -1;
        }
        size_t i = find(&t->table, id);
        if (t->table.slots[i].key == EMPTY) {
            t->table.slots[i].key = id;
            t->table.used++;
        }
        t->table.slots[i].mask = (uint64_t)stored;
        return 0;
    }
    if (fits) {
        Py_ssize_t i = slot_of_id(&t->table, id);
        if (i >= 0) {
            remove_at(&t->table, (size_t)i);
        }
    }
    if (t->other == NULL && (t->other = PyDict_New()) == NULL) {
        return -1;
    }
    PyObject *high = Py_NewRef(t->other); /* held: storing may run an id's __eq__ */
    int failed = PyDict_SetItem(high, key, value);
    Py_DECREF(high);
    t->exotic |= !failed && !plain_id(key, 2);
    return failed;
}

static int
block_delete(BlockMap *t, PyObject *key)
{
    int64_t id;
    int fits = id_of(key, &id);
    if (fits < 0) {
        return -1;
    }
    if (fits) {
        Py_ssize_t i = slot_of_id(&t->table, id);
        if (i >= 0) {
            remove_at(&t->table, (size_t)i);
            return 0;
        }
    }
    return other_delete(t, key, 1);
}

static Py_ssize_t
BlockMap_length(BlockMap *t)
{
    return t->table.used + (t->other == NULL ? 0 : PyDict_GET_SIZE(t->other));
}

static PyObject *
BlockMap_subscript(BlockMap *t, PyObject *key)
{
    return block_get(t, key, NULL);
}

static int
BlockMap_ass_subscript(BlockMap *t, PyObject *key, PyObject *value)
{
    return value == NULL ? block_delete(t, key) : block_set(t, key, value);
}

static int
BlockMap_contains(BlockMap *t, PyObject *key)
{
    PyObject *found = block_get(t, key, Py_None);
    if (found == NULL) {
        return -1;
    }
    Py_DECREF(found);
    if (found != Py_None) {
        return 1;
    }
    /* None is also what an orphan's entry holds: ask the dict it would be in */
    if (t->other == NULL) {
        return 0;
    }
    PyObject *high = Py_NewRef(t->other); /* held: the lookup may run an id's __eq__ */
    int present = PyDict_Contains(high, key);
    Py_DECREF(high);
    return present;
}

static PyObject *
BlockMap_get(BlockMap *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        return PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
    }
    return block_get(t, args[0], nargs == 2 ? args[1] : Py_None);
}

static PyObject *
BlockMap_pop(BlockMap *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        return PyErr_Format(PyExc_TypeError, "pop expected 1 or 2 arguments, got %zd", nargs);
    }
    int present = BlockMap_contains(t, args[0]);
    if (present < 0) {
        return NULL;
    }
    if (!present) {
        if (nargs == 2) {
            return Py_NewRef(args[1]);
        }
        PyErr_SetObject(PyExc_KeyError, args[0]);
        return NULL;
    }
    PyObject *value = block_get(t, args[0], NULL);
    if (value != NULL && block_delete(t, args[0]) < 0) {
        Py_CLEAR(value);
    }
    return value;
}

static PyObject *
BlockMap_setdefault(BlockMap *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        return PyErr_Format(PyExc_TypeError, "setdefault expected 1 or 2 arguments");
    }
    PyObject *fallback = nargs == 2 ? args[1] : Py_None;
    int present = BlockMap_contains(t, args[0]);
    if (present < 0) {
        return NULL;
    }
    if (present) {
        return block_get(t, args[0], NULL);
    }
    return block_set(t, args[0], fallback) < 0 ? NULL : Py_NewRef(fallback);
}

/* pop_many(ids, default): [pop(id, default) for id in ids], one lookup each for the usual
   id (the list comprehension made three, and a method call, per block); None, having popped
   nothing, unless `ids` is a list or tuple of plain ids and the map holds only plain ids. */
static PyObject *
BlockMap_pop_many(BlockMap *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "pop_many expected 2 arguments, got %zd", nargs);
    }
    if (!PyList_CheckExact(args[0]) && !PyTuple_CheckExact(args[0])) {
        Py_RETURN_NONE;
    }
    PyObject *fast = Py_NewRef(args[0]); /* held: the list is not ours */
    Py_ssize_t size = PySequence_Fast_GET_SIZE(fast);
    PyObject **ids = PySequence_Fast_ITEMS(fast);
    if (!loop_is_plain(t, ids, size)) {
        Py_DECREF(fast);
        Py_RETURN_NONE;
    }
    PyObject *popped = PyList_New(size); /* its items NULL until set: safe to drop */
    for (Py_ssize_t n = 0; popped != NULL && n < size; n++) {
        int64_t id;
        fetch_ahead(&t->table, ids, size, n, 1);
        int fits = id_of(ids[n], &id);
        Py_ssize_t i = fits > 0 ? slot_of_id(&t->table, id) : -1;
        PyObject *value = NULL;
        if (fits < 0) {
            /* the error is set */
        } else if (i >= 0) {
            value = PyLong_FromLongLong((long long)t->table.slots[i].mask);
            if (value != NULL) {
                remove_at(&t->table, (size_t)i);
            }
        } else {
            PyObject *pair[2] = {ids[n], args[1]};
            value = BlockMap_pop(t, pair, 2); /* the other dict (plain ids), or the default */
        }
        if (value == NULL) {
            Py_CLEAR(popped);
        } else {
            PyList_SET_ITEM(popped, n, value);
        }
    }
    Py_DECREF(fast);
    return popped;
}

/* What `part` asks of every entry: 0 ids, 1 values, 2 (id, value) pairs; as a list. */
static PyObject *
block_list(BlockMap *t, int part)
{
    PyObject *found = PyList_New(0);
    for (size_t i = 0; found != NULL && i < t->table.capacity; i++) {
        if (t->table.slots[i].key == EMPTY) {
            continue;
        }
        PyObject *item;
        if (part == 0) {
            item = id_object(t->table.slots[i].key);
        } else if (part == 1) {
            item = PyLong_FromLongLong((long long)t->table.slots[i].mask);
        } else {
            item = Py_BuildValue("(NL)", id_object(t->table.slots[i].key), (long long)t->table.slots[i].mask);
        }
        if (item == NULL || PyList_Append(found, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(found);
        } else {
            Py_DECREF(item);
        }
    }
    if (found == NULL || t->other == NULL) {
        return found;
    }
    PyObject *rest = part == 0   ? PyDict_Keys(t->other)
                     : part == 1 ? PyDict_Values(t->other)
                                 : PyDict_Items(t->other);
    if (rest == NULL) {
        Py_DECREF(found);
        return NULL;
    }
    Py_ssize_t size = PyList_GET_SIZE(found);
    int failed = PyList_SetSlice(found, size, size, rest) < 0;
    Py_DECREF(rest);
    if (failed) {
        Py_CLEAR(found);
    }
    return found;
}

static PyObject *
BlockMap_iter(BlockMap *t)
{
    return iterate(block_list(t, 0));
}

static PyObject *
BlockMap_values(BlockMap *t, PyObject *unused)
{
    return block_list(t, 1);
}

static PyObject *
BlockMap_items(BlockMap *t, PyObject *unused)
{
    return block_list(t, 2);
}

/* add_new(ids, keys): filing's usual run, blocks new to the worker: when no id is in the map
   nor twice in `ids`, each stored with its key: True; else False, the map as it was. None,
   having changed nothing, for what only the map's dict beside the slots holds (an id that is
   not an exact int below 2**64 - 1, a key that is not an int from hash(): an orphan's None),
   for ids and keys that are not lists or tuples, and while the dict holds an id that is not
   plain: the Python path stores those. */
static PyObject *
BlockMap_add_new(BlockMap *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "add_new expected 2 arguments, got %zd", nargs);
    }
    PyObject *ids = args[0], *keys = args[1];
    if (!(PyList_CheckExact(ids) || PyTuple_CheckExact(ids)) ||
        !(PyList_CheckExact(keys) || PyTuple_CheckExact(keys)) || t->exotic) {
        Py_RETURN_NONE;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ids);
    if (PySequence_Fast_GET_SIZE(keys) != count) {
        return PyErr_Format(PyExc_ValueError, "add_new: %zd ids and %zd keys", count,
                            PySequence_Fast_GET_SIZE(keys));
    }
    int64_t *bits = PyMem_Malloc((size_t)(count ? 2 * count : 1) * sizeof(int64_t));
    if (bits == NULL) { /* the ids' bits, then the keys' */
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    for (Py_ssize_t n = 0; n < count; n++) { /* exact ints only: no Python code runs here */
        PyObject *id = PySequence_Fast_GET_ITEM(ids, n);
        int fits = id_of(id, &bits[n]);
        int holds = fits > 0 ? key_of(PySequence_Fast_GET_ITEM(keys, n), &bits[count + n]) : fits;
        if (holds <= 0) {
            result = holds < 0 ? NULL : Py_NewRef(Py_None);
            goto done;
        }
        int beside = t->other != NULL && PyDict_GET_SIZE(t->other) ? PyDict_Contains(t->other, id)
                                                                    : 0;
        if (beside) {
            result = beside < 0 ? NULL : Py_NewRef(Py_False);
            goto done;
        }
    }
    int added = store_new(&t->table, bits, count, bits + count, 0);
    result = added < 0 ? NULL : PyBool_FromLong(added);
done:
    PyMem_Free(bits);
    return result;
}

static PyMethodDef BlockMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))BlockMap_get, METH_FASTCALL,
     "get(id, default=None): the block's key, or default."},
    {"add_new", (PyCFunction)(void (*)(void))BlockMap_add_new, METH_FASTCALL,
     "add_new(ids, keys): store blocks none of which is here, or none; whether it did."},
    {"pop_many", (PyCFunction)(void (*)(void))BlockMap_pop_many, METH_FASTCALL,
     "pop_many(ids, default): each id's key, popped, or default."},
    {"pop", (PyCFunction)(void (*)(void))BlockMap_pop, METH_FASTCALL,
     "pop(id[, default]): the block's key, taken out."},
    {"setdefault", (PyCFunction)(void (*)(void))BlockMap_setdefault, METH_FASTCALL,
     "setdefault(id, default=None): the block's key, stored first if it had none."},
    {"keys", (PyCFunction)BlockMap_keys, METH_NOARGS, "keys(): the map, its own keys view."},
    {"values", (PyCFunction)BlockMap_values, METH_NOARGS, "values(): a list of the keys."},
    {"items", (PyCFunction)BlockMap_items, METH_NOARGS, "items(): a list of (id, key)."},
    {"clear", (PyCFunction)BlockMap_clear, METH_NOARGS, "clear(): forget every block."},
    {"__sizeof__", (PyCFunction)BlockMap_sizeof, METH_NOARGS, "the table's bytes"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot BlockMap_slots[] = {
    {Py_tp_doc, "A worker's blocks, engine hash -> content key, as a dict, compactly."},
    {Py_tp_new, BlockMap_new},
    {Py_tp_dealloc, BlockMap_dealloc},
    {Py_mp_length, BlockMap_length},
    {Py_mp_subscript, BlockMap_subscript},
    {Py_mp_ass_subscript, BlockMap_ass_subscript},
    {Py_sq_contains, BlockMap_contains},
    {Py_tp_iter, BlockMap_iter},
    {Py_tp_methods, BlockMap_methods},
    {0, NULL},
};

static PyType_Spec BlockMap_spec = {
    .name = "tskv.core._compiled.BlockMap",
    .basicsize = sizeof(BlockMap),
    .flags = Py_TPFLAGS_DEFAULT | TYPE_IMMUTABLE,
    .slots = BlockMap_slots,
};
