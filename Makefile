# visor: `make run` (install, start core + gateway, show them answering) and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip
STAMP := $(VENV)/.installed
DEBIAN_DEV := libjpeg-dev zlib1g-dev libpng-dev libwebp-dev libtiff-dev libfreetype-dev liblcms2-dev libjpeg-turbo-progs
MODEL := models/demo
PIP_QUIET := --quiet --disable-pip-version-check

.PHONY: install run demo test protos lint bench clean interop debian-dev fuzz soak gpu-wheels

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	@$(PIP) install $(PIP_QUIET) --upgrade pip
	@$(MAKE) --no-print-directory debian-dev
	$(PIP) install $(PIP_QUIET) torch==2.13.0
	@if $(PIP) install $(PIP_QUIET) "pillow-simd>=9.5"; then \
	  $(PIP) install $(PIP_QUIET) -e '.[gateway,core,dev]'; \
	  if $(PIP) show pillow >/dev/null 2>&1; then \
	    echo "a dependency (matplotlib) pulled in plain Pillow over pillow-simd: putting pillow-simd back"; \
	    $(PIP) uninstall $(PIP_QUIET) -y pillow && \
	      $(PIP) install $(PIP_QUIET) --no-deps --force-reinstall "pillow-simd>=9.5"; \
	  fi; \
	else \
	  echo "WARNING: pillow-simd could not be built; falling back to Pillow (slower resizing)." >&2; \
	  $(PIP) install $(PIP_QUIET) Pillow "pyseccomp>=0.1.2" "av>=14" && $(PIP) install $(PIP_QUIET) -e '.[core,dev]'; \
	fi
	@$(MAKE) --no-print-directory interop
	@touch $@

# pillow-simd compiles against these (libjpeg-turbo-progs: djpeg, the floor `visor bench gateway`
# compares with); installed only when root and missing.
debian-dev:
	@missing=$$(for p in $(DEBIAN_DEV); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing $$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing) >/dev/null \
	      || echo "WARNING: apt-get could not install $$missing" >&2; \
	  else \
	    echo "WARNING: missing $$missing (not root): pillow-simd may not build" >&2; \
	  fi; \
	fi

# The Node client used by the interop test (a second toolchain over the same .proto files).
interop:
	@command -v npm >/dev/null || { echo "npm (Node.js) is needed for the interop test client" >&2; exit 1; }
	cd tests/interop && npm ci --silent --no-audit --no-fund

protos: $(STAMP)
	$(BIN)/python -m shared.protogen

$(MODEL)/config.json: | $(STAMP)
	$(BIN)/visor model init-demo --out $(MODEL)

run: $(STAMP) protos $(MODEL)/config.json
	$(BIN)/visor demo --model $(MODEL) --serve

demo: $(STAMP) protos $(MODEL)/config.json
	$(BIN)/visor demo --model $(MODEL)

test: $(STAMP) protos $(MODEL)/config.json
	$(BIN)/python -m pytest -q

# Fuzz sniff -> probe -> decode for SECONDS (atheris/libFuzzer; a mutation loop without it).
# Seeds and any crash-* artifact go to .visor/fuzz.
SECONDS ?= 300
fuzz: $(STAMP)
	$(BIN)/python -m tests.gateway.fuzz_media --seconds $(SECONDS) --workdir .visor/fuzz

# The noisy-neighbour soak (about 16 minutes): one JSON report, also written to bench/results/.
soak: $(STAMP) protos $(MODEL)/config.json
	$(BIN)/visor bench soak --model $(MODEL) --out bench/results/soak.json

# Wheels bench/gpu_check.sh installs offline on a GPU host with only torch + transformers, into
# .whl/ (git-ignored); PYVER is that host's CPython (312 = 3.12), default this machine's.
gpu-wheels: $(STAMP)
	PY=$(BIN)/python bench/gpu_wheels.sh $(PYVER)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy gateway core shared visor

bench: $(STAMP) protos $(MODEL)/config.json
	$(BIN)/visor bench wire
	$(BIN)/visor bench cache --json
	$(BIN)/visor bench gateway --json

clean:
	rm -rf $(VENV) shared/pb .pytest_cache .mypy_cache .ruff_cache tests/interop/node_modules .visor
