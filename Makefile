# memguard: `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.memguard-deps
EXT    := python/memguard/_C$(shell $(PYTHON) -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
CSRC   := $(wildcard csrc/*/*.c csrc/*/*.h csrc/platform/*/*.c csrc/platform/*/*.h \
            include/memguard/*.h)

.PHONY: all build posix test test-posix ctest demo bench fuzz system-deps lint clean

all: build

$(DEPS): requirements-dev.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(EXT): $(DEPS) $(CSRC) setup.py
	$(PY) setup.py -q build_ext --inplace

build: $(EXT)

test: build posix
	$(PY) -m pytest -q -rs --durations=25
	$(MAKE) --no-print-directory test-posix

# The POSIX fallback layer (what a Unix without its own layer builds), built
# here with MEMGUARD_PLATFORM=posix into build/posix/, and the
# platform-independent tests run on it: all but those that never reach the
# platform layer (the planner's C core and the batch split, the same code on
# both layers: the main suite ran them). PORTABLE_TESTS is what a platform
# with no CI of its own runs (docs/platforms.md).
POSIX_LIB := build/posix/lib
PORTABLE_TESTS := tests/test_platform.py tests/test_planner.py tests/test_batch.py \
  tests/test_step_transaction.py tests/test_guard.py tests/test_guard_oom.py \
  tests/test_lightning.py tests/test_gradcache.py tests/test_checkpoint.py tests/test_mps.py
LAYER_FREE_TESTS := tests/test_planner.py tests/test_batch.py

posix: $(DEPS) $(CSRC) setup.py
	MEMGUARD_PLATFORM=posix $(PY) setup.py -q build --build-base build/posix \
	  --build-lib $(POSIX_LIB) >/dev/null

test-posix: posix
	MEMGUARD_PLATFORM=posix PYTHONPATH=$(POSIX_LIB) $(PY) -m pytest -q -rs -p no:cacheprovider \
	  $(filter-out $(LAYER_FREE_TESTS),$(PORTABLE_TESTS))

# The C unit tests alone: plain, under AddressSanitizer + UBSan, and under
# ThreadSanitizer (each skips where the compiler lacks its runtime).
ctest: build
	$(PY) -m pytest -q tests/test_c.py

# The main job on its embedded defaults: a ViT trained under a memory limit,
# the plain loop and then memguard, side by side (memguard alone under a
# budget where no limit can be set), then the report of memguard's run.
demo: build
	@mkdir -p out
	$(PY) -m memguard demo --out out
	$(PY) -m memguard report out/demo-memguard.jsonl -o out/demo-memguard.html
	@echo "side by side: out/demo-report.png; memguard's run: out/demo-memguard.html"

# memguard's benchmarks, a pytest-benchmark suite: timings of each configuration,
# the side-by-side ratios in the terminal summary and in out/bench.json; each run
# is also saved under .benchmarks/ for `--benchmark-compare` (see docs/benchmarks.md).
# BENCH_ARGS passes options on, e.g. BENCH_ARGS="--benchmark-compare -k throttle".
BENCH_ARGS ?=
bench: build
	$(PY) -m pip install -q accelerate || echo "accelerate not installed: bench_throttle leaves out its column"
	@mkdir -p out
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-autosave \
	  --benchmark-json=out/bench.json -p no:cacheprovider $(BENCH_ARGS)

# libFuzzer targets over the C parsers (/proc and cgroup files, budgets,
# options), FUZZ_SECONDS each under ASan + UBSan + LeakSanitizer; needs clang
# with libFuzzer (`make system-deps`). `make test` runs each for 5 s where
# it is present, and elsewhere passes their seeds through them built with the
# C compiler at hand (`tests/fuzz/run.py --replay`).
FUZZ_SECONDS ?= 600
fuzz: $(DEPS)
	$(PY) tests/fuzz/run.py --seconds $(FUZZ_SECONDS)

# Optional system packages: jemalloc for `memguard run` (its tests skip
# without it) and clang with its libFuzzer runtime for the fuzz targets
# (without it their tests replay the seeds through the targets built with the
# C compiler at hand). Installed where the user is root and has apt-get;
# elsewhere what to install is said. A failed install fails nothing.
LIBFUZZER_PROBE := int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }
system-deps:
	@install() { \
	  [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null || return 2; \
	  [ -n "$$updated" ] || apt-get update -qq >/dev/null 2>&1; updated=1; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$$@" \
	    >/dev/null 2>&1; }; \
	libfuzzer() { mkdir -p build && echo '$(LIBFUZZER_PROBE)' | clang -fsanitize=fuzzer,address,undefined \
	  -x c - -o build/libfuzzer-probe >/dev/null 2>&1; }; \
	updated=; \
	if ldconfig -p 2>/dev/null | grep -q libjemalloc.so.2; then echo "libjemalloc2: present"; \
	else install libjemalloc2; case $$? in \
	  0) echo "libjemalloc2: installed";; \
	  2) echo "libjemalloc2: absent; install it (apt-get install libjemalloc2) to test with jemalloc";; \
	  *) echo "libjemalloc2: not installed (jemalloc tests skip)";; esac; fi; \
	if libfuzzer; then echo "clang: present, with libFuzzer"; \
	else install clang libclang-rt-dev || install clang; case $$? in \
	  2) echo "clang: absent; install it (apt-get install clang libclang-rt-dev) to run the fuzz targets";; \
	  *) if libfuzzer; then echo "clang: installed, with libFuzzer"; \
	     else echo "clang: not installed with libFuzzer (the fuzz tests replay the seeds instead)"; fi;; \
	  esac; fi

lint: $(DEPS)
	$(VENV)/bin/ruff check python tests benchmarks examples

clean:
	rm -rf build python/memguard/_C*.so out .pytest_cache
