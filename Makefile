# Quick start: `make run` (the default experiment) and `make test` (the test suite).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install run test test-all lint format bench doctor comm slurm-start slurm-stop

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install-torch.sh
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet uv  # installs the rest: 40 s where pip takes 75-130 s
	scripts/install-torch.sh $(PY)
	$(VENV)/bin/uv pip install --quiet --compile-bytecode --python $(PY) -e '.[dev,hf,ft,float8]'
	touch $@

run: install
	$(VENV)/bin/meshrun

# The fast suite (two test modules at a time) with the tests that wait on a clock and the
# SLURM tests in one lane beside it (scripts/run-tests.sh says how and why).
test: install
	scripts/run-tests.sh $(PY)

test-all: install
	$(PY) -m pytest -n 2 --dist loadscope -m "not slurm and not alone"
	$(PY) -m pytest -m "alone and not slurm"
	$(PY) -m pytest -m slurm

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/lint-imports --no-cache

format: install
	$(VENV)/bin/ruff check --fix src tests benchmarks
	$(VENV)/bin/ruff format src tests benchmarks

bench: install
	$(PY) benchmarks/ddp_overhead.py
	$(PY) benchmarks/pipeline_overhead.py
	$(PY) benchmarks/tensor_parallel_overhead.py
	$(PY) -m benchmarks.planner_accuracy

doctor: install
	$(VENV)/bin/meshrun-doctor

comm: install
	$(VENV)/bin/meshrun-comm

# A real two-node SLURM cluster on this machine (root), for launcher=slurm and its tests.
slurm-start:
	scripts/slurm-cluster.sh start

slurm-stop:
	scripts/slurm-cluster.sh stop
