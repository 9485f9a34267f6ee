.PHONY: install test bench bench-quick lint

install:
	pip install torch==2.13.0 && pip install -e ".[dev]"

test:
	python -m pytest -q

lint:
	python -m ruff check .

# Regenerates every figure the README quotes (bench/results/*.json|md|png and REPORT.md).
bench:
	hintserve bench all

bench-quick:
	hintserve bench all --quick
