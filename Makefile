# Two commands set up and use hfl on a fresh machine (Python >= 3.11):
#   make run    - install into .venv if needed, run the default experiment (ARGS="..." for Hydra overrides)
#   make test   - install into .venv if needed, run the test suite
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/hfl-simulate $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun
