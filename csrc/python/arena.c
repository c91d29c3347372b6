/* Python access to the arena and the in-process install. */
#include <dlfcn.h>
#include <errno.h>

#include "memguard/memguard-arena.h"
#include "mgpy.h"

PyObject *mgpy_install(PyObject *m, PyObject *args)
{
    (void)m;
    const char *prefix = "libc10.so";
    int slots = 0, rc;
    if (!PyArg_ParseTuple(args, "|s", &prefix))
        return NULL;
    rc = mg_install(prefix, &slots);
    switch (rc) {
    case 0:
        return PyLong_FromLong(slots);
    case ENOENT:
        PyErr_Format(PyExc_RuntimeError,
                     "%s is not loaded in this process: import torch before installing "
                     "memguard's allocator", prefix);
        return NULL;
    case ESRCH:
        PyErr_Format(PyExc_RuntimeError,
                     "%s does not import posix_memalign and free: this torch build "
                     "allocates CPU tensors some other way, which memguard cannot route",
                     prefix);
        return NULL;
    case ENOTSUP:
        PyErr_Format(PyExc_RuntimeError,
                     "memguard's in-process allocator needs the linux platform layer on "
                     "x86-64 or aarch64 (ELF import slots); this build's layer is %s, where "
                     "the throttle works without it (Guard(allocator=False))", MG_PLATFORM);
        return NULL;
    default:
        return mgpy_raise(rc, "cannot install memguard's allocator");
    }
}

PyObject *mgpy_uninstall(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    int rc = mg_uninstall();
    if (rc)
        return mgpy_raise(rc, "cannot uninstall memguard's allocator");
    Py_RETURN_NONE;
}

PyObject *mgpy_installed(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return PyBool_FromLong(mg_installed());
}

/* Is the preload shim in this process (its marker visible)? */
PyObject *mgpy_preloaded(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return PyBool_FromLong(dlsym(RTLD_DEFAULT, "mg_preload_active") != NULL);
}

PyObject *mgpy_arena_stats(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    mg_arena_stats_t s;
    mg_arena_stats(&s);
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
        "allocated_bytes.current", (unsigned long long)s.allocated_current,
        "allocated_bytes.peak", (unsigned long long)s.allocated_peak,
        "reserved_bytes.current", (unsigned long long)s.reserved_current,
        "reserved_bytes.peak", (unsigned long long)s.reserved_peak,
        "active_bytes.current", (unsigned long long)s.active_current,
        "active_bytes.peak", (unsigned long long)s.active_peak,
        "requested_bytes.current", (unsigned long long)s.requested_current,
        "requested_bytes.peak", (unsigned long long)s.requested_peak,
        "cached_bytes", (unsigned long long)s.cached_bytes,
        "budget_bytes", (unsigned long long)s.budget_bytes,
        "cache_limit_bytes", (unsigned long long)s.cache_limit_bytes,
        "num_allocs", (unsigned long long)s.num_allocs,
        "num_frees", (unsigned long long)s.num_frees,
        "num_cache_hits", (unsigned long long)s.num_cache_hits,
        "num_ooms", (unsigned long long)s.num_ooms,
        "num_trims", (unsigned long long)s.num_trims,
        "trimmed_bytes", (unsigned long long)s.trimmed_bytes,
        "reserve_bytes", (unsigned long long)s.reserve_bytes,
        "last_oom_bytes", (unsigned long long)s.last_oom_bytes,
        "decayed_bytes", (unsigned long long)s.decayed_bytes,
        "epoch", (unsigned long long)s.epoch,
        "tree_reserved_bytes", (unsigned long long)s.tree_reserved_bytes,
        "num_overruns", (unsigned long long)s.num_overruns,
        "last_overrun_bytes", (unsigned long long)s.last_overrun_bytes);
}

/* Set one of the arena's byte limits from a Python int (0: none). */
static PyObject *arena_set(PyObject *arg, void (*setter)(uint64_t))
{
    unsigned long long b = PyLong_AsUnsignedLongLong(arg);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    int rc = mg_arena_init();
    if (rc)
        return mgpy_raise(rc, "cannot reserve an address range for the arena");
    Py_BEGIN_ALLOW_THREADS
    setter(b); /* may release cached blocks */
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyObject *mgpy_arena_set_budget(PyObject *m, PyObject *arg)
{
    (void)m;
    return arena_set(arg, mg_arena_set_budget);
}

PyObject *mgpy_arena_set_cache_limit(PyObject *m, PyObject *arg)
{
    (void)m;
    return arena_set(arg, mg_arena_set_cache_limit);
}

/* Run a cache release with the GIL released; the bytes it gave back. */
static PyObject *released(int (*release)(uint64_t, uint64_t *), uint64_t arg)
{
    uint64_t freed = 0;
    Py_BEGIN_ALLOW_THREADS
    release(arg, &freed);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(freed);
}

static int decay(uint64_t age, uint64_t *freed)
{
    return mg_arena_decay((uint32_t)age, freed);
}

PyObject *mgpy_arena_trim(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned long long keep = 0;
    if (!PyArg_ParseTuple(args, "|K", &keep))
        return NULL;
    return released(mg_arena_trim, keep);
}

PyObject *mgpy_arena_decay(PyObject *m, PyObject *args)
{
    (void)m;
    unsigned int age;
    if (!PyArg_ParseTuple(args, "I", &age))
        return NULL;
    return released(decay, age);
}

PyObject *mgpy_arena_reset_peaks(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    mg_arena_reset_peaks();
    Py_RETURN_NONE;
}

PyObject *mgpy_arena_set_soft(PyObject *m, PyObject *arg)
{
    (void)m;
    int soft = PyObject_IsTrue(arg);
    if (soft < 0)
        return NULL;
    int rc = mg_arena_init();
    if (rc)
        return mgpy_raise(rc, "cannot reserve an address range for the arena");
    mg_arena_set_soft(soft);
    Py_RETURN_NONE;
}

PyObject *mgpy_arena_strict(PyObject *m, PyObject *arg)
{
    (void)m;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    mg_arena_strict(on);
    Py_RETURN_NONE;
}

PyObject *mgpy_system_trim(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    const char *how = "none";
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mg_system_trim(&how);
    Py_END_ALLOW_THREADS
    if (rc && rc != ENOTSUP)
        return mgpy_raise(rc, "jemalloc's purge failed");
    return PyUnicode_FromString(how);
}

PyObject *mgpy_swap_in(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    char root[MGI_PATH_MAX];
    uint64_t bytes = 0;
    int rc;
    mgi_option_text(MGI_OPT_PROC_ROOT, root, sizeof(root));
    Py_BEGIN_ALLOW_THREADS
    rc = mgi_swap_in(root, &bytes);
    Py_END_ALLOW_THREADS
    if (rc)
        return mgpy_raise(rc, "cannot read this process's smaps");
    return PyLong_FromUnsignedLongLong(bytes);
}
