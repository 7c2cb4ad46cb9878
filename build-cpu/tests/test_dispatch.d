build-cpu/tests/test_dispatch.o: tests/test_dispatch.c tests/harness.h \
 include/moeflow.h
tests/harness.h:
include/moeflow.h:
