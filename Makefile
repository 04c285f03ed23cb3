# eagle3_ops — `make demo` and `make test` work on a fresh machine (Python 3.11, optional nvcc).
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Everything through uv (parallel downloads and unpacking). uv does not read pip's configuration, so
# it is given the package folders pip is configured with on this machine (extra-index-url, find-links:
# torch's several GB come from the disk there, ~30 s instead of pip's ~80 s, measured on a 2-core box of
# the CI kind), and merges versions across indexes as pip does (unsafe-best-match).
UV     := $(VENV)/bin/uv
UV_LOCAL = $(shell for u in $$($(PYTHON) -m pip config get global.extra-index-url 2>/dev/null); do \
		case "$$u" in (file://*) [ -d "$$(echo "$$u" | cut -c8-)" ] || continue;; esac; printf -- '--extra-index-url %s ' "$$u"; done; \
	for l in $$($(PYTHON) -m pip config get global.find-links 2>/dev/null); do \
		[ -d "$$l" ] && printf -- '--find-links %s ' "$$l"; done)
TORCH_VERSION  ?= 2.14.1
TORCHVISION_VERSION ?= 0.29.1
SGLANG_VERSION ?= 0.5.23
RUFF_VERSION ?= 0.17.6

.PHONY: venv deps build install demo test test-real-size test-fast bench clean

# pip prints a warning per package for the machine's local index folders; keep the log readable.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
QUIET_PIP := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

# Python writes the .pyc files of what it imports (uv does not compile at install; compiling all of
# torch, SGLang and transformers there cost ~2 minutes here). With PYTHONDONTWRITEBYTECODE set (it is on
# this machine) every fresh interpreter would compile its imports from source again: the suite ran
# 635 s instead of ~350 s.
unexport PYTHONDONTWRITEBYTECODE
UV_INSTALL = $(UV) pip install -q --python $(PY) $(UV_LOCAL) --index-strategy unsafe-best-match
TORCH_REQS = "torch==$(TORCH_VERSION)" "torchvision==$(TORCHVISION_VERSION)"

# What the extension builds against first, so that it compiles (CPU) while uv fetches the rest (network).
$(VENV)/.torch-stamp: Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q uv $(QUIET_PIP)
	$(UV_INSTALL) pip "setuptools>=68" wheel ninja $(TORCH_REQS)
	touch $@

$(VENV)/.deps-stamp: $(VENV)/.torch-stamp
	$(UV_INSTALL) $(TORCH_REQS) "sglang==$(SGLANG_VERSION)" \
		pytest pytest-benchmark pytest-xdist hypothesis safetensors transformers tabulate cmake "ruff==$(RUFF_VERSION)"
	$(PY) -c "import torch, sglang, pytest, triton; assert torch.__version__.startswith('$(TORCH_VERSION)'), torch.__version__"
	touch $@

deps: $(VENV)/.deps-stamp

# Builds the CUDA extension when nvcc is found (see setup.py); the full log is in .venv/build.log.
# --no-deps: the dependencies are the Makefile's (deps), installed beside the build.
build: $(VENV)/.torch-stamp
	MAX_JOBS=$${MAX_JOBS:-2} $(PIP) install --no-build-isolation --no-deps -v -e . > $(VENV)/build.log 2>&1 \
		|| (tail -40 $(VENV)/build.log; exit 1)

install:
	$(MAKE) --no-print-directory -j2 build deps
	grep "eagle3_ops build:" $(VENV)/build.log || true
	$(PY) -c "import eagle3_ops; print('eagle3_ops build info:', eagle3_ops.build_info())"

demo: install
	$(PY) -m eagle3_ops demo

# Two workers (PYTEST_WORKERS), one file per worker at a time (module fixtures build SGLang models
# once), one intra-op thread each: the CI machine has 2 cores. benchmarks/test_device_check.py checks the
# device script (its dry run, its report) without a GPU.
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -p no:cacheprovider -n $${PYTEST_WORKERS:-2} --dist loadfile tests \
		benchmarks/test_device_check.py -m "not real_size"

# The live check's replay at the seed's real dimensions (tests/test_replay_real_size.py): ~20 minutes, ~10 GB disk.
test-real-size: install
	$(PY) -m pytest -q -s -p no:cacheprovider tests/test_replay_real_size.py -m real_size

bench: install
	$(PY) -m pytest -q benchmarks --benchmark-columns=median,min,max

clean:
	rm -rf build *.egg-info eagle3_ops/*.so
