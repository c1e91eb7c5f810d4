# The two commands of the README. Both install what is missing first (idempotent).
.PHONY: setup demo test fixtures

setup:
	bash scripts/setup.sh

demo: setup
	ddops demo

test: setup
	python3 -m pytest

# Rebuild the committed tiny model pairs (fixtures/README.md); minutes of CPU.
fixtures:
	python3 scripts/build_tiny_fixtures.py
