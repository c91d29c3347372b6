/* memguard._C: the method table and module setup. The work lives in the
 * files beside this one, by subject. */
#include "mgpy.h"

mgpy_state_t *mgpy_state(PyObject *module)
{
    return (mgpy_state_t *)PyModule_GetState(module);
}

static PyObject *sample_fields(PyObject *m, PyObject *unused)
{
    (void)m;
    (void)unused;
    return mgpy_sample_fields();
}

static PyMethodDef methods[] = {
    {"parse", (PyCFunction)(void (*)(void))mgpy_parse, METH_VARARGS | METH_KEYWORDS,
     "parse(kind, data, version=2) -> dict: run one pure /proc or cgroup parser."},
    {"parse_size", mgpy_parse_size, METH_O, "parse_size(text) -> bytes"},
    {"live_budget", (PyCFunction)(void (*)(void))mgpy_live_budget, METH_VARARGS | METH_KEYWORDS,
     "live_budget(sample, user=0, reserve=0.0) -> (bytes, 'user'|'cgroup'|'host'), or None "
     "when neither a budget nor a reading says"},
    {"parse_budget", (PyCFunction)(void (*)(void))mgpy_parse_budget,
     METH_VARARGS | METH_KEYWORDS, "parse_budget(text, total, available=0) -> bytes"},
    {"option_get", mgpy_option_get, METH_O, "option_get(name) -> text"},
    {"option_set", mgpy_option_set, METH_VARARGS, "option_set(name, value)"},
    {"option_names", mgpy_option_names, METH_NOARGS, "Names of all options."},
    {"option_check", mgpy_option_check, METH_NOARGS,
     "option_check() -> None, or why the thresholds are out of order"},
    {"option_warnings", mgpy_option_warnings, METH_NOARGS,
     "Warnings about bad MEMGUARD_* values, each returned once."},
    {"sample_fields", sample_fields, METH_NOARGS, "Field names of a sample dict."},
    {"install", mgpy_install, METH_VARARGS,
     "install(prefix='libc10.so') -> slots rewritten: route its tensor memory to the arena."},
    {"uninstall", mgpy_uninstall, METH_NOARGS, "Give posix_memalign back (free stays hooked)."},
    {"installed", mgpy_installed, METH_NOARGS, "Whether the allocator is installed."},
    {"preloaded", mgpy_preloaded, METH_NOARGS, "Whether the preload shim is in the process."},
    {"arena_stats", mgpy_arena_stats, METH_NOARGS, "The arena's counters as a flat dict."},
    {"arena_set_budget", mgpy_arena_set_budget, METH_O, "Budget in bytes (0: none)."},
    {"arena_trim", mgpy_arena_trim, METH_VARARGS,
     "arena_trim(keep=0) -> bytes given back to the kernel from the cache."},
    {"arena_reset_peaks", mgpy_arena_reset_peaks, METH_NOARGS, "Peaks := current values."},
    {"arena_set_soft", mgpy_arena_set_soft, METH_O,
     "arena_set_soft(bool): outside strict sections, serve and count what the budget refuses."},
    {"arena_strict", mgpy_arena_strict, METH_O,
     "arena_strict(bool): open or close the section where a soft budget refuses."},
    {"swap_in", mgpy_swap_in, METH_NOARGS,
     "swap_in() -> bytes the mappings held in swap: fault this process's swapped-out "
     "pages back in."},
    {"arena_decay", mgpy_arena_decay, METH_VARARGS,
     "arena_decay(age) -> bytes released: a step boundary; cached blocks not reused at the "
     "last age boundaries go back to the kernel."},
    {"arena_set_cache_limit", mgpy_arena_set_cache_limit, METH_O,
     "Most bytes of freed large blocks kept cached (0: no limit)."},
    {"cuda_init", (PyCFunction)(void (*)(void))mgpy_cuda_init, METH_VARARGS | METH_KEYWORDS,
     "cuda_init(backend, path=None, capacity=0) -> where: back the CUDA allocator with the "
     "CUDA runtime ('cuda') or host memory ('host', tests)."},
    {"cuda_backend", mgpy_cuda_backend, METH_NOARGS, "Backend of the CUDA allocator, or None."},
    {"cuda_detach", mgpy_cuda_detach, METH_NOARGS,
     "cuda_detach(): back the CUDA allocator with nothing again (its cache released); "
     "RuntimeError while blocks are in use."},
    {"cuda_stats", mgpy_cuda_stats, METH_O, "cuda_stats(device) -> counters as a flat dict."},
    {"cuda_set_budget", mgpy_cuda_set_budget, METH_VARARGS,
     "cuda_set_budget(device, bytes): 0 for none."},
    {"cuda_trim", mgpy_cuda_trim, METH_VARARGS,
     "cuda_trim(device=-1) -> bytes released to the backend."},
    {"cuda_reset_peaks", mgpy_cuda_reset_peaks, METH_O, "cuda_reset_peaks(device)."},
    {"cuda_host_used", mgpy_cuda_host_used, METH_NOARGS,
     "Bytes the host backend holds (tests)."},
    {"system_trim", mgpy_system_trim, METH_NOARGS,
     "system_trim() -> 'jemalloc' | 'glibc' | 'none': give malloc's free memory back."},
    {NULL, NULL, 0, NULL},
};

static int exec_module(PyObject *m)
{
    mgpy_state_t *st = mgpy_state(m);
    st->sampler_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &mgpy_sampler_spec, NULL);
    if (!st->sampler_type || PyModule_AddType(m, st->sampler_type))
        return -1;
    st->pressure_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &mgpy_pressure_spec, NULL);
    if (!st->pressure_type || PyModule_AddType(m, st->pressure_type))
        return -1;
    st->planner_type = (PyTypeObject *)PyType_FromModuleAndSpec(m, &mgpy_planner_spec, NULL);
    if (!st->planner_type || PyModule_AddType(m, st->planner_type))
        return -1;
    if (PyModule_AddStringConstant(m, "PLATFORM", MG_PLATFORM) ||
        PyModule_AddIntConstant(m, "SAMPLE_VERSION", MG_SAMPLE_VERSION) ||
        PyModule_AddIntConstant(m, "WAKE_LEVEL", MG_WAKE_LEVEL) ||
        PyModule_AddIntConstant(m, "WAKE_SAMPLE", MG_WAKE_SAMPLE) ||
        PyModule_AddIntConstant(m, "WAKE_USER", MG_WAKE_USER))
        return -1;
    return 0;
}

static int traverse(PyObject *m, visitproc visit, void *arg)
{
    mgpy_state_t *st = mgpy_state(m);
    Py_VISIT(st->sampler_type);
    Py_VISIT(st->pressure_type);
    Py_VISIT(st->planner_type);
    return 0;
}

static int clear(PyObject *m)
{
    mgpy_state_t *st = mgpy_state(m);
    Py_CLEAR(st->sampler_type);
    Py_CLEAR(st->pressure_type);
    Py_CLEAR(st->planner_type);
    return 0;
}

static void free_module(void *m)
{
    clear((PyObject *)m);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED},
#endif
    /* Py_mod_gil is left at its default (the GIL is used): PressureModel and
     * Sampler objects are not locked against free-threaded callers. */
    {0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "memguard._C",
    .m_doc = "memguard's C core: telemetry sampler, pressure model, parsers, options.",
    .m_size = sizeof(mgpy_state_t),
    .m_methods = methods,
    .m_slots = slots,
    .m_traverse = traverse,
    .m_clear = clear,
    .m_free = free_module,
};

PyMODINIT_FUNC PyInit__C(void)
{
    return PyModuleDef_Init(&module_def);
}
