# Two commands set up and use hfl on a fresh machine (Python >= 3.11):
#   make run    - install into .venv if needed, run the default experiment, experiment=demo (ARGS="..." for Hydra overrides)
#   make test   - install into .venv if needed, run the test suite: the default suite, then the
#                 deployment tests (real SuperLink/SuperNode processes, a few minutes)
PYTHON ?= python3
VENV ?= .venv
STAMP := $(VENV)/.installed

.PHONY: run test test-fast install clean

# pip's own output goes to $(VENV)/install.log (shown only if the install fails).
$(STAMP): pyproject.toml
	@echo "installing hfl into $(VENV) (a few minutes the first time; log: $(VENV)/install.log)"
	@$(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/pip install --quiet --upgrade pip > $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@$(VENV)/bin/pip install --quiet -e ".[dev]" >> $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	@$(VENV)/bin/hfl-simulate experiment=demo $(ARGS)

test: test-fast
	$(VENV)/bin/python -m pytest -q -m deployment

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun
