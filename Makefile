# Two commands on a fresh machine with only Python 3.11: `make demo` and `make test`.
# Both create .venv and install what the project needs (torch 2.13.0 CPU build first,
# so that no multi-GB CUDA build is pulled in). `make test` also runs the linter and the formatter check.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test install clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(BIN)/.installed

demo: $(BIN)/.installed
	$(BIN)/densebatch train

test: $(BIN)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2

clean:
	rm -rf $(VENV) .densebatch-cache runs
