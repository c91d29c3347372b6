/* Declarations shared by the files of the memguard._C module. */
#ifndef MEMGUARD_MGPY_H
#define MEMGUARD_MGPY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "mgi.h"

/* The platform layer this module was built with (setup.py sets it). */
#ifndef MG_PLATFORM
#define MG_PLATFORM "linux"
#endif

/* Per-module state (multi-phase init). */
typedef struct mgpy_state {
    PyTypeObject *sampler_type;
    PyTypeObject *pressure_type;
    PyTypeObject *planner_type;
} mgpy_state_t;

mgpy_state_t *mgpy_state(PyObject *module);

/* errors.c: the one place C error codes become Python exceptions. */
PyObject *mgpy_raise(int rc, const char *what);

/* convert.c: mg_sample_t <-> dict, driven by one field table. */
PyObject *mgpy_sample_to_dict(const mg_sample_t *s);
int mgpy_sample_from_dict(PyObject *d, mg_sample_t *s);
PyObject *mgpy_sample_fields(void);
int mgpy_pressure_opts(PyObject *mapping, mg_pressure_opts_t *o);

/* parsers.c */
PyObject *mgpy_parse(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mgpy_parse_size(PyObject *m, PyObject *arg);
PyObject *mgpy_parse_budget(PyObject *m, PyObject *args, PyObject *kw);

/* options.c */
PyObject *mgpy_option_get(PyObject *m, PyObject *arg);
PyObject *mgpy_option_set(PyObject *m, PyObject *args);
PyObject *mgpy_option_names(PyObject *m, PyObject *unused);
PyObject *mgpy_option_warnings(PyObject *m, PyObject *unused);
PyObject *mgpy_option_check(PyObject *m, PyObject *unused);

/* arena.c */
PyObject *mgpy_install(PyObject *m, PyObject *args);
PyObject *mgpy_uninstall(PyObject *m, PyObject *unused);
PyObject *mgpy_installed(PyObject *m, PyObject *unused);
PyObject *mgpy_preloaded(PyObject *m, PyObject *unused);
PyObject *mgpy_arena_stats(PyObject *m, PyObject *unused);
PyObject *mgpy_arena_set_budget(PyObject *m, PyObject *arg);
PyObject *mgpy_arena_trim(PyObject *m, PyObject *args);
PyObject *mgpy_arena_set_cache_limit(PyObject *m, PyObject *arg);
PyObject *mgpy_arena_reset_peaks(PyObject *m, PyObject *unused);
PyObject *mgpy_arena_decay(PyObject *m, PyObject *args);
PyObject *mgpy_arena_set_soft(PyObject *m, PyObject *arg);
PyObject *mgpy_arena_strict(PyObject *m, PyObject *arg);
PyObject *mgpy_swap_in(PyObject *m, PyObject *unused);
PyObject *mgpy_live_budget(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mgpy_system_trim(PyObject *m, PyObject *unused);

/* cuda.c */
PyObject *mgpy_cuda_init(PyObject *m, PyObject *args, PyObject *kw);
PyObject *mgpy_cuda_backend(PyObject *m, PyObject *unused);
PyObject *mgpy_cuda_detach(PyObject *m, PyObject *unused);
PyObject *mgpy_cuda_stats(PyObject *m, PyObject *arg);
PyObject *mgpy_cuda_set_budget(PyObject *m, PyObject *args);
PyObject *mgpy_cuda_trim(PyObject *m, PyObject *args);
PyObject *mgpy_cuda_reset_peaks(PyObject *m, PyObject *arg);
PyObject *mgpy_cuda_host_used(PyObject *m, PyObject *unused);

/* sampler.c, pressure.c: type specs */
extern PyType_Spec mgpy_sampler_spec;
extern PyType_Spec mgpy_pressure_spec;
extern PyType_Spec mgpy_planner_spec;

#endif
