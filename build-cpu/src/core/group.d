build-cpu/src/core/group.o: src/core/group.c src/core/internal.h \
 include/moeflow.h src/transport/transport.h
src/core/internal.h:
include/moeflow.h:
src/transport/transport.h:
