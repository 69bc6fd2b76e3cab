# Two commands set up and use hfl on a fresh machine (Python >= 3.11):
#   make run    - install into .venv if needed (with the docs and tracking extras the README's tour uses), run the
#                 default experiment, experiment=demo (ARGS="..." for Hydra overrides)
#   make test   - install into .venv if needed (with the test, docs and tracking extras), run the test suite: the
#                 default suite, then the deployment tests (real SuperLink/SuperNode processes, a few minutes)
# Both install the versions in constraints.txt, those the suite last passed with; `make lock` refreshes it
# from the newest releases, and CONSTRAINTS= (empty) installs the newest without pinning.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)
# Named anew when what `make run` installs changes, so that an existing .venv gets it too.
RUN_STAMP := $(VENV)/.installed-run-docs-track
TEST_STAMP := $(VENV)/.installed-test
# The tour's extras: logger=tensorboard|mlflow and their UIs, mkdocs serve (53 packages, 266 MB, 39 s beside hfl's own).
RUN_EXTRAS := docs,track
TEST_EXTRAS := dev,docs,track

.PHONY: run test test-fast test-slow test-deploy install lock clean

# pip's own output goes to $(VENV)/install.log (shown only if the install fails).
$(RUN_STAMP): pyproject.toml $(CONSTRAINTS)
	@echo "installing hfl into $(VENV) (a few minutes the first time; log: $(VENV)/install.log)"
	@$(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/pip install --quiet --upgrade pip > $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@$(VENV)/bin/pip install --quiet $(PIN) -e ".[$(RUN_EXTRAS)]" >> $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	@echo "installing the test extra (log: $(VENV)/install.log)"
	@$(VENV)/bin/pip install --quiet $(PIN) -e ".[$(TEST_EXTRAS)]" >> $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	@touch $(TEST_STAMP)

install: $(TEST_STAMP)

run: $(RUN_STAMP)
	@$(VENV)/bin/hfl-simulate experiment=demo $(ARGS)

test: test-fast
	$(VENV)/bin/python -m pytest -q -m "deployment and not slow"

# Every deployment test, the slow ones too (more algorithms, a device killed mid-run, real-time policies, secure
# aggregation, DP): 24 tests, 29 minutes on 2 cores.
test-deploy: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -q -m deployment $(ARGS)

# The long end-to-end runs left out of make test (Ray runs killed and resumed, signals on Ray, a two-node Ray
# cluster, FeMAM's trees): ~5 minutes.
test-slow: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -q -m "slow and not deployment" $(ARGS)

test-fast: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest -q $(ARGS)

# The newest releases of everything, installed into a scratch venv and frozen into constraints.txt;
# then `make test` installs and tests them (commit constraints.txt once it passes).
lock:
	@rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	@.lock-venv/bin/pip install --quiet --upgrade pip
	@.lock-venv/bin/pip install --quiet -e ".[$(TEST_EXTRAS)]"
	@(echo "# The versions hfl's test suite passed with (make lock refreshes it; see README)."; \
	  .lock-venv/bin/pip freeze --exclude-editable | grep -v '^-e ' | sort -f) > constraints.txt
	@rm -rf .lock-venv
	@echo "constraints.txt: $$(grep -vc '^#' constraints.txt) pins; now run make test"

clean:
	rm -rf $(VENV) outputs multirun .lock-venv site
