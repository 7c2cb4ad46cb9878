build-cpu/src/transport/rendezvous.o: src/transport/rendezvous.c \
 src/transport/transport.h src/core/internal.h include/moeflow.h
src/transport/transport.h:
src/core/internal.h:
include/moeflow.h:
