build-cpu/src/cpu/gemm.o: src/cpu/gemm.c src/core/numerics.h \
 src/cpu/gemm.h
src/core/numerics.h:
src/cpu/gemm.h:
