# `make release` runs the monthly release on the embedded default; `make test` runs the tests.
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

PREFECT_PORT ?= 4200

.PHONY: release test prefect clean

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

test: $(STAMP)
	$(PY) -m pytest -q

# A local Prefect server (UI at http://127.0.0.1:$(PREFECT_PORT)) and the monthly-release deployment
# served from this checkout until Ctrl-C; the server stops with it.
prefect: $(STAMP)
	$(PY) -m flows.local_server --port $(PREFECT_PORT) -- $(PY) -m flows.serve --params params.yaml

clean:
	rm -rf artifacts data models
