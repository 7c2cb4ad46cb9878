build-cpu/tests/ref.o: tests/ref.c tests/ref.h include/moeflow.h
tests/ref.h:
include/moeflow.h:
