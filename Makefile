# memguard: `make test` and `make demo` set everything up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
DEPS   := $(VENV)/.memguard-deps
EXT    := python/memguard/_C$(shell $(PYTHON) -c "import sysconfig;print(sysconfig.get_config_var('EXT_SUFFIX'))")
CSRC   := $(wildcard csrc/*/*.c csrc/*/*.h include/memguard/*.h)

.PHONY: all build test ctest demo bench lint clean

all: build

$(DEPS): requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(EXT): $(DEPS) $(CSRC) setup.py
	$(PY) setup.py -q build_ext --inplace

build: $(EXT)

test: build
	$(PY) -m pytest -q

# The C unit tests alone, plain and under AddressSanitizer + UBSan.
ctest: build
	$(PY) -m pytest -q tests/test_c.py

demo: build
	$(PY) -m memguard demo

bench: build
	$(PY) benchmarks/bench_sampler.py

lint: $(DEPS)
	$(VENV)/bin/ruff check python tests benchmarks

clean:
	rm -rf build python/memguard/_C*.so out .pytest_cache
