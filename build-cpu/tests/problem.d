build-cpu/tests/problem.o: tests/problem.c tests/problem.h \
 include/moeflow.h tests/ref.h
tests/problem.h:
include/moeflow.h:
tests/ref.h:
