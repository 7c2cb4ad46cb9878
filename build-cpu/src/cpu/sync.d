build-cpu/src/cpu/sync.o: src/cpu/sync.c src/cpu/sync.h \
 src/core/internal.h include/moeflow.h
src/cpu/sync.h:
src/core/internal.h:
include/moeflow.h:
