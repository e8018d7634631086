# Two commands on a fresh machine with only Python 3.11: `make demo` and `make test`.
# Both create .venv and install what the project needs (torch 2.13.0 CPU build first,
# so that no multi-GB CUDA build is pulled in). `make test` also runs the linter and the formatter check.
# constraints.txt pins every other package to the versions the suite last passed with, so that a
# release upstream cannot change a test run between two commits (transformers 5.25 once did);
# pyproject.toml keeps the ranges a user's `pip install densebatch` gets. To try the newest releases:
# `make test CONSTRAINTS=`; when that passes, `make lock` writes them into constraints.txt (pinned for
# Python 3.11, like the rest of this file). Each way has its own install stamp, and installing one
# removes the other's, so switching back to the pins reinstalls them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= constraints.txt
STAMP := $(BIN)/.installed$(if $(CONSTRAINTS),,-newest)
# Writers the format tests build corpora with that cannot be installed with their requirements: litdata
# (it requires torchvision, whose PyPI build is CUDA's, does not load beside the CPU torch and then breaks
# transformers' model imports) and mosaicml-streaming (it also pins numpy<2.2 and transformers<5). They go
# in with --no-deps, with only what their writers import (boto3 & co.: litdata's import; brotli, snappy,
# zstd, catalogue: streaming's); their versions are pinned in constraints.txt with the rest.
NO_DEPS_WRITERS := litdata lightning-utilities boto3 botocore jmespath s3transfer \
	mosaicml-streaming brotli python-snappy cramjam zstd xxhash catalogue

.PHONY: demo test install clean lock

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	rm -f $(BIN)/.installed $(BIN)/.installed-newest
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q $(if $(CONSTRAINTS),-c $(CONSTRAINTS),-U --upgrade-strategy eager torch==2.13.0) -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(if $(CONSTRAINTS),-c $(CONSTRAINTS),-U) $(NO_DEPS_WRITERS)
	touch $@

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/densebatch train

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2

lock:
	test -x $(BIN)/pip || { echo "make lock: no $(VENV) to read: run make test first"; exit 1; }
	{ echo "# Written by make lock: the versions make install last passed make test with (see Makefile)."; \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

clean:
	rm -rf $(VENV) .densebatch-cache runs
