# The two commands of a fresh machine: `make run` (the random agent on the embedded default) and `make test`.
# Both create .venv if missing and install what they need. On a CPU machine torch is pinned to the local
# CPU build; on a GPU machine install your CUDA torch into .venv first (see README).
PY := .venv/bin/python
TORCH ?= torch==2.13.0
# pytest-xdist workers (the CPU machines have 2 cores; many tests wait on processes and sockets)
JOBS ?= 2

.venv/.installed: pyproject.toml
	test -d .venv || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

run: .venv/.installed
	.venv/bin/tandem run $(ARGS)

test: .venv/.installed
	$(PY) -m ruff check tandem tests benchmarks examples
	$(PY) -m pytest -q -n $(JOBS) $(ARGS)

.PHONY: run test
