/* In-process install: route one library's tensor allocations (libc10.so's
 * posix_memalign, which c10::alloc_cpu calls for every CPU tensor) to the
 * arena, by rewriting that library's import slots.
 *
 * free and realloc are hooked too and stay hooked for good: an arena block
 * may outlive an uninstall, and handing it to the original free would abort
 * the process. Pointers the arena does not own go to whatever the slot held
 * before, after an O(1) range check. Uninstall restores posix_memalign only.
 * The hooks run on any thread, never call Python, and never block beyond
 * the arena's short locks. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "memguard/memguard-arena.h"
#include "rebind.h"

typedef int (*memalign_fn)(void **, size_t, size_t);
typedef void (*free_fn)(void *);
typedef void *(*realloc_fn)(void *, size_t);

/* Set before any slot points at a hook (seq_cst), and kept for good. */
static _Atomic(free_fn) orig_free;
static _Atomic(realloc_fn) orig_realloc;

static pthread_mutex_t install_lock = PTHREAD_MUTEX_INITIALIZER; /* guards what follows */
static mgi_object_t target;
static memalign_fn orig_memalign; /* what uninstall puts back */
static int installed;

static int hook_posix_memalign(void **out, size_t align, size_t size)
{
    /* posix_memalign's contract: EINVAL for a bad alignment, ENOMEM when full */
    if (align < sizeof(void *) || (align & (align - 1)))
        return EINVAL;
    return mg_arena_alloc(size, align, out);
}

static void hook_free(void *p)
{
    if (mg_arena_owns(p))
        mg_arena_free(p);
    else
        atomic_load_explicit(&orig_free, memory_order_acquire)(p);
}

static void *hook_realloc(void *p, size_t n)
{
    if (!mg_arena_owns(p))
        return atomic_load_explicit(&orig_realloc, memory_order_acquire)(p, n);
    size_t have = mg_arena_usable_size(p);
    if (n == 0) {
        mg_arena_free(p);
        return NULL;
    }
    if (n <= have)
        return p;
    void *q;
    if (mg_arena_alloc(n, 64, &q) != 0) {
        errno = ENOMEM;
        return NULL;
    }
    memcpy(q, p, have);
    mg_arena_free(p);
    return q;
}

/* Hook sym in the target: resolve the original first, publish it, then
 * rewrite the slots, so a concurrent call never finds a hook without it. */
static int hook(const char *sym, void *fn, void *_Atomic *orig_slot, void **orig_out, int *n)
{
    void *orig;
    int rc = mgi_resolve(&target, sym, fn, &orig);
    if (rc)
        return rc;
    if (orig_slot && !atomic_load(orig_slot))
        atomic_store(orig_slot, orig);
    if (orig_out)
        *orig_out = orig;
    int count = 0;
    rc = mgi_rebind(&target, sym, fn, &count);
    *n += count;
    return rc;
}

int mg_install(const char *prefix, int *slots)
{
    int rc = 0, n = 0;
    pthread_mutex_lock(&install_lock);
    if (installed)
        goto out;
    if ((rc = mg_arena_init()) != 0)
        goto out;
    if ((rc = mgi_object_find(prefix, &target)) != 0)
        goto out;
    if (!mgi_imports(&target, "posix_memalign") || !mgi_imports(&target, "free")) {
        rc = ESRCH;
        goto out;
    }
    /* free first: once posix_memalign is ours, every block must be freeable */
    if ((rc = hook("free", (void *)hook_free, (void *_Atomic *)&orig_free, NULL, &n)) != 0)
        goto out;
    if (mgi_imports(&target, "realloc") &&
        (rc = hook("realloc", (void *)hook_realloc, (void *_Atomic *)&orig_realloc, NULL,
                   &n)) != 0)
        goto out;
    void *m = NULL;
    if ((rc = hook("posix_memalign", (void *)hook_posix_memalign, NULL, &m, &n)) != 0)
        goto out;
    orig_memalign = (memalign_fn)m;
    installed = 1;
out:
    pthread_mutex_unlock(&install_lock);
    if (slots)
        *slots = n;
    return rc;
}

int mg_uninstall(void)
{
    int rc = 0, n = 0;
    pthread_mutex_lock(&install_lock);
    if (installed) {
        rc = mgi_rebind(&target, "posix_memalign", (void *)orig_memalign, &n);
        if (rc == 0)
            installed = 0;
    }
    pthread_mutex_unlock(&install_lock);
    return rc;
}

int mg_installed(void)
{
    pthread_mutex_lock(&install_lock);
    int r = installed;
    pthread_mutex_unlock(&install_lock);
    return r;
}
