build-cpu/tests/test_quant.o: tests/test_quant.c tests/harness.h \
 include/moeflow.h
tests/harness.h:
include/moeflow.h:
