build-cpu/src/plan/plan.o: src/plan/plan.c src/plan/plan.h \
 src/core/internal.h include/moeflow.h
src/plan/plan.h:
src/core/internal.h:
include/moeflow.h:
