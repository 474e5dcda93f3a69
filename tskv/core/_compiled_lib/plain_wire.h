/* The bytes of a plain TokenSpeed-wire batch, parsed into C values: no Python object is made
here, as msgpack's unpack_template.h parses apart from unpack.h, which builds the objects.

Each reader takes a Cursor over the payload and returns 0 with what it read, or -1 where the
bytes are not what a plain batch has there; the batch is then declined, with no exception set,
and the general decoder reads it (and refuses it, if it must). Lengths are checked against the
bytes left before anything is read.
*/

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
