# loaderd — developer entry points. `make demo` and `make test` are the whole set-up.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# The type checker sees the installed import names through a tree of links
# (loaderd/, loaderd/client -> client/, loaderd/storage -> storage/).
TYPES   := build/typecheck

.PHONY: install demo test test-unit test-integration lint format typecheck bench \
        bench-importance bench-cache bench-throughput bench-sizes bench-load bench-hybrid \
        bench-autotune bench-device bench-cores bench-workers clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py loaderd/gather_rows.c storage/read_rows.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel is local; an unpinned torch pulls gigabytes of CUDA.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: install
	$(BIN)/loaderd demo

test: install
	$(BIN)/pytest -q tests

test-unit: install
	$(BIN)/pytest -q tests/unit

test-integration: install
	$(BIN)/pytest -q tests/integration

format: install
	$(BIN)/ruff format loaderd client storage tests benchmarks
	$(BIN)/ruff check --fix loaderd client storage tests benchmarks

typecheck: install
	rm -rf $(TYPES) && mkdir -p $(TYPES)/loaderd
	for f in loaderd/*.py loaderd/py.typed; do ln -s $(CURDIR)/$$f $(TYPES)/loaderd/; done
	ln -s $(CURDIR)/client $(TYPES)/loaderd/client
	ln -s $(CURDIR)/storage $(TYPES)/loaderd/storage
	cd $(TYPES) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p loaderd

lint: install typecheck
	$(BIN)/ruff format --check loaderd client storage tests benchmarks
	$(BIN)/ruff check loaderd client storage tests benchmarks

bench: bench-importance bench-cache bench-throughput bench-sizes bench-load bench-hybrid \
       bench-autotune bench-device bench-cores bench-workers

bench-importance: install
	$(BIN)/python benchmarks/bench_importance.py

bench-cache: install
	$(BIN)/python benchmarks/bench_cache.py

bench-throughput: install
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/pip install -q --no-deps -r benchmarks/requirements-streaming.txt
	nice -n 19 $(BIN)/python benchmarks/bench_throughput.py

bench-sizes: install
	$(BIN)/pip install -q -e '.[bench]'
	nice -n 19 $(BIN)/python benchmarks/bench_sizes.py

bench-workers: install
	$(BIN)/pip install -q -e '.[bench]'
	nice -n 19 $(BIN)/python benchmarks/bench_workers.py

# Where CUDA exists; elsewhere it says so and measures nothing.
bench-device: install
	$(BIN)/python benchmarks/bench_device.py

# What more cores change: DataLoader workers against loaderd's miss workers (a node's figures).
bench-cores: install
	$(BIN)/pip install -q -e '.[bench]'
	nice -n 19 $(BIN)/python benchmarks/bench_cores.py

bench-load: install
	$(BIN)/python benchmarks/bench_load.py

bench-hybrid: install
	nice -n 19 $(BIN)/python benchmarks/bench_hybrid.py

bench-autotune: install
	$(BIN)/python benchmarks/bench_autotune.py
	nice -n 19 $(BIN)/python benchmarks/bench_autotune_daemon.py

clean:
	rm -rf build $(TYPES) .pytest_cache .mypy_cache .ruff_cache demo-data
	find . -name __pycache__ -prune -exec rm -rf {} +
