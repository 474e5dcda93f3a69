/* Matcher: the usual match, whole.

PrefixIndex.match for a request with no per-block identity, on a table whose masks fit 64
bits: one call walks, counts and makes the prefix_index.Match, as prefix_index.counts_of would
count a plain walk's changes. It keeps only what it was given (set_answer): the table, the
worker of each bit, and the usual answer, a Match with no counts that Match's own constructor
made; each answer is a copy of it with the counts filled in. Whether a query is a usual one (no
worker hybrid, none hashing with lookahead, no predictions in force) is the index's to keep, in
one state (PrefixIndex._fast, set again wherever one of those changes), and it calls the Matcher
only while that is open: the Matcher reads none of the index's containers and none of Match's
field names, so neither can change under it unnoticed. It
declines (None) what the pure path must answer: token ids that are not a list of exact ints (a
string, which the index keys as its digest; an int subclass, whose hash may be its own), a root
key that is not an exact int, a worker whose hash is not C's own (plain_worker), a table with
masks past 64 bits. So no Python code runs from the moment it reads the request to the moment
it returns the Match. */

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

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    KeyTable *table;
    Py_ssize_t block_size;
    PyObject *by_position; /* the worker of each bit (None: a free one), a tuple */
    PyTypeObject *answer;  /* the usual answer's type (set_answer); NULL: not told yet */
    PyObject *fields;      /* its slots' values, in the type's member order (see new_answer) */
    PyObject *no_args;     /* (): what the answer's type is made from */
    int plain_workers;     /* every worker hashes and compares in C (plain_worker) */
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

/* The answer's fields are the ones Match's own constructor set on the usual answer, whatever
   they are: the Matcher copies each of its type's slots, and makes each dict among them anew,
   so that no two answers share one. So Match's fields have one author, its constructor, and a
   field added there reaches every answer with no line here; yet no Python code runs for an
   answer, where a constructor's frame would cost a cold router more than the rest of a short
   match (docs/performance.md, "The compiled core"). set_answer refuses what a copy would not
   keep apart: a type with a __dict__, a slot left unset, a mutable value other than an empty
   dict. */

/* Whether every answer can take `value` as it is: an immutable container or scalar can be
   shared by them, and an empty dict is made anew for each (copying a full one could compare
   keys, which is Python code). */
static int
copyable(PyObject *value)
{
    return value == Py_None || PyLong_CheckExact(value) || PyBool_Check(value) ||
           PyFloat_CheckExact(value) || PyUnicode_CheckExact(value) || PyBytes_CheckExact(value) ||
           PyTuple_CheckExact(value) || PyFrozenSet_CheckExact(value) ||
           (PyDict_CheckExact(value) && PyDict_GET_SIZE(value) == 0);
}

/* A new answer with no counts yet: the usual one copied, slot by slot, each dict made anew.
   It reads the fields set_answer took, not the usual answer, which its maker still holds. */
static PyObject *
new_answer(Matcher *m)
{
    PyTypeObject *type = m->answer;
    PyObject *made = type->tp_new(type, m->no_args, NULL);
    if (made == NULL) {
        return NULL;
    }
    Py_ssize_t field = 0;
    for (PyMemberDef *slot = type->tp_members; slot->name != NULL; slot++, field++) {
        assert(field < PyTuple_GET_SIZE(m->fields));
        PyObject *value = PyTuple_GET_ITEM(m->fields, field);
        PyObject *copy = PyDict_CheckExact(value) ? PyDict_New() : Py_NewRef(value);
        if (copy == NULL) {
            Py_DECREF(made);
            return NULL;
        }
        Py_XSETREF(*(PyObject **)((char *)made + slot->offset), copy);
    }
    return made;
}

/* The values new_answer copies, from `usual`'s slots (its dicts not shared, so that a change
   to the usual answer after set_answer reaches no answer): a new tuple, or NULL with an
   exception naming what new_answer could not copy. */
static PyObject *
answer_fields(PyObject *usual)
{
    PyTypeObject *type = Py_TYPE(usual);
    if (!PyDict_Check(usual) || type->tp_base != &PyDict_Type || type->tp_dictoffset != 0 ||
        type->tp_new != PyDict_Type.tp_new || type->tp_members == NULL ||
        PyDict_GET_SIZE(usual) != 0) {
        PyErr_Format(PyExc_TypeError,
                     "Matcher.set_answer: the usual answer must be an empty instance of a "
                     "direct dict subclass with no __new__ and all its fields in __slots__, "
                     "not %R",
                     usual);
        return NULL;
    }
    Py_ssize_t count = 0;
    for (PyMemberDef *slot = type->tp_members; slot->name != NULL; slot++) {
        count++;
    }
    PyObject *fields = PyTuple_New(count);
    Py_ssize_t field = 0;
    for (PyMemberDef *slot = type->tp_members; fields && slot->name != NULL; slot++, field++) {
        if (slot->type != T_OBJECT_EX || (slot->flags & READONLY)) {
            PyErr_Format(PyExc_TypeError,
                         "Matcher.set_answer: the usual answer's %s is not a plain __slots__ "
                         "field", slot->name);
            Py_CLEAR(fields);
            break;
        }
        PyObject *value = *(PyObject **)((char *)usual + slot->offset);
        if (value == NULL) {
            PyErr_Format(PyExc_TypeError,
                         "Matcher.set_answer: the usual answer's %s is unset; its constructor "
                         "must set every slot", slot->name);
            Py_CLEAR(fields);
            break;
        }
        if (!copyable(value)) {
            PyErr_Format(PyExc_TypeError,
                         "Matcher.set_answer: the usual answer's %s is %R, which answers "
                         "would share; make it an empty dict (each answer gets its own) or "
                         "an immutable value",
                         slot->name, value);
            Py_CLEAR(fields);
            break;
        }
        PyObject *copy = PyDict_CheckExact(value) ? PyDict_New() : Py_NewRef(value);
        if (copy == NULL) {
            Py_CLEAR(fields);
            break;
        }
        PyTuple_SET_ITEM(fields, field, copy);
    }
    return fields;
}

/* matcher(key, tokens) -> Match | None: the usual match from root key `key`, or None where
   the pure path answers (see above) or no usual answer was set yet. */
static PyObject *
Matcher_call(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Matcher *m = (Matcher *)self;
    if (PyVectorcall_NARGS(nargsf) != 2 || kwnames != NULL) {
        return PyErr_Format(PyExc_TypeError, "a Matcher takes (key, tokens)");
    }
    PyObject *key = args[0], *tokens = args[1];
    if (!PyList_CheckExact(tokens) || !PyLong_CheckExact(key) || m->table->high != NULL ||
        !m->plain_workers || m->answer == NULL) {
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
    PyObject *counts = found < 0 ? NULL : new_answer(m);
    if (counts != NULL && count_changes(counts, m->by_position, changes, found, blocks) < 0) {
        Py_CLEAR(counts);
    }
    return counts;
}

/* Matcher(table, size) */
static PyObject *
Matcher_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *table;
    Py_ssize_t size;
    if (kwds != NULL && PyDict_GET_SIZE(kwds)) {
        return PyErr_Format(PyExc_TypeError, "Matcher takes no keyword arguments");
    }
    State *state = PyType_GetModuleState(type); /* its own type: Matchers are no base type */
    if (state == NULL) {
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "O!n:Matcher", state->key_table, &table, &size)) {
        return NULL;
    }
    if (size < 1) {
        return PyErr_Format(PyExc_TypeError, "Matcher(table, size): size at least 1, not %zd",
                            size);
    }
    Matcher *m = (Matcher *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->vectorcall = Matcher_call;
    m->table = (KeyTable *)Py_NewRef(table);
    m->block_size = size;
    m->by_position = PyTuple_New(0);
    m->no_args = PyTuple_New(0);
    m->plain_workers = 1;
    if (m->by_position == NULL || m->no_args == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

/* set_answer(by_position, usual): the index's workers, or what its answers start as, changed:
   the worker of each bit, and an answer with no counts that the answer type's constructor
   made. */
static PyObject *
Matcher_set_answer(Matcher *m, PyObject *args)
{
    PyObject *by_position, *usual;
    if (!PyArg_ParseTuple(args, "O!O:set_answer", &PyTuple_Type, &by_position, &usual)) {
        return NULL;
    }
    PyObject *fields = answer_fields(usual);
    if (fields == NULL) {
        return NULL;
    }
    int plain = 1;
    for (Py_ssize_t i = 0; plain && i < PyTuple_GET_SIZE(by_position); i++) {
        plain = plain_worker(PyTuple_GET_ITEM(by_position, i), 0);
    }
    Py_SETREF(m->by_position, Py_NewRef(by_position));
    Py_XSETREF(m->answer, (PyTypeObject *)Py_NewRef(Py_TYPE(usual)));
    Py_XSETREF(m->fields, fields);
    m->plain_workers = plain;
    Py_RETURN_NONE;
}

static int
Matcher_traverse(Matcher *m, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(m)); /* a heap type's instance holds its type */
    Py_VISIT(m->table);
    Py_VISIT(m->by_position);
    Py_VISIT(m->answer);
    Py_VISIT(m->fields);
    Py_VISIT(m->no_args);
    return 0;
}

static int
Matcher_clear(Matcher *m)
{
    Py_CLEAR(m->table);
    Py_CLEAR(m->by_position);
    Py_CLEAR(m->answer);
    Py_CLEAR(m->fields);
    Py_CLEAR(m->no_args);
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
    {"set_answer", (PyCFunction)Matcher_set_answer, METH_VARARGS,
     "set_answer(by_position, usual): the workers, or what every answer starts as, changed."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Matcher_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(Matcher, vectorcall), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyType_Slot Matcher_slots[] = {
    {Py_tp_doc, "The usual PrefixIndex.match in one call: matcher(key, tokens) -> Match | None."},
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
