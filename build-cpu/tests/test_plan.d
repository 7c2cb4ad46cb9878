build-cpu/tests/test_plan.o: tests/test_plan.c tests/harness.h \
 include/moeflow.h src/plan/plan.h src/core/internal.h
tests/harness.h:
include/moeflow.h:
src/plan/plan.h:
src/core/internal.h:
