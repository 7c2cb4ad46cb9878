build-cpu/src/transport/setup.o: src/transport/setup.c \
 src/transport/transport.h src/core/internal.h include/moeflow.h
src/transport/transport.h:
src/core/internal.h:
include/moeflow.h:
