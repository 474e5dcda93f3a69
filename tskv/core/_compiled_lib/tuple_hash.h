/* CPython's tuple hash, computed from the items' hashes without making the tuple.

A block's key is hash((parent_key, content)) and content is the tuple of its token ids: in
Python that is two tuples a block and a loop of bytecode. The rounds below are
Objects/tupleobject.c's (xxHash's, since CPython 3.8), over the same item hashes, so the keys
are Python's own; tskv/core/compiled.py checks that at import and falls back to the pure path
if a CPython ever hashes tuples otherwise. An item is hashed here only when it is an exact int
(or an exact tuple of them, for a block's content with its identity): any other object's hash
may be Python code, so it is declined (-1, no exception set) and the caller hands the request
to the pure path before anything has changed.
*/

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
