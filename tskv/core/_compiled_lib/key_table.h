/* KeyTable: the holders map, content key -> bit mask of the workers holding it.

Holdings keeps it as it would a dict of ints, in slots (slot_table.h): a key is an int from
hash(), never -1 (that is EMPTY), and the usual mask fits 64 bits; the high bits of a wider
mask (past 64 workers) go in a dict beside the slots, which goes again once it is empty, so
the Matcher and the fast paths that decline while it exists serve again. Its own fast paths,
add_new, let_go and mirror, do in one call what Holdings' loops do a key at a time. A reader
process sends its runs of keys packed as 8-byte ints (pack_keys), and mirror reads them where
they lie. Room is always made before anything changes, so an allocation that fails leaves the
table and its dict as they were.
*/

typedef struct {
    PyObject_HEAD
    Slots table;
    PyObject *high; /* key -> mask >> 64 where that is not 0 (a dict, made when first needed) */
} KeyTable;

static int
stored_key(PyObject *obj, int64_t *out)
{
    int found = key_of(obj, out);
    if (found == 0) {
        PyErr_Format(PyExc_TypeError,
                     "KeyTable: a key is an int from hash() (not -1, within 64 bits), not %R",
                     obj);
        return -1;
    }
    return found < 0 ? -1 : 0;
}

/* `count` keys made C integers, in a new array for PyMem_Free, or NULL with the error set (a
   key that is not an int from hash(): TypeError). With `let_go`, None and holdings.ABSENT are
   EMPTY: keys let go of that held nothing. */
static int64_t *
c_keys(PyObject *const *items, Py_ssize_t count, int let_go)
{
    int64_t *keys = PyMem_Malloc((size_t)(count ? count : 1) * sizeof(int64_t));
    if (keys == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t n = 0; n < count; n++) {
        if (let_go && (items[n] == Py_None || is_absent(items[n]))) {
            keys[n] = EMPTY;
        } else if (stored_key(items[n], &keys[n]) < 0) {
            PyMem_Free(keys);
            return NULL;
        }
    }
    return keys;
}

/* The mask stored for slot `i` as an int (a new reference). */
static PyObject *
mask_at(const KeyTable *t, size_t i)
{
    PyObject *low = PyLong_FromUnsignedLongLong(t->table.slots[i].mask);
    if (low == NULL || t->high == NULL) {
        return low;
    }
    PyObject *key = PyLong_FromLongLong(t->table.slots[i].key);
    if (key == NULL) {
        Py_DECREF(low);
        return NULL;
    }
    PyObject *high = PyDict_GetItemWithError(t->high, key); /* borrowed */
    Py_DECREF(key);
    if (high == NULL) {
        if (PyErr_Occurred()) {
            Py_DECREF(low);
            return NULL;
        }
        return low;
    }
    PyObject *shift = PyLong_FromLong(64), *shifted = NULL, *whole = NULL;
    if (shift != NULL && (shifted = PyNumber_Lshift(high, shift)) != NULL) {
        whole = PyNumber_Or(shifted, low);
    }
    Py_XDECREF(shift);
    Py_XDECREF(shifted);
    Py_DECREF(low);
    return whole;
}

/* The dict beside the slots goes once it is empty: the Matcher, and every fast path that
   declines while there is one, serve again (masks past 64 workers came and went, a tiered
   block was removed). */
static void
drop_if_empty(KeyTable *t)
{
    if (t->high != NULL && PyDict_GET_SIZE(t->high) == 0) {
        Py_CLEAR(t->high);
    }
}

static int
table_set(KeyTable *t, PyObject *key_obj, PyObject *value)
{
    int64_t key;
    if (stored_key(key_obj, &key) < 0) {
        return -1;
    }
    if (!PyLong_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "KeyTable: a mask is an int, not %R", value);
        return -1;
    }
    uint64_t low = PyLong_AsUnsignedLongLong(value); /* the usual mask: 64 workers or fewer */
    PyObject *high = NULL;
    if (low == (uint64_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        PyObject *zero = PyLong_FromLong(0);
        int negative = zero == NULL ? -1 : PyObject_RichCompareBool(value, zero, Py_LT);
        Py_XDECREF(zero);
        if (negative) {
            if (negative > 0) {
                PyErr_Format(PyExc_ValueError, "KeyTable: a mask is not negative: %R", value);
            }
            return -1;
        }
        low = PyLong_AsUnsignedLongLongMask(value);
        PyObject *shift = PyLong_FromLong(64);
        high = shift == NULL ? NULL : PyNumber_Rshift(value, shift);
        Py_XDECREF(shift);
        if (high == NULL) {
            return -1;
        }
    }
    /* Room first, then the dict, then the slot: an allocation that fails on the way leaves
       the slots and the dict as they were (a grown table holds what it held). */
    size_t i = 0;
    int failed = t->table.capacity == 0 && make_room(&t->table) < 0;
    if (!failed && t->table.slots[i = find(&t->table, key)].key == EMPTY) {
        failed = make_room(&t->table) < 0;
        i = failed ? 0 : find(&t->table, key);
    }
    if (!failed && high != NULL) {
        if (t->high == NULL) {
            t->high = PyDict_New();
        }
        failed = t->high == NULL || PyDict_SetItem(t->high, key_obj, high) < 0;
    } else if (!failed && t->high != NULL && PyDict_DelItem(t->high, key_obj) < 0) {
        if (PyErr_ExceptionMatches(PyExc_KeyError)) {
            PyErr_Clear();
        } else {
            failed = 1;
        }
    }
    Py_XDECREF(high);
    if (failed) {
        return -1;
    }
    drop_if_empty(t);
    if (t->table.slots[i].key == EMPTY) {
        t->table.slots[i].key = key;
        t->table.used++;
    }
    t->table.slots[i].mask = low;
    return 0;
}

static int
table_delete(KeyTable *t, PyObject *key_obj)
{
    int64_t key;
    int found = key_of(key_obj, &key);
    if (found < 0) {
        return -1;
    }
    size_t i = 0;
    if (found) { /* an empty table has no slots to look in */
        found = t->table.capacity != 0 && t->table.slots[i = find(&t->table, key)].key != EMPTY;
    }
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, key_obj);
        return -1;
    }
    remove_at(&t->table, i);
    if (t->high != NULL && PyDict_DelItem(t->high, key_obj) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError)) {
            return -1;
        }
        PyErr_Clear();
    }
    drop_if_empty(t);
    return 0;
}

/* The slot of `key_obj`, or -1 for none; -2 with an exception set on an error. */
static Py_ssize_t
table_slot(const KeyTable *t, PyObject *key_obj)
{
    int64_t key;
    int found = key_of(key_obj, &key);
    if (found <= 0) {
        return found < 0 ? -2 : -1;
    }
    if (t->table.capacity == 0) {
        return -1;
    }
    size_t i = find(&t->table, key);
    return t->table.slots[i].key == EMPTY ? -1 : (Py_ssize_t)i;
}

/* KeyTable(): empty. */
static PyObject *
KeyTable_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) || PyTuple_GET_SIZE(args)) {
        return PyErr_Format(PyExc_TypeError, "KeyTable() takes no arguments");
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0); /* zeroed: no slots, no dict */
    return (PyObject *)t;
}

static void
KeyTable_dealloc(KeyTable *t)
{
    slots_free(t->table.slots, t->table.capacity);
    Py_XDECREF(t->high);
    free_instance((PyObject *)t);
}

static Py_ssize_t
KeyTable_length(KeyTable *t)
{
    return t->table.used;
}

static PyObject *
KeyTable_subscript(KeyTable *t, PyObject *key)
{
    Py_ssize_t i = table_slot(t, key);
    if (i == -2) {
        return NULL;
    }
    if (i == -1) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return mask_at(t, (size_t)i);
}

static int
KeyTable_ass_subscript(KeyTable *t, PyObject *key, PyObject *value)
{
    return value == NULL ? table_delete(t, key) : table_set(t, key, value);
}

static int
KeyTable_contains(KeyTable *t, PyObject *key)
{
    Py_ssize_t i = table_slot(t, key);
    return i == -2 ? -1 : i >= 0;
}

static PyObject *
KeyTable_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        return PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
    }
    Py_ssize_t i = table_slot(t, args[0]);
    if (i == -2) {
        return NULL;
    }
    if (i == -1) {
        PyObject *fallback = nargs == 2 ? args[1] : Py_None;
        Py_INCREF(fallback);
        return fallback;
    }
    return mask_at(t, (size_t)i);
}

static PyObject *
KeyTable_items(KeyTable *t, PyObject *unused)
{
    PyObject *items = PyList_New(0);
    for (size_t i = 0; items != NULL && i < t->table.capacity; i++) {
        if (t->table.slots[i].key == EMPTY) {
            continue;
        }
        PyObject *mask = mask_at(t, i);
        PyObject *item = mask == NULL ? NULL : Py_BuildValue("(LN)", (long long)t->table.slots[i].key, mask);
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(items);
            break;
        }
        Py_DECREF(item);
    }
    return items;
}

static PyObject *
KeyTable_iter(KeyTable *t)
{
    PyObject *keys = PyList_New(0);
    for (size_t i = 0; keys != NULL && i < t->table.capacity; i++) {
        if (t->table.slots[i].key == EMPTY) {
            continue;
        }
        PyObject *key = PyLong_FromLongLong(t->table.slots[i].key);
        if (key == NULL || PyList_Append(keys, key) < 0) {
            Py_XDECREF(key);
            Py_CLEAR(keys);
            break;
        }
        Py_DECREF(key);
    }
    return iterate(keys);
}

/* keys(): the table is its own keys view (in, len, iteration, isdisjoint), as Holdings asks. */
static PyObject *
KeyTable_keys(KeyTable *t, PyObject *unused)
{
    Py_INCREF(t);
    return (PyObject *)t;
}

static PyObject *
KeyTable_isdisjoint(KeyTable *t, PyObject *other)
{
    return disjoint((PyObject *)t, &t->table, other, (objobjproc)KeyTable_contains);
}

static PyObject *
KeyTable_update(KeyTable *t, PyObject *other)
{
    if (!PyDict_Check(other)) {
        return PyErr_Format(PyExc_TypeError, "KeyTable.update takes a dict, not %R", other);
    }
    Py_ssize_t position = 0;
    PyObject *key, *value;
    while (PyDict_Next(other, &position, &key, &value)) {
        if (table_set(t, key, value) < 0) {
            return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
KeyTable_clear(KeyTable *t, PyObject *unused)
{
    slots_free(t->table.slots, t->table.capacity);
    t->table.slots = NULL;
    t->table.capacity = 0;
    t->table.used = 0;
    Py_CLEAR(t->high);
    Py_RETURN_NONE;
}

/* A worker's copies of `key` beyond the first, in its `extra` dict (WorkerBlocks.extra_refs),
   one more (step 1) or one fewer (-1). With -1: 1 if it had one to take, 0 if not, as
   `Holdings.release` looks there before it lets go of the worker's hold. Rare: a key held
   twice by one worker (a block in two tiers, or stored under two hashes). */
static int
count_copy(PyObject *extra, int64_t key, int step)
{
    PyObject *as_int = PyLong_FromLongLong(key);
    if (as_int == NULL) {
        return -1;
    }
    PyObject *had = PyDict_GetItemWithError(extra, as_int); /* borrowed */
    long long count = 0;
    int result = 0;
    if (had != NULL) {
        count = PyLong_AsLongLong(had);
        if (count == LLONG_MAX) {
            PyErr_SetString(PyExc_OverflowError, "mirror: a worker's copies of a key overflow");
        }
    }
    if (PyErr_Occurred()) {
        result = -1;
    } else if (step > 0 || count > 1) {
        PyObject *now = PyLong_FromLongLong(count + step);
        result = now == NULL ? -1 : PyDict_SetItem(extra, as_int, now);
        Py_XDECREF(now);
        result = result < 0 ? -1 : 1;
    } else if (count == 1) {
        result = PyDict_DelItem(extra, as_int) < 0 ? -1 : 1;
    }
    Py_DECREF(as_int);
    return result;
}

/* One run of mirror(): `keys` taken by `bit` (letting_go 0) or let go of (1), in order, each
   key once a copy: one the worker holds already is counted in `extra`, and its hold let go of
   with its last copy. EMPTY (-1) among keys let go of is a block that held nothing
   (holdings.ABSENT, or None as it came). A key let go of that no worker holds is a KeyError,
   as `Holdings.release` gives, after the keys before it were let go of. */
static int
mirror_keys(KeyTable *t, uint64_t bit, int letting_go, const int64_t *keys, Py_ssize_t count,
            PyObject *extra)
{
    for (Py_ssize_t n = 0; n < count; n++) {
        fetch_keys_ahead(&t->table, keys, count, n, letting_go);
        int64_t key = keys[n];
        if (key == EMPTY) {
            if (letting_go) {
                continue; /* it held nothing: as Holdings.release skips it */
            }
            PyErr_SetString(PyExc_TypeError, "KeyTable: a key is an int from hash(), never -1");
            return -1;
        }
        if (!letting_go) {
            if (make_room(&t->table) < 0) {
                return -1;
            }
            size_t i = find(&t->table, key);
            if (t->table.slots[i].key == EMPTY) {
                t->table.slots[i].key = key;
                t->table.slots[i].mask = 0;
                t->table.used++;
            }
            int again = (t->table.slots[i].mask & bit) != 0;
            t->table.slots[i].mask |= bit;
            /* counted last: the dict may run Python code, after which `i` means nothing */
            if (again && count_copy(extra, key, 1) < 0) {
                return -1;
            }
            continue;
        }
        if (PyDict_GET_SIZE(extra)) {
            int counted = count_copy(extra, key, -1);
            if (counted != 0) {
                if (counted < 0) {
                    return -1;
                }
                continue; /* another copy still has it */
            }
        }
        size_t i = t->table.capacity ? find(&t->table, key) : 0;
        if (t->table.capacity == 0 || t->table.slots[i].key == EMPTY) {
            PyObject *missing = PyLong_FromLongLong(key);
            if (missing != NULL) {
                PyErr_SetObject(PyExc_KeyError, missing);
                Py_DECREF(missing);
            }
            return -1;
        }
        t->table.slots[i].mask &= ~bit;
        if (t->table.slots[i].mask == 0) {
            int high = 0;
            if (t->high != NULL) {
                PyObject *as_int = PyLong_FromLongLong(key);
                high = as_int == NULL ? -1 : PyDict_Contains(t->high, as_int);
                Py_XDECREF(as_int);
            }
            if (high < 0) {
                return -1;
            }
            if (!high) {
                remove_at(&t->table, i);
            }
        }
    }
    return 0;
}

/* A bytes object's data follows its header at an offset that keeps 8-byte integers aligned
   (objects themselves are allocated 16-byte aligned), so packed keys are read in place. */
_Static_assert(offsetof(PyBytesObject, ob_sval) % _Alignof(int64_t) == 0,
               "bytes data aligned for int64_t");

/* One run as mirror() takes it: packed keys (bytes, as a reader's report carries them, or a
   buffer of format "q": 8-byte ints in this machine's order) are read as they are; any other
   sequence is made C integers first, None and ABSENT among keys let go of as EMPTY. Bytes are
   read in place: a memoryview over them, which a report's parse made before, was two objects
   for the garbage collector to count, and a frame's worth of them set it running. */
static int
mirror_run(KeyTable *t, uint64_t bit, int letting_go, PyObject *run, PyObject *extra)
{
    if (PyBytes_CheckExact(run)) {
        Py_ssize_t size = PyBytes_GET_SIZE(run);
        const char *data = PyBytes_AS_STRING(run);
        if (size % 8) {
            PyErr_Format(PyExc_TypeError, "a run of packed keys is 8 bytes a key, not %zd bytes",
                         size);
            return -1;
        }
        return mirror_keys(t, bit, letting_go, (const int64_t *)data, size / 8, extra);
    }
    Py_buffer view;
    if (!PyList_Check(run) && PyObject_CheckBuffer(run)) {
        if (PyObject_GetBuffer(run, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear(); /* not contiguous, or released: read as a sequence, or refused there */
        } else {
            int packed = view.itemsize == 8 && view.format != NULL && !strcmp(view.format, "q");
            int result =
                packed ? mirror_keys(t, bit, letting_go, view.buf, view.len / 8, extra) : 0;
            PyBuffer_Release(&view);
            if (packed) {
                return result;
            }
        }
    }
    PyObject *fast = PySequence_Fast(run, "mirror: a run must be a sequence of keys");
    if (fast == NULL) {
        return -1;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    int64_t *keys = c_keys(PySequence_Fast_ITEMS(fast), count, letting_go);
    int result = keys == NULL ? -1 : mirror_keys(t, bit, letting_go, keys, count, extra);
    PyMem_Free(keys);
    Py_DECREF(fast);
    return result;
}

/* mirror(bit, runs, extra): a worker's copies taken and let go of as its reader sent them
   (runs of keys: taken, let go of, taken...), for a worker whose bit is below 1 << 64; `extra`
   is its dict of copies beyond the first (WorkerBlocks.extra_refs). */
static PyObject *
KeyTable_mirror(KeyTable *t, PyObject *args)
{
    unsigned long long bit;
    PyObject *runs, *extra;
    if (!PyArg_ParseTuple(args, "KOO!:mirror", &bit, &runs, &PyDict_Type, &extra)) {
        return NULL;
    }
    PyObject *all = PySequence_Fast(runs, "mirror: runs must be a sequence");
    if (all == NULL) {
        return NULL;
    }
    for (Py_ssize_t number = 0; number < PySequence_Fast_GET_SIZE(all); number++) {
        if (mirror_run(t, bit, number % 2, PySequence_Fast_GET_ITEM(all, number), extra) < 0) {
            Py_DECREF(all);
            return NULL;
        }
    }
    Py_DECREF(all);
    Py_RETURN_NONE;
}

/* clear_bits(bits): every key's mask without `bits` (below 1 << 64), a key left with none
   removed: the workers of a reader that died let go of everything at once, in one pass over
   the slots instead of a Python loop over millions of keys. */
static PyObject *
KeyTable_clear_bits(KeyTable *t, PyObject *arg)
{
    unsigned long long bits = PyLong_AsUnsignedLongLong(arg);
    if (bits == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    size_t i = 0;
    while (i < t->table.capacity) {
        Slot *slot = &t->table.slots[i];
        if (slot->key == EMPTY || !(slot->mask & bits)) {
            i++;
            continue;
        }
        slot->mask &= ~(uint64_t)bits;
        int high = 0;
        if (slot->mask == 0 && t->high != NULL) {
            PyObject *key = PyLong_FromLongLong(slot->key);
            high = key == NULL ? -1 : PyDict_Contains(t->high, key);
            Py_XDECREF(key);
            if (high < 0) {
                return NULL;
            }
        }
        if (slot->mask == 0 && !high) {
            /* a later key may move back into slot i: look at it again (a key that moves from
               the table's start to its end is looked at twice, which changes nothing) */
            remove_at(&t->table, i);
        } else {
            i++;
        }
    }
    Py_RETURN_NONE;
}

/* The (keys, mask) arguments of let_go and add_new: 1 and the mask in *out when it is within
   64 bits; 0 when it is past them (or negative): both decline those, and the Python path does
   them; -1 with an exception set for a wrong count or a mask that is no int. */
static int
keys_and_mask(const char *name, Py_ssize_t nargs, PyObject *const *args, unsigned long long *out)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "%s expected 2 arguments, got %zd", name, nargs);
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(args[1]);
    if (*out == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1;
        }
        PyErr_Clear();
        return 0;
    }
    return 1;
}

/* let_go(keys, bit): Holdings.release's usual case in one call, for a worker whose keys have
   no other refs and no predictions: each key's mask without `bit` (a key left with none
   removed), None and holdings.ABSENT passed over; returns how many keys it let go of (a
   count, not a list: release needs only to know it was done). None when a mask or `bit` is
   past 64 bits (over 64 workers): the Python loop does those. A key not held raises KeyError,
   as holders[key] does, after the keys before it were let go of. */
static PyObject *
KeyTable_let_go(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long bit;
    int fits = keys_and_mask("let_go", nargs, args, &bit);
    if (fits <= 0) {
        return fits < 0 ? NULL : Py_NewRef(Py_None);
    }
    if (t->high != NULL && PyDict_GET_SIZE(t->high)) {
        Py_RETURN_NONE;
    }
    PyObject *fast = PySequence_Fast(args[0], "let_go takes a sequence of keys");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t let_go = 0;
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t n = 0; n < count; n++) {
        PyObject *item = items[n];
        fetch_ahead(&t->table, items, count, n, 1);
        if (item == Py_None || is_absent(item)) {
            continue; /* it held nothing */
        }
        Py_ssize_t i = table_slot(t, item); /* anything not held: KeyError, as holders[key] */
        if (i < 0) {
            if (i == -1) {
                PyErr_SetObject(PyExc_KeyError, item);
            }
            Py_DECREF(fast);
            return NULL;
        }
        t->table.slots[i].mask &= ~(uint64_t)bit;
        if (t->table.slots[i].mask == 0) {
            remove_at(&t->table, (size_t)i);
        }
        let_go++;
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(let_go);
}

/* add_new(keys, mask): Holdings.hold's usual case in one call, content no worker held: when
   none of `keys` is in the table nor twice in `keys`, each stored with `mask`: True; else
   False, the table as it was. None when `mask` is past 64 bits (the Python path stores it).
   A key that is not an int from hash() is a TypeError, as storing it is. */
static PyObject *
KeyTable_add_new(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    unsigned long long mask;
    int fits = keys_and_mask("add_new", nargs, args, &mask);
    if (fits <= 0) {
        return fits < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *fast = PySequence_Fast(args[0], "add_new takes a sequence of keys");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    int64_t *keys = c_keys(PySequence_Fast_ITEMS(fast), count, 0);
    int added = keys == NULL ? -1 : store_new(&t->table, keys, count, NULL, mask);
    PyMem_Free(keys);
    Py_DECREF(fast);
    return added < 0 ? NULL : PyBool_FromLong(added);
}

static PyObject *
KeyTable_sizeof(KeyTable *t, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(KeyTable) + t->table.capacity * sizeof(Slot));
}

static PyMethodDef KeyTable_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyTable_get, METH_FASTCALL,
     "get(key, default=None): the key's mask, or default."},
    {"items", (PyCFunction)KeyTable_items, METH_NOARGS, "items(): a list of (key, mask)."},
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "keys(): the table, its own keys view."},
    {"isdisjoint", (PyCFunction)KeyTable_isdisjoint, METH_O,
     "isdisjoint(keys): whether none of `keys` is here."},
    {"update", (PyCFunction)KeyTable_update, METH_O, "update(mapping): store a dict's masks."},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "clear(): forget every key."},
    {"mirror", (PyCFunction)KeyTable_mirror, METH_VARARGS,
     "mirror(bit, runs): take and let go of a worker's holds as its reader sent them."},
    {"add_new", (PyCFunction)(void (*)(void))KeyTable_add_new, METH_FASTCALL,
     "add_new(keys, mask): store keys none of which is held, or none; whether it did."},
    {"let_go", (PyCFunction)(void (*)(void))KeyTable_let_go, METH_FASTCALL,
     "let_go(keys, bit): keys without bit; how many it let go of, or None for wide masks."},
    {"clear_bits", (PyCFunction)KeyTable_clear_bits, METH_O,
     "clear_bits(bits): take `bits` out of every mask, and the keys left with none."},
    {"__sizeof__", (PyCFunction)KeyTable_sizeof, METH_NOARGS, "the table's bytes"},
    {NULL, NULL, 0, NULL},
};

/* pack_keys(keys) -> bytes: array("q", keys).tobytes(), a reader's runs of keys as its report
   carries them (reader_messages), without array's generic per-item conversion. */
static PyObject *
pack_keys(PyObject *module, PyObject *keys)
{
    PyObject *fast = PySequence_Fast(keys, "pack_keys takes a sequence of ints");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    PyObject **items = PySequence_Fast_ITEMS(fast);
    PyObject *packed = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int64_t));
    for (Py_ssize_t n = 0; packed != NULL && n < count; n++) {
        int overflow;
        long long value = PyLong_Check(items[n]) /* its value read in C, never hashed */
                              ? PyLong_AsLongLongAndOverflow(items[n], &overflow)
                              : (PyErr_Format(PyExc_TypeError, "pack_keys: %R is not an int",
                                              items[n]),
                                 -1);
        if (value == -1 && PyErr_Occurred()) {
            Py_CLEAR(packed);
        } else if (overflow) {
            PyErr_Format(PyExc_OverflowError, "pack_keys: %R is past 64 bits", items[n]);
            Py_CLEAR(packed);
        } else {
            int64_t key = (int64_t)value;
            memcpy(PyBytes_AS_STRING(packed) + n * (Py_ssize_t)sizeof(int64_t), &key, sizeof key);
        }
    }
    Py_DECREF(fast);
    return packed;
}

static PyType_Slot KeyTable_slots[] = {
    {Py_tp_doc, "Content key -> mask of the workers holding it, as a dict of ints, compactly."},
    {Py_tp_new, KeyTable_new},
    {Py_tp_dealloc, KeyTable_dealloc},
    {Py_mp_length, KeyTable_length},
    {Py_mp_subscript, KeyTable_subscript},
    {Py_mp_ass_subscript, KeyTable_ass_subscript},
    {Py_sq_contains, KeyTable_contains},
    {Py_tp_iter, KeyTable_iter},
    {Py_tp_methods, KeyTable_methods},
    {0, NULL},
};

static PyType_Spec KeyTable_spec = {
    .name = "tskv.core._compiled.KeyTable",
    .basicsize = sizeof(KeyTable),
    .flags = Py_TPFLAGS_DEFAULT | TYPE_IMMUTABLE,
    .slots = KeyTable_slots,
};
