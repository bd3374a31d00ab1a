# The two commands of the README: `make train` and `make test`. Each installs what it needs.
.PHONY: setup train test test-slow eval build-default-model

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/tidal train $(ARGS)

test: setup
	.venv/bin/python -m pytest -m "not slow and not gpu" -q $(ARGS)

test-slow: setup
	.venv/bin/python -m pytest -m "slow" -q $(ARGS)

eval: setup
	.venv/bin/tidal eval $(or $(MODEL),default) $(ARGS)

build-default-model: setup
	.venv/bin/tidal build-default-model
