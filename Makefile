# Two commands on a fresh machine with only Python 3.11: `make demo` and `make test`.
# Both create .venv and install what the project needs (torch 2.13.0 CPU build first,
# so that no multi-GB CUDA build is pulled in). `make test` also runs the linter and the formatter check.
# constraints.txt pins every other package to the versions the suite last passed with, so that a
# release upstream cannot change a test run between two commits (transformers 5.25 once did);
# pyproject.toml keeps the ranges a user's `pip install densebatch` gets. To try the newest releases:
# `make clean test CONSTRAINTS=`; when that passes, `make lock` writes them into constraints.txt.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= constraints.txt

.PHONY: demo test install clean lock

$(BIN)/.installed: pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/densebatch train

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2

lock: $(BIN)/.installed
	{ echo "# Written by make lock: the versions make install last passed make test with (see Makefile)."; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt

clean:
	rm -rf $(VENV) .densebatch-cache runs
