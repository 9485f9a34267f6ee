.PHONY: install test bench bench-quick lint soak docs

install:
	pip install torch==2.13.0 && pip install -e ".[dev]"

test:
	python -m pytest -q

lint:
	python -m ruff check .

# Re-runs every benchmark (bench/results/*.json|md|png and REPORT.md); `make docs` then renders the figures.
bench:
	hintserve bench all

bench-quick:
	hintserve bench all --quick

# 10 minutes at 32 concurrent streams against a real cluster (not in CI): failures and memory growth.
soak:
	python -m tests.soak --duration-s 600 --concurrency 32 --out bench/results/soak.json

# The generated references and every figure in docs/ and README.md, then the site (into site/, ignored).
docs:
	python -m services.cli docs generate && python -m mkdocs build --strict
