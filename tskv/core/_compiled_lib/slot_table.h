/* The slots KeyTable and BlockMap keep their entries in: open addressing, linear probing.

A Python dict of millions of int keys costs about a hundred bytes a key and three cache misses
a lookup (its table, the entry, the key object); a slot here is 16 bytes, a key and its value
side by side, and a lookup is one miss. Keys are mixed by MurmurHash3's finalizer before they
pick a slot, because an engine's hashes may be counters or multiples of a constant. A table is
kept at most 4 slots in 5 full so a probe stays within a cache line or two, and grows by half
(not doubling) so a grown table is at least 8 in 15 full. Big tables ask for 2 MB pages, and
a batch of lookups asks the CPU for its slots a few keys ahead: at millions of keys every
lookup is a cache miss, and those misses then overlap. What a slot cannot hold (a mask past
64 bits, a tiered block's id) each type keeps in a dict beside the slots.
*/

#define EMPTY ((int64_t)-1) /* hash() never gives -1, so no key is ever this */

typedef struct {
    int64_t key;
    uint64_t mask; /* the low 64 bits of the workers' mask */
} Slot;

/* The slots themselves, which KeyTable and BlockMap each keep beside what no slot can hold. */
typedef struct {
    Slot *slots;
    size_t capacity; /* slots, below 1 << 32; 0 before the first key */
    Py_ssize_t used;
} Slots;

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
   compiler must keep: GCC at -O3 removed such loops whole (fetch_ahead's first keys of a
   batch), and a batch of new keys then waited for each miss in turn. */
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
   Each line not asked for is a miss waited for (docs/performance.md, "The compiled core",
   measures a key stored and let go of at millions of keys). A hint only: a value no slot
   holds (not an int, past 64 bits) fetches useless lines. */
static inline void
fetch_key(const Slots *t, int64_t bits, int removing)
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
fetch_home(const Slots *t, PyObject *obj, int removing)
{
    if (PyLong_CheckExact(obj)) {
        fetch_key(t, (int64_t)PyLong_AsUnsignedLongLongMask(obj), removing); /* no error */
    }
}

/* Called before looking up items[n] of a batch: at the first, asks for the first FETCH_AHEAD
   slots; at each, for the slot FETCH_AHEAD further on, so that many stay in flight.
   `removing`: the keys found are taken out of the table. */
static inline void
fetch_ahead(const Slots *t, PyObject *const *items, Py_ssize_t count, Py_ssize_t n,
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
fetch_keys_ahead(const Slots *t, const int64_t *keys, Py_ssize_t count, Py_ssize_t n,
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
find(const Slots *t, int64_t key)
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
resize(Slots *t, size_t capacity)
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
   20 to 30 bytes; doubling at 7 in 10 could leave a table barely over a third full. */
static inline int
make_room(Slots *t)
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
remove_at(Slots *t, size_t i)
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
   _PyLong_AsByteArray and PyLong_AsLongLongAndOverflow digit by digit with checks. 0 also where it cannot tell (a CPython whose private calls may differ): ask the API. */
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
    if (!PyLong_CheckExact(obj)) {
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
    if (!PyLong_CheckExact(obj)) {
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

/* add_new's work on keys made C integers: when none of `keys` is in the table nor twice in
   `keys`, each is stored with its value (values[n], or `value` for every key when values is
   NULL) and 1 returned; else 0, the table as it was; -1 with MemoryError set, as it was too. */
static int
store_new(Slots *t, const int64_t *keys, Py_ssize_t count, const int64_t *values,
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

/* The slot of `id`, or -1 for none. */
static inline Py_ssize_t
slot_of_id(const Slots *t, int64_t id)
{
    if (t->capacity == 0) {
        return -1;
    }
    size_t i = find(t, id);
    return t->slots[i].key == EMPTY ? -1 : (Py_ssize_t)i;
}

/* Whether none of `other`'s items is in `self` (a KeyTable or a BlockMap, whose slots are
   `slots`), as `contains` says. */
static PyObject *
disjoint(PyObject *self, const Slots *slots, PyObject *other, objobjproc contains)
{
    PyObject *fast = PySequence_Fast(other, "isdisjoint takes an iterable");
    if (fast == NULL) {
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(fast);
    Py_ssize_t count = PySequence_Fast_GET_SIZE(fast);
    Items held = {fast, items, count};
    for (Py_ssize_t n = 0; n < count; n++) {
        fetch_ahead(slots, items, count, n, 0);
        PyObject *item = Py_NewRef(items[n]); /* held: its __eq__ may drop it */
        int present = contains(self, item);
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

/* A heap type's instance goes: the type it holds a reference to goes with it. */
static void
free_instance(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free(self);
    Py_DECREF(type);
}
