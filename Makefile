# make demo: set up .venv (deps + pk_jax with its CUDA extension when nvcc is found) and train
#            the tensor-parallel MLP example.
# make test: set up .venv and run the test suite (CPU: 8 host devices; GPU tests need an H100/H200).
# jax 0.11 needs Python >= 3.12 (and 3.12 builds the stable-ABI module the GPU machine loads):
# take the first such interpreter on the PATH or under pyenv.
PYTHON ?= $(shell for p in python3.12 python3.13 python3 $$(ls -d $$HOME/.pyenv/versions/3.1[2-9]*/bin/python 2>/dev/null); do \
            $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Versions of the GPU machine's image (GPU_MACHINE.md), so CPU tests and GPU runs agree.
DEPS   := "jax==0.11.2" "flax==0.12.10" "equinox==0.13.8" optax "nanobind==3.1.0" \
          "scikit-build-core>=0.10" "cmake>=3.26" ninja pytest pytest-timeout
PK_JAX_CUDA ?= AUTO

.PHONY: setup demo test clean

$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard ffi/* cuda/include/pk/* cuda/kernels/*)
	@test -n "$(PYTHON)" || { echo 'pk_jax needs Python >= 3.12 (set PYTHON=...)'; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(DEPS)
	PATH=$(abspath $(VENV))/bin:$$PATH PK_JAX_CUDA=$(PK_JAX_CUDA) \
	  $(PIP) install -q --no-build-isolation --no-deps .
	cd / && $(abspath $(PY)) -c "import pk_jax; print('pk_jax', pk_jax.__version__, 'HAS_CUDA', pk_jax.HAS_CUDA)"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/01_tp_mlp_flax.py

test: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build
