/* The prefix index's hot path, compiled: its keys, its walk and its table of holders.

A block's key is Python's hash((parent_key, content)), content the tuple of its token ids.
Hashing it in Python makes two tuples a block and runs a loop of bytecode; here the tuple hash
is computed from its items' hashes without making the tuples, by CPython's own algorithm for
tuples (xxHash's rounds over the items' hashes, Objects/tupleobject.c since 3.8). Nothing here
decides anything the pure-Python modules do not: tskv/core/compiled.py checks this module
against Python's hash() when it is imported, and the index falls back to the pure path if the
two ever differ (a future CPython changing its tuple hash, say).

What it holds:
  chain(key, blocks): block_keys.chain, the keys of consecutive contents under `key`.
  plain_run(run, size, blocks, root_key): filing's keys for a run of plain stored events,
    straight from their token ids: no tuple a block, no Python call an event.
  walk(real, predicted, key, tokens, size, keys_out): the match's walk down a request's
    blocks, the masks of the workers holding each, until no worker holds one.
  Matcher: PrefixIndex.match's usual query whole (walk, counts and answer) in one call.
  KeyTable: the holders map (content key -> bit mask of the workers holding it) as a dict of
    ints would be, in 16 bytes a slot: a Python dict of 3.2M int keys and masks costs about
    100 bytes a key and three cache misses a lookup (the table, the entry, the key object);
    this costs one. Masks past 64 workers keep their high bits in a dict beside it.
  BlockMap: a worker's blocks (engine hash -> content key) in the same slots, what no slot
    can hold (a tiered block's tuple, an orphan's None) in a dict beside them.
  pack_keys(keys): a reader's run of keys as 8-byte integers, as its report carries them
    (KeyTable.mirror reads them so).
  read_plain(payload, size), read_run(run, size, blocks, root): a plain TokenSpeed-wire batch
    read from its msgpack bytes, each stored block as the hash of its contents, and a run of
    them keyed: a watcher's batches filed with no event object and no token id int made.
*/
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#if PY_VERSION_HEX < 0x030B0000
#include <longintrepr.h> /* Python.h includes it from 3.11 on */
#endif
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#if SIZEOF_PY_UHASH_T > 4
#define XXPRIME_1 ((Py_uhash_t)11400714785074694791ULL)
#define XXPRIME_2 ((Py_uhash_t)14029467366897019727ULL)
#define XXPRIME_5 ((Py_uhash_t)2870177450012600261ULL)
#define XXROTATE(x) ((x << 31) | (x >> 33))
#else
#define XXPRIME_1 ((Py_uhash_t)2654435761UL)
#define XXPRIME_2 ((Py_uhash_t)2246822519UL)
#define XXPRIME_5 ((Py_uhash_t)374761393UL)
#define XXROTATE(x) ((x << 13) | (x >> 19))
#endif

static inline Py_uhash_t
tuple_round(Py_uhash_t acc, Py_uhash_t item_hash)
{
    acc += item_hash * XXPRIME_2;
    acc = XXROTATE(acc);
    return acc * XXPRIME_1;
}

static inline Py_hash_t
tuple_end(Py_uhash_t acc, Py_ssize_t length)
{
    acc += (Py_uhash_t)length ^ (XXPRIME_5 ^ 3527539UL);
    return acc == (Py_uhash_t)-1 ? 1546275796 : (Py_hash_t)acc;
}

/* hash((parent, content)), given hash(parent) and hash(content): the pair's tuple hash. */
static inline Py_hash_t
pair_hash(Py_hash_t parent_hash, Py_hash_t content_hash)
{
    Py_uhash_t acc = tuple_round(XXPRIME_5, (Py_uhash_t)parent_hash);
    return tuple_end(tuple_round(acc, (Py_uhash_t)content_hash), 2);
}

/* The items of a list or a tuple that a loop reads where they lie (PySequence_Fast's): the
   block ids a BlockMap pops or stores. An id that is not an exact int goes to the dict beside
   the slots, whose lookup may run its __hash__ or __eq__, which may change the list meanwhile,
   and its items then move: the loop asks after each such call and stops with an error where
   they did, instead of reading freed memory. Token ids never need this: the walks decline any
   that is not an exact int (int_hash_of), so nothing runs while they are read. */
typedef struct {
    PyObject *sequence;
    PyObject **items; /* where its items were */
    Py_ssize_t size;  /* and how many */
} Items;

/* Whether `items` moved, with an exception set if so. */
static int
items_moved(const Items *items)
{
    PyObject *list = items->sequence;
    if (!PyList_Check(list) || (((PyListObject *)list)->ob_item == items->items &&
                                PyList_GET_SIZE(list) >= items->size)) {
        return 0;
    }
    PyErr_SetString(PyExc_RuntimeError,
                    "a list changed while it was read: one of its items' own __hash__ or __eq__ "
                    "changed it (the block ids of a removal or a store)");
    return 1;
}

/* hash(item) for an exact int, without the two calls PyObject_Hash makes: an int below 2**30
   in magnitude (one digit, as every token id is) is its own hash, -1 made -2 (long_hash in
   Objects/longobject.c); a larger one asks long_hash, which is C and cannot fail. Anything
   else, an int subclass included, is declined (-1, no exception set): its hash may be Python
   code, which may change what the caller is reading, so the caller hands the whole request to
   the pure path, which runs such code as Python does. */
static inline Py_hash_t
int_hash_of(PyObject *item)
{
    if (!PyLong_CheckExact(item)) {
        return -1;
    }
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)item)) {
        Py_ssize_t value = PyUnstable_Long_CompactValue((PyLongObject *)item);
        return value == -1 ? -2 : (Py_hash_t)value;
    }
#else
    Py_ssize_t digits = Py_SIZE(item);
    if (digits == 0 || digits == 1) {
        return digits ? (Py_hash_t)((PyLongObject *)item)->ob_digit[0] : 0;
    }
#endif
    return PyObject_Hash(item);
}

/* hash(tuple(items[0:size])) without the tuple, for exact ints; -1 (no exception set) where
   an item is anything else (int_hash_of). */
static Py_hash_t
items_hash(PyObject *const *items, Py_ssize_t size)
{
    Py_uhash_t acc = XXPRIME_5;
    for (Py_ssize_t i = 0; i < size; i++) {
        Py_hash_t item_hash = int_hash_of(items[i]);
        if (item_hash == -1) {
            return -1;
        }
        acc = tuple_round(acc, (Py_uhash_t)item_hash);
    }
    return tuple_end(acc, size);
}

#define CONTENT_DEPTH 8 /* tuples within tuples a block's content may nest, at most */

/* hash(content) for a block's content as block_keys makes it: an exact int, or an exact tuple
   of such contents (its token ids, with its identity made `stable`); -1 (no exception set)
   for anything else, or nested deeper than CONTENT_DEPTH: declined, as int_hash_of. */
static Py_hash_t
content_hash_of(PyObject *content, int depth)
{
    if (!PyTuple_CheckExact(content)) {
        return int_hash_of(content);
    }
    if (depth >= CONTENT_DEPTH) {
        return -1;
    }
    Py_uhash_t acc = XXPRIME_5;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(content); i++) {
        Py_hash_t item_hash = content_hash_of(PyTuple_GET_ITEM(content, i), depth + 1);
        if (item_hash == -1) {
            return -1;
        }
        acc = tuple_round(acc, (Py_uhash_t)item_hash);
    }
    return tuple_end(acc, PyTuple_GET_SIZE(content));
}

/* Python's hash of an int within 64 bits (Python/pyhash.c, Objects/longobject.c): its value
   modulo 2**61 - 1 (2**31 - 1 on 32-bit builds), with the int's sign, and -1 made -2. */
static inline Py_hash_t
int_hash(int64_t value)
{
    const uint64_t modulus = ((uint64_t)1 << _PyHASH_BITS) - 1;
    uint64_t magnitude = value < 0 ? (uint64_t)0 - (uint64_t)value : (uint64_t)value;
    uint64_t reduced = magnitude % modulus;
    Py_hash_t hash = value < 0 ? -(Py_hash_t)reduced : (Py_hash_t)reduced;
    return hash == -1 ? -2 : hash;
}

/* The key of block `block` of `size` token ids under the parent whose hash is *parent_hash,
   into *key; *parent_hash becomes the key's own hash, for the block after it. -1 (no
   exception set) where a token id is not an exact int. */
static inline int
next_key(Py_hash_t *parent_hash, PyObject *const *tokens, Py_ssize_t block, Py_ssize_t size,
         Py_hash_t *key)
{
    Py_hash_t content_hash = items_hash(tokens + block * size, size);
    if (content_hash == -1) {
        return -1;
    }
    *key = pair_hash(*parent_hash, content_hash);
    *parent_hash = int_hash(*key);
    return 0;
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

/* ---- KeyTable: content key -> mask of holders, open addressing with linear probing ---- */

#define EMPTY ((int64_t)-1) /* hash() never gives -1, so no key is ever this */

typedef struct {
    int64_t key;
    uint64_t mask; /* the low 64 bits of the workers' mask */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    size_t capacity; /* slots, below 1 << 32; 0 before the first key */
    Py_ssize_t used;
    PyObject *high; /* key -> mask >> 64 where that is not 0 (a dict, made when first needed) */
} KeyTable;

static PyTypeObject KeyTableType;
static PyObject *ZERO; /* the int 0, made once */

static inline size_t
home_of(int64_t key, size_t capacity)
{
    /* MurmurHash3's 64-bit finalizer rounds: an engine's hashes may be anything (counters, or
       n times a constant), and one multiply left such keys in clusters */
    uint64_t mixed = (uint64_t)key;
    mixed ^= mixed >> 33;
    mixed *= 0xFF51AFD7ED558CCDULL;
    mixed ^= mixed >> 33;
    /* the high 32 bits scaled to [0, capacity): any capacity, not only a power of two */
    return (size_t)(((mixed >> 32) * (uint64_t)capacity) >> 32);
}

static inline size_t
next_slot(size_t i, size_t capacity)
{
    return i + 1 == capacity ? 0 : i + 1;
}

#if defined(__GNUC__) || defined(__clang__)
/* The empty asm takes the address as an input, so a loop that only prefetches has an effect the
   compiler must keep: GCC 12 at -O3 removed such loops whole (fetch_ahead's first keys of a
   batch), and a 40-key batch of new keys took 112-116 ns a key to store instead of 58-66. */
#define PREFETCH(address)                                                                      \
    do {                                                                                       \
        __builtin_prefetch(address);                                                           \
        __asm__ __volatile__("" : : "r"(address));                                             \
    } while (0)
#define LOWEST_BIT(mask) ((Py_ssize_t)__builtin_ctzll(mask))
#else
#define PREFETCH(address) ((void)(address))
static inline Py_ssize_t
LOWEST_BIT(uint64_t mask) /* the index of the lowest set bit of a mask that has one */
{
    Py_ssize_t bit = 0;
    for (; !(mask & 1); mask >>= 1) {
        bit++;
    }
    return bit;
}
#endif

#define FETCH_AHEAD 16 /* keys of a batch whose slots are fetched before the one looked up */

/* Ask the CPU to fetch the slots a lookup of `bits` (a key, or an id: the same bits) will read
   into its cache: its home slot's line and the next, and for a key about to be let go of
   (`removing`) the one after. At millions of keys every lookup is a cache miss, and a batch's
   misses, asked for a few keys ahead, overlap instead of each waiting for the one before
   (walk_table does the same with its keys). A key the table lacks is looked for until an empty
   slot, about three slots on at a table's usual fill, so in the next line about half the
   time; letting go of a key moves back the keys after it in its run (remove_at), further on.
   Each line not asked for was a miss waited for: over 3.2M keys, a key stored took 60 ns and
   one let go of 99 with the home line alone (and the next for a removal whose home lies in the
   second half of its line), 45 and 68 so. A hint only: a value no slot holds (not an int,
   past 64 bits) fetches useless lines. */
static inline void
fetch_key(const KeyTable *t, int64_t bits, int removing)
{
    if (t->capacity) {
        const Slot *home = &t->slots[home_of(bits, t->capacity)];
        const Slot *end = t->slots + t->capacity;
        PREFETCH(home);
        if (home + 4 < end) {
            PREFETCH(home + 4);
        }
        if (removing && home + 8 < end) {
            PREFETCH(home + 8);
        }
    }
}

static inline void
fetch_home(const KeyTable *t, PyObject *obj, int removing)
{
    if (PyLong_Check(obj)) {
        fetch_key(t, (int64_t)PyLong_AsUnsignedLongLongMask(obj), removing); /* no error */
    }
}

/* Called before looking up items[n] of a batch: at the first, asks for the first FETCH_AHEAD
   slots; at each, for the slot FETCH_AHEAD further on, so that many stay in flight.
   `removing`: the keys found are taken out of the table. */
static inline void
fetch_ahead(const KeyTable *t, PyObject *const *items, Py_ssize_t count, Py_ssize_t n,
            int removing)
{
    for (Py_ssize_t k = 0; n == 0 && k < count && k < FETCH_AHEAD; k++) {
        fetch_home(t, items[k], removing);
    }
    if (n + FETCH_AHEAD < count) {
        fetch_home(t, items[n + FETCH_AHEAD], removing);
    }
}

/* fetch_ahead for keys already made C integers; `removing`: the keys are being let go of. */
static inline void
fetch_keys_ahead(const KeyTable *t, const int64_t *keys, Py_ssize_t count, Py_ssize_t n,
                 int removing)
{
    for (Py_ssize_t k = 0; n == 0 && k < count && k < FETCH_AHEAD; k++) {
        fetch_key(t, keys[k], removing);
    }
    if (n + FETCH_AHEAD < count) {
        fetch_key(t, keys[n + FETCH_AHEAD], removing);
    }
}

/* The slot holding `key`, or the empty slot where it would go (the table is never full). */
static inline size_t
find(const KeyTable *t, int64_t key)
{
    size_t i = home_of(key, t->capacity);
    while (t->slots[i].key != EMPTY && t->slots[i].key != key) {
        i = next_slot(i, t->capacity);
    }
    return i;
}

#define HUGE_PAGE ((size_t)2 << 20)

/* Whether slots for `capacity` are a table of their own on 2 MB pages (slots_new). */
static inline int
on_huge_pages(size_t capacity)
{
#if defined(MADV_HUGEPAGE)
    return capacity * sizeof(Slot) >= HUGE_PAGE;
#else
    (void)capacity;
    return 0;
#endif
}

/* Memory for `capacity` slots. A table of millions of keys asks the OS for 2 MB pages (a hint
   it may refuse): on 4 KB pages a random slot is also a miss in the CPU's table of pages, and
   at 50 MB that walk costs as much as the slot's own miss; the small tables stay with Python's
   allocator. Freed by slots_free with the same capacity. tracemalloc is told of both, so that
   what it counts (the bench's memory figures) is the same either way. */
static Slot *
slots_new(size_t capacity)
{
#if defined(MADV_HUGEPAGE)
    if (on_huge_pages(capacity)) {
        size_t bytes = (capacity * sizeof(Slot) + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
        void *memory = NULL;
        if (posix_memalign(&memory, HUGE_PAGE, bytes) != 0) {
            return NULL;
        }
        (void)madvise(memory, bytes, MADV_HUGEPAGE);
        (void)PyTraceMalloc_Track(0, (uintptr_t)memory, bytes); /* -2 when it is not tracing */
        return memory;
    }
#endif
    return PyMem_Malloc(capacity * sizeof(Slot));
}

static void
slots_free(Slot *slots, size_t capacity)
{
    if (on_huge_pages(capacity)) {
        (void)PyTraceMalloc_Untrack(0, (uintptr_t)slots);
        free(slots);
    } else {
        PyMem_Free(slots);
    }
}

static int
resize(KeyTable *t, size_t capacity)
{
    Slot *slots = slots_new(capacity);
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memset(slots, 0xFF, capacity * sizeof(Slot)); /* every key EMPTY */
    Slot *old = t->slots;
    size_t old_capacity = t->capacity;
    t->slots = slots;
    t->capacity = capacity;
    for (size_t i = 0; i < old_capacity; i++) {
        if (old[i].key != EMPTY) {
            t->slots[find(t, old[i].key)] = old[i];
        }
    }
    slots_free(old, old_capacity);
    return 0;
}

/* Room for one more key. At most 4 slots in 5 used keeps a probe within a few cache lines;
   growing by half (not doubling) keeps a grown table at least 8 in 15 full, so a key costs
   20-30 bytes, where doubling at 7 in 10 left 3.2M keys at 38% (42 bytes a key). */
static inline int
make_room(KeyTable *t)
{
    if ((size_t)(t->used + 1) * 5 <= t->capacity * 4) {
        return 0;
    }
    size_t capacity = t->capacity ? t->capacity + t->capacity / 2 : 64;
    if ((uint64_t)capacity >= (uint64_t)1 << 32) { /* home_of scales 32 bits */
        PyErr_SetString(PyExc_MemoryError, "a table of over 3 billion keys");
        return -1;
    }
    return resize(t, capacity);
}

/* Empty slot `i`, moving back each later key of its run that would no longer be found. */
static void
remove_at(KeyTable *t, size_t i)
{
    size_t j = i;
    for (;;) {
        j = next_slot(j, t->capacity);
        if (t->slots[j].key == EMPTY) {
            break;
        }
        size_t home = home_of(t->slots[j].key, t->capacity);
        /* the key at j may move to i unless its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].key = EMPTY;
    t->used--;
}

/* Whether an int surely fits in `bits` bits, its sign apart, and is not negative unless
   `negative_ok`: then PyLong_AsUnsignedLongLongMask reads it exactly, a loop of three shifts
   for a hash-sized int, where PyLong_AsUnsignedLongLong converts it through the generic
   _PyLong_AsByteArray (230 instructions) and PyLong_AsLongLongAndOverflow digit by digit with
   checks. 0 also where it cannot tell (a CPython whose private calls may differ): ask the API. */
static inline int
fits_in(PyObject *obj, int64_t bits, int negative_ok)
{
#if PY_VERSION_HEX < 0x030E0000
    int64_t width = (int64_t)_PyLong_NumBits(obj);
    if (width < 0) {
        PyErr_Clear(); /* past 2**63 bits: the API says what it is */
        return 0;
    }
    return width <= bits && (negative_ok || _PyLong_Sign(obj) >= 0);
#else
    (void)obj, (void)bits, (void)negative_ok;
    return 0;
#endif
}

/* 1 and the key in *out if `obj` is an int a key can be; 0 if it cannot (any other value, or
   -1); -1 with an exception set on an error. */
static int
key_of(PyObject *obj, int64_t *out)
{
    if (!PyLong_Check(obj)) {
        return 0;
    }
    if (fits_in(obj, 63, 1)) { /* within int64 either sign: the mask is its two's complement */
        *out = (int64_t)PyLong_AsUnsignedLongLongMask(obj);
        return *out != -1;
    }
    int overflow;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || value == -1) {
        return 0;
    }
    *out = (int64_t)value;
    return 1;
}

/* Whether `obj` is the int -1, holdings.ABSENT: what a block that held nothing is let go as. */
static int
is_absent(PyObject *obj)
{
    if (!PyLong_Check(obj)) {
        return 0;
    }
    int overflow;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return !overflow && value == -1;
}

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
    PyObject *low = PyLong_FromUnsignedLongLong(t->slots[i].mask);
    if (low == NULL || t->high == NULL) {
        return low;
    }
    PyObject *key = PyLong_FromLongLong(t->slots[i].key);
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
    if (!PyLong_Check(value)) {
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
        int negative = PyObject_RichCompareBool(value, ZERO, Py_LT);
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
    int failed = t->capacity == 0 && make_room(t) < 0;
    if (!failed && t->slots[i = find(t, key)].key == EMPTY) {
        failed = make_room(t) < 0;
        i = failed ? 0 : find(t, key);
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
    if (t->slots[i].key == EMPTY) {
        t->slots[i].key = key;
        t->used++;
    }
    t->slots[i].mask = low;
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
        found = t->capacity != 0 && t->slots[i = find(t, key)].key != EMPTY;
    }
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, key_obj);
        return -1;
    }
    remove_at(t, i);
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
    if (t->capacity == 0) {
        return -1;
    }
    size_t i = find(t, key);
    return t->slots[i].key == EMPTY ? -1 : (Py_ssize_t)i;
}

/* KeyTable() and BlockMap(): both empty, both the same struct. */
static PyObject *
table_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if ((kwargs != NULL && PyDict_GET_SIZE(kwargs)) || PyTuple_GET_SIZE(args)) {
        return PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
    }
    KeyTable *t = (KeyTable *)type->tp_alloc(type, 0);
    if (t != NULL) {
        t->slots = NULL;
        t->capacity = 0;
        t->used = 0;
        t->high = NULL;
    }
    return (PyObject *)t;
}

static void
KeyTable_dealloc(KeyTable *t)
{
    slots_free(t->slots, t->capacity);
    Py_XDECREF(t->high);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t
KeyTable_length(KeyTable *t)
{
    return t->used;
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
    for (size_t i = 0; items != NULL && i < t->capacity; i++) {
        if (t->slots[i].key == EMPTY) {
            continue;
        }
        PyObject *mask = mask_at(t, i);
        PyObject *item = mask == NULL ? NULL : Py_BuildValue("(LN)", (long long)t->slots[i].key, mask);
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(items);
            break;
        }
        Py_DECREF(item);
    }
    return items;
}

/* An iterator over `items` (a new reference, taken), or NULL if it is NULL. */
static PyObject *
iterate(PyObject *items)
{
    if (items == NULL) {
        return NULL;
    }
    PyObject *iterator = PyObject_GetIter(items);
    Py_DECREF(items);
    return iterator;
}

static PyObject *
KeyTable_iter(KeyTable *t)
{
    PyObject *keys = PyList_New(0);
    for (size_t i = 0; keys != NULL && i < t->capacity; i++) {
        if (t->slots[i].key == EMPTY) {
            continue;
        }
        PyObject *key = PyLong_FromLongLong(t->slots[i].key);
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

/* Whether none of `other`'s items is in the table, as `contains` says. */
static PyObject *
disjoint(KeyTable *t, PyObject *other, int (*contains)(KeyTable *, PyObject *))
{
    PyObject *fast = PySequence_Fast(other, "isdisjoint takes an iterable");
    if (fast == NULL) {
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Items held = {fast, items, count};
    for (Py_ssize_t n = 0; n < count; n++) {
        fetch_ahead(t, items, count, n, 0);
        PyObject *item = Py_NewRef(items[n]); /* held: its __eq__ may drop it */
        int present = contains(t, item);
        Py_DECREF(item);
        present = present == 0 && items_moved(&held) ? -1 : present;
        if (present) {
            Py_DECREF(fast);
            return present < 0 ? NULL : Py_NewRef(Py_False);
        }
    }
    Py_DECREF(fast);
    return Py_NewRef(Py_True);
}

static PyObject *
KeyTable_isdisjoint(KeyTable *t, PyObject *other)
{
    return disjoint(t, other, KeyTable_contains);
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
    slots_free(t->slots, t->capacity);
    t->slots = NULL;
    t->capacity = 0;
    t->used = 0;
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
        fetch_keys_ahead(t, keys, count, n, letting_go);
        int64_t key = keys[n];
        if (key == EMPTY) {
            if (letting_go) {
                continue; /* it held nothing: as Holdings.release skips it */
            }
            PyErr_SetString(PyExc_TypeError, "KeyTable: a key is an int from hash(), never -1");
            return -1;
        }
        if (!letting_go) {
            if (make_room(t) < 0) {
                return -1;
            }
            size_t i = find(t, key);
            if (t->slots[i].key == EMPTY) {
                t->slots[i].key = key;
                t->slots[i].mask = 0;
                t->used++;
            }
            int again = (t->slots[i].mask & bit) != 0;
            t->slots[i].mask |= bit;
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
        size_t i = t->capacity ? find(t, key) : 0;
        if (t->capacity == 0 || t->slots[i].key == EMPTY) {
            PyObject *missing = PyLong_FromLongLong(key);
            if (missing != NULL) {
                PyErr_SetObject(PyExc_KeyError, missing);
                Py_DECREF(missing);
            }
            return -1;
        }
        t->slots[i].mask &= ~bit;
        if (t->slots[i].mask == 0) {
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
                remove_at(t, i);
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
    while (i < t->capacity) {
        Slot *slot = &t->slots[i];
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
            remove_at(t, i);
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
        fetch_ahead(t, items, count, n, 1);
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
        t->slots[i].mask &= ~(uint64_t)bit;
        if (t->slots[i].mask == 0) {
            remove_at(t, (size_t)i);
        }
        let_go++;
    }
    Py_DECREF(fast);
    return PyLong_FromSsize_t(let_go);
}

/* add_new's work on keys made C integers: when none of `keys` is in the table nor twice in
   `keys`, each is stored with its value (values[n], or `value` for every key when values is
   NULL) and 1 returned; else 0, the table as it was; -1 with MemoryError set, as it was too. */
static int
store_new(KeyTable *t, const int64_t *keys, Py_ssize_t count, const int64_t *values,
          uint64_t value)
{
    Py_ssize_t stored = 0;
    int result = 1;
    for (; stored < count; stored++) {
        fetch_keys_ahead(t, keys, count, stored, 0);
        if (make_room(t) < 0) {
            result = -1;
            break;
        }
        size_t i = find(t, keys[stored]);
        if (t->slots[i].key != EMPTY) { /* held, or twice in `keys`: what was stored goes */
            result = 0;
            break;
        }
        t->slots[i].key = keys[stored];
        t->slots[i].mask = values == NULL ? value : (uint64_t)values[stored];
        t->used++;
    }
    if (result != 1) {
        for (Py_ssize_t n = 0; n < stored; n++) {
            remove_at(t, find(t, keys[n]));
        }
    }
    return result;
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
    int added = keys == NULL ? -1 : store_new(t, keys, count, NULL, mask);
    PyMem_Free(keys);
    Py_DECREF(fast);
    return added < 0 ? NULL : PyBool_FromLong(added);
}

static PyObject *
KeyTable_sizeof(KeyTable *t, PyObject *unused)
{
    return PyLong_FromSize_t(sizeof(KeyTable) + t->capacity * sizeof(Slot));
}

static PyMappingMethods KeyTable_as_mapping = {
    (lenfunc)KeyTable_length,
    (binaryfunc)KeyTable_subscript,
    (objobjargproc)KeyTable_ass_subscript,
};

static PySequenceMethods KeyTable_as_sequence = {
    .sq_contains = (objobjproc)KeyTable_contains,
};

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

static PyTypeObject KeyTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tskv.core._compiled.KeyTable",
    .tp_doc = "Content key -> mask of the workers holding it, as a dict of ints, compactly.",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = table_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_mapping = &KeyTable_as_mapping,
    .tp_as_sequence = &KeyTable_as_sequence,
    .tp_iter = (getiterfunc)KeyTable_iter,
    .tp_methods = KeyTable_methods,
};

/* ---- BlockMap: a worker's blocks, engine hash -> content key, as a dict would keep them ----

The usual entry, an engine hash within 0..2**64 - 2 and a key from hash() (never -1), is a
16-byte slot of the same table KeyTable uses (the hash's bits as its key, the key's bits as its
mask); anything else (a tiered block's tuple, a negative hash, a None key: an orphan) goes in a
dict beside it (`other`). An id is in one place or the other, never both. Iteration follows the
slots, not the order of insertion: nothing the index does with a worker's blocks depends on it.
*/

static PyTypeObject BlockMapType;

/* 1 and the id's bits if `obj` is an int a slot can hold; 0 if not; -1 on an error. */
static int
id_of(PyObject *obj, int64_t *out)
{
    if (!PyLong_Check(obj)) {
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

/* The slot of `id`, or -1 for none. */
static inline Py_ssize_t
slot_of_id(const KeyTable *t, int64_t id)
{
    if (t->capacity == 0) {
        return -1;
    }
    size_t i = find(t, id);
    return t->slots[i].key == EMPTY ? -1 : (Py_ssize_t)i;
}

/* The value of `key` (a new reference), or NULL: with KeyError set when missing and `missing`
   is NULL, else `missing` itself (a new reference). */
static PyObject *
block_get(KeyTable *t, PyObject *key, PyObject *missing)
{
    int64_t id;
    int fits = id_of(key, &id);
    if (fits < 0) {
        return NULL;
    }
    if (fits) {
        Py_ssize_t i = slot_of_id(t, id);
        if (i >= 0) {
            return PyLong_FromLongLong((long long)t->slots[i].mask);
        }
    }
    if (t->high != NULL) {
        PyObject *high = Py_NewRef(t->high); /* held: the lookup may run an id's __eq__ */
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
other_delete(KeyTable *t, PyObject *key, int must)
{
    if (t->high == NULL) {
        if (must) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        return 0;
    }
    PyObject *high = Py_NewRef(t->high); /* held: the lookup may run an id's __eq__ */
    int deleted = PyDict_DelItem(high, key);
    Py_DECREF(high);
    if (deleted == 0) {
        drop_if_empty(t);
        return 0;
    }
    if (!must && PyErr_ExceptionMatches(PyExc_KeyError)) {
        PyErr_Clear();
        return 0;
    }
    return -1;
}

static int
block_set(KeyTable *t, PyObject *key, PyObject *value)
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
        if (make_room(t) < 0) {
            return -1;
        }
        if (t->high != NULL && PyDict_GET_SIZE(t->high) && other_delete(t, key, 0) < 0) {
            return -1;
        }
        if (make_room(t) < 0) {
            return -1;
        }
        size_t i = find(t, id);
        if (t->slots[i].key == EMPTY) {
            t->slots[i].key = id;
            t->used++;
        }
        t->slots[i].mask = (uint64_t)stored;
        return 0;
    }
    if (fits) {
        Py_ssize_t i = slot_of_id(t, id);
        if (i >= 0) {
            remove_at(t, (size_t)i);
        }
    }
    if (t->high == NULL && (t->high = PyDict_New()) == NULL) {
        return -1;
    }
    PyObject *high = Py_NewRef(t->high); /* held: storing may run an id's __eq__ */
    int failed = PyDict_SetItem(high, key, value);
    Py_DECREF(high);
    return failed;
}

static int
block_delete(KeyTable *t, PyObject *key)
{
    int64_t id;
    int fits = id_of(key, &id);
    if (fits < 0) {
        return -1;
    }
    if (fits) {
        Py_ssize_t i = slot_of_id(t, id);
        if (i >= 0) {
            remove_at(t, (size_t)i);
            return 0;
        }
    }
    return other_delete(t, key, 1);
}

static Py_ssize_t
BlockMap_length(KeyTable *t)
{
    return t->used + (t->high == NULL ? 0 : PyDict_GET_SIZE(t->high));
}

static PyObject *
BlockMap_subscript(KeyTable *t, PyObject *key)
{
    return block_get(t, key, NULL);
}

static int
BlockMap_ass_subscript(KeyTable *t, PyObject *key, PyObject *value)
{
    return value == NULL ? block_delete(t, key) : block_set(t, key, value);
}

static int
BlockMap_contains(KeyTable *t, PyObject *key)
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
    if (t->high == NULL) {
        return 0;
    }
    PyObject *high = Py_NewRef(t->high); /* held: the lookup may run an id's __eq__ */
    int present = PyDict_Contains(high, key);
    Py_DECREF(high);
    return present;
}

static PyObject *
BlockMap_get(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        return PyErr_Format(PyExc_TypeError, "get expected 1 or 2 arguments, got %zd", nargs);
    }
    return block_get(t, args[0], nargs == 2 ? args[1] : Py_None);
}

static PyObject *
BlockMap_pop(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
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
BlockMap_setdefault(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
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
   id (the list comprehension made three, and a method call, per block). */
static PyObject *
BlockMap_pop_many(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "pop_many expected 2 arguments, got %zd", nargs);
    }
    PyObject *fast = PySequence_Fast(args[0], "pop_many takes a sequence of block ids");
    if (fast == NULL) {
        return NULL;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(fast);
    PyObject **ids = PySequence_Fast_ITEMS(fast);
    Items held = {fast, ids, size};
    PyObject *popped = PyList_New(size); /* its items NULL until set: safe to drop */
    for (Py_ssize_t n = 0; popped != NULL && n < size; n++) {
        int64_t id;
        fetch_ahead(t, ids, size, n, 1);
        int fits = id_of(ids[n], &id);
        Py_ssize_t i = fits > 0 ? slot_of_id(t, id) : -1;
        PyObject *value = NULL;
        if (fits < 0) {
            /* the error is set */
        } else if (i >= 0) {
            value = PyLong_FromLongLong((long long)t->slots[i].mask);
            if (value != NULL) {
                remove_at(t, (size_t)i);
            }
        } else {
            PyObject *pair[2] = {Py_NewRef(ids[n]), args[1]}; /* held: its __eq__ may drop it */
            value = BlockMap_pop(t, pair, 2); /* the other dict, or the default */
            Py_DECREF(pair[0]);
            if (value != NULL && items_moved(&held)) {
                Py_CLEAR(value);
            }
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
block_list(KeyTable *t, int part)
{
    PyObject *found = PyList_New(0);
    for (size_t i = 0; found != NULL && i < t->capacity; i++) {
        if (t->slots[i].key == EMPTY) {
            continue;
        }
        PyObject *item;
        if (part == 0) {
            item = id_object(t->slots[i].key);
        } else if (part == 1) {
            item = PyLong_FromLongLong((long long)t->slots[i].mask);
        } else {
            item = Py_BuildValue("(NL)", id_object(t->slots[i].key), (long long)t->slots[i].mask);
        }
        if (item == NULL || PyList_Append(found, item) < 0) {
            Py_XDECREF(item);
            Py_CLEAR(found);
        } else {
            Py_DECREF(item);
        }
    }
    if (found == NULL || t->high == NULL) {
        return found;
    }
    PyObject *rest = part == 0   ? PyDict_Keys(t->high)
                     : part == 1 ? PyDict_Values(t->high)
                                 : PyDict_Items(t->high);
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
BlockMap_iter(KeyTable *t)
{
    return iterate(block_list(t, 0));
}

static PyObject *
BlockMap_values(KeyTable *t, PyObject *unused)
{
    return block_list(t, 1);
}

static PyObject *
BlockMap_items(KeyTable *t, PyObject *unused)
{
    return block_list(t, 2);
}

static PyObject *
BlockMap_isdisjoint(KeyTable *t, PyObject *other)
{
    return disjoint(t, other, BlockMap_contains);
}

/* update(pairs): a dict, or any iterable of (id, value) pairs (zip(ids, keys), say). */
static PyObject *
BlockMap_update(KeyTable *t, PyObject *pairs)
{
    PyObject *source = PyDict_Check(pairs) ? PyDict_Items(pairs) : Py_NewRef(pairs);
    PyObject *iterator = source == NULL ? NULL : PyObject_GetIter(source), *pair;
    Py_XDECREF(source);
    if (iterator == NULL) {
        return NULL;
    }
    while ((pair = PyIter_Next(iterator)) != NULL) {
        int failed = !PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2;
        if (failed) {
            PyErr_Format(PyExc_TypeError, "BlockMap.update takes (id, key) pairs, not %R", pair);
        } else {
            failed = block_set(t, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1)) < 0;
        }
        Py_DECREF(pair);
        if (failed) {
            Py_DECREF(iterator);
            return NULL;
        }
    }
    Py_DECREF(iterator);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* add_new(ids, keys): filing's usual run, blocks new to the worker: when no id is in the map
   nor twice in `ids`, each stored with its key: True; else False, the map as it was. None for
   what only the map's dict beside the slots holds (an id that is not an int below 2**64 - 1,
   a key that is not an int from hash(): an orphan's None): the Python path stores those. */
static PyObject *
BlockMap_add_new(KeyTable *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        return PyErr_Format(PyExc_TypeError, "add_new expected 2 arguments, got %zd", nargs);
    }
    PyObject *ids = PySequence_Fast(args[0], "add_new takes a sequence of block ids");
    PyObject *keys = ids == NULL ? NULL : PySequence_Fast(args[1], "add_new takes keys");
    if (keys == NULL) {
        Py_XDECREF(ids);
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ids);
    Items held = {ids, PySequence_Fast_ITEMS(ids), count};
    Items held_keys = {keys, PySequence_Fast_ITEMS(keys), PySequence_Fast_GET_SIZE(keys)};
    PyObject *result = NULL;
    int64_t *bits = NULL; /* the ids' bits, then the keys' */
    if (PySequence_Fast_GET_SIZE(keys) != count) {
        PyErr_Format(PyExc_ValueError, "add_new: %zd ids and %zd keys", count,
                     PySequence_Fast_GET_SIZE(keys));
        goto done;
    }
    if ((bits = PyMem_Malloc((size_t)(count ? 2 * count : 1) * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int others = t->high != NULL && PyDict_GET_SIZE(t->high);
    for (Py_ssize_t n = 0; n < count; n++) {
        PyObject *id = PySequence_Fast_GET_ITEM(ids, n);
        int fits = id_of(id, &bits[n]);
        int holds = fits > 0 ? key_of(PySequence_Fast_GET_ITEM(keys, n), &bits[count + n]) : fits;
        if (holds <= 0) {
            result = holds < 0 ? NULL : Py_NewRef(Py_None);
            goto done;
        }
        int beside = 0;
        if (others && t->high != NULL) { /* the id and the dict held: an __eq__ may drop them */
            PyObject *high = Py_NewRef(t->high);
            Py_INCREF(id);
            beside = PyDict_Contains(high, id);
            Py_DECREF(id);
            Py_DECREF(high);
            beside = beside == 0 && (items_moved(&held) || items_moved(&held_keys)) ? -1 : beside;
        }
        if (beside) {
            result = beside < 0 ? NULL : Py_NewRef(Py_False);
            goto done;
        }
    }
    int added = store_new(t, bits, count, bits + count, 0);
    result = added < 0 ? NULL : PyBool_FromLong(added);
done:
    PyMem_Free(bits);
    Py_DECREF(ids);
    Py_DECREF(keys);
    return result;
}

static PyMappingMethods BlockMap_as_mapping = {
    (lenfunc)BlockMap_length,
    (binaryfunc)BlockMap_subscript,
    (objobjargproc)BlockMap_ass_subscript,
};

static PySequenceMethods BlockMap_as_sequence = {
    .sq_contains = (objobjproc)BlockMap_contains,
};

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
    {"keys", (PyCFunction)KeyTable_keys, METH_NOARGS, "keys(): the map, its own keys view."},
    {"values", (PyCFunction)BlockMap_values, METH_NOARGS, "values(): a list of the keys."},
    {"items", (PyCFunction)BlockMap_items, METH_NOARGS, "items(): a list of (id, key)."},
    {"isdisjoint", (PyCFunction)BlockMap_isdisjoint, METH_O,
     "isdisjoint(ids): whether none of `ids` is here."},
    {"update", (PyCFunction)BlockMap_update, METH_O, "update(pairs): store (id, key) pairs."},
    {"clear", (PyCFunction)KeyTable_clear, METH_NOARGS, "clear(): forget every block."},
    {"__sizeof__", (PyCFunction)KeyTable_sizeof, METH_NOARGS, "the table's bytes"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BlockMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tskv.core._compiled.BlockMap",
    .tp_doc = "A worker's blocks, engine hash -> content key, as a dict, compactly.",
    .tp_basicsize = sizeof(KeyTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = table_new,
    .tp_dealloc = (destructor)KeyTable_dealloc,
    .tp_as_mapping = &BlockMap_as_mapping,
    .tp_as_sequence = &BlockMap_as_sequence,
    .tp_iter = (getiterfunc)BlockMap_iter,
    .tp_methods = BlockMap_methods,
};

/* The mask of the workers holding `key`: real | predicted, 0 for none (a new reference). */
static PyObject *
holders_of(PyObject *real, PyObject *predicted, PyObject *key, PyObject *zero)
{
    PyObject *mask;
    if (Py_IS_TYPE(real, &KeyTableType)) {
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
            if (t->capacity) {
                PREFETCH(&t->slots[home_of(ahead[made], t->capacity)]);
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
            if (t->capacity) {
                size_t i = find(t, key);
                held = t->slots[i].key == EMPTY ? 0 : active & t->slots[i].mask;
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

/* ---- Matcher: the usual match, whole ----

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
moment it reads the request to the moment it calls the Match type with the counts. */

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
    PyObject *answer;      /* prefix_index.Match, called as Match(counts, stale, None, None,
                              size, known) */
    Py_ssize_t block_size;
    PyObject *size;        /* the same, an int, for the answer */
    PyObject *by_position; /* the worker of each bit (None: a free one), a tuple */
    PyObject *known;       /* every worker, a tuple */
    int plain_workers;     /* every worker hashes and compares in C (plain_worker) */
    PyObject *no_stale;    /* frozenset(): the usual answer's stale */
} Matcher;

static PyTypeObject MatcherType;

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
    PyObject *counts = found < 0 ? NULL : PyDict_New();
    if (counts != NULL && count_changes(counts, m->by_position, changes, found, blocks) < 0) {
        Py_CLEAR(counts);
    }
    if (counts == NULL) {
        return NULL;
    }
    /* the first call into Python: the counts are made, and the walk is over */
    PyObject *frozen = PySet_GET_SIZE(stale) ? PyFrozenSet_New(stale) : Py_NewRef(m->no_stale);
    PyObject *answer = NULL;
    if (frozen != NULL) {
        PyObject *made[] = {counts, frozen, Py_None, Py_None, m->size, m->known};
        answer = PyObject_Vectorcall(m->answer, made, 6, NULL);
    }
    Py_XDECREF(frozen);
    Py_DECREF(counts);
    return answer;
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
    if (!PyArg_ParseTuple(args, "O!On:Matcher", &KeyTableType, &table, &answer, &size)) {
        return NULL;
    }
    if (!PyCallable_Check(answer) || size < 1) {
        return PyErr_Format(PyExc_TypeError, "Matcher(table, answer, size): positional only, "
                            "answer callable, size at least 1");
    }
    Matcher *m = (Matcher *)type->tp_alloc(type, 0);
    if (m == NULL) {
        return NULL;
    }
    m->vectorcall = Matcher_call;
    m->table = (KeyTable *)Py_NewRef(table);
    m->answer = Py_NewRef(answer);
    m->block_size = size;
    m->by_position = PyTuple_New(0);
    m->known = PyTuple_New(0);
    m->plain_workers = 1;
    m->size = PyLong_FromSsize_t(size);
    m->no_stale = PyFrozenSet_New(NULL);
    if (!m->by_position || !m->known || !m->size || !m->no_stale) {
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
    Py_VISIT(m->table);
    Py_VISIT(m->answer);
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
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyMethodDef Matcher_methods[] = {
    {"set_workers", (PyCFunction)Matcher_set_workers, METH_VARARGS,
     "set_workers(by_position, known): the index's workers changed."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MatcherType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tskv.core._compiled.Matcher",
    .tp_doc = "The usual PrefixIndex.match in one call: matcher(key, tokens, stale) -> Match | None.",
    .tp_basicsize = sizeof(Matcher),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Matcher, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = Matcher_new,
    .tp_traverse = (traverseproc)Matcher_traverse,
    .tp_clear = (inquiry)Matcher_clear,
    .tp_dealloc = (destructor)Matcher_dealloc,
    .tp_methods = Matcher_methods,
};

/* walk(real, predicted, key, tokens, size, keys_out) -> (changes, blocks)

   Down the request's full blocks from root key `key`: `changes` lists (depth, held) each time
   the workers holding every block so far (`held`, a mask) change, the last with held 0 where
   no worker holds a block; `blocks` is the number of full blocks. Each key walked goes into
   `keys_out` when it is a list. prefix_index._leading_counts turns this into counts. */
static PyObject *
walk(PyObject *module, PyObject *args)
{
    PyObject *real, *predicted, *key, *tokens, *keys_out;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "OOOOnO:walk", &real, &predicted, &key, &tokens, &size,
                          &keys_out)) {
        return NULL;
    }
    if (!PyDict_Check(real) && !Py_IS_TYPE(real, &KeyTableType)) {
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
    if (Py_IS_TYPE(real, &KeyTableType) && predicted == Py_None && !((KeyTable *)real)->high) {
        Change found[MAX_CHANGES];
        Py_hash_t root_hash = blocks ? PyObject_Hash(key) : 0; /* an exact int's: no error */
        Py_ssize_t count = walk_table((KeyTable *)real, root_hash, tokens_at, blocks, size,
                                      keys_out, found);
        Py_DECREF(fast);
        if (count == DECLINED) {
            Py_RETURN_NONE;
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
            Py_RETURN_NONE;
        }
        Py_SETREF(current, PyLong_FromSsize_t(pair_hash(parent_hash, content_hash)));
        if (current == NULL) {
            goto error;
        }
        if (keys_out != Py_None && PyList_Append(keys_out, current) < 0) {
            goto error;
        }
        PyObject *mask = holders_of(real, predicted, current, zero);
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

/* ---- plain_run: the keys of a run of plain stored events ---- */

enum { MEDIUM, GROUP, EXTRA, MEDIA, LOOKAHEAD, PARENT, HASHES, TOKENS, SIZE, LORA, SALT, NAMES };
static const char *const NAME_TEXT[NAMES] = {
    "medium", "group_idx", "extra_keys", "mm_keys", "lookahead_token_ids", "parent_block_hash",
    "block_hashes", "token_ids", "block_size", "lora_name", "cache_salt",
};
static PyObject *NAME[NAMES]; /* interned when the module is made */

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
            Py_XSETREF(field[f], PyObject_GetAttr(event, NAME[f]));
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

/* ---- read_plain: a TokenSpeed-wire batch of plain events, read and keyed from its bytes ----

The watcher's subscribers hand every payload here first (tskv/core/read_batch.py). A batch of
plain events on TokenSpeed's wire ([ts, [[tag, fields...], ...], rank], each BlockStored with
exactly its four fields, each BlockRemoved with its hashes alone) is read straight from the
bytes: each stored event's blocks become content hashes (the tuple hash of their token ids, as
items_hash makes it) with no token id int and no event object made. Anything else, or anything
the general decoder would refuse or read otherwise, is declined (None), and that decoder reads
it: this reader accepts a subset of what codec.decode_batch accepts, never more. */

enum { STEP_STORED, STEP_REMOVED, STEP_CLEARED, STEPS };
static PyObject *STEP[STEPS]; /* each kind's int, made once (PyTuple_Pack: Py_BuildValue parses
                                 its format every call, 600 instructions a tuple) */
#define TOKEN_MIN (-((int64_t)1 << 31)) /* events.TOKEN_MIN */
#define TOKEN_LIMIT ((int64_t)1 << 31)  /* events.TOKEN_LIMIT */

/* Where the reading is; each reader below returns 0, or -1 when the bytes there are not what
   a plain batch has (the batch is then declined: no exception is set). */
typedef struct {
    const unsigned char *at, *end;
} Cursor;

static inline int
take(Cursor *c, Py_ssize_t n, const unsigned char **out)
{
    if (c->end - c->at < n) {
        return -1;
    }
    *out = c->at;
    c->at += n;
    return 0;
}

static inline uint64_t
big_endian(const unsigned char *p, int n)
{
    /* the widths msgpack uses, written out: compilers make each one load and a byte swap */
    switch (n) {
    case 1: return p[0];
    case 2: return (uint64_t)p[0] << 8 | p[1];
    case 4: return (uint64_t)p[0] << 24 | (uint64_t)p[1] << 16 | (uint64_t)p[2] << 8 | p[3];
    default:
        return (uint64_t)p[0] << 56 | (uint64_t)p[1] << 48 | (uint64_t)p[2] << 40 |
               (uint64_t)p[3] << 32 | (uint64_t)p[4] << 24 | (uint64_t)p[5] << 16 |
               (uint64_t)p[6] << 8 | p[7];
    }
}

/* An int of any msgpack width into *value; past int64 (a uint64 hash), *wide is set and *value
   holds its bits. */
static inline int
read_int(Cursor *c, int64_t *value, int *wide)
{
    const unsigned char *p;
    *wide = 0;
    if (take(c, 1, &p) < 0) {
        return -1;
    }
    unsigned char head = p[0];
    if (head <= 0x7f || head >= 0xe0) { /* fixints */
        *value = (int8_t)head;
        return 0;
    }
    if (head < 0xcc || head > 0xd3) {
        return -1;
    }
    int width = 1 << ((head - 0xcc) & 3); /* 0xcc..0xcf unsigned, 0xd0..0xd3 signed */
    if (take(c, width, &p) < 0) {
        return -1;
    }
    uint64_t bits = big_endian(p, width);
    if (head <= 0xcf) {
        *value = (int64_t)bits;
        *wide = bits > (uint64_t)INT64_MAX;
        return 0;
    }
    switch (width) {
    case 1: *value = (int8_t)bits; break;
    case 2: *value = (int16_t)bits; break;
    case 4: *value = (int32_t)bits; break;
    default: *value = (int64_t)bits; break;
    }
    return 0;
}

static PyObject *
int_object(int64_t value, int wide)
{
    return wide ? PyLong_FromUnsignedLongLong((uint64_t)value) : PyLong_FromLongLong(value);
}

/* An array's length; never more than the bytes left (each item takes one at least). */
static int
read_array(Cursor *c, Py_ssize_t *count)
{
    const unsigned char *p;
    if (take(c, 1, &p) < 0) {
        return -1;
    }
    if ((p[0] & 0xf0) == 0x90) {
        *count = p[0] & 0x0f;
    } else if (p[0] == 0xdc || p[0] == 0xdd) {
        int width = p[0] == 0xdc ? 2 : 4;
        if (take(c, width, &p) < 0) {
            return -1;
        }
        *count = (Py_ssize_t)big_endian(p, width);
    } else {
        return -1;
    }
    return *count <= c->end - c->at ? 0 : -1;
}

/* A string's bytes, undecoded: an event's tag. */
static int
read_str(Cursor *c, const unsigned char **text, Py_ssize_t *length)
{
    const unsigned char *p;
    if (take(c, 1, &p) < 0) {
        return -1;
    }
    if ((p[0] & 0xe0) == 0xa0) {
        *length = p[0] & 0x1f;
    } else if (p[0] == 0xd9 || p[0] == 0xda || p[0] == 0xdb) {
        int width = 1 << (p[0] - 0xd9);
        if (take(c, width, &p) < 0) {
            return -1;
        }
        *length = (Py_ssize_t)big_endian(p, width);
    } else {
        return -1;
    }
    return take(c, *length, text);
}

static inline int
is_tag(const unsigned char *text, Py_ssize_t length, const char *tag)
{
    return length == (Py_ssize_t)strlen(tag) && memcmp(text, tag, (size_t)length) == 0;
}

static int
read_nil(Cursor *c)
{
    if (c->at < c->end && *c->at == 0xc0) {
        c->at++;
        return 1;
    }
    return 0;
}

/* A number (float or int) into *out: the batch's ts. */
static int
read_number(Cursor *c, double *out)
{
    const unsigned char *p;
    if (c->at < c->end && (*c->at == 0xca || *c->at == 0xcb)) {
        int width = *c->at == 0xca ? 4 : 8;
        c->at++;
        if (take(c, width, &p) < 0) {
            return -1;
        }
        uint64_t bits = big_endian(p, width);
        if (width == 4) {
            uint32_t narrow = (uint32_t)bits;
            float single;
            memcpy(&single, &narrow, sizeof single);
            *out = single;
        } else {
            memcpy(out, &bits, sizeof *out);
        }
        return 0;
    }
    int64_t value;
    int wide;
    if (read_int(c, &value, &wide) < 0) {
        return -1;
    }
    *out = wide ? (double)(uint64_t)value : (double)value;
    return 0;
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
read_event(Cursor *c, Py_ssize_t size, PyObject **out)
{
    Py_ssize_t fields, length;
    const unsigned char *tag;
    if (read_array(c, &fields) < 0 || fields < 1 || read_str(c, &tag, &length) < 0) {
        return 0;
    }
    int stored = is_tag(tag, length, "BlockStored"), removed = is_tag(tag, length, "BlockRemoved");
    if (is_tag(tag, length, "AllBlocksCleared") && fields == 1) {
        *out = PyTuple_Pack(1, STEP[STEP_CLEARED]);
        return *out == NULL ? -1 : 1;
    }
    PyObject *hashes = NULL, *parent = NULL, *contents = NULL, *block_size = NULL;
    int got = (stored && fields == 5) || (removed && fields == 2) ? read_hashes(c, &hashes) : 0;
    if (got == 1 && removed) {
        *out = PyTuple_Pack(2, STEP[STEP_REMOVED], hashes);
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
        *out = PyTuple_Pack(5, STEP[STEP_STORED], hashes, parent, contents, block_size);
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
read_batch(Cursor *c, Py_ssize_t size, PyObject **out)
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
        got = read_event(c, size, &step);
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
    int got = read_batch(&cursor, size, &made);
    PyBuffer_Release(&bytes);
    if (got < 0) {
        return NULL;
    }
    return got == 1 ? made : Py_NewRef(Py_None);
}

/* read_run(run, size, blocks, root) -> (ids, keys, mismatched, orphans): plain_run for a run
   of read_plain's stored steps, each block keyed from its content hash; `root` is the key an
   event with no parent hangs from (read_plain's events name no LoRA and no salt). `orphans`
   counts the None keys: list.count(None) compared each int key with None, 150 instructions. */
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
        long long value = PyLong_Check(items[n])
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

static PyMethodDef methods[] = {
    {"pack_keys", pack_keys, METH_O,
     "pack_keys(keys) -> bytes: array('q', keys).tobytes(), compiled."},
    {"chain", chain, METH_VARARGS,
     "chain(key, blocks) -> list: block_keys.chain, compiled."},
    {"walk", walk, METH_VARARGS,
     "walk(real, predicted, key, tokens, size, keys_out) -> (changes, blocks): a match's walk."},
    {"plain_run", plain_run, METH_VARARGS,
     "plain_run(run, size, blocks, root_key) -> (ids, keys, mismatched) | None: filing's keys."},
    {"read_plain", read_plain, METH_VARARGS,
     "read_plain(payload, size) -> (ts, rank, steps) | None: a plain batch, read and hashed."},
    {"read_run", read_run, METH_VARARGS,
     "read_run(run, size, blocks, root) -> (ids, keys, mismatched, orphans): steps' keys."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tskv.core._compiled",
    "The prefix index's hot path, compiled (see tskv/core/compiled.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__compiled(void)
{
    if (PyType_Ready(&KeyTableType) < 0 || PyType_Ready(&BlockMapType) < 0 ||
        PyType_Ready(&MatcherType) < 0 ||
        (ZERO == NULL && (ZERO = PyLong_FromLong(0)) == NULL)) {
        return NULL;
    }
    for (int f = 0; f < NAMES; f++) {
        if (NAME[f] == NULL && (NAME[f] = PyUnicode_InternFromString(NAME_TEXT[f])) == NULL) {
            return NULL;
        }
    }
    for (int kind = 0; kind < STEPS; kind++) {
        if (STEP[kind] == NULL && (STEP[kind] = PyLong_FromLong(kind)) == NULL) {
            return NULL;
        }
    }
    PyObject *made = PyModule_Create(&module);
    if (made != NULL &&
        (PyModule_AddObjectRef(made, "KeyTable", (PyObject *)&KeyTableType) < 0 ||
         PyModule_AddObjectRef(made, "BlockMap", (PyObject *)&BlockMapType) < 0 ||
         PyModule_AddObjectRef(made, "Matcher", (PyObject *)&MatcherType) < 0)) {
        Py_CLEAR(made);
    }
    return made;
}
