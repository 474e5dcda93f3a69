/* What the module keeps, in its state (PEP 489's multi-phase init, PEP 573's module state):
its three types, made from specs as heap types, and the objects its loops use, made once so
that no loop makes them: the interned names of an event's fields (plain_run reads each event's
eleven), and each step kind's int (read_plain packs one into every step it makes, with
PyTuple_Pack: Py_BuildValue would parse its format string for every tuple).
Nothing here is a global: two interpreters, or the module imported again, each have their own.
*/

/* The fields plain_run reads of a stored event, as State.name indexes them. */
enum { MEDIUM, GROUP, EXTRA, MEDIA, LOOKAHEAD, PARENT, HASHES, TOKENS, SIZE, LORA, SALT, NAMES };

/* The kinds of step read_plain makes, as read_batch.STORED, REMOVED and CLEARED number them. */
enum { STEP_STORED, STEP_REMOVED, STEP_CLEARED, STEPS };

typedef struct {
    PyTypeObject *key_table;
    PyTypeObject *block_map;
    PyTypeObject *matcher;
    PyObject *name[NAMES];
    PyObject *step[STEPS];
} State;

static inline State *
state_of(PyObject *module)
{
    return (State *)PyModule_GetState(module);
}

/* Heap types that, like the static types they replace, take no new attributes. */
#ifdef Py_TPFLAGS_IMMUTABLETYPE
#define TYPE_IMMUTABLE Py_TPFLAGS_IMMUTABLETYPE
#else
#define TYPE_IMMUTABLE 0
#endif
