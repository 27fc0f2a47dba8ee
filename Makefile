# mlxcel-pool: `make run` starts a local pool, `make test` runs the test suite (`make test-fast`: the
# tests that start no process).
# The install step is stamped on pyproject.toml, so a second `make` skips pip entirely.

PYTHON ?= $(shell command -v python3.11 2>/dev/null || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mlxcel-installed

.PHONY: run test test-fast lint bench install openblas

run: install
	$(VENV)/bin/mlxcel-pool up $(UP_ARGS)

# Test files on TEST_JOBS processes (pytest-xdist), each file whole on one of them: most of the
# suite's time is fault tests waiting out real thresholds, which overlap. TEST_JOBS=0: one process.
TEST_JOBS ?= 2

test: install
	@rc=0; $(PY) -m pytest -q -n $(TEST_JOBS) --dist loadfile $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; \
	exit $$rc

# The tests that start no process (no redis-server, worker, router or pool): seconds, not minutes.
test-fast: install
	$(PY) -m pytest -q -m "not pool" $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

# Each bench/*.py is a standalone script; --quick keeps it short.
bench: install
	@set -e; for f in bench/bench_*.py; do \
		[ -e "$$f" ] || continue; \
		echo "== $$f"; $(PY) "$$f" --quick; \
	done

install: $(STAMP) openblas

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

# MLX's Linux CPU wheel uses a slow reference BLAS; the worker preloads OpenBLAS when present.
# Best effort only: this target never fails the build.
openblas:
	@if dpkg-query -W -f='$${Status}' libopenblas0-pthread 2>/dev/null | grep -q 'ok installed'; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get install -y -q libopenblas0-pthread libgfortran5 \
		|| (apt-get update -q && apt-get install -y -q libopenblas0-pthread libgfortran5) \
		|| echo "note: could not install OpenBLAS; the worker falls back to MLX's slow BLAS"; \
	else \
		echo "note: OpenBLAS not installed (needs root + apt-get: libopenblas0-pthread);" \
			"see MLXCEL_OPENBLAS_PATH in docs/environment-variables.md"; \
	fi
