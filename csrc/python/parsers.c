/* Python access to the pure parsers, sizes and budgets (tests, fuzzing,
 * budget strings). */
#include <errno.h>
#include <string.h>

#include "mgpy.h"

#define SETU(d, k, v) (set_u((d), (k), (v)))

static int set_obj(PyObject *d, const char *k, PyObject *v)
{
    if (!v)
        return -1;
    int rc = PyDict_SetItemString(d, k, v);
    Py_DECREF(v);
    return rc;
}

static int set_u(PyObject *d, const char *k, uint64_t v)
{
    return set_obj(d, k, PyLong_FromUnsignedLongLong(v));
}

static int set_f(PyObject *d, const char *k, double v)
{
    return set_obj(d, k, PyFloat_FromDouble(v));
}

static int set_opt_u(PyObject *d, const char *k, int have, uint64_t v)
{
    return have ? set_u(d, k, v) : set_obj(d, k, Py_NewRef(Py_None));
}

/* parse(kind, data, version=2) -> dict; ValueError("<kind>: <why>") when malformed. */
PyObject *mgpy_parse(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"kind", "data", "version", NULL};
    const char *kind;
    Py_buffer buf;
    int version = 2;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ss*|i", kwlist, &kind, &buf, &version))
        return NULL;
    const char *b = buf.buf, *why = "malformed";
    size_t len = (size_t)buf.len;
    PyObject *d = PyDict_New();
    int rc = EINVAL, err = 0;
    if (!d)
        goto out;
    if (strcmp(kind, "status") == 0) {
        mgi_status_t x;
        if (!(rc = mgi_parse_status(b, len, &x, &why)))
            err = set_u(d, "rss_bytes", x.rss_bytes) || set_u(d, "hwm_bytes", x.hwm_bytes) ||
                  set_opt_u(d, "swap_bytes", x.have_swap, x.swap_bytes);
    } else if (strcmp(kind, "meminfo") == 0) {
        mgi_meminfo_t x;
        if (!(rc = mgi_parse_meminfo(b, len, &x, &why)))
            err = set_u(d, "total_bytes", x.total_bytes) ||
                  set_opt_u(d, "available_bytes", x.have_available, x.available_bytes) ||
                  set_opt_u(d, "swap_total_bytes", x.have_swap, x.swap_total_bytes) ||
                  set_opt_u(d, "swap_free_bytes", x.have_swap, x.swap_free_bytes);
    } else if (strcmp(kind, "vmstat") == 0) {
        mgi_vmstat_t x;
        if (!(rc = mgi_parse_vmstat(b, len, &x, &why)))
            err = set_u(d, "pswpin", x.pswpin) || set_u(d, "pswpout", x.pswpout) ||
                  set_u(d, "pgmajfault", x.pgmajfault);
    } else if (strcmp(kind, "psi") == 0) {
        mgi_psi_t x;
        if (!(rc = mgi_parse_psi(b, len, &x, &why))) {
            err = set_f(d, "some_avg10", x.some_avg10) || set_f(d, "some_avg60", x.some_avg60) ||
                  set_u(d, "some_total_us", x.some_total_us);
            if (!err && x.have_full)
                err = set_f(d, "full_avg10", x.full_avg10) ||
                      set_f(d, "full_avg60", x.full_avg60) ||
                      set_u(d, "full_total_us", x.full_total_us);
        }
    } else if (strcmp(kind, "statm") == 0) {
        uint64_t rss;
        if (!(rc = mgi_parse_statm(b, len, 4096, &rss, &why)))
            err = set_u(d, "rss_bytes", rss); /* pages of 4 KiB */
    } else if (strcmp(kind, "stat") == 0) {
        mgi_faults_t x;
        if (!(rc = mgi_parse_stat(b, len, &x, &why)))
            err = set_u(d, "minor_faults", x.minor) || set_u(d, "major_faults", x.major);
    } else if (strcmp(kind, "cgroup") == 0) {
        mgi_cgpaths_t x;
        if (!(rc = mgi_parse_cgroup(b, len, &x, &why)))
            err = set_obj(d, "v1_memory", x.have_v1 ? PyUnicode_FromString(x.v1_memory)
                                                    : Py_NewRef(Py_None)) ||
                  set_obj(d, "v2", x.have_v2 ? PyUnicode_FromString(x.v2) : Py_NewRef(Py_None));
    } else if (strcmp(kind, "limit") == 0) {
        uint64_t v;
        int unlimited;
        if (!(rc = mgi_parse_limit(b, len, &v, &unlimited, &why)))
            err = set_obj(d, "limit_bytes", unlimited ? Py_NewRef(Py_None)
                                                      : PyLong_FromUnsignedLongLong(v));
    } else if (strcmp(kind, "cgstat") == 0) {
        mgi_cgstat_t x;
        if (!(rc = mgi_parse_cgstat(b, len, version, &x, &why)))
            err = set_opt_u(d, "inactive_file", x.have_inactive_file, x.inactive_file) ||
                  set_opt_u(d, "hierarchical_limit", x.hierarchical_limit != 0,
                            x.hierarchical_limit);
    } else if (strcmp(kind, "cgevents") == 0) {
        mgi_cgevents_t x;
        if (!(rc = mgi_parse_cgevents(b, len, version, &x, &why)))
            /* v1 counts kills only: without the oom_kill line there is no count */
            err = set_opt_u(d, "oom", version == 2 || x.have_oom_kill, x.oom) ||
                  set_opt_u(d, "oom_kill", x.have_oom_kill, x.oom_kill);
    } else if (strcmp(kind, "rollup") == 0) {
        uint64_t v;
        if (!(rc = mgi_parse_rollup(b, len, &v, &why)))
            err = set_u(d, "private_bytes", v);
    } else if (strcmp(kind, "pids") == 0) {
        uint32_t pids[MGI_TREE_MAX];
        size_t n = 0;
        if (!(rc = mgi_parse_pids(b, len, pids, MGI_TREE_MAX, &n, &why))) {
            PyObject *list = PyList_New((Py_ssize_t)n);
            for (size_t i = 0; list && i < n; i++)
                PyList_SET_ITEM(list, (Py_ssize_t)i, PyLong_FromUnsignedLong(pids[i]));
            err = set_obj(d, "pids", list);
        }
    } else {
        PyErr_Format(PyExc_ValueError, "unknown parser kind %R", PyTuple_GET_ITEM(args, 0));
        Py_CLEAR(d);
        goto out;
    }
    if (rc) {
        PyErr_Format(PyExc_ValueError, "%s: %s", kind, why);
        Py_CLEAR(d);
    } else if (err) {
        Py_CLEAR(d);
    }
out:
    PyBuffer_Release(&buf);
    return d;
}

/* UTF-8 of a str without embedded NULs (which C would silently cut at). */
static const char *text_of(PyObject *obj, const char *what)
{
    Py_ssize_t n;
    const char *t = PyUnicode_AsUTF8AndSize(obj, &n);
    if (t && strlen(t) != (size_t)n) {
        PyErr_Format(PyExc_ValueError, "%s %R holds a NUL character", what, obj);
        return NULL;
    }
    return t;
}

PyObject *mgpy_parse_size(PyObject *m, PyObject *arg)
{
    (void)m;
    uint64_t v;
    if (!PyUnicode_Check(arg)) {
        PyErr_Format(PyExc_ValueError, "%R is not a byte size", arg);
        return NULL;
    }
    const char *text = text_of(arg, "size");
    if (!text)
        return NULL;
    int rc = mg_parse_size(text, &v);
    if (rc) {
        PyErr_Format(PyExc_ValueError, "%R is not a byte size%s", arg,
                     rc == ERANGE ? " (too large)" : " (e.g. 512MiB, 12GiB, 1.5G)");
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(v);
}

/* parse_budget(text, total, available=0) -> int */
PyObject *mgpy_parse_budget(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"text", "total", "available", NULL};
    PyObject *obj;
    unsigned long long total, available = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "UK|K", kwlist, &obj, &total, &available))
        return NULL;
    uint64_t v;
    const char *text = text_of(obj, "budget");
    if (!text)
        return NULL;
    int rc = mg_parse_budget(text, total, available, &v);
    if (rc == ERANGE && strchr(text, '%')) {
        PyErr_Format(PyExc_ValueError, "budget %R is out of range: percentages lie in (0, 100]",
                     obj);
        return NULL;
    }
    if (rc == ERANGE) {
        PyErr_Format(PyExc_ValueError,
                     "budget %R is larger than memguard can hold (at most 4 EiB, 2**62 "
                     "bytes); pass None for no budget", obj);
        return NULL;
    }
    if (rc) {
        PyErr_Format(PyExc_ValueError,
                     "budget %R is not valid: use \"auto\", a size such as \"12GiB\" or "
                     "\"512MB\", a percentage such as \"75%%\", or a positive integer of bytes",
                     obj);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(v);
}

/* live_budget(sample, user=0, reserve=0.0) -> (bytes, source) or None */
PyObject *mgpy_live_budget(PyObject *m, PyObject *args, PyObject *kw)
{
    (void)m;
    static char *kwlist[] = {"sample", "user", "reserve", NULL};
    static const char *const names[] = {"none", "user", "cgroup", "host"};
    PyObject *d;
    unsigned long long user = 0;
    double reserve = 0.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Kd", kwlist, &d, &user, &reserve))
        return NULL;
    if (!(reserve >= 0.0 && reserve < 1.0)) {
        PyErr_Format(PyExc_ValueError, "reserve must be a fraction in [0, 1), not %R",
                     PyTuple_Size(args) > 2 ? PyTuple_GET_ITEM(args, 2)
                                            : PyDict_GetItemString(kw, "reserve"));
        return NULL;
    }
    mg_sample_t s;
    if (mgpy_sample_from_dict(d, &s))
        return NULL;
    uint64_t v;
    int src = 0;
    if (mg_budget_live(&s, user, reserve, &v, &src))
        Py_RETURN_NONE;
    return Py_BuildValue("(Ks)", (unsigned long long)v, names[src]);
}
