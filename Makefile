.PHONY: install test bench bench-quick lint soak

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

# 10 minutes at 32 concurrent streams against a real cluster (not in CI): failures and memory growth.
soak:
	python -m tests.soak --duration-s 600 --concurrency 32 --out bench/results/soak.json
