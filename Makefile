# The README's two commands: `make demo` and `make test`. Both work on a fresh machine
# that has only python3 (3.10+), pip and make: they create .venv and install posenc
# with its extras, torch pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.posenc-installed
OUT ?= posenc-out

# `make test` runs the numerical tests (marker `numerical`, set by tests/conftest.py on the
# tests that compare with tests/tolerances.py) once more per kernel set: ATen's AVX2
# kernels (a CPU without AVX-512) and its plain C++ ones, MKL and oneDNN capped alike, so
# that a tolerance tuned to this CPU's rounding fails here rather than on a user's machine.
# Slow and compiled tests are left out (inductor's cache does not key on the kernel set,
# and FlexAttention on a CPU needs AVX2); each set still gets its own inductor cache.
KERNEL_SETS ?= avx2 default
NUMERICAL := -m "numerical and not slow and not compile"
MKL_ISA_avx2 := AVX2
MKL_ISA_default := SSE4_2
ONEDNN_ISA_avx2 := AVX2
ONEDNN_ISA_default := SSE41

.PHONY: demo test lint setup clean $(addprefix test-kernels-,$(KERNEL_SETS))

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev,plot]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/posenc demo --out $(OUT)/

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools
	$(VENV)/bin/ruff format --check src tests tools

test: lint
	$(PY) -m pytest -q
	$(MAKE) --no-print-directory $(addprefix test-kernels-,$(KERNEL_SETS))

$(addprefix test-kernels-,$(KERNEL_SETS)): test-kernels-%: $(STAMP)
	@echo "numerical tests under ATEN_CPU_CAPABILITY=$*"
	ATEN_CPU_CAPABILITY=$* MKL_ENABLE_INSTRUCTIONS=$(MKL_ISA_$*) ONEDNN_MAX_CPU_ISA=$(ONEDNN_ISA_$*) \
		TORCHINDUCTOR_CACHE_DIR=$(abspath $(VENV))/inductor-$* $(PY) -m pytest -q $(NUMERICAL)

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache
