# batchgen developer entry points. `make demo` and `make test` are the README's two set-up commands.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# On these CPU machines torch==2.13.0 resolves to a local CPU wheel; on a GPU box override with
# e.g. `make install TORCH=torch` to get the usual CUDA build, or keep an existing torch.
TORCH ?= torch==2.13.0
DEMO_MODEL := examples/tiny-llama

.PHONY: install test test-slurm test-gpu lint format demo clean-demo

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# numpy < 2.3: triton 3.6's interpreter (TRITON_INTERPRET=1, used by the kernel tests) breaks on 2.4.
install: $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q "numpy<2.3" -e ".[test]"

test: install
	TRITON_INTERPRET=1 $(BIN)/pytest -m "not gpu and not slurm"

# examples/slurm/ on a real one-node Slurm cluster (as root; installs slurm-wlm and munge
# with apt-get if they are missing). .ci/run runs it; there a missing Slurm fails the test.
test-slurm: install
	$(BIN)/pytest -m slurm tests/slurm

# On a CUDA machine: every test including the @pytest.mark.gpu ones, kernels compiled for real.
test-gpu:
	$(PYTHON) -m pytest -m gpu tests

lint: install
	$(BIN)/ruff check batchgen kernels tests examples
	$(BIN)/ruff format --check batchgen kernels tests examples

format: install
	$(BIN)/ruff format batchgen kernels tests examples
	$(BIN)/ruff check --fix batchgen kernels tests examples

$(DEMO_MODEL)/config.json: install
	$(BIN)/batchgen make-model --arch llama --preset tiny $(DEMO_MODEL)

demo: install $(DEMO_MODEL)/config.json
	$(BIN)/batchgen run jobs/summarize.yaml
	$(BIN)/batchgen status out/summarize

clean-demo:
	rm -rf out/summarize
