/* memguard._C.Planner: the micro-batch planner (memguard-planner.h) as a
 * Python object; Guard.step drives it and tests replay traces through it. */
#include <errno.h>

#include "memguard/memguard-planner.h"
#include "mgpy.h"

typedef struct {
    PyObject_HEAD
    mg_planner_t p;
} PlannerObject;

static int Planner_init(PlannerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"micro", "min_micro", "multiple_of", "divisor_of", "budget_bytes",
                             "margin", "decay", "grow_after", "retry_after", "fixed", "align",
                             NULL};
    mg_planner_opts_t o;
    unsigned long long micro = 0, min_micro, multiple_of, divisor_of, budget, align;
    unsigned int grow_after, retry_after;
    int fixed = 0;
    mg_planner_opts_default(&o);
    min_micro = o.min_micro;
    multiple_of = o.multiple_of;
    divisor_of = o.divisor_of;
    budget = o.budget_bytes;
    grow_after = o.grow_after;
    retry_after = o.retry_after;
    align = o.align;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$KKKKKddIIpK", kwlist, &micro, &min_micro,
                                     &multiple_of, &divisor_of, &budget, &o.margin, &o.decay,
                                     &grow_after, &retry_after, &fixed, &align))
        return -1;
    o.align = align ? align : 1;
    o.min_micro = min_micro;
    o.multiple_of = multiple_of;
    o.divisor_of = divisor_of;
    o.budget_bytes = budget;
    o.grow_after = grow_after;
    o.retry_after = retry_after;
    o.fixed = fixed;
    if (mg_planner_init(&self->p, &o, micro)) {
        /* PyErr_Format knows no %g: format here */
        char msg[256];
        snprintf(msg, sizeof(msg),
                 "invalid planner options: no micro-batch size satisfies min_micro=%llu, "
                 "multiple_of=%llu, divisor_of=%llu, or margin %g is not in [0, 1), "
                 "decay %g not in (0, 1], grow_after %u is 0",
                 min_micro, multiple_of, divisor_of, o.margin, o.decay, grow_after);
        PyErr_SetString(PyExc_ValueError, msg);
        return -1;
    }
    return 0;
}

static void Planner_dealloc(PlannerObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

static PyObject *Planner_begin(PlannerObject *self, PyObject *args)
{
    unsigned long long batch;
    int level;
    uint64_t micro;
    if (!PyArg_ParseTuple(args, "Ki", &batch, &level))
        return NULL;
    if (mg_planner_begin(&self->p, batch, level, &micro))
        return mgpy_raise(EINVAL, "a step needs a batch of at least one sample");
    return PyLong_FromUnsignedLongLong(micro);
}

/* A size argument: 0, or -1 with an exception set. */
static int size_arg(PyObject *arg, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

/* The planner's answer, or None where it had none (rc != 0). */
static PyObject *size_or_none(int rc, uint64_t v)
{
    if (rc)
        Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(v);
}

/* oom(micro) -> size to retry at, or None when nothing smaller is allowed */
static PyObject *Planner_oom(PlannerObject *self, PyObject *arg)
{
    uint64_t micro, next = 0;
    if (size_arg(arg, &micro))
        return NULL;
    int rc = mg_planner_oom(&self->p, micro, &next); /* before next is read */
    return size_or_none(rc, next);
}

static PyObject *Planner_agree(PlannerObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"micro", "failed", NULL};
    unsigned long long micro, failed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "K|K", kwlist, &micro, &failed))
        return NULL;
    if (mg_planner_agree(&self->p, micro, failed)) {
        PyErr_SetString(PyExc_ValueError, "agree: the agreed micro-batch size must be positive");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Planner_end(PlannerObject *self, PyObject *args)
{
    unsigned long long micro, peak, floor = 0;
    if (!PyArg_ParseTuple(args, "KK|K", &micro, &peak, &floor))
        return NULL;
    mg_planner_end(&self->p, micro, peak, floor);
    Py_RETURN_NONE;
}

/* time(micro, batch, seconds): a calm step's duration, for the time model */
static PyObject *Planner_time(PlannerObject *self, PyObject *args)
{
    unsigned long long micro, batch;
    double seconds;
    if (!PyArg_ParseTuple(args, "KKd", &micro, &batch, &seconds))
        return NULL;
    mg_planner_time(&self->p, micro, batch, seconds);
    Py_RETURN_NONE;
}

static PyObject *Planner_predict_time(PlannerObject *self, PyObject *arg)
{
    uint64_t micro;
    double s = 0.0;
    if (size_arg(arg, &micro))
        return NULL;
    if (mg_planner_predict_time(&self->p, micro, &s))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(s);
}

static PyObject *Planner_set_align(PlannerObject *self, PyObject *arg)
{
    uint64_t a;
    if (size_arg(arg, &a))
        return NULL;
    mg_planner_set_align(&self->p, a);
    Py_RETURN_NONE;
}

static PyObject *Planner_predict(PlannerObject *self, PyObject *arg)
{
    uint64_t micro, bytes = 0;
    if (size_arg(arg, &micro))
        return NULL;
    int rc = mg_planner_predict(&self->p, micro, &bytes); /* before bytes is read */
    return size_or_none(rc, bytes);
}

static PyObject *Planner_fit(PlannerObject *self, PyObject *arg)
{
    uint64_t x, s = 0;
    if (size_arg(arg, &x))
        return NULL;
    int rc = mg_planner_fit(&self->p, x, &s); /* before s is read */
    return size_or_none(rc, s);
}

static PyObject *Planner_set_budget(PlannerObject *self, PyObject *arg)
{
    uint64_t b;
    if (size_arg(arg, &b))
        return NULL;
    mg_planner_set_budget(&self->p, b);
    Py_RETURN_NONE;
}

static PyObject *Planner_room_fit(PlannerObject *self, PyObject *unused)
{
    (void)unused;
    uint64_t s = 0;
    int rc = mg_planner_room_fit(&self->p, &s); /* before s is read */
    return size_or_none(rc, s);
}

/* The planner's state and last decision, for telemetry and state_dict. */
static PyObject *Planner_state(PlannerObject *self, PyObject *unused)
{
    (void)unused;
    const mg_planner_t *p = &self->p;
    double base = 0.0, per = 0.0;
    int timed = mg_planner_time_model(p, &base, &per) == 0;
    PyObject *st = Py_BuildValue(
        "{sKsKsKsKsIsIsKsKsssssKsKsKsKsKsd}", "micro", (unsigned long long)p->micro, "full",
        (unsigned long long)p->full, "failed", (unsigned long long)p->failed, "step",
        (unsigned long long)p->step, "calm", p->calm, "calm_since_fail", p->calm_since_fail,
        "ooms", (unsigned long long)p->ooms, "decision_step", (unsigned long long)p->last.step,
        "action", mg_plan_action_name(p->last.action), "reason",
        mg_plan_reason_name(p->last.reason), "from", (unsigned long long)p->last.from, "to",
        (unsigned long long)p->last.to, "budget_bytes", (unsigned long long)p->opts.budget_bytes,
        "failed_room", (unsigned long long)p->failed_room, "ran", (unsigned long long)p->ran,
        "margin", p->margin);
    if (st == NULL || !timed)
        return st;
    /* the time model, once a step was timed */
    PyObject *b = PyFloat_FromDouble(base), *m = PyFloat_FromDouble(per);
    if (b == NULL || m == NULL || PyDict_SetItemString(st, "time_base_s", b) ||
        PyDict_SetItemString(st, "time_per_micro_s", m))
        Py_CLEAR(st);
    Py_XDECREF(b);
    Py_XDECREF(m);
    return st;
}

static PyMethodDef Planner_methods[] = {
    {"begin", (PyCFunction)Planner_begin, METH_VARARGS,
     "begin(batch, level) -> micro-batch size for this step"},
    {"oom", (PyCFunction)Planner_oom, METH_O,
     "oom(micro) -> smaller size to redo the step at, or None at the minimum"},
    {"agree", (PyCFunction)(void (*)(void))Planner_agree, METH_VARARGS | METH_KEYWORDS,
     "agree(micro, failed=0): adopt the size the ranks agreed on; failed: a peer's OOM size"},
    {"end", (PyCFunction)Planner_end, METH_VARARGS,
     "end(micro, peak_bytes, floor_bytes=0): step finished; floor: held as it began"},
    {"time", (PyCFunction)Planner_time, METH_VARARGS,
     "time(micro, batch, seconds): a calm step's duration, for the time model"},
    {"predict_time", (PyCFunction)Planner_predict_time, METH_O,
     "predict_time(micro) -> predicted step seconds at the full batch, or None"},
    {"set_align", (PyCFunction)Planner_set_align, METH_O,
     "set_align(n): prefer multiples of n where they add no micro-batch"},
    {"predict", (PyCFunction)Planner_predict, METH_O,
     "predict(micro) -> predicted peak bytes, or None before any observation"},
    {"fit", (PyCFunction)Planner_fit, METH_O,
     "fit(x) -> largest allowed size not above x, or None"},
    {"set_budget", (PyCFunction)Planner_set_budget, METH_O,
     "set_budget(budget): the room peaks are planned against (0: none)"},
    {"room_fit", (PyCFunction)Planner_room_fit, METH_NOARGS,
     "room_fit() -> largest size whose predicted peak fits the room (0: none), or None"},
    {"state", (PyCFunction)Planner_state, METH_NOARGS, "State and last decision as a dict."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot Planner_slots[] = {
    {Py_tp_init, Planner_init},
    {Py_tp_dealloc, Planner_dealloc},
    {Py_tp_methods, Planner_methods},
    {Py_tp_doc, "Planner(*, micro=0, min_micro=1, multiple_of=1, divisor_of=0, budget_bytes=0, "
                "margin=0.03, decay=0.98, grow_after=8, retry_after=64, fixed=False, align=1)"},
    {0, NULL},
};

PyType_Spec mgpy_planner_spec = {
    .name = "memguard._C.Planner",
    .basicsize = sizeof(PlannerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Planner_slots,
};
