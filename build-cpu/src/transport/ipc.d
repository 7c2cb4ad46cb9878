build-cpu/src/transport/ipc.o: src/transport/ipc.c \
 src/transport/transport.h src/core/internal.h include/moeflow.h
src/transport/transport.h:
src/core/internal.h:
include/moeflow.h:
