# The two quick-start commands: `make demo` (the main job) and `make test` (lint + tests).
# Each creates the virtual environment and installs the package with its test extra first.
VENV ?= .venv
PYTHON ?= python3
STAMP := $(VENV)/.installed

.PHONY: demo test install

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet -c constraints.txt -e '.[test,peers,plot,export]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/tvm-deform demo
	$(VENV)/bin/tvm-deform compare --quick

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/python -m pytest
