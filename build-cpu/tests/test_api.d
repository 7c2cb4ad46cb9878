build-cpu/tests/test_api.o: tests/test_api.c src/core/internal.h \
 include/moeflow.h tests/harness.h
src/core/internal.h:
include/moeflow.h:
tests/harness.h:
