# The two commands of the README. Both install what is missing first (idempotent), into .venv/.
.PHONY: setup demo test fixtures

VENV := $(CURDIR)/.venv/bin
export PATH := $(VENV):$(PATH)

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/ddops demo

# Two workers (pytest-xdist): the lab's tests share one booted lab, so they go to one worker together
# (tests/conftest.py marks them); the rest spread over both.
test: setup
	$(VENV)/python -m pytest -n 2 --dist loadgroup

# Rebuild the committed tiny model pairs (fixtures/README.md); minutes of CPU.
fixtures: setup
	$(VENV)/python scripts/build_tiny_fixtures.py
