/* memguard._C.PressureModel: the sampler's pressure model on its own, fed
 * recorded samples so traces replay through the same C code. */
#include "mgpy.h"

typedef struct {
    PyObject_HEAD
    mg_pressure_t p;
} PressureObject;

static int Pressure_init(PressureObject *self, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"pressure", NULL};
    PyObject *pressure = NULL;
    mg_pressure_opts_t o;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &pressure))
        return -1;
    if (mgpy_pressure_opts(pressure, &o))
        return -1;
    mg_pressure_init(&self->p, &o);
    return 0;
}

static void Pressure_dealloc(PressureObject *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    tp->tp_free((PyObject *)self);
    Py_DECREF(tp);
}

/* update(sample_dict) -> the sample as the sampler would have published it */
static PyObject *Pressure_update(PressureObject *self, PyObject *d)
{
    mg_sample_t s;
    if (mgpy_sample_from_dict(d, &s))
        return NULL;
    mg_pressure_update(&self->p, &s);
    return mgpy_sample_to_dict(&s);
}

static PyObject *Pressure_level(PressureObject *self, void *closure)
{
    (void)closure;
    return PyLong_FromLong(self->p.level);
}

static PyMethodDef Pressure_methods[] = {
    {"update", (PyCFunction)Pressure_update, METH_O,
     "update(sample) -> sample with raw_level, level, reasons and fractions set"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pressure_getset[] = {
    {"level", (getter)Pressure_level, NULL, "Current level after hysteresis.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot Pressure_slots[] = {
    {Py_tp_init, Pressure_init},
    {Py_tp_dealloc, Pressure_dealloc},
    {Py_tp_methods, Pressure_methods},
    {Py_tp_getset, Pressure_getset},
    {Py_tp_doc, "PressureModel(pressure=None): the pressure model with hysteresis."},
    {0, NULL},
};

PyType_Spec mgpy_pressure_spec = {
    .name = "memguard._C.PressureModel",
    .basicsize = sizeof(PressureObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = Pressure_slots,
};
