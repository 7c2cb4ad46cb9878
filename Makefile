# moeflow — the build. `make` builds libmoeflow (static + shared), the `moeflow` CLI and the test
# runner into build/; the CUDA backend is compiled whenever nvcc is found (CUDA=0 turns it off).
#
#   make              library, CLI, tests          make test      CPU suite (CI), CLI, Python tests
#   make SAN=1 test   ASan + UBSan build, into build-san/ (CPU only)
#   make test-gpu     CUDA suite, then the Python tests (on CUDA where torch sees a GPU)
#   make clean

CC      ?= cc
NVCC    ?= nvcc
BUILD   ?= build
SAN     ?= 0

NVCC_FOUND := $(shell command -v $(NVCC) 2>/dev/null)
ifeq ($(SAN),1)
CUDA    ?= 0
BUILD   := build-san
endif
ifeq ($(NVCC_FOUND),)
CUDA    ?= 0
else
CUDA    ?= 1
endif

CPPFLAGS := -Iinclude -Isrc -Iworkload -D_POSIX_C_SOURCE=200809L -DMF_WITH_CUDA=$(CUDA)
CFLAGS   := -std=c11 -Wall -Wextra -Werror -Wshadow -Wstrict-prototypes -O3 -g -fPIC -pthread -fvisibility=hidden
LDLIBS   := -lm -pthread
ifeq ($(SAN),1)
CFLAGS   += -O1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
LDFLAGS  += -fsanitize=address,undefined
endif

LIB_C_SRC := $(wildcard src/core/*.c src/plan/*.c src/balance/*.c src/transport/*.c src/cpu/*.c)
LIB_OBJ   := $(LIB_C_SRC:%.c=$(BUILD)/%.o)

ifeq ($(CUDA),1)
CUDA_HOME  ?= $(patsubst %/bin/nvcc,%,$(realpath $(NVCC_FOUND)))
NVCCFLAGS  := -std=c++17 -O3 -g -lineinfo -Xcompiler -fPIC -Xcompiler -Wall -Xcompiler -fvisibility=hidden \
              -gencode arch=compute_90a,code=sm_90a -Werror all-warnings \
              -Iinclude -Isrc -DMF_WITH_CUDA=1
LIB_CU_SRC := $(wildcard src/cuda/*.cu src/balance/*.cu)
LIB_OBJ    += $(LIB_CU_SRC:%.cu=$(BUILD)/%.o)
LDLIBS     += -L$(CUDA_HOME)/lib64 -lcudart -lcuda -ldl -lrt -lstdc++
CPPFLAGS   += -I$(CUDA_HOME)/include
endif

TEST_SRC     := $(wildcard tests/*.c)
TEST_OBJ     := $(TEST_SRC:%.c=$(BUILD)/%.o)
# workload/: random problems, the R-rank driver and the fp64 reference, shared by tests and the CLI.
WORKLOAD_SRC := $(wildcard workload/*.c)
WORKLOAD_OBJ := $(WORKLOAD_SRC:%.c=$(BUILD)/%.o)
GPU_TEST_SRC := $(wildcard tests/gpu/test_*.c)
GPU_TEST_OBJ := $(GPU_TEST_SRC:%.c=$(BUILD)/%.o)

STATIC := $(BUILD)/libmoeflow.a
SHARED := $(BUILD)/libmoeflow.so
CLI    := $(BUILD)/moeflow
TESTS  := $(BUILD)/moeflow_tests
GPU_TESTS := $(BUILD)/moeflow_gpu_tests

.PHONY: all lib test test-python test-gpu clean
all: lib $(CLI) $(TESTS)
lib: $(STATIC) $(SHARED)

# Rebuild everything when the configuration (CUDA on/off, sanitizers) changes.
FLAGS_STAMP := $(BUILD)/.flags
$(shell mkdir -p $(BUILD); echo '$(CPPFLAGS) $(CFLAGS)' | cmp -s - $(FLAGS_STAMP) || echo '$(CPPFLAGS) $(CFLAGS)' > $(FLAGS_STAMP))

$(BUILD)/%.o: %.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/%.o: %.cu $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@

$(STATIC): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# Only the public API is exported: hidden visibility, and a version script (tests/abi.sh checks it).
$(SHARED): $(LIB_OBJ) src/moeflow.map
	$(CC) -shared $(LDFLAGS) -Wl,--version-script=src/moeflow.map -o $@ $(LIB_OBJ) $(LDLIBS)

# The CLI; with CUDA it also holds `moeflow bench gemm` (tools/bench_gemm.c, cuBLASLt as the peer)
# and `moeflow bench overlap` (tools/bench_overlap.c).
CLI_OBJ  := $(BUILD)/tools/moeflow.o $(BUILD)/tools/bench_json.o $(WORKLOAD_OBJ)
CLI_LIBS :=
ifeq ($(CUDA),1)
CLI_OBJ  += $(BUILD)/tools/bench_gemm.o $(BUILD)/tools/bench_overlap.o
CLI_LIBS := -lcublasLt
endif

$(CLI): $(CLI_OBJ) $(STATIC)
	$(CC) $(LDFLAGS) -o $@ $^ $(CLI_LIBS) $(LDLIBS)

$(TESTS): $(TEST_OBJ) $(WORKLOAD_OBJ) $(STATIC)
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

# The CUDA suite: tests/main.c compiled again with MFT_GPU_SUITE, the CUDA tests, the shared harness.
$(BUILD)/tests/gpu/main.o: tests/main.c $(FLAGS_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) -DMFT_GPU_SUITE $(CFLAGS) -MMD -MP -c $< -o $@

# The CUDA suite drives an ncclComm of its own (the nccl transport's test): it links libnccl; the
# library never does (src/transport/nccl.c resolves NCCL in the process).
$(GPU_TESTS): $(BUILD)/tests/gpu/main.o $(GPU_TEST_OBJ) $(BUILD)/tests/harness.o $(WORKLOAD_OBJ) $(STATIC)
	$(CC) $(LDFLAGS) -o $@ $^ -lnccl $(LDLIBS)

test: $(TESTS) $(CLI) $(SHARED)
	./$(TESTS)
	bash tests/abi.sh $(SHARED) include/moeflow.h
	bash tests/cli.sh $(CLI)
ifeq ($(SAN),0)
	@$(MAKE) --no-print-directory test-python
endif

# The Python binding's tests (tests/python, pytest) on the checkout's python/ and this build's
# library, where $(PYTHON) has torch and pytest (else a SKIP line; .ci/run installs both). Not under
# SAN=1: a sanitized library cannot be loaded into an unsanitized python.
PYTHON ?= python3
test-python: $(SHARED)
	@if $(PYTHON) -c "import torch, pytest" 2>/dev/null; then \
	  echo "MOEFLOW_LIB=$(SHARED) PYTHONPATH=python $(PYTHON) -m pytest tests/python -q"; \
	  MOEFLOW_LIB=$(abspath $(SHARED)) PYTHONPATH=python $(PYTHON) -m pytest tests/python -q \
	    -p no:cacheprovider; \
	else echo "test-python: SKIP ($(PYTHON) lacks torch or pytest: pip install torch pytest)"; fi

# The whole CUDA suite, then compute-sanitizer memcheck and racecheck on its one-rank config. The
# suite's multi-process cases (tests/gpu/test_transport.c) take R = the GPUs visible where several.
# The sm90 GEMM labs validate every kernel variant the library ships against their CPU references.
test-gpu:
ifeq ($(CUDA),1)
	$(MAKE) $(GPU_TESTS) $(CLI) $(SHARED) lab
	bash tests/abi.sh $(SHARED) include/moeflow.h
	@echo "# test-gpu: $$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ') GPU(s) visible: the multi-process cases run with R = that many (ipc, nccl; one process per GPU) where > 1, else R processes share GPU 0 (ipc; nccl at R = 1)"
	@suite=0; ./$(GPU_TESTS) || suite=1; \
	if ! ./$(GPU_TESTS) --has-gpu; then echo "test-gpu: no GPU: GEMM labs and sanitizers SKIP"; \
	else set -e; for lab in sm90_decode_lab sm90_gemm_lab; do echo "# $$lab --validate (log: $(BUILD)/$$lab.log)"; \
	  ./$(BUILD)/dev/$$lab --validate > $(BUILD)/$$lab.log 2>&1 || { grep -E "FAIL|FATAL" $(BUILD)/$$lab.log | head -20; exit 1; }; \
	  tail -1 $(BUILD)/$$lab.log; done; \
	  if ! command -v compute-sanitizer >/dev/null; then echo "test-gpu: compute-sanitizer not found: SKIP"; \
	  else for tool in memcheck racecheck; do echo "# compute-sanitizer --tool $$tool: cuda_sanitize (log: $(BUILD)/san_$$tool.log)"; \
	    bash tests/gpu/sanitize.sh $$tool $(BUILD)/san_$$tool.log ./$(GPU_TESTS) --no-fork cuda_sanitize; done; \
	  for lab in sm90_decode_lab sm90_gemm_lab; do echo "# compute-sanitizer --tool memcheck: $$lab --selftest"; \
	    compute-sanitizer --tool memcheck --error-exitcode 1 ./$(BUILD)/dev/$$lab --selftest > $(BUILD)/$$lab.san.log 2>&1 \
	      || { tail -20 $(BUILD)/$$lab.san.log; exit 1; }; tail -1 $(BUILD)/$$lab.san.log; done; fi; fi; \
	if [ $$suite != 0 ]; then echo "test-gpu: the CUDA suite FAILED (above)"; exit 1; fi
	@$(MAKE) --no-print-directory test-python
else
	@echo "test-gpu: SKIP (this build has no CUDA: nvcc not found or CUDA=0)"
endif

clean:
	rm -rf build build-san

-include $(LIB_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(GPU_TEST_OBJ:.o=.d) $(CLI_OBJ:.o=.d)

# ---- the kernel lab (dev/cuda/): validate-then-bench mains, not part of `make` or the tests ------
#   make lab    builds build/dev/<name> for every dev/cuda/<name>.cu (+ libmoeflow.a); run them on
#               an sm_90 GPU machine, e.g. ./build/dev/gemm_lab [--validate | --bench]
.PHONY: lab
ifeq ($(CUDA),1)
LAB_BINS := $(patsubst dev/cuda/%.cu,$(BUILD)/dev/%,$(wildcard dev/cuda/*.cu))
lab: $(LAB_BINS)

$(BUILD)/dev/%: dev/cuda/%.cu dev/cuda/common.h dev/cuda/sm90_tma_lab_kernel.cuh $(STATIC)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -Idev/cuda -o $@ $< $(STATIC) -lcublasLt -lcuda -ldl -lrt -lpthread -lm
else
lab:
	@echo "lab: SKIP (this build has no CUDA: nvcc not found or CUDA=0)"
endif
