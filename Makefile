# Two commands do everything on a fresh machine:
#   make demo   install into .venv and run the main job on the embedded default
#   make test   install into .venv and run the full test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# torch is pinned to the CPU build that lies on our machines: an unpinned torch pulls a
# multi-GB CUDA build.
TORCH   ?= torch==2.13.0

.PHONY: install demo test bench clean proto

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

proto: install
	PYTHON=$(BIN)/python scripts/gen_proto.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
