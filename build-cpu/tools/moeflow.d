build-cpu/tools/moeflow.o: tools/moeflow.c include/moeflow.h \
 tools/../tests/problem.h tools/../tests/ref.h tools/../tests/ref.h \
 tools/bench.h
include/moeflow.h:
tools/../tests/problem.h:
tools/../tests/ref.h:
tools/../tests/ref.h:
tools/bench.h:
