/* memguard._C.Sampler: the C sampler behind a Python object. Every call
 * that may block (start, stop, sample_now, wait) releases the GIL; nothing
 * here calls back into Python from the sampler thread. Those calls note the
 * process's ranks first (mg_ranks_note), holding the GIL, which os.environ's
 * writers hold too: a launcher names them after the sampler's start, and
 * the callback thread enters wait() at least once a second. */
#include <errno.h>
#include <limits.h>

#include "mgpy.h"

typedef struct {
    PyObject_HEAD
    mg_sampler_t *s;
    uint32_t ring_size; /* bounds since()'s buffer */
} SamplerObject;

static int Sampler_init(SamplerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"interval_ms", "ring_size", "budget_bytes", "proc_root",
                             "cgroup_root", "pressure", "live", NULL};
    double interval_ms = 0;
    unsigned int ring_size = 0;
    unsigned long long budget = 0;
    const char *proc_root = NULL, *cgroup_root = NULL;
    PyObject *pressure = NULL;
    int live = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|dIKzzOp", kwlist, &interval_ms, &ring_size,
                                     &budget, &proc_root, &cgroup_root, &pressure, &live))
        return -1;
    if (self->s) {
        PyErr_SetString(PyExc_RuntimeError, "Sampler already initialised");
        return -1;
    }
    if (interval_ms != 0 && !(interval_ms >= 5 && interval_ms <= 60000)) { /* NaN too */
        PyErr_Format(PyExc_ValueError, "interval_ms must lie in [5, 60000], got %R",
                     PyTuple_Size(args) ? PyTuple_GET_ITEM(args, 0) : PyDict_GetItemString(kw, "interval_ms"));
        return -1;
    }
    if (ring_size == 1) {
        PyErr_SetString(PyExc_ValueError, "ring_size must be at least 2");
        return -1;
    }
    mg_pressure_opts_t popts;
    if (mgpy_pressure_opts(pressure, &popts))
        return -1;
    mg_sampler_config_t cfg = {
        .interval_us = (uint32_t)(interval_ms * 1000),
        .ring_size = ring_size,
        .budget_bytes = budget,
        .live = live,
        .proc_root = proc_root,
        .cgroup_root = cgroup_root,
        .pressure = &popts,
    };
    self->ring_size = ring_size ? ring_size : (uint32_t)mgi_option_long(MGI_OPT_RING_SIZE);
    int rc = mg_sampler_create(&cfg, &self->s);
    if (rc) {
        mgpy_raise(rc, "cannot create the sampler (interval, ring size or roots invalid)");
        return -1;
    }
    return 0;
}

static void Sampler_dealloc(SamplerObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    if (self->s) {
        mg_sampler_t *s = self->s;
        self->s = NULL;
        Py_BEGIN_ALLOW_THREADS
        mg_sampler_destroy(s);
        Py_END_ALLOW_THREADS
    }
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static int ready(SamplerObject *self)
{
    if (!self->s) {
        PyErr_SetString(PyExc_RuntimeError, "Sampler not initialised");
        return 0;
    }
    return 1;
}

static PyObject *Sampler_start(SamplerObject *self, PyObject *unused)
{
    (void)unused;
    int rc;
    if (!ready(self))
        return NULL;
    mg_ranks_note();
    Py_BEGIN_ALLOW_THREADS
    rc = mg_sampler_start(self->s);
    Py_END_ALLOW_THREADS
    if (rc)
        return mgpy_raise(rc, "cannot start the sampler");
    Py_RETURN_NONE;
}

static PyObject *Sampler_stop(SamplerObject *self, PyObject *unused)
{
    (void)unused;
    if (!ready(self))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    mg_sampler_stop(self->s);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Sampler_running(SamplerObject *self, void *closure)
{
    (void)closure;
    if (!ready(self))
        return NULL;
    return PyBool_FromLong(mg_sampler_running(self->s));
}

static PyObject *Sampler_sample_now(SamplerObject *self, PyObject *unused)
{
    (void)unused;
    mg_sample_t s;
    int rc;
    if (!ready(self))
        return NULL;
    mg_ranks_note();
    Py_BEGIN_ALLOW_THREADS
    rc = mg_sampler_sample_now(self->s, &s);
    Py_END_ALLOW_THREADS
    if (rc)
        return mgpy_raise(rc, "cannot sample now (the sampler thread is running)");
    return mgpy_sample_to_dict(&s);
}

static PyObject *Sampler_latest(SamplerObject *self, PyObject *unused)
{
    (void)unused;
    mg_sample_t s;
    if (!ready(self))
        return NULL;
    if (mg_sampler_latest(self->s, &s) == ENOENT)
        Py_RETURN_NONE;
    return mgpy_sample_to_dict(&s);
}

/* since(after_seq, limit=4096) -> (list of dicts, dropped) */
static PyObject *Sampler_since(SamplerObject *self, PyObject *args)
{
    unsigned long long after;
    Py_ssize_t limit = 4096;
    if (!ready(self) || !PyArg_ParseTuple(args, "K|n", &after, &limit))
        return NULL;
    if (limit < 1)
        return Py_BuildValue("(NK)", PyList_New(0), 0ULL);
    if ((size_t)limit > self->ring_size) /* never more than the ring holds */
        limit = (Py_ssize_t)self->ring_size;
    mg_sample_t *buf = PyMem_New(mg_sample_t, (size_t)limit);
    if (!buf)
        return PyErr_NoMemory();
    size_t n;
    uint64_t dropped;
    mg_sampler_since(self->s, after, buf, (size_t)limit, &n, &dropped);
    PyObject *l = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; l && i < n; i++) {
        PyObject *d = mgpy_sample_to_dict(&buf[i]);
        if (!d) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, (Py_ssize_t)i, d);
    }
    PyMem_Free(buf);
    if (!l)
        return NULL;
    return Py_BuildValue("(NK)", l, (unsigned long long)dropped);
}

/* wait(timeout_s) -> MG_WAKE_* bits (0 on timeout); GIL released. */
static PyObject *Sampler_wait(SamplerObject *self, PyObject *arg)
{
    double timeout = PyFloat_AsDouble(arg);
    int wake = 0, rc;
    if (timeout == -1.0 && PyErr_Occurred())
        return NULL;
    if (!ready(self))
        return NULL;
    /* negative: forever; NaN or beyond int milliseconds: as long as poll allows */
    int ms = timeout < 0 ? -1 : !(timeout < INT_MAX / 1000.0) ? INT_MAX : (int)(timeout * 1000);
    mg_ranks_note();
    Py_BEGIN_ALLOW_THREADS
    rc = mg_sampler_wait(self->s, ms, &wake);
    Py_END_ALLOW_THREADS
    if (rc)
        return mgpy_raise(rc, "sampler wait failed");
    return PyLong_FromLong(wake);
}

static PyObject *Sampler_wake(SamplerObject *self, PyObject *unused)
{
    (void)unused;
    if (!ready(self))
        return NULL;
    mg_sampler_wake(self->s);
    Py_RETURN_NONE;
}

static PyObject *Sampler_notify_samples(SamplerObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0 || !ready(self))
        return NULL;
    mg_sampler_notify_samples(self->s, on);
    Py_RETURN_NONE;
}

static PyObject *Sampler_cpu_ns(SamplerObject *self, PyObject *unused)
{
    (void)unused;
    uint64_t v;
    if (!ready(self))
        return NULL;
    mg_sampler_cpu_ns(self->s, &v);
    return PyLong_FromUnsignedLongLong(v);
}

static PyObject *Sampler_set_budget(SamplerObject *self, PyObject *arg)
{
    unsigned long long b = PyLong_AsUnsignedLongLong(arg);
    if (b == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    if (!ready(self))
        return NULL;
    mg_sampler_set_budget(self->s, b);
    Py_RETURN_NONE;
}

static PyObject *Sampler_set_live(SamplerObject *self, PyObject *arg)
{
    int live = PyObject_IsTrue(arg);
    if (live < 0 || !ready(self))
        return NULL;
    mg_sampler_set_live(self->s, live);
    Py_RETURN_NONE;
}

/* A CUDA device's counters from a dict with the mg_cuda_counters_t names;
 * missing or None entries read 0 ("device" -1). */
static PyObject *Sampler_push_cuda(SamplerObject *self, PyObject *arg)
{
    if (!ready(self))
        return NULL;
    if (!PyDict_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "push_cuda takes a dict of counters");
        return NULL;
    }
    mg_cuda_counters_t c = {.device = -1};
    static const struct {
        const char *name;
        size_t off;
    } keys[] = {
#define K(f) {#f, offsetof(mg_cuda_counters_t, f)}
        K(allocated_bytes), K(reserved_bytes), K(active_bytes), K(allocated_peak_bytes),
        K(reserved_peak_bytes), K(alloc_retries), K(ooms), K(free_bytes), K(total_bytes),
        K(budget_bytes),
#undef K
    };
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(arg, &pos, &k, &v)) {
        const char *name = PyUnicode_AsUTF8(k);
        if (!name)
            return NULL;
        if (v == Py_None)
            continue;
        if (strcmp(name, "device") == 0) {
            long d = PyLong_AsLong(v);
            if (d == -1 && PyErr_Occurred())
                return NULL;
            c.device = (int32_t)d;
            continue;
        }
        size_t i;
        for (i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
            if (strcmp(name, keys[i].name) == 0)
                break;
        if (i == sizeof(keys) / sizeof(keys[0]))
            return PyErr_Format(PyExc_ValueError, "unknown CUDA counter %R", k);
        unsigned long long x = PyLong_AsUnsignedLongLong(v);
        if (x == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
        *(uint64_t *)((char *)&c + keys[i].off) = x;
    }
    int level = 0;
    int rc = mg_sampler_push_cuda(self->s, &c, &level);
    if (rc)
        return mgpy_raise(rc, "mg_sampler_push_cuda");
    return PyLong_FromLong(level);
}

static PyObject *Sampler_level_fd(SamplerObject *self, PyObject *unused)
{
    (void)unused;
    if (!ready(self))
        return NULL;
    return PyLong_FromLong(mg_sampler_level_fd(self->s));
}

static PyMethodDef Sampler_methods[] = {
    {"start", (PyCFunction)Sampler_start, METH_NOARGS, "Start the sampling thread."},
    {"stop", (PyCFunction)Sampler_stop, METH_NOARGS, "Stop and join the sampling thread."},
    {"sample_now", (PyCFunction)Sampler_sample_now, METH_NOARGS,
     "Take one sample on this thread (not while running)."},
    {"latest", (PyCFunction)Sampler_latest, METH_NOARGS, "Newest sample or None."},
    {"since", (PyCFunction)Sampler_since, METH_VARARGS,
     "since(after_seq, limit=4096) -> (samples, dropped)"},
    {"wait", (PyCFunction)Sampler_wait, METH_O,
     "wait(timeout_s) -> wake bits; 1 level change, 2 sample, 4 wake()"},
    {"wake", (PyCFunction)Sampler_wake, METH_NOARGS, "Interrupt one wait()."},
    {"notify_samples", (PyCFunction)Sampler_notify_samples, METH_O,
     "Wake wait() after every sample (True) or on level changes only."},
    {"cpu_ns", (PyCFunction)Sampler_cpu_ns, METH_NOARGS, "CPU time of the sampling thread."},
    {"set_budget", (PyCFunction)Sampler_set_budget, METH_O, "Budget in bytes (0: none)."},
    {"set_live", (PyCFunction)Sampler_set_live, METH_O,
     "Judge against the live budget, capped by the budget set (True), or not."},
    {"push_cuda", (PyCFunction)Sampler_push_cuda, METH_O,
     "push_cuda(counters) -> raw level of the CUDA signals: hand the sampler a CUDA "
     "device's allocator counters (later samples carry them)."},
    {"level_fd", (PyCFunction)Sampler_level_fd, METH_NOARGS, "The level-change eventfd."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Sampler_getset[] = {
    {"running", (getter)Sampler_running, NULL, "Whether the thread runs.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Sampler_slots[] = {
    {Py_tp_init, Sampler_init},
    {Py_tp_dealloc, Sampler_dealloc},
    {Py_tp_methods, Sampler_methods},
    {Py_tp_getset, Sampler_getset},
    {Py_tp_doc, "Sampler(interval_ms=0, ring_size=0, budget_bytes=0, proc_root=None, "
                "cgroup_root=None, pressure=None, live=False): the C telemetry sampler."},
    {0, NULL},
};

PyType_Spec mgpy_sampler_spec = {
    .name = "memguard._C.Sampler",
    .basicsize = sizeof(SamplerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Sampler_slots,
};
