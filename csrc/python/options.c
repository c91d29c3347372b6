/* Python access to the option table. */
#include <errno.h>
#include <string.h>

#include "mgpy.h"

PyObject *mgpy_option_get(PyObject *m, PyObject *arg)
{
    (void)m;
    char buf[512];
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name)
        return NULL;
    if (mg_option_get(name, buf, sizeof(buf))) {
        PyErr_Format(PyExc_KeyError, "unknown memguard option %R", arg);
        return NULL;
    }
    return PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "backslashreplace");
}

PyObject *mgpy_option_check(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    char why[256];
    if (mg_option_check(why, sizeof(why)) == 0)
        Py_RETURN_NONE;
    return PyUnicode_FromString(why);
}

PyObject *mgpy_option_set(PyObject *m, PyObject *args)
{
    (void)m;
    const char *name, *value;
    if (!PyArg_ParseTuple(args, "ss", &name, &value)) /* "s" refuses embedded NULs */
        return NULL;
    int rc = mg_option_set(name, value);
    if (rc == ENOENT) {
        PyErr_Format(PyExc_KeyError, "unknown memguard option %R", PyTuple_GET_ITEM(args, 0));
        return NULL;
    }
    if (rc) {
        PyErr_Format(PyExc_ValueError, "%R is not a valid value for option %s",
                     PyTuple_GET_ITEM(args, 1), name);
        return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *mgpy_option_names(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    PyObject *l = PyList_New(0);
    for (size_t i = 0; l && mg_option_name(i); i++) {
        PyObject *s = PyUnicode_FromString(mg_option_name(i));
        if (!s || PyList_Append(l, s)) {
            Py_XDECREF(s);
            Py_CLEAR(l);
            break;
        }
        Py_DECREF(s);
    }
    return l;
}

PyObject *mgpy_option_warnings(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    char buf[256];
    PyObject *l = PyList_New(0);
    while (l && mg_option_next_warning(buf, sizeof(buf)) == 0) {
        /* an environment value is bytes: show what is not UTF-8 as \xNN */
        PyObject *s = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)strlen(buf), "backslashreplace");
        if (!s || PyList_Append(l, s)) {
            Py_XDECREF(s);
            Py_CLEAR(l);
            break;
        }
        Py_DECREF(s);
    }
    return l;
}
