# The two commands of the README. Both install what is missing first (idempotent).
.PHONY: setup demo test

setup:
	bash scripts/setup.sh

demo: setup
	ddops demo

test: setup
	python3 -m pytest
