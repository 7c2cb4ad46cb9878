build-cpu/tests/main.o: tests/main.c tests/harness.h include/moeflow.h \
 tests/problem.h tests/ref.h
tests/harness.h:
include/moeflow.h:
tests/problem.h:
tests/ref.h:
