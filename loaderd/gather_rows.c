/* A batch's rows gathered in one call: the copy on a cache hit's path (loaderd/row_copy.py).
 *
 * For each output (a field), row i of its `dst` is bytes [offset, offset + width) of record
 * i. Plain C without Python's headers: loaderd loads it with ctypes.PyDLL, which keeps
 * the GIL held for the call, as the Python copy it replaces does (a copy that lets go of the
 * GIL waits up to the switch interval to win it back from the server loop).
 *
 * It does two things a copy from Python cannot:
 *  - streaming stores (`stream`): each line of the batch goes to memory without first being
 *    read into the cache. A batch larger than the cache is written back before the trainer
 *    reads it anyway; an ordinary store reads every line it writes as well.
 *  - `threads` threads, each copying a run of whole rows: one core's copy is bound by its own
 *    traffic to memory, well below the machine's.
 * benchmarks/bench_gather.py measures both.
 */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#define MAX_THREADS 16

typedef struct {
    uint64_t dst, offset, width; /* as Python passes them: one uint64 row of three per output */
} out_t;

typedef struct {
    const char *const *srcs;
    const out_t *outs;
    size_t first, rows, nouts;
    int stream;
} part_t;

static void stream_copy(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    size_t head = (16 - ((uintptr_t)d & 15)) & 15; /* streaming stores need 16-byte alignment */
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
#endif
    memcpy(d, s, n);
}

static void *copy_part(void *arg) {
    const part_t *p = arg;
    for (size_t k = 0; k < p->nouts; k++) {
        const out_t *o = &p->outs[k];
        for (size_t i = p->first; i < p->first + p->rows; i++) {
            char *d = (char *)(uintptr_t)o->dst + i * o->width;
            const char *s = p->srcs[i] + o->offset;
            if (p->stream)
                stream_copy(d, s, o->width);
            else
                memcpy(d, s, o->width);
        }
    }
#if defined(__SSE2__)
    if (p->stream)
        _mm_sfence(); /* streamed lines are visible to other cores before the batch is sent */
#endif
    return NULL;
}

/* Copies every row on up to `threads` threads (this one among them); returns how many. */
int loaderd_gather_rows(const char *const *srcs, size_t rows, const out_t *outs, size_t nouts,
                        int threads, int stream) {
    part_t parts[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    size_t n = (size_t)(threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads);
    if (n > rows)
        n = rows ? rows : 1;
    size_t first = 0;
    for (size_t t = 0; t < n; t++) {
        size_t count = rows / n + (t < rows % n);
        parts[t] = (part_t){srcs, outs, first, count, nouts, stream};
        first += count;
    }
    size_t started = 1; /* part 0 is this thread's */
    for (; started < n; started++)
        if (pthread_create(&ids[started], NULL, copy_part, &parts[started]) != 0)
            break;
    for (size_t t = started; t < n; t++) /* a thread that could not start: copied here */
        copy_part(&parts[t]);
    copy_part(&parts[0]);
    for (size_t t = 1; t < started; t++)
        pthread_join(ids[t], NULL);
    return (int)started;
}
