# Two entry points; each creates the virtual environment when it is missing.
PY ?= PYENV_VERSION=3.12.1 python3.12
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test setup clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The main job: a short training run on the embedded default config. A second run into
# runs/tiny is refused unless told what to do with the first: make train TRAIN_ARGS=--resume
# (continue it) or TRAIN_ARGS=--overwrite (start over).
TRAIN_ARGS ?=
train: $(STAMP)
	$(VENV)/bin/python -m train.main --config tiny $(TRAIN_ARGS)

# The test suite (CPU; kernels run in Mosaic GPU interpret mode).
test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2 --dist worksteal -q --durations=30

clean:
	rm -rf $(VENV)
