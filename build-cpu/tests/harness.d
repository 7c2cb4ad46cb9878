build-cpu/tests/harness.o: tests/harness.c tests/harness.h \
 include/moeflow.h
tests/harness.h:
include/moeflow.h:
