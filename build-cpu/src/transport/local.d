build-cpu/src/transport/local.o: src/transport/local.c \
 src/transport/transport.h src/core/internal.h include/moeflow.h
src/transport/transport.h:
src/core/internal.h:
include/moeflow.h:
