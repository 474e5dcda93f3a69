/* Matcher: the usual match, whole.

PrefixIndex.match for a request with no per-block identity, on a table whose masks fit 64
bits: one call walks, counts and makes the prefix_index.Match, as prefix_index.counts_of would
count a plain walk's changes. It keeps only what it was given: the table, the Match type, and
the worker of each bit (set_workers). Whether a query is a usual one (no worker hybrid, none
hashing with lookahead, no predictions in force) is the index's to decide, in one place
(PrefixIndex.match), before it calls: the Matcher reads none of the index's containers, so
none can change under it unnoticed. It declines (None) what the pure path must answer: token
ids that are not a list of exact ints (a string, which the index keys as its digest; an int
subclass, whose hash may be its own), a root key that is not an exact int, a worker whose hash
is not C's own (plain_worker), a table with masks past 64 bits. So no Python code runs from the
moment it reads the request to the moment it returns the Match. */

/* Whether hashing and comparing `obj` runs no Python code: an exact int, str, bytes, float or
   bool, None, or an exact tuple of such, nested at most CONTENT_DEPTH deep. */
static int
plain_worker(PyObject *obj, int depth)
{
    if (PyLong_CheckExact(obj) || PyUnicode_CheckExact(obj) || PyBytes_CheckExact(obj) ||
        PyFloat_CheckExact(obj) || PyBool_Check(obj) || obj == Py_None) {
        return 1;
    }
    if (!PyTuple_CheckExact(obj) || depth >= CONTENT_DEPTH) {
        return 0;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(obj); i++) {
        if (!plain_worker(PyTuple_GET_ITEM(obj, i), depth + 1)) {
            return 0;
        }
    }
    return 1;
}

/* The slots of prefix_index.Match the Matcher fills, and nothing else: Matcher_new refuses an
   answer type whose slots are not exactly these, so a slot added to Match is a loud error where
   the Matcher is made, never a Match left half made. The Match is made as dict.__new__ makes it
   and its slots set as their own descriptors set them: Match.__init__'s frame cost a cold
   router more than the rest of a short match (docs/performance.md, "The compiled core"). */
enum { STALE, WORKERS, BLOCK_SIZE, PREDICTED, LOWER, ANSWER_SLOTS };
static const char *const ANSWER_SLOT_NAME[ANSWER_SLOTS] = {
    "stale", "workers", "block_size", "predicted", "lower",
};

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    KeyTable *table;
    PyTypeObject *answer;         /* prefix_index.Match: a dict subclass with those slots */
    PyObject *slot[ANSWER_SLOTS]; /* its member descriptors */
    Py_ssize_t block_size;
    PyObject *size;        /* the same, an int, for the answer */
    PyObject *by_position; /* the worker of each bit (None: a free one), a tuple */
    PyObject *known;       /* every worker, a tuple */
    int plain_workers;     /* every worker hashes and compares in C (plain_worker) */
    PyObject *no_stale;    /* frozenset(): the usual answer's stale */
} Matcher;


/* The counts of a walk's `found` changes into `counts`, as counts_of makes them; -1 with an
   exception set. */
static int
count_changes(PyObject *counts, PyObject *workers, const Change *changes, Py_ssize_t found,
              Py_ssize_t blocks)
{
    uint64_t active = 0; /* the first change, at depth 0, sets it */
    for (Py_ssize_t i = 0; i < found; i++) { /* some workers' prefixes end at its depth */
        if (changes[i].depth &&
            count_workers(counts, workers, active & ~changes[i].held, changes[i].depth) < 0) {
            return -1;
        }
        if (!changes[i].held) {
            return 0;
        }
        active = changes[i].held;
    }
    return active ? count_workers(counts, workers, active, blocks) : 0;
}

/* A new Match with no counts yet, `stale` frozen as it is now: made as dict.__new__ makes
   it, each slot set as its own descriptor sets it (see ANSWER_SLOT_NAME). */
static PyObject *
new_answer(Matcher *m, PyObject *stale)
{
    PyObject *none = PyTuple_New(0);
    PyObject *made = none == NULL ? NULL : m->answer->tp_new(m->answer, none, NULL);
    Py_XDECREF(none);
    PyObject *value[ANSWER_SLOTS] = {NULL};
    value[STALE] = PySet_GET_SIZE(stale) ? PyFrozenSet_New(stale) : Py_NewRef(m->no_stale);
    value[WORKERS] = Py_NewRef(m->known);
    value[BLOCK_SIZE] = Py_NewRef(m->size);
    value[PREDICTED] = PyDict_New();
    value[LOWER] = PyDict_New();
    int failed = made == NULL;
    for (int s = 0; s < ANSWER_SLOTS; s++) {
        failed = failed || value[s] == NULL ||
                 PyMember_SetOne((char *)made, ((PyMemberDescrObject *)m->slot[s])->d_member,
                                 value[s]) < 0;
        Py_XDECREF(value[s]);
    }
    if (failed) {
        Py_XDECREF(made);
        return NULL;
    }
    return made;
}

/* Whether `answer`'s own __slots__ are exactly ANSWER_SLOT_NAME; -1 with an exception set. */
static int
slots_are_the_answers(PyObject *answer)
{
    PyObject *slots = PyObject_GetAttrString(answer, "__slots__");
    PyObject *names = slots == NULL ? NULL : PySequence_Fast(slots, "__slots__");
    Py_XDECREF(slots);
    if (names == NULL) {
        return -1;
    }
    int same = PySequence_Fast_GET_SIZE(names) == ANSWER_SLOTS;
    for (int s = 0; same && s < ANSWER_SLOTS; s++) {
        int found = 0;
        for (Py_ssize_t n = 0; n < PySequence_Fast_GET_SIZE(names); n++) {
            PyObject *name = PySequence_Fast_GET_ITEM(names, n);
            found = found || (PyUnicode_Check(name) &&
                              PyUnicode_CompareWithASCIIString(name, ANSWER_SLOT_NAME[s]) == 0);
        }
        same = found;
    }
    if (!same) {
        PyErr_Format(PyExc_TypeError,
                     "Matcher: the answer type's __slots__ are %R; it fills stale, workers, "
                     "block_size, predicted and lower, and a slot it does not fill would be "
                     "left unset: teach matcher.h the new one",
                     names);
    }
    Py_DECREF(names);
    return same ? 1 : -1;
}

/* matcher(key, tokens, stale) -> Match | None: the usual match from root key `key`, `stale`
   the index's set of stale workers as it is now, or None where the pure path answers (see
   above). */
static PyObject *
Matcher_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Matcher *m = (Matcher *)self;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL) {
        return PyErr_Format(PyExc_TypeError, "a Matcher takes (key, tokens, stale)");
    }
    PyObject *key = args[0], *tokens = args[1], *stale = args[2];
    if (!PyAnySet_Check(stale)) {
        return PyErr_Format(PyExc_TypeError, "a Matcher's stale is a set, not %R", stale);
    }
    if (!PyList_CheckExact(tokens) || !PyLong_CheckExact(key) || m->table->high != NULL ||
        !m->plain_workers) {
        Py_RETURN_NONE;
    }
    Py_ssize_t blocks = PyList_GET_SIZE(tokens) / m->block_size;
    Change changes[MAX_CHANGES];
    Py_hash_t root_hash = blocks ? PyObject_Hash(key) : 0; /* an exact int's: no error */
    Py_ssize_t found = walk_table(m->table, root_hash, ((PyListObject *)tokens)->ob_item,
                                  blocks, m->block_size, Py_None, changes);
    if (found == DECLINED) {
        Py_RETURN_NONE;
    }
    PyObject *counts = found < 0 ? NULL : new_answer(m, stale);
    if (counts != NULL && count_changes(counts, m->by_position, changes, found, blocks) < 0) {
        Py_CLEAR(counts);
    }
    return counts;
}

/* Matcher(table, answer, size) */
static PyObject *
Matcher_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *table, *answer;
    Py_ssize_t size;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        return PyErr_Format(PyExc_TypeError, "Matcher takes no keyword arguments");
    }
    State *state = PyType_GetModuleState(type); /* its own type: Matchers are no base type */
    if (state == NULL) {
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!On:Matcher", state->key_table, &table, &answer, &size)) {
        return NULL;
    }
    if (!PyType_Check(answer) || !PyType_IsSubtype((PyTypeObject *)answer, &PyDict_Type) ||
        size < 1) {
        return PyErr_Format(PyExc_TypeError, "Matcher(table, answer, size): positional only, "
                            "answer a dict subclass, size at least 1");
    }
    if (slots_are_the_answers(answer) < 0) {
        return NULL;
    }
    Matcher *m = (Matcher *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->vectorcall = Matcher_call;
    m->table = (KeyTable *)Py_NewRef(table);
    m->answer = (PyTypeObject *)Py_NewRef(answer);
    m->block_size = size;
    m->by_position = PyTuple_New(0);
    m->known = PyTuple_New(0);
    m->plain_workers = 1;
    m->size = PyLong_FromSsize_t(size);
    m->no_stale = PyFrozenSet_New(NULL);
    int failed = !m->by_position || !m->known || !m->size || !m->no_stale;
    for (int s = 0; s < ANSWER_SLOTS && !failed; s++) {
        m->slot[s] = PyObject_GetAttrString(answer, ANSWER_SLOT_NAME[s]);
        failed = m->slot[s] == NULL;
        if (!failed && (!Py_IS_TYPE(m->slot[s], &PyMemberDescr_Type) ||
                        ((PyMemberDescrObject *)m->slot[s])->d_member->type != T_OBJECT_EX)) {
            PyErr_Format(PyExc_TypeError, "Matcher: answer's %s must be a slot",
                         ANSWER_SLOT_NAME[s]);
            failed = 1;
        }
    }
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

/* set_workers(by_position, known): the index's workers changed. */
static PyObject *
Matcher_set_workers(Matcher *m, PyObject *args)
{
    PyObject *by_position, *known;
    if (!PyArg_ParseTuple(args, "O!O!:set_workers", &PyTuple_Type, &by_position, &PyTuple_Type,
                          &known)) {
        return NULL;
    }
    int plain = 1;
    for (Py_ssize_t i = 0; plain && i < PyTuple_GET_SIZE(known); i++) {
        plain = plain_worker(PyTuple_GET_ITEM(known, i), 0);
    }
    Py_SETREF(m->by_position, Py_NewRef(by_position));
    Py_SETREF(m->known, Py_NewRef(known));
    m->plain_workers = plain;
    Py_RETURN_NONE;
}

static int
Matcher_traverse(Matcher *m, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(m)); /* a heap type's instance holds its type */
    Py_VISIT(m->table);
    Py_VISIT(m->answer);
    for (int s = 0; s < ANSWER_SLOTS; s++) {
        Py_VISIT(m->slot[s]);
    }
    Py_VISIT(m->size);
    Py_VISIT(m->by_position);
    Py_VISIT(m->known);
    Py_VISIT(m->no_stale);
    return 0;
}

static int
Matcher_clear(Matcher *m)
{
    Py_CLEAR(m->table);
    Py_CLEAR(m->answer);
    for (int s = 0; s < ANSWER_SLOTS; s++) {
        Py_CLEAR(m->slot[s]);
    }
    Py_CLEAR(m->size);
    Py_CLEAR(m->by_position);
    Py_CLEAR(m->known);
    Py_CLEAR(m->no_stale);
    return 0;
}

static void
Matcher_dealloc(Matcher *m)
{
    PyObject_GC_UnTrack(m);
    (void)Matcher_clear(m);
    free_instance((PyObject *)m);
}

static PyMethodDef Matcher_methods[] = {
    {"set_workers", (PyCFunction)Matcher_set_workers, METH_VARARGS,
     "set_workers(by_position, known): the index's workers changed."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Matcher_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Matcher, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Matcher_slots[] = {
    {Py_tp_doc, "The usual PrefixIndex.match in one call: matcher(key, tokens, stale) -> Match "
                "| None."},
    {Py_tp_new, Matcher_new},
    {Py_tp_call, PyVectorcall_Call},
    {Py_tp_traverse, Matcher_traverse},
    {Py_tp_clear, Matcher_clear},
    {Py_tp_dealloc, Matcher_dealloc},
    {Py_tp_methods, Matcher_methods},
    {Py_tp_members, Matcher_members},
    {0, NULL},
};

static PyType_Spec Matcher_spec = {
    .name = "tskv.core._compiled.Matcher",
    .basicsize = sizeof(Matcher),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | TYPE_IMMUTABLE,
    .slots = Matcher_slots,
};
