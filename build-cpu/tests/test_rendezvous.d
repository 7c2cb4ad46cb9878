build-cpu/tests/test_rendezvous.o: tests/test_rendezvous.c \
 src/core/internal.h include/moeflow.h tests/harness.h
src/core/internal.h:
include/moeflow.h:
tests/harness.h:
