# Two entry points that set up everything they need (Debian packages, .venv, pip), idempotently:
#   make run   - run the daemon (config: $CHANDRAD_CONFIG, /etc/chandrad/config.toml, or embedded defaults)
#   make test  - the whole test suite (real Ghostscript, poppler, tesseract, SQLite, watchdog, vLLM on CPU)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test lint setup-run setup-test bench soak clean install

setup-run:
	@VENV=$(VENV) scripts/setup.sh run

setup-test:
	@VENV=$(VENV) scripts/setup.sh test

run: setup-run
	$(VENV)/bin/chandrad run $(if $(CONFIG),--config $(CONFIG))

# Lint, format, type and layer checks on chandrad/ (configured in pyproject.toml: ruff, mypy, and
# import-linter's contracts, the layers of docs/architecture.md); `make test` runs them
# first and stops if one fails. All run even when an earlier one fails, so one pass shows
# everything there is to fix. The grep: every `type: ignore[code]` says why after it
# (`# type: ignore[import-untyped]  # chandra-ocr ships no type hints`); ruff's PGH003 only
# asks for the code.
lint: setup-test
	@rc=0; \
	$(VENV)/bin/ruff check chandrad || rc=1; \
	$(VENV)/bin/ruff format --check chandrad || rc=1; \
	$(VENV)/bin/mypy || rc=1; \
	$(VENV)/bin/lint-imports --no-cache || rc=1; \
	if grep -rnE --include='*.py' 'type: *ignore(\[[^]]*\])? *$$' chandrad; then \
		echo "make lint: the type: ignore above carries no reason (add '  # why' after it)" >&2; rc=1; fi; \
	if [ $$rc -ne 0 ]; then echo "make lint: failed (ruff check --fix / ruff format fix most of it)" >&2; fi; exit $$rc

# Most tests two at a time (pytest-xdist, one test file per worker: CI has two cores and most
# tests wait on daemons, settle times and timeouts), then the `alone` ones, which measure time or
# memory, with nothing beside them (the event-loop test in a pytest of its own). pytest exits 5
# when it collects nothing; that is a failure here, like any other non-zero exit, in every run.
TEST_WORKERS ?= 2
# It runs the daemon inside pytest's own process and fails on any callback over 100 ms of wall
# time: in a process of its own, so that what earlier tests left in pytest's heap cannot lengthen
# its garbage collections (a 145 ms callback right after test_rel_load, 2026-12-02).
LOOP_TEST = tests/test_event_loop.py
# Each pytest run has a limit of its own (seconds; the whole suite takes ~25 min on CI's two
# cores): pytest-timeout ends a test that hangs, but not a hang outside a test (a worker's
# teardown, the controller waiting on a worker). At the limit pytest gets SIGINT, which makes it
# print its summary (what failed, which test a crashed worker was running), then SIGKILL a
# minute later; 124 is timeout(1)'s exit status for it. -rfEx: a crashed worker is named there.
SUITE_LIMIT ?= 2700
ALONE_LIMIT ?= 900
BOUNDED = HF_HUB_OFFLINE=1 timeout --signal=INT --kill-after=60
test: setup-test lint
	@rc=0; \
	$(BOUNDED) $(SUITE_LIMIT) $(PY) -m pytest -rfEx -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS) -m "not soak and not alone" tests || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests: that is a failure" >&2; fi; \
	if [ $$rc -eq 124 ]; then echo "make test: the suite ran past $(SUITE_LIMIT) s and was stopped: that is a failure" >&2; fi; \
	$(BOUNDED) $(ALONE_LIMIT) $(PY) -m pytest -rfEx $(PYTEST_ARGS) -m "alone and not soak" --ignore=$(LOOP_TEST) tests || rc2=$$?; \
	if [ "$${rc2:-0}" -eq 5 ]; then echo "make test: pytest collected no 'alone' tests: that is a failure" >&2; fi; \
	if [ "$${rc2:-0}" -eq 124 ]; then echo "make test: the 'alone' tests ran past $(ALONE_LIMIT) s and were stopped" >&2; fi; \
	$(BOUNDED) $(ALONE_LIMIT) $(PY) -m pytest -rfEx $(PYTEST_ARGS) -m "alone and not soak" $(LOOP_TEST) || rc3=$$?; \
	if [ "$${rc3:-0}" -eq 5 ]; then echo "make test: pytest collected no test in $(LOOP_TEST): that is a failure" >&2; fi; \
	if [ "$${rc3:-0}" -eq 124 ]; then echo "make test: $(LOOP_TEST) ran past $(ALONE_LIMIT) s and was stopped" >&2; fi; \
	if [ $$rc -eq 0 ]; then rc=$${rc2:-0}; fi; if [ $$rc -eq 0 ]; then rc=$${rc3:-0}; fi; exit $$rc

# A soak runs for many minutes by design (the kill after every fsync of a document's life is
# dozens of daemon runs): pytest's 300 s per test is the suite's guard, not theirs.
soak: setup-test
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m soak --timeout 3600 tests

bench: setup-test
	$(PY) bench/prepare.py

# As root: service user, units, /etc/chandrad/config.toml, /opt/chandrad/venv (see scripts/install-service.sh).
install: setup-run
	scripts/install-service.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
