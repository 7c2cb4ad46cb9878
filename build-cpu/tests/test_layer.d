build-cpu/tests/test_layer.o: tests/test_layer.c tests/harness.h \
 include/moeflow.h tests/problem.h tests/ref.h
tests/harness.h:
include/moeflow.h:
tests/problem.h:
tests/ref.h:
