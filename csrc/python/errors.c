/* C error codes to Python exceptions, in one place. */
#include <errno.h>
#include <string.h>

#include "mgpy.h"

PyObject *mgpy_raise(int rc, const char *what)
{
    switch (rc) {
    case EINVAL:
    case ERANGE:
    case EBADMSG:
        PyErr_Format(PyExc_ValueError, "%s", what);
        break;
    case ENOMEM:
        PyErr_NoMemory();
        break;
    case EALREADY:
    case EBUSY:
        PyErr_Format(PyExc_RuntimeError, "%s: %s", what, strerror(rc));
        break;
    default:
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        break;
    }
    return NULL;
}
