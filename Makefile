# mimo-sft: the two commands a user needs are `make demo` and `make test`.
PY := .venv/bin/python
export OMP_NUM_THREADS ?= 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: install demo test test-fast clean bench

# make install [PYTHON=/path/to/python] [WHEELHOUSE=dir] [MIMO_SFT_KEEP_TORCH=1]: PYTHON's CUDA torch is
# reused, never replaced; WHEELHOUSE installs without network (docs/install.md).
install:
	@bash scripts/install.sh

demo: install
	@bash scripts/demo.sh

test: install
	$(PY) -m pytest -q -n 2 --dist loadgroup tests

test-fast: install
	$(PY) -m pytest -q -x -m "not distributed and not e2e" tests

bench: install
	$(PY) scripts/bench_validate.py

clean:
	rm -rf runs demo .pytest_cache
