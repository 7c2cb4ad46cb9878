build-cpu/src/core/quant.o: src/core/quant.c src/core/internal.h \
 include/moeflow.h src/core/numerics.h src/core/quant.h src/core/tensor.h
src/core/internal.h:
include/moeflow.h:
src/core/numerics.h:
src/core/quant.h:
src/core/tensor.h:
