# The two commands of the README: `make run` (the tiny DAPO run on CPU) and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: install run test lint

install:
	bash scripts/install.sh

run: install
	$(PYTHON) -m megatron_dapo.train examples/tiny_cpu.yaml

lint: install
	$(PYTHON) -m ruff check .

test: lint
	$(PYTHON) -m pytest -q tests
