/* mg_sample_t <-> dict. One table names each field, its type and the
 * MG_HAVE_* bit that says it was read; absent fields and NaN rates become
 * None, so Python never sees a made-up zero. */
#include <math.h>
#include <stddef.h>

#include "mgpy.h"

typedef enum { F_U64, F_F64, F_I32, F_I64, F_U32 } ftype_t;

typedef struct field {
    const char *name;
    size_t off;
    ftype_t type;
    uint64_t have; /* 0: always present (doubles: present unless NaN) */
} field_t;

#define U(f, h) {#f, offsetof(mg_sample_t, f), F_U64, h}
#define D(f, h) {#f, offsetof(mg_sample_t, f), F_F64, h}
#define I(f, h) {#f, offsetof(mg_sample_t, f), F_I32, h}
#define I64(f, h) {#f, offsetof(mg_sample_t, f), F_I64, h}
#define U32(f, h) {#f, offsetof(mg_sample_t, f), F_U32, h}

static const field_t fields[] = {
    U(seq, 0),
    U(rss_bytes, MG_HAVE_STATUS), U(rss_peak_bytes, MG_HAVE_RSS_PEAK),
    U(swap_bytes, MG_HAVE_SWAP),
    U(minor_faults, MG_HAVE_FAULTS), U(major_faults, MG_HAVE_FAULTS),
    D(minor_faults_per_s, 0), D(major_faults_per_s, 0),
    U(mem_total_bytes, MG_HAVE_MEMINFO), U(mem_available_bytes, MG_HAVE_MEMAVAIL),
    U(swap_total_bytes, MG_HAVE_SWAP_TOTAL), U(swap_free_bytes, MG_HAVE_SWAP_TOTAL),
    U(swap_in_pages, MG_HAVE_VMSTAT), U(swap_out_pages, MG_HAVE_VMSTAT),
    U(system_major_faults, MG_HAVE_VMSTAT),
    D(swap_in_pages_per_s, 0), D(swap_out_pages_per_s, 0),
    D(psi_some_avg10, MG_HAVE_PSI), D(psi_some_avg60, MG_HAVE_PSI),
    U(psi_some_total_us, MG_HAVE_PSI),
    D(psi_full_avg10, MG_HAVE_PSI_FULL), D(psi_full_avg60, MG_HAVE_PSI_FULL),
    U(psi_full_total_us, MG_HAVE_PSI_FULL),
    D(psi_some_stall, 0), D(psi_full_stall, 0),
    I(cgroup_version, MG_HAVE_CGROUP), U(cgroup_usage_bytes, MG_HAVE_CGROUP),
    U(cgroup_limit_bytes, MG_HAVE_CGROUP_LIMIT), U(cgroup_high_bytes, MG_HAVE_CGROUP_HIGH),
    U(cgroup_working_set_bytes, MG_HAVE_CGROUP_WS),
    U(cgroup_oom_events, MG_HAVE_CGROUP_EVENTS), U(cgroup_oom_kill_events, MG_HAVE_CGROUP_EVENTS),
    D(cgroup_psi_some_avg10, MG_HAVE_CGROUP_PSI), D(cgroup_psi_full_avg10, MG_HAVE_CGROUP_PSI),
    U(cgroup_psi_some_total_us, MG_HAVE_CGROUP_PSI), U(cgroup_psi_full_total_us, MG_HAVE_CGROUP_PSI),
    D(cgroup_psi_some_stall, 0), D(cgroup_psi_full_stall, 0),
    U(budget_bytes, MG_HAVE_BUDGET), D(budget_used_fraction, 0), D(headroom_fraction, 0),
    I(raw_level, 0), I(level, 0),
    U(arena_allocated_bytes, MG_HAVE_ARENA), U(arena_reserved_bytes, MG_HAVE_ARENA),
    U(arena_cached_bytes, MG_HAVE_ARENA), U(arena_budget_bytes, MG_HAVE_ARENA),
    U(arena_ooms, MG_HAVE_ARENA), D(arena_budget_used_fraction, 0),
    I(cuda_device, MG_HAVE_CUDA),
    U(cuda_allocated_bytes, MG_HAVE_CUDA), U(cuda_reserved_bytes, MG_HAVE_CUDA),
    U(cuda_active_bytes, MG_HAVE_CUDA),
    U(cuda_allocated_peak_bytes, MG_HAVE_CUDA), U(cuda_reserved_peak_bytes, MG_HAVE_CUDA),
    U(cuda_alloc_retries, MG_HAVE_CUDA), U(cuda_ooms, MG_HAVE_CUDA),
    U(cuda_new_retries, MG_HAVE_CUDA),
    U(cuda_free_bytes, MG_HAVE_CUDA), U(cuda_total_bytes, MG_HAVE_CUDA),
    U(cuda_budget_bytes, MG_HAVE_CUDA), I64(cuda_age_ns, MG_HAVE_CUDA),
    D(cuda_budget_used_fraction, 0),
    U(footprint_bytes, MG_HAVE_FOOTPRINT),
    U(children_bytes, MG_HAVE_CHILDREN), U32(children, MG_HAVE_CHILDREN),
    U(compressed_bytes, MG_HAVE_COMPRESSED), U(compressions, MG_HAVE_COMPRESSED),
    D(compressions_per_s, 0), I(os_pressure_level, MG_HAVE_OS_LEVEL),
};
#define N_FIELDS (sizeof(fields) / sizeof(fields[0]))

static const char *const reason_names[] = {"budget", "headroom", "psi", "swap", "faults",
                                           "cuda_retries", "os", "compressor"};

/* MG_BUDGET_SRC_* by name; NONE is None. */
static const char *const budget_sources[] = {NULL, "user", "cgroup", "host"};
#define N_BUDGET_SOURCES (sizeof(budget_sources) / sizeof(budget_sources[0]))

static PyObject *field_value(const mg_sample_t *s, const field_t *f)
{
    const char *p = (const char *)s + f->off;
    if (f->have && !(s->have & f->have))
        Py_RETURN_NONE;
    switch (f->type) {
    case F_U64:
        return PyLong_FromUnsignedLongLong(*(const uint64_t *)p);
    case F_I32:
        return PyLong_FromLong(*(const int32_t *)p);
    case F_I64:
        return PyLong_FromLongLong(*(const int64_t *)p);
    case F_U32:
        return PyLong_FromUnsignedLong(*(const uint32_t *)p);
    default: {
        double v = *(const double *)p;
        if (isnan(v))
            Py_RETURN_NONE;
        return PyFloat_FromDouble(v);
    }
    }
}

static int set_item(PyObject *d, const char *k, PyObject *v)
{
    if (!v)
        return -1;
    int rc = PyDict_SetItemString(d, k, v);
    Py_DECREF(v);
    return rc;
}

PyObject *mgpy_sample_to_dict(const mg_sample_t *s)
{
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (set_item(d, "t", PyFloat_FromDouble((double)s->t_ns / 1e9)) ||
        set_item(d, "interval_s", s->interval_ns ? PyFloat_FromDouble((double)s->interval_ns / 1e9)
                                                 : Py_NewRef(Py_None)) ||
        set_item(d, "sample_cost_us", PyFloat_FromDouble((double)s->cost_ns / 1e3)))
        goto fail;
    int bs = s->budget_source;
    if (set_item(d, "budget_source", bs > 0 && (size_t)bs < N_BUDGET_SOURCES
                                         ? PyUnicode_FromString(budget_sources[bs])
                                         : Py_NewRef(Py_None)) ||
        set_item(d, "user_budget_bytes", s->user_budget_bytes
                                             ? PyLong_FromUnsignedLongLong(s->user_budget_bytes)
                                             : Py_NewRef(Py_None)))
        goto fail;
    for (size_t i = 0; i < N_FIELDS; i++)
        if (set_item(d, fields[i].name, field_value(s, &fields[i])))
            goto fail;
    PyObject *names = PyList_New(0);
    if (!names)
        goto fail;
    for (size_t i = 0; i < sizeof(reason_names) / sizeof(reason_names[0]); i++) {
        if (!(s->reasons & (1u << i)))
            continue;
        PyObject *name = PyUnicode_FromString(reason_names[i]);
        if (!name || PyList_Append(names, name)) {
            Py_XDECREF(name);
            Py_DECREF(names);
            goto fail;
        }
        Py_DECREF(name);
    }
    PyObject *reasons = PyList_AsTuple(names);
    Py_DECREF(names);
    if (set_item(d, "reasons", reasons))
        goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

/* The inverse, for replaying recorded samples through the pressure model:
 * a missing or None field leaves its bit clear (or its rate NaN). */
int mgpy_sample_from_dict(PyObject *d, mg_sample_t *s)
{
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "a sample must be a dict");
        return -1;
    }
    mgi_sample_init(s);
    PyObject *t = PyDict_GetItemString(d, "t");
    if (t && t != Py_None) {
        double v = PyFloat_AsDouble(t);
        if (v == -1.0 && PyErr_Occurred())
            return -1;
        s->t_ns = (int64_t)(v * 1e9);
    }
    for (size_t i = 0; i < N_FIELDS; i++) {
        const field_t *f = &fields[i];
        PyObject *v = PyDict_GetItemString(d, f->name);
        if (!v || v == Py_None)
            continue;
        char *p = (char *)s + f->off;
        if (f->type == F_F64) {
            double x = PyFloat_AsDouble(v);
            if (x == -1.0 && PyErr_Occurred())
                return -1;
            *(double *)p = x;
        } else if (f->type == F_I32) {
            long x = PyLong_AsLong(v);
            if (x == -1 && PyErr_Occurred())
                return -1;
            *(int32_t *)p = (int32_t)x;
        } else if (f->type == F_I64) {
            long long x = PyLong_AsLongLong(v);
            if (x == -1 && PyErr_Occurred())
                return -1;
            *(int64_t *)p = (int64_t)x;
        } else if (f->type == F_U32) {
            unsigned long x = PyLong_AsUnsignedLong(v);
            if (x == (unsigned long)-1 && PyErr_Occurred())
                return -1;
            *(uint32_t *)p = (uint32_t)x;
        } else {
            unsigned long long x = PyLong_AsUnsignedLongLong(v);
            if (x == (unsigned long long)-1 && PyErr_Occurred())
                return -1;
            *(uint64_t *)p = x;
        }
        s->have |= f->have;
    }
    PyObject *ub = PyDict_GetItemString(d, "user_budget_bytes");
    if (ub && ub != Py_None) {
        unsigned long long x = PyLong_AsUnsignedLongLong(ub);
        if (x == (unsigned long long)-1 && PyErr_Occurred())
            return -1;
        s->user_budget_bytes = x;
    }
    PyObject *src = PyDict_GetItemString(d, "budget_source");
    if (src && src != Py_None) {
        const char *name = PyUnicode_AsUTF8(src);
        if (!name)
            return -1;
        for (size_t i = 1; i < N_BUDGET_SOURCES; i++)
            if (strcmp(name, budget_sources[i]) == 0)
                s->budget_source = (int32_t)i;
    }
    return 0;
}

PyObject *mgpy_sample_fields(void)
{
    const char *extra[] = {"t", "interval_s", "sample_cost_us", "reasons", "budget_source",
                           "user_budget_bytes"};
    const size_t n_extra = sizeof(extra) / sizeof(extra[0]);
    PyObject *t = PyTuple_New((Py_ssize_t)(N_FIELDS + n_extra));
    if (!t)
        return NULL;
    for (size_t i = 0; i < N_FIELDS + n_extra; i++) {
        PyObject *name = PyUnicode_FromString(i < n_extra ? extra[i] : fields[i - n_extra].name);
        if (!name) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, name);
    }
    return t;
}

/* Thresholds from a mapping {"psi_high": 0.2, ...} over the option defaults. */
int mgpy_pressure_opts(PyObject *mapping, mg_pressure_opts_t *o)
{
    static const struct {
        const char *name;
        size_t off;
    } keys[] = {
#define T(n, f, i) {n, offsetof(mg_pressure_opts_t, f) + (i) * sizeof(double)}
        T("budget_elevated", budget, 0), T("budget_high", budget, 1),
        T("budget_critical", budget, 2), T("headroom_elevated", headroom, 0),
        T("headroom_high", headroom, 1), T("headroom_critical", headroom, 2),
        T("psi_elevated", psi, 0), T("psi_high", psi, 1), T("psi_critical", psi, 2),
        T("swap_in_elevated", swap_in, 0), T("swap_in_high", swap_in, 1),
        T("swap_in_critical", swap_in, 2), T("major_faults_elevated", major_faults, 0),
        T("major_faults_high", major_faults, 1), T("major_faults_critical", major_faults, 2),
#undef T
    };
    mg_pressure_opts_default(o);
    if (!mapping || mapping == Py_None)
        return 0;
    if (!PyDict_Check(mapping)) {
        PyErr_SetString(PyExc_TypeError, "pressure thresholds must be a dict");
        return -1;
    }
    PyObject *k, *v;
    Py_ssize_t pos = 0;
    while (PyDict_Next(mapping, &pos, &k, &v)) {
        const char *name = PyUnicode_AsUTF8(k);
        if (!name)
            return -1;
        size_t i;
        if (strcmp(name, "calm_samples") == 0) {
            long n = PyLong_AsLong(v);
            if (n == -1 && PyErr_Occurred())
                return -1;
            if (n < 1) {
                PyErr_Format(PyExc_ValueError, "calm_samples must be >= 1, got %ld", n);
                return -1;
            }
            o->calm_samples = (uint32_t)n;
            continue;
        }
        for (i = 0; i < sizeof(keys) / sizeof(keys[0]); i++)
            if (strcmp(name, keys[i].name) == 0)
                break;
        if (i == sizeof(keys) / sizeof(keys[0])) {
            PyErr_Format(PyExc_ValueError, "unknown pressure threshold %R", k);
            return -1;
        }
        double x = PyFloat_AsDouble(v);
        if (x == -1.0 && PyErr_Occurred())
            return -1;
        *(double *)((char *)o + keys[i].off) = x;
    }
    if (mg_pressure_opts_check(o)) {
        PyErr_Format(PyExc_ValueError,
                     "pressure thresholds %R must rise from elevated to critical "
                     "(headroom: fall) and lie in range",
                     mapping);
        return -1;
    }
    return 0;
}
