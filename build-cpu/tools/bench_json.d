build-cpu/tools/bench_json.o: tools/bench_json.c tools/bench.h
tools/bench.h:
