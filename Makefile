# The README's two commands: `make demo` and `make test`. Both work on a fresh machine
# that has only python3 (3.10+), pip and make: they create .venv and install posenc
# with its extras, torch pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.posenc-installed
OUT ?= posenc-out

.PHONY: demo test lint setup clean

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

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache .ruff_cache
