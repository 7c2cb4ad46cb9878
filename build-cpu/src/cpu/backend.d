build-cpu/src/cpu/backend.o: src/cpu/backend.c src/core/numerics.h \
 src/core/quant.h src/cpu/gemm.h src/plan/plan.h src/core/internal.h \
 include/moeflow.h src/cpu/sync.h
src/core/numerics.h:
src/core/quant.h:
src/cpu/gemm.h:
src/plan/plan.h:
src/core/internal.h:
include/moeflow.h:
src/cpu/sync.h:
