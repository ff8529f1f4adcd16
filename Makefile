# The README's commands. `make run` and `make test` set up .venv first when needed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
# Prefect's temporary API and vLLM's CPU backend both want the cores to themselves; one
# pytest process keeps the default suite predictable on a 2-core machine.
PYTEST := $(PY) -m pytest -p no:cacheprovider

.PHONY: setup run test test-slow lint format clean bench bench-data simulate sim-profile

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/sluice run $(CONFIG)

test: setup
	$(PYTEST) -m "not slow and not gpu"

# pytest exits 5 when no test carries the marker: not a failure here.
test-slow: setup
	$(PYTEST) -m "slow and not gpu" || [ $$? -eq 5 ]

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy rl envs engines/protocols.py storage tasks/tracking.py sim

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf runs .cache

# Each writes its own section of BENCHMARKS.md; `make bench-data` alone takes ~3 minutes.
bench: bench-data
	$(PY) -m benchmarks.modes --steps 200

bench-data: setup
	$(PY) -m benchmarks.data_planes

# The simulator: its calibration check against the modes table, then its predictions at
# 64-1024 accelerators; each writes a BENCHMARKS.md section (~7 minutes, pure Python).
simulate: setup
	$(PY) -m sim.calibrate --write
	$(PY) -m sim.scale

# Re-measure this machine's costs for the simulator: a short real sync run on the long-tail
# config, then the streaming engine timed in-process (~5 minutes; run it on a quiet machine).
SIM_RUN ?= sim-calibration
sim-profile: setup
	$(VENV)/bin/sluice run configs/longtail.yaml --set mode=sync --set train.steps=60 \
		--set name=$(SIM_RUN) --set eval.every=60 --set eval.prompts=64
	$(PY) -m benchmarks.sim_profile --run runs/$(SIM_RUN) --policy runs/$(SIM_RUN)/policy \
		--out sim/profiles/cpu2core.json
