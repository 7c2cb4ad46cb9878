build-cpu/src/transport/nccl.o: src/transport/nccl.c \
 src/transport/transport.h src/core/internal.h include/moeflow.h
src/transport/transport.h:
src/core/internal.h:
include/moeflow.h:
