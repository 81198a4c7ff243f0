# shoal developer entry points. `make help` lists them.
.PHONY: help install demo test test-fast bench lint

# ruff over the tree, mypy over the product packages ([tool.mypy] in pyproject.toml)
LINT = .venv/bin/python -m ruff check --quiet . && .venv/bin/python -m mypy --no-error-summary

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 14

install:  ## apt packages and .venv (idempotent)
	@bash scripts/install.sh

demo: install  ## the main job on one machine: registry, convert, profile, region, two nodes, prefetch, lazy starts
	@.venv/bin/python scripts/demo.py

test: install  ## lint, then the whole test suite (root: registry, containerd, FUSE)
	@$(LINT)
	@.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 tests

test-fast: install  ## tests that need no daemons
	@.venv/bin/python -m pytest -q tests -m "not registry and not containerd and not slow"

bench: install  ## all benchmarks, quick versions
	@for b in bench/*.py; do .venv/bin/python $$b --quick; done

lint: install  ## ruff over the tree, mypy over the product packages (both pinned in .venv)
	@$(LINT)
