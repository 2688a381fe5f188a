# The two commands of the README. Each sets up what is missing (scripts/setup.sh), then runs.
.PHONY: run test setup

TINY_DIR ?= out/tiny

setup:
	@bash scripts/setup.sh

run: setup
	@bash scripts/run_main.sh $(ARGS)

test: setup
	@.venv/bin/python -m pytest -q --durations=25 tests
