build-cpu/src/core/tensor.o: src/core/tensor.c src/core/tensor.h \
 src/core/internal.h include/moeflow.h
src/core/tensor.h:
src/core/internal.h:
include/moeflow.h:
