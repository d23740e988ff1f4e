# Two entry points that set up everything they need (Debian packages, .venv, pip), idempotently:
#   make run   - run the daemon (config: $CHANDRAD_CONFIG, /etc/chandrad/config.toml, or embedded defaults)
#   make test  - the whole test suite (real Ghostscript, poppler, tesseract, SQLite, watchdog, vLLM on CPU)
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: run test setup-run setup-test bench soak clean install

setup-run:
	@VENV=$(VENV) scripts/setup.sh run

setup-test:
	@VENV=$(VENV) scripts/setup.sh test

run: setup-run
	$(VENV)/bin/chandrad run $(if $(CONFIG),--config $(CONFIG))

# pytest exits 5 when it collects nothing; that is a failure here, like any other non-zero exit.
test: setup-test
	@HF_HUB_OFFLINE=1 $(PY) -m pytest $(PYTEST_ARGS) -m "not soak" tests; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests: that is a failure" >&2; fi; exit $$rc

soak: setup-test
	HF_HUB_OFFLINE=1 $(PY) -m pytest -m soak tests

bench: setup-test
	$(PY) bench/prepare.py

# As root: service user, units, /etc/chandrad/config.toml, /opt/chandrad/venv (see scripts/install-service.sh).
install: setup-run
	scripts/install-service.sh

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
