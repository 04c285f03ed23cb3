# eagle3_ops — `make demo` and `make test` work on a fresh machine (Python 3.11, optional nvcc).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch and torchvision come through pip (it finds them on the machine's disk); SGLang and the rest
# through uv, which fetches in parallel (about 25 s instead of pip's ~200 s, measured on a 2-core box of the CI kind).
UV     := $(VENV)/bin/uv
TORCH_VERSION  ?= 2.14.1
TORCHVISION_VERSION ?= 0.29.1
SGLANG_VERSION ?= 0.5.23

.PHONY: venv deps install demo test test-fast bench clean

# pip prints a warning per package for the machine's local index folders; keep the log readable.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
QUIET_PIP := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

$(VENV)/.deps-stamp: Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel $(QUIET_PIP)
	$(PIP) install -q "torch==$(TORCH_VERSION)" "torchvision==$(TORCHVISION_VERSION)" uv $(QUIET_PIP)
	$(UV) pip install -q --python $(PY) "sglang==$(SGLANG_VERSION)" "torch==$(TORCH_VERSION)" \
		"torchvision==$(TORCHVISION_VERSION)" \
		pytest pytest-benchmark pytest-xdist hypothesis safetensors transformers tabulate ninja cmake
	$(PY) -c "import torch, sglang, pytest, triton; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	touch $@

deps: $(VENV)/.deps-stamp

# Builds the CUDA extension when nvcc is found (see setup.py); the full log is in .venv/build.log.
install: deps
	MAX_JOBS=$${MAX_JOBS:-2} $(PIP) install --no-build-isolation -v -e . > $(VENV)/build.log 2>&1 || (tail -40 $(VENV)/build.log; exit 1)
	grep "eagle3_ops build:" $(VENV)/build.log || true
	$(PY) -c "import eagle3_ops; print('eagle3_ops build info:', eagle3_ops.build_info())"

demo: install
	$(PY) -m eagle3_ops demo

# Two workers (PYTEST_WORKERS), one file per worker at a time (module fixtures build SGLang models
# once), one intra-op thread each: the CI machine has 2 cores.
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -p no:cacheprovider -n $${PYTEST_WORKERS:-2} --dist loadfile tests

bench: install
	$(PY) -m pytest -q benchmarks --benchmark-columns=median,min,max

clean:
	rm -rf build *.egg-info eagle3_ops/*.so
