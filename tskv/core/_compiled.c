/* The prefix index's hot path, compiled: its keys, its walk and its table of holders.

A block's key is Python's hash((parent_key, content)), content the tuple of its token ids.
Hashing it in Python makes two tuples a block and runs a loop of bytecode; here the tuple hash
is computed from its items' hashes without making the tuples, by CPython's own algorithm for
tuples. Nothing here decides anything the pure-Python modules do not: tskv/core/compiled.py
checks this module against Python's hash() when it is imported, and the index falls back to
the pure path if the two ever differ (a future CPython changing its tuple hash, say).

One rule holds everywhere: no Python code runs inside a loop here. The loops read exact ints
(and bytes where keys come packed); anything else (an int subclass, a string, an object with
its own __hash__ or __eq__) is declined before the loop begins, and the pure path answers it,
where such code runs as Python runs it. Where an entry must still call into Python (a dict
beside the slots, holding what no slot can), it holds every reference it needs across the
call and checks afterwards whether what it was reading moved.

Each concern is a header of _compiled_lib/, included here in the order they build on:
  state.h        what the module keeps: its types, the names and ints its loops use
  tuple_hash.h   CPython's tuple hash without the tuples, and a block's key from its parent's
  slot_table.h   the open-addressed slots KeyTable and BlockMap share: probing, prefetch,
                 huge pages, growth
  key_table.h    KeyTable: content key -> mask of the workers holding it, and a reader's
                 packed runs of keys (pack_keys, mirror)
  block_map.h    BlockMap: a worker's blocks, engine hash -> content key
  walk.h         walk(), chain(): a request's keys and the masks of its holders
  matcher.h      Matcher: PrefixIndex.match's usual query whole
  run_keys.h     plain_run(), read_run(): the keys of a run of stored events
  plain_wire.h   the msgpack bytes of a plain TokenSpeed-wire batch, parsed into C values
  plain_batch.h  read_plain(): those values made into the steps the index files
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* Python.h includes it from 3.11 on */
#endif
#include <structmember.h> /* T_PYSSIZET: the Matcher's vectorcall offset */
#include <assert.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "_compiled_lib/state.h"
#include "_compiled_lib/tuple_hash.h"
#include "_compiled_lib/slot_table.h"
#include "_compiled_lib/key_table.h"
#include "_compiled_lib/block_map.h"
#include "_compiled_lib/walk.h"
#include "_compiled_lib/matcher.h"
#include "_compiled_lib/run_keys.h"
#include "_compiled_lib/plain_wire.h"
#include "_compiled_lib/plain_batch.h"

static PyMethodDef methods[] = {
    {"pack_keys", pack_keys, METH_O,
     "pack_keys(keys) -> bytes: array('q', keys).tobytes(), compiled."},
    {"chain", chain, METH_VARARGS,
     "chain(key, blocks) -> list | None: block_keys.chain, compiled."},
    {"walk", walk, METH_VARARGS,
     "walk(real, predicted, key, tokens, size, keys_out) -> (changes, blocks) | None."},
    {"plain_run", plain_run, METH_VARARGS,
     "plain_run(run, size, blocks, roots, event_type) -> (ids, keys, mismatched) | None: "
     "filing's keys."},
    {"read_plain", read_plain, METH_VARARGS,
     "read_plain(payload, size) -> (ts, rank, steps) | None: a plain batch, read and hashed."},
    {"read_run", read_run, METH_VARARGS,
     "read_run(run, size, blocks, root) -> (ids, keys, mismatched, orphans) | None: steps' "
     "keys."},
    {NULL, NULL, 0, NULL},
};

static const char *const NAME_TEXT[NAMES] = {
    "medium", "group_idx", "extra_keys", "mm_keys", "lookahead_token_ids", "parent_block_hash",
    "block_hashes", "token_ids", "block_size", "lora_name", "cache_salt",
};

/* A type of this module's, made from its spec and added to it; -1 with an exception set. */
static int
add_type(PyObject *module, PyType_Spec *spec, PyTypeObject **into)
{
    *into = (PyTypeObject *)PyType_FromModuleAndSpec(module, spec, NULL);
    return *into == NULL ? -1 : PyModule_AddType(module, *into);
}

/* Multi-phase init (PEP 489): the module object exists, its state zeroed; fill it in. */
static int
module_exec(PyObject *module)
{
    State *state = state_of(module);
    if (add_type(module, &KeyTable_spec, &state->key_table) < 0 ||
        add_type(module, &BlockMap_spec, &state->block_map) < 0 ||
        add_type(module, &Matcher_spec, &state->matcher) < 0) {
        return -1;
    }
    for (int f = 0; f < NAMES; f++) {
        if ((state->name[f] = PyUnicode_InternFromString(NAME_TEXT[f])) == NULL) {
            return -1;
        }
    }
    for (int kind = 0; kind < STEPS; kind++) {
        if ((state->step[kind] = PyLong_FromLong(kind)) == NULL) {
            return -1;
        }
    }
    return 0;
}

static int
module_traverse(PyObject *module, visitproc visit, void *arg)
{
    State *state = state_of(module);
    Py_VISIT(state->key_table);
    Py_VISIT(state->block_map);
    Py_VISIT(state->matcher);
    for (int f = 0; f < NAMES; f++) {
        Py_VISIT(state->name[f]);
    }
    for (int kind = 0; kind < STEPS; kind++) {
        Py_VISIT(state->step[kind]);
    }
    return 0;
}

static int
module_clear(PyObject *module)
{
    State *state = state_of(module);
    Py_CLEAR(state->key_table);
    Py_CLEAR(state->block_map);
    Py_CLEAR(state->matcher);
    for (int f = 0; f < NAMES; f++) {
        Py_CLEAR(state->name[f]);
    }
    for (int kind = 0; kind < STEPS; kind++) {
        Py_CLEAR(state->step[kind]);
    }
    return 0;
}

static void
module_free(void *module)
{
    (void)module_clear((PyObject *)module);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tskv.core._compiled",
    .m_doc = "The prefix index's hot path, compiled (see tskv/core/compiled.py).",
    .m_size = sizeof(State),
    .m_methods = methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__compiled(void)
{
    return PyModuleDef_Init(&module_def);
}
