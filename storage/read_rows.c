/* A batch's records read from data.mdb into its rows and hashed, in one call
 * (storage/row_reads.py says why and what the caller checks).
 *
 * For record i: one preadv of lengths[i] bytes at offsets[i] that scatters the record as it
 * goes: its header to headers + i * head, each field's bytes [offset, offset + width) to row i
 * of that field's frame, and the bytes between and after them to `scratch`; or, given the
 * address of the record in a map, the same pieces copied from there with memcpy. Then the
 * xxh3-64 of everything after the header, in record order, seeded with seeds[i], into digests[i],
 * while the pieces are still in the cache. The hash is xxHash's own, from the library
 * python-xxhash is built with: the caller passes its functions (`hasher_t`), so the record
 * format and the choice of hash stay in Python. Plain C without Python's headers, loaded with
 * ctypes.PyDLL (the GIL stays held: a miss worker runs no other thread).
 *
 * `loaderd_read_whole`, at the end, reads whole records to given addresses for the arena.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

#define MAX_PIECES 1024 /* IOV_MAX: row_reads.MAX_PIECES */

typedef struct {
    uint64_t dst, offset, width; /* a field's frame, sorted by offset, disjoint, past the header */
} out_t;

typedef struct {
    void *(*create)(void);
    int (*free)(void *state);
    int (*reset)(void *state, uint64_t seed);
    int (*update)(void *state, const void *data, size_t n);
    uint64_t (*digest)(const void *state);
} hasher_t;

/* All `total` bytes at `at`, through partial reads and signals: 0, 1 at the end of the file,
 * or -errno. `iov` is consumed. */
static int read_all(int fd, struct iovec *iov, int count, size_t total, off_t at) {
    while (total > 0) {
        ssize_t got = preadv(fd, iov, count, at);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            return 1;
        total -= (size_t)got, at += got;
        while (count > 0 && (size_t)got >= iov->iov_len)
            got -= (ssize_t)iov->iov_len, iov++, count--;
        if (count > 0)
            iov->iov_base = (char *)iov->iov_base + got, iov->iov_len -= (size_t)got;
    }
    return 0;
}

/* The same pieces copied from a record that lies whole at `from` (the caller checked it). */
static void copy_all(const char *from, const struct iovec *iov, int count) {
    for (int p = 0; p < count; p++) {
        memcpy(iov[p].iov_base, from, iov[p].iov_len);
        from += iov[p].iov_len;
    }
}

/* Returns n when every record was read; i < n when record i runs past the end of the file
 * (records before it are read and hashed); -errno when a read failed; -EINVAL when the fields
 * need more pieces than one call takes (as preadv would), -ENOMEM when no hash state could be
 * made. Record i is read from `fd` at offsets[i] unless from[i] (`from` not NULL) gives the
 * address where it lies whole in a map: it is copied from there. */
long loaderd_read_or_copy_rows(int fd, const uint64_t *from, size_t n, const int64_t *offsets,
                               const int64_t *lengths, const uint64_t *seeds, char *headers,
                               size_t head, const out_t *outs, size_t nouts, char *scratch,
                               const hasher_t *h, uint64_t *digests) {
    static __thread struct iovec pieces[MAX_PIECES], iov[MAX_PIECES]; /* 32 KB: off the stack */
    if (2 * nouts + 2 > MAX_PIECES)
        return -EINVAL;
    void *state = h->create();
    if (state == NULL)
        return -ENOMEM;
    long done = 0;
    for (; (size_t)done < n; done++) {
        size_t i = (size_t)done, length = (size_t)lengths[i], pos = head;
        int count = 0;
        pieces[count++] = (struct iovec){headers + i * head, head};
        for (size_t k = 0; k < nouts; k++) {
            const out_t *o = &outs[k];
            if (o->offset > pos)
                pieces[count++] = (struct iovec){scratch + pos, o->offset - pos};
            pieces[count++] = (struct iovec){(char *)(uintptr_t)o->dst + i * o->width, o->width};
            pos = o->offset + o->width;
        }
        if (length > pos)
            pieces[count++] = (struct iovec){scratch + pos, length - pos};
        for (int p = 0; p < count; p++)
            iov[p] = pieces[p];
        int r = 0;
        if (from != NULL && from[i] != 0)
            copy_all((const char *)(uintptr_t)from[i], iov, count);
        else
            r = read_all(fd, iov, count, length, (off_t)offsets[i]);
        if (r != 0) {
            h->free(state);
            return r < 0 ? r : done;
        }
        h->reset(state, seeds[i]);
        for (int p = 1; p < count; p++)
            h->update(state, pieces[p].iov_base, pieces[p].iov_len);
        digests[i] = h->digest(state);
    }
    h->free(state);
    return done;
}

/* Whole records read from `fd` (lengths[i] bytes at offsets[i]) to the addresses dests[i] of
 * this process, each then hashed where it landed, seed 0, into digests[i]: how the NVRAM
 * arena's writer copies records of data.mdb into its log (storage/arena.py) without mapping
 * the store's pages into the daemon. Loaded with ctypes.CDLL: the GIL is let go for the whole
 * batch. Returns n; i < n when record i runs past the end of the file (those before it are
 * read and hashed); -errno when a read failed; -ENOMEM when no hash state could be made. */
long loaderd_read_whole(int fd, size_t n, const int64_t *offsets, const int64_t *lengths,
                        const uint64_t *dests, const hasher_t *h, uint64_t *digests) {
    void *state = h->create();
    if (state == NULL)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++) {
        void *dest = (void *)(uintptr_t)dests[i];
        size_t length = (size_t)lengths[i];
        struct iovec iov = {dest, length};
        int r = read_all(fd, &iov, 1, length, (off_t)offsets[i]);
        if (r != 0) {
            h->free(state);
            return r < 0 ? r : (long)i;
        }
        h->reset(state, 0);
        h->update(state, dest, length);
        digests[i] = h->digest(state);
    }
    h->free(state);
    return (long)n;
}
