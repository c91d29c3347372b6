/* memguard._C's side of the CUDA allocator: choose the backend of the
 * device cache, set budgets, read counters. The allocation functions
 * themselves (mg_cuda_alloc, mg_cuda_free) are called by PyTorch, not from
 * here. */
#include "mgpy.h"
#include "shim.h"

PyObject *mgpy_cuda_init(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"backend", "path", "capacity", NULL};
    const char *backend, *path = NULL;
    unsigned long long capacity = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|zK", kwlist, &backend, &path, &capacity))
        return NULL;
    const mg_dev_backend_t *b;
    int mode;
    if (strcmp(backend, "cuda") == 0) {
        char err[600] = "";
        int rc = mgi_cuda_runtime_open(path, err, sizeof(err));
        if (rc) {
            PyErr_SetString(PyExc_RuntimeError, err);
            return NULL;
        }
        b = mgi_cuda_backend();
        mode = MGI_OOM_THROW;
    } else if (strcmp(backend, "host") == 0) {
        b = mgi_host_backend(capacity);
        mode = MGI_OOM_NULL;
    } else {
        /* backend may have come as a keyword: args holds nothing then */
        return PyErr_Format(PyExc_ValueError, "backend must be 'cuda' or 'host', not '%s'",
                            backend);
    }
    if (mode == MGI_OOM_THROW && mgi_cuda_set_oom_mode(mode) != 0) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the C++ runtime (libstdc++.so.6) is not loadable: memguard's CUDA "
                        "allocator could not report out-of-memory errors to PyTorch");
        return NULL;
    }
    int rc = mg_dev_init(b);
    if (rc == EBUSY) {
        PyErr_SetString(PyExc_RuntimeError, "memguard's CUDA allocator still holds blocks in "
                                            "use: its backend cannot change now");
        return NULL;
    }
    if (rc)
        return mgpy_raise(rc, "mg_dev_init");
    if (mode == MGI_OOM_NULL)
        mgi_cuda_set_oom_mode(mode);
    const char *where = mode == MGI_OOM_THROW ? mgi_cuda_runtime_path() : "host";
    return PyUnicode_FromString(where ? where : "");
}

PyObject *mgpy_cuda_detach(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    int rc = mg_dev_detach();
    if (rc == EBUSY) {
        PyErr_SetString(PyExc_RuntimeError, "memguard's CUDA allocator still holds blocks in "
                                            "use: its backend cannot be detached now");
        return NULL;
    }
    if (rc)
        return mgpy_raise(rc, "mg_dev_detach");
    Py_RETURN_NONE;
}

PyObject *mgpy_cuda_backend(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    const char *n = mg_dev_backend_name();
    if (!n)
        Py_RETURN_NONE;
    return PyUnicode_FromString(n);
}

static int device_arg(PyObject *arg, int *device)
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v >= MG_DEV_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "CUDA device %ld is out of range [0, %d)", v,
                     MG_DEV_MAX_DEVICES);
        return -1;
    }
    *device = (int)v;
    return 0;
}

PyObject *mgpy_cuda_stats(PyObject *m, PyObject *arg)
{
    (void)m;
    int device;
    if (device_arg(arg, &device))
        return NULL;
    mg_dev_stats_t s;
    mg_dev_stats(device, &s);
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,"
        "s:K}",
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
        "num_allocs", (unsigned long long)s.num_allocs,
        "num_frees", (unsigned long long)s.num_frees,
        "num_cache_hits", (unsigned long long)s.num_cache_hits,
        "num_ooms", (unsigned long long)s.num_ooms,
        "num_trims", (unsigned long long)s.num_trims,
        "num_alloc_retries", (unsigned long long)s.num_alloc_retries,
        "num_device_allocs", (unsigned long long)s.num_device_allocs,
        "num_device_frees", (unsigned long long)s.num_device_frees,
        "num_uncached", (unsigned long long)s.num_uncached,
        "trimmed_bytes", (unsigned long long)s.trimmed_bytes,
        "streams", (unsigned long long)s.streams,
        "last_oom_bytes", (unsigned long long)s.last_oom_bytes);
}

PyObject *mgpy_cuda_set_budget(PyObject *m, PyObject *args)
{
    (void)m;
    int device;
    unsigned long long bytes;
    if (!PyArg_ParseTuple(args, "iK", &device, &bytes))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mg_dev_set_budget(device, bytes);
    Py_END_ALLOW_THREADS
    if (rc == EINVAL)
        return PyErr_Format(PyExc_ValueError, "CUDA device %d is out of range [0, %d)", device,
                            MG_DEV_MAX_DEVICES);
    if (rc)
        return mgpy_raise(rc, "mg_dev_set_budget");
    Py_RETURN_NONE;
}

PyObject *mgpy_cuda_trim(PyObject *m, PyObject *args)
{
    (void)m;
    int device = -1;
    if (!PyArg_ParseTuple(args, "|i", &device))
        return NULL;
    uint64_t freed = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = mg_dev_trim(device, &freed);
    Py_END_ALLOW_THREADS
    if (rc)
        return PyErr_Format(PyExc_ValueError, "CUDA device %d is out of range", device);
    return PyLong_FromUnsignedLongLong(freed);
}

PyObject *mgpy_cuda_reset_peaks(PyObject *m, PyObject *arg)
{
    (void)m;
    int device;
    if (device_arg(arg, &device))
        return NULL;
    mg_dev_reset_peaks(device);
    Py_RETURN_NONE;
}

PyObject *mgpy_cuda_host_used(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return PyLong_FromUnsignedLongLong(mgi_host_backend_used());
}
