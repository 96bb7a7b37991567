# Two commands do everything on a fresh machine:
#   make demo   install into .venv and run the main job on the embedded default
#   make test   install into .venv and run the full test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch is pinned to the CPU build that lies on our machines: an unpinned torch pulls a
# multi-GB CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: install demo test test-lmcache bench-lmcache bench clean proto

$(BIN)/activate:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/activate
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)" -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/statestore demo

test: install
	$(BIN)/python -m pytest -q
	$(MAKE) test-lmcache

# LMCache interop (tests/lmcache, bench/lmcache_compare.py) runs in a second venv: LMCache 0.5.6 pins
# grpcio==1.78.0, protobuf<7, numpy<=2.2.6. Its light route: the deps LMCache imports on the CPU and
# our runtime deps held to its pins, then lmcache and our package without their declared deps
# (LMCache declares CUDA, cloud and telemetry packages it does not import here).
LMCACHE_VENV ?= .venv-lmcache
LBIN         := $(LMCACHE_VENV)/bin
LMCACHE_DEPS := sortedcontainers pyyaml requests cachetools "prometheus_client>=0.18,<=0.24.1" py-cpuinfo psutil aiohttp \
                "numpy<=2.2.6" numba aiofile aiofiles msgspec pyzmq transformers cryptography redis "setuptools>=77,<81"
OUR_DEPS     := grpcio==1.78.0 grpcio-health-checking==1.78.0 grpcio-reflection==1.78.0 "protobuf>=6.31.1,<7" \
                "zstandard>=0.22" "xxhash>=3.4" "pytest>=8" "pytest-asyncio>=0.24" "pytest-timeout>=2.3"

$(LMCACHE_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(LMCACHE_VENV)
	echo '*' > $(LMCACHE_VENV)/.gitignore
	$(LBIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(LBIN)/pip install -q --disable-pip-version-check "$(TORCH)" $(LMCACHE_DEPS) $(OUR_DEPS)
	$(LBIN)/pip install -q --disable-pip-version-check --no-deps lmcache==0.5.6 -e .
	touch $@

# STATESTORE_REQUIRE_LMCACHE=1: a missing lmcache fails these tests instead of skipping them.
test-lmcache: $(LMCACHE_VENV)/.installed
	STATESTORE_REQUIRE_LMCACHE=1 PYTHONHASHSEED=0 $(LBIN)/python -m pytest -q tests/lmcache

# statestore behind LMCache against LMCache's own tiers (needs Redis on 127.0.0.1:6379). ARGS=--quick
bench-lmcache: $(LMCACHE_VENV)/.installed
	PYTHONHASHSEED=0 $(LBIN)/python -m bench.lmcache_compare $(ARGS)

proto: install
	PYTHON=$(BIN)/python scripts/gen_proto.sh

clean:
	rm -rf $(VENV) $(LMCACHE_VENV) .pytest_cache .hypothesis
