build-cpu/src/core/moe.o: src/core/moe.c src/core/internal.h \
 include/moeflow.h src/core/tensor.h src/core/numerics.h \
 src/transport/transport.h
src/core/internal.h:
include/moeflow.h:
src/core/tensor.h:
src/core/numerics.h:
src/transport/transport.h:
