build-cpu/src/core/errors.o: src/core/errors.c src/core/internal.h \
 include/moeflow.h
src/core/internal.h:
include/moeflow.h:
