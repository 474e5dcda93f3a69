/* The walk down a request's blocks: each block's key from its parent's, and the workers
holding every block so far, until none does.

A key depends on the one before it, but the slot it lands in does not depend on the table:
so walk_table makes the next few keys and asks the CPU for their slots together, and the walk
then finds them in its cache. The masks stay C integers on a KeyTable whose masks fit 64 bits;
a dict, predictions or wider masks take the general loop, which keeps them as Python ints. The
token ids are read where they lie, and only exact ints are hashed: a walk that reaches any
other token id is declined (None), and the pure walk answers it.
*/

/* The mask of the workers holding `key`: real | predicted, 0 for none (a new reference). */
static PyObject *
holders_of(PyObject *real, PyObject *predicted, PyObject *key, PyObject *zero,
           PyTypeObject *key_table)
{
    PyObject *mask;
    if (Py_IS_TYPE(real, key_table)) {
        Py_ssize_t i = table_slot((KeyTable *)real, key);
        if (i == -2) {
            return NULL;
        }
        mask = i == -1 ? Py_NewRef(zero) : mask_at((KeyTable *)real, (size_t)i);
    } else {
        mask = PyDict_GetItemWithError(real, key); /* borrowed */
        if (mask == NULL && PyErr_Occurred()) {
            return NULL;
        }
        mask = Py_NewRef(mask == NULL ? zero : mask);
    }
    if (mask == NULL || predicted == Py_None) {
        return mask;
    }
    PyObject *guess = PyDict_GetItemWithError(predicted, key);
    if (guess == NULL) {
        return PyErr_Occurred() ? (Py_DECREF(mask), NULL) : mask;
    }
    PyObject *either = PyNumber_Or(mask, guess);
    Py_DECREF(mask);
    return either;
}

#define AHEAD 8 /* blocks keyed ahead of the one looked up */

/* Where the workers holding every block so far change: at `depth`, `held` hold it. At most
   66 of them: the first block's, one for each of 64 workers dropping out, and the block that
   no worker holds. */
typedef struct {
    Py_ssize_t depth;
    uint64_t held;
} Change;

#define MAX_CHANGES 66

#define DECLINED (-2) /* what walk_table returns for a request the pure path must walk */

/* walk() on a KeyTable whose masks all fit 64 bits, with no predictions: the masks stay C
   integers, and a key becomes an int only for `keys_out`. A key depends on the one before,
   but its slot's address does not depend on the table: so the next AHEAD keys are made and
   their slots fetched from memory together, and the walk then finds them in the CPU's cache
   (at millions of keys each lookup is a cache miss). `tokens` are read where they lie: no
   Python code runs while they are (a token id not an exact int is declined, not hashed), so
   nothing can change them. A block made ahead past where the walk stops is not used, a
   declined one included. Fills changes[] (MAX_CHANGES at most); their number, DECLINED when
   the walk reaches a token id not an exact int, or -1 with an exception set. */
static Py_ssize_t
walk_table(KeyTable *t, Py_hash_t parent_hash, PyObject *const *tokens, Py_ssize_t blocks,
           Py_ssize_t size, PyObject *keys_out, Change *changes)
{
    Py_ssize_t found = 0;
    uint64_t active = ~(uint64_t)0;
    Py_hash_t ahead[AHEAD];
    for (Py_ssize_t start = 0; start < blocks; start += AHEAD) {
        Py_ssize_t count = blocks - start < AHEAD ? blocks - start : AHEAD, made = 0;
        for (; made < count; made++) {
            if (next_key(&parent_hash, tokens, start + made, size, &ahead[made]) < 0) {
                break; /* declined only if the walk gets there */
            }
            if (t->table.capacity) {
                PREFETCH(&t->table.slots[home_of(ahead[made], t->table.capacity)]);
            }
        }
        for (Py_ssize_t k = 0; k < made; k++) {
            Py_ssize_t depth = start + k;
            Py_hash_t key = ahead[k];
            if (keys_out != Py_None) {
                PyObject *as_int = PyLong_FromSsize_t(key);
                if (as_int == NULL || PyList_Append(keys_out, as_int) < 0) {
                    Py_XDECREF(as_int);
                    return -1;
                }
                Py_DECREF(as_int);
            }
            uint64_t held = 0;
            if (t->table.capacity) {
                size_t i = find(&t->table, key);
                held = t->table.slots[i].key == EMPTY ? 0 : active & t->table.slots[i].mask;
            }
            if (depth == 0 || held != active) { /* at 0: Python's `active` is -1, never a mask */
                /* the first change, then one a worker dropping out (a bit fewer each), then
                   the last (none held): 1 + 64 + 1 */
                assert(found < MAX_CHANGES);
                changes[found++] = (Change){depth, held};
            }
            if (!held) {
                return found;
            }
            active = held;
        }
        if (made < count) { /* the walk reached the block whose key could not be made */
            return DECLINED;
        }
    }
    return found;
}

/* The walk's changes as walk() returns them: (changes, blocks). */
static PyObject *
changes_list(const Change *changes, Py_ssize_t found, Py_ssize_t blocks)
{
    PyObject *list = PyList_New(found);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < found; i++) {
        PyObject *change =
            Py_BuildValue("(nK)", changes[i].depth, (unsigned long long)changes[i].held);
        if (change == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, change);
    }
    return Py_BuildValue("(Nn)", list, blocks);
}

/* counts[workers[bit]] = blocks for each bit of `mask`; -1 with an exception set. */
static int
count_workers(PyObject *counts, PyObject *workers, uint64_t mask, Py_ssize_t blocks)
{
    PyObject *number = PyLong_FromSsize_t(blocks);
    if (number == NULL) {
        return -1;
    }
    for (; mask; mask &= mask - 1) {
        Py_ssize_t bit = LOWEST_BIT(mask);
        PyObject *worker = bit < PyTuple_GET_SIZE(workers) ? PyTuple_GET_ITEM(workers, bit)
                                                           : Py_None;
        if (worker == Py_None) {
            PyErr_Format(PyExc_KeyError, "leading: no worker has bit %zd", bit);
            Py_DECREF(number);
            return -1;
        }
        if (PyDict_SetItem(counts, worker, number) < 0) {
            Py_DECREF(number);
            return -1;
        }
    }
    Py_DECREF(number);
    return 0;
}

/* walk() declines: None, and `keys_out` back to the `kept` keys it had, so that the pure walk
   the caller runs instead reports each key once. */
static PyObject *
declined(PyObject *keys_out, Py_ssize_t kept)
{
    if (keys_out != Py_None &&
        PyList_SetSlice(keys_out, kept, PyList_GET_SIZE(keys_out), NULL) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* walk(real, predicted, key, tokens, size, keys_out) -> (changes, blocks) | None

   Down the request's full blocks from root key `key`: `changes` lists (depth, held) each time
   the workers holding every block so far (`held`, a mask) change, the last with held 0 where
   no worker holds a block; `blocks` is the number of full blocks. Each key walked goes into
   `keys_out` when it is a list. prefix_index._leading_counts turns this into counts. None,
   with `keys_out` as it was, where a token id is not an exact int (declined). */
static PyObject *
walk(PyObject *module, PyObject *args)
{
    PyObject *real, *predicted, *key, *tokens, *keys_out;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "OOOOnO:walk", &real, &predicted, &key, &tokens, &size,
                          &keys_out)) {
        return NULL;
    }
    PyTypeObject *key_table = state_of(module)->key_table;
    if (!PyDict_Check(real) && !Py_IS_TYPE(real, key_table)) {
        return PyErr_Format(PyExc_TypeError, "walk: real must be a dict or a KeyTable");
    }
    if (predicted != Py_None && !PyDict_Check(predicted)) {
        return PyErr_Format(PyExc_TypeError, "walk: predicted must be a dict or None");
    }
    if (keys_out != Py_None && !PyList_Check(keys_out)) {
        return PyErr_Format(PyExc_TypeError, "walk: keys_out must be a list or None");
    }
    if (size < 1) {
        return PyErr_Format(PyExc_ValueError, "walk: size = %zd must be at least 1", size);
    }
    PyObject *fast = PySequence_Fast(tokens, "walk: tokens must be a sequence");
    if (fast == NULL) {
        return NULL;
    }
    if (!PyLong_CheckExact(key)) {
        Py_DECREF(fast);
        Py_RETURN_NONE; /* the pure walk hashes it */
    }
    Py_ssize_t blocks = PySequence_Fast_GET_SIZE(fast) / size;
    PyObject **tokens_at = PySequence_Fast_ITEMS(fast);
    Py_ssize_t kept = keys_out == Py_None ? 0 : PyList_GET_SIZE(keys_out);
    if (Py_IS_TYPE(real, key_table) && predicted == Py_None && !((KeyTable *)real)->high) {
        Change found[MAX_CHANGES];
        Py_hash_t root_hash = blocks ? PyObject_Hash(key) : 0; /* an exact int's: no error */
        Py_ssize_t count = walk_table((KeyTable *)real, root_hash, tokens_at, blocks, size,
                                      keys_out, found);
        Py_DECREF(fast);
        if (count == DECLINED) {
            return declined(keys_out, kept);
        }
        return count < 0 ? NULL : changes_list(found, count, blocks);
    }
    PyObject *changes = PyList_New(0);
    PyObject *zero = PyLong_FromLong(0);
    PyObject *active = PyLong_FromLong(-1); /* every worker, until the first block says */
    PyObject *current = key; /* the parent of the block at hand */
    Py_INCREF(current);
    if (changes == NULL || zero == NULL || active == NULL) {
        goto error;
    }
    for (Py_ssize_t depth = 0; depth < blocks; depth++) {
        /* the parent's hash, then the content's: the order Python hashes the pair in */
        Py_hash_t parent_hash = PyObject_Hash(current);
        if (parent_hash == -1) {
            goto error;
        }
        Py_hash_t content_hash = items_hash(tokens_at + depth * size, size);
        if (content_hash == -1) { /* declined: the pure walk hashes what is no exact int */
            Py_DECREF(fast);
            Py_DECREF(changes);
            Py_DECREF(zero);
            Py_DECREF(active);
            Py_DECREF(current);
            return declined(keys_out, kept);
        }
        Py_SETREF(current, PyLong_FromSsize_t(pair_hash(parent_hash, content_hash)));
        if (current == NULL) {
            goto error;
        }
        if (keys_out != Py_None && PyList_Append(keys_out, current) < 0) {
            goto error;
        }
        PyObject *mask = holders_of(real, predicted, current, zero, key_table);
        if (mask == NULL) {
            goto error;
        }
        PyObject *held = PyNumber_And(active, mask);
        Py_DECREF(mask);
        if (held == NULL) {
            goto error;
        }
        int same = PyObject_RichCompareBool(held, active, Py_EQ);
        if (same < 0) {
            Py_DECREF(held);
            goto error;
        }
        if (!same) {
            PyObject *change = Py_BuildValue("(nO)", depth, held);
            if (change == NULL || PyList_Append(changes, change) < 0) {
                Py_XDECREF(change);
                Py_DECREF(held);
                goto error;
            }
            Py_DECREF(change);
        }
        Py_SETREF(active, held);
        int none = PyObject_Not(active);
        if (none < 0) {
            goto error;
        }
        if (none) {
            break;
        }
    }
    Py_DECREF(fast);
    Py_DECREF(zero);
    Py_DECREF(active);
    Py_DECREF(current);
    return Py_BuildValue("(Nn)", changes, blocks);
error:
    Py_DECREF(fast);
    Py_XDECREF(changes);
    Py_XDECREF(zero);
    Py_XDECREF(active);
    Py_XDECREF(current);
    return NULL;
}

/* chain(key, blocks) -> list | None: block_keys.chain for a key that is an exact int (or
   None) and contents that are exact ints or tuples of them (content_hash_of); None, having
   made nothing, for anything else, which block_keys.chain_in_python keys. */
static PyObject *
chain(PyObject *module, PyObject *args)
{
    PyObject *key, *blocks;
    if (!PyArg_ParseTuple(args, "OO:chain", &key, &blocks)) {
        return NULL;
    }
    if ((key != Py_None && !PyLong_CheckExact(key)) || !PyList_CheckExact(blocks)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t count = PyList_GET_SIZE(blocks);
    PyObject *keys = PyList_New(count);
    if (keys == NULL) {
        return NULL;
    }
    /* No Python code runs from here on (exact ints and tuples hash in C), so `blocks` cannot
       change while it is read. */
    int reachable = key != Py_None;
    Py_hash_t parent_hash = reachable ? PyObject_Hash(key) : 0; /* an exact int: never fails */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *content = PyList_GET_ITEM(blocks, i);
        reachable = reachable && content != Py_None;
        if (!reachable) { /* no query can reach this block, nor any after it */
            PyList_SET_ITEM(keys, i, Py_NewRef(Py_None));
            continue;
        }
        Py_hash_t content_hash = content_hash_of(content, 0);
        if (content_hash == -1) {
            Py_DECREF(keys);
            Py_RETURN_NONE;
        }
        Py_hash_t made = pair_hash(parent_hash, content_hash);
        PyObject *as_int = PyLong_FromSsize_t(made);
        if (as_int == NULL) {
            Py_DECREF(keys);
            return NULL;
        }
        PyList_SET_ITEM(keys, i, as_int);
        parent_hash = int_hash(made);
    }
    return keys;
}
