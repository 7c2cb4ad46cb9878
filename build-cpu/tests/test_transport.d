build-cpu/tests/test_transport.o: tests/test_transport.c tests/harness.h \
 include/moeflow.h tests/problem.h tests/ref.h
tests/harness.h:
include/moeflow.h:
tests/problem.h:
tests/ref.h:
