build-cpu/tests/test_numerics.o: tests/test_numerics.c tests/harness.h \
 include/moeflow.h
tests/harness.h:
include/moeflow.h:
