/*
 * moeflow.c — the `moeflow` command line.
 *
 *   moeflow run    builds a random EP MoE problem (workload/problem.c), runs the layer on the best
 *                  backend present and checks y against the fp64 reference (workload/ref.c);
 *   moeflow bench  the same over a sweep of token counts, timing --iters forwards after --warmup.
 *
 * Output follows nccl-tests: `#` metadata lines, a `#` header, then one fixed-column row per
 * (size, dtype), so `grep -v '^#'` leaves only data. Progress goes to stderr. --json writes the
 * docs/DESIGN.md "Benchmark records" object (its path is checked before any work). Exit status
 * (tools/bench.h): 0 every row passed; 1 a row failed or the library returned an error; 2 bad
 * usage, or a request this machine cannot serve (--backend cuda without a GPU, a problem past the
 * memory check); 3 an I/O or system failure (--json not writable, out of host memory).
 *
 * The memory check: the problem's host bytes (estimate_bytes) against 80% of the kernel's
 * MemAvailable (/proc/meminfo: free pages plus the cache it would give back; free pages where it is
 * absent), or against --memory-limit G; --memory-limit 0 turns it off.
 *
 * Counting (docs/DESIGN.md "Performance doctrine"), with rows = routed (token, k) pairs of all ranks:
 *   FLOPs = 2 * rows * H * I * 3
 *   bytes = weights of the experts that received rows, read once (with FP8 scales)
 *           + x and y (R * T * H * 2 each) + rows * H * (payload + 2) (dispatched rows, partials)
 *   floor = max(FLOPs / peak, bytes / copy bandwidth), from the H200 ceilings on CUDA; the CPU
 *           backend has no ceiling, so its floor columns read "-".
 * bench also splits each row into its phases (count(): prepare and dispatch as copies, W13 and W2
 * as GEMMs that read the routed experts' weights once, combine as the partials' return and sum),
 * each with its own floor, in the table after the main one and as extra JSON rows (op = phase).
 * floor/rk is the same floor for the busiest rank's share alone (its tokens, the rows it receives,
 * its routed experts): the floor of one GPU per rank.
 *
 * bench --op comm times mf_dispatch and mf_combine alone (no expert GEMM between them: combine
 * reads a fixed buffer), one row each, device events around each call on every rank (slowest rank,
 * median). GB/s is counted as DeepEP's low-latency tests count it, per rank: every top-k selection
 * (id != -1) of the rank's tokens moves H + H/128 * 4 + 16 bytes in an FP8 dispatch (2H in BF16)
 * and 2H in the combine; the mean selections per rank over the slowest rank's time.
 */
#if MF_WITH_CUDA
#include <cuda_runtime_api.h> /* --timeline's stamp buffer */
#endif
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "moeflow.h"
#include "problem.h"
#include "ref.h"
#include "testing.h" /* --rebalance: a staged map's schedule; --timeline: the small kernel's stamps */
#include "bench.h" /* the H200 ceilings; `moeflow bench gemm` */

/* ---- defaults and limits -------------------------------------------------------------------- */
#define DEF_R 8
#define DEF_E 64
#define DEF_K 6
#define DEF_H 1024
#define DEF_I 512
#define DEF_T 64
#define DEF_SEED 1
#define DEF_ZIPF_S 1.2
#define PRESET_T 4                /* presets default to a size the CPU backend can run */
#define RUN_ITERS 1
#define RUN_WARMUP 0
#define BENCH_ITERS_CUDA 20
#define BENCH_WARMUP_CUDA 5
#define BENCH_ITERS_CPU 3
#define BENCH_WARMUP_CPU 1
#define BENCH_ROUNDS 3            /* bench: rounds over the whole sweep (min / median / max) */
#define MAX_ROUNDS 1000
#define SPREAD_FLAG 0.05          /* (max - min) / median over the rounds above this: flagged */
#define MAX_SIZES 32              /* entries of a -T list */
#define MAX_CAPACITIES 8          /* entries of a -S list */
#define S_OF_T 0                  /* a -S entry "T": each row's capacity is its own T */
#define QBLOCK 128                /* FP8 block edge: H and I multiples of it */
#define BF16_ALIGN 8              /* BF16: H and I multiples of it (16-byte rows) */
#define MEM_FRACTION 0.8          /* refuse when the estimate passes this share of MemAvailable */
#define PROGRESS_AFTER_S 1.0      /* show progress only for stages longer than this */
#define PROGRESS_TTY_EVERY_S 0.1
#define PROGRESS_LINE_EVERY_S 5.0 /* stderr not a terminal: one line this often */
#define MAX_REF_THREADS 64
#define DEF_LINK_GBPS 450.0       /* --link-gbps: H200 NVLink 4, 900 GB/s both ways = 450 each way
                                     (nominal; pass the rate measured on the node) */

static const char *const k_phase_names[MF_NUM_PHASES] = {"prepare", "dispatch", "w13", "w2", "combine"};

/* ---- presets: real model shapes -------------------------------------------------------------- */
typedef struct preset {
    const char *name;
    int32_t E, K, H, I, dtype;
    const char *why; /* the dtype's justification */
} preset_t;

static const preset_t k_presets[] = {
    {"deepseek-v3", 256, 8, 7168, 2048, MF_DTYPE_FP8_E4M3, "ships FP8 E4M3, 128x128 block scales"},
    {"kimi-k2", 384, 8, 7168, 2048, MF_DTYPE_FP8_E4M3, "ships FP8 in DeepSeek-V3's block format"},
    {"qwen3-235b-a22b", 128, 8, 4096, 1536, MF_DTYPE_FP8_E4M3, "Qwen3-235B-A22B-FP8: 128x128 blocks"},
    {"glm-4.5", 160, 8, 5120, 1536, MF_DTYPE_FP8_E4M3, "GLM-4.5-FP8: 128x128 blocks"},
    {"mixtral-8x7b", 8, 2, 4096, 14336, MF_DTYPE_BF16, "ships BF16 only"},
};
#define NUM_PRESETS ((int)(sizeof k_presets / sizeof k_presets[0]))

/* ---- options ---------------------------------------------------------------------------------- */
typedef struct opts {
    int bench;
    int32_t R, E, K, H, I, S; /* S: the largest capacity of the -S list (host buffers) */
    int32_t T[MAX_SIZES], nT;
    int32_t Sl[MAX_CAPACITIES], nS; /* the -S list (S_OF_T: the row's T); nS 0 = max T */
    int32_t events[2], nevents;    /* --phases: 1 phase events (the default), 0 none (--no-phases) */
    int32_t rounds;                /* bench: rounds over the whole sweep */
    int32_t dtypes[2], ndtypes;
    int32_t flows[4], nflows; /* mf_dataflow_t values to run, in order */
    int32_t layout, routing, hot, ue8m0;
    double zipf_s, drop;
    uint64_t seed;
    mf_backend_t backend_req, backend;
    const preset_t *preset;
    int32_t iters, warmup, check, per_rank, gated, no_phases;
    int32_t transport; /* MF_TRANSPORT_LOCAL (threads), _IPC or _NCCL (a process per rank) */
    int32_t comm_op;   /* --op comm: dispatch and combine alone */
    int32_t cuda_present; /* a usable CUDA device was found (asked without touching CUDA for ipc) */
    int64_t timeout_ms;
    const char *json;
    int32_t balance;   /* --balance B: spare slots per rank; each row also runs with B (0 = off) */
    int32_t timeline;  /* --timeline: the small-batch kernel's per-CTA stamps after each row's run */
    const char *timeline_raw; /* --timeline-raw FILE: and every CTA's stamps appended there (JSON lines) */
    double link_gbps;  /* the step-time model's link rate */
    int32_t rebalance; /* --rebalance N: each row stages a new map, N experts per step (-1 = off) */
    double memory_limit_gb; /* --memory-limit G: -1 = MEM_FRACTION of MemAvailable, 0 = no check */
    double mem_need, mem_limit, mem_avail; /* the memory check's figures, bytes (memory_guard) */
    const char *mem_source; /* where mem_avail came from: "MemAvailable" or "free pages" */
} opts_t;

static void usage(FILE *f) {
    fprintf(f,
            "usage: moeflow [run|bench [layer]] [options]\n"
            "       moeflow bench gemm [options]\n"
            "       moeflow bench overlap [options]\n"
            "\n"
            "  run         run the EP MoE layer once per dtype and check it against the fp64 reference\n"
            "  bench       (or bench layer) time --iters forwards after --warmup per size, dtype and\n"
            "              dataflow (-T and --dataflow take lists)\n"
            "  bench gemm  the grouped expert GEMMs alone beside their floor and cuBLAS dense (CUDA\n"
            "              builds; options: moeflow bench gemm --help)\n"
            "  bench overlap  two micro-batches through the split halves, GEMMs overlapping the other's\n"
            "              communication, beside the pair back to back (CUDA builds; --help)\n"
            "\n"
            "shape                                                                      [default]\n"
            "  -R, --ranks N          ranks (threads of one process, or processes: --transport) [%d]\n"
            "  -E, --experts N        experts, a multiple of R                            [%d]\n"
            "  -K, --topk N           experts per token, 1..%-2d                            [%d]\n"
            "  -H, --hidden N         hidden size (FP8: a multiple of 128)                [%d]\n"
            "  -I, --inter N          expert intermediate size (FP8: a multiple of 128)   [%d]\n"
            "  -T, --tokens N[,N..]   tokens per rank; bench sweeps a list such as 1,8,64 [%d]\n"
            "  -S, --capacity S[,S..] max tokens per rank per call (the layer's S), >= every\n"
            "                         T; bench: a list times each row at each S; T: the row's\n"
            "                         own T, e.g. -S T,4096                               [max T]\n"
            "      --preset NAME      a real model's E, K, H, I and dtype, with T = %d; other\n"
            "                         flags override it: deepseek-v3, kimi-k2, qwen3-235b-a22b,\n"
            "                         glm-4.5, mixtral-8x7b\n"
            "numerics and layout\n"
            "      --dtype bf16|fp8|all     weights and dispatch payload; all: bf16, then fp8 [all]\n"
            "      --ue8m0                  power-of-two activation scales (FP8)\n"
            "      --layout expert_major|masked                                [expert_major]\n"
            "      --dataflow F[,F..]       auto|direct|pull|unfused (docs/API.md); a list runs\n"
            "                               each, e.g. direct,pull,unfused              [auto]\n"
            "routing\n"
            "      --routing uniform|zipf[:s]|hot[:e]                                [uniform]\n"
            "                               zipf: P(e) ~ 1 / popularity rank^s, s = %.1f;\n"
            "                               hot: every token picks expert e (default 0)\n"
            "      --drop P                 probability of a -1 (skipped) id per (t, k)   [0]\n"
            "      --seed N                                                               [%d]\n"
            "      --balance B              per-step balancing with B spare slots per rank: each\n"
            "                               row runs without, then with (mf_moe_prefetch between\n"
            "                               forwards); prints rows per rank before / after, the\n"
            "                               weights moved and the modelled R-GPU step (bench) [0]\n"
            "      --link-gbps G            the model's link rate per direction, GB/s        [%g]\n"
            "      --rebalance N            each row stages a new expert map a quarter into its\n"
            "                               timed forwards (mf_moe_stage_expert_map, N experts per\n"
            "                               rank per prefetch step, 0 = all): half of each rank's\n"
            "                               experts move to the previous rank; prints the forward\n"
            "                               time while staging and not, steps and bytes per step\n"
            "running\n"
            "      --backend auto|cpu|cuda  auto: CUDA when present, else CPU          [auto]\n"
            "      --transport local|ipc|nccl  local: the ranks are threads of this process (one\n"
            "                               GPU); ipc: one process per rank, met through the\n"
            "                               built-in rendezvous (mf_comm_init), rank r on GPU\n"
            "                               r %% GPUs; nccl: as ipc, over an ncclComm per rank\n"
            "                               (libnccl.so.2; one GPU per rank)          [local]\n"
            "      --op layer|comm          bench: the whole layer, or mf_dispatch and\n"
            "                               mf_combine alone (GB/s counted as DeepEP) [layer]\n"
            "      --iters N, --warmup N    run: %d, %d; bench: %d, %d on CUDA and %d, %d on CPU\n"
            "      --no-check               bench: skip the reference\n"
            "      --rounds N               bench: run the whole sweep N times, rounds one after\n"
            "                               the other; each row reports the median round and the\n"
            "                               min / max, and flags a spread (max - min) / median\n"
            "                               above %.0f%% with '!'                                 [%d]\n"
            "      --per-rank               bench: each rank's own phase medians too\n"
            "      --timeline               bench, CUDA, R = 1, local: after each row's run, where its\n"
            "                               last small-batch kernel's time went, per CTA (stamps:\n"
            "                               entry, tables, first ring position, consumers done;\n"
            "                               late entries and their SMs, the wait for publish,\n"
            "                               time per unit, the walks' end)\n"
            "      --timeline-raw FILE      --timeline, and each run's stamps of every CTA appended\n"
            "                               to FILE, one JSON line per run (bench/summarize.py\n"
            "                               timeline reads them)\n"
            "      --gated                  CUDA: hold each rank's stream until its forward is\n"
            "                               enqueued (device time without host launch gaps;\n"
            "                               a graph replay of the forward can still be faster)\n"
            "      --no-phases              CUDA layer: time each forward between two events only\n"
            "                               (no phase events, which end programmatic dependent\n"
            "                               launches between kernels); the phases print as -\n"
            "      --phases on|off|on,off   bench: with phase events (on), without (off, as\n"
            "                               --no-phases), or each row both ways            [on]\n"
            "      --timeout-ms N           bound on every wait for a peer; 0: the library's\n"
            "                               default, MF_TIMEOUT_MS (env) or else 30 s        [0]\n"
            "      --json FILE              write the results as docs/DESIGN.md's benchmark record\n"
            "                               (FILE must be writable: checked before the run)\n"
            "      --memory-limit G         refuse a problem whose host memory estimate passes G GB;\n"
            "                               0: no check                  [%.0f%% of MemAvailable]\n"
            "  -h, --help\n"
            "      --version                the library's version\n"
            "\n"
            "Exit status: 0 every row passed; 1 a row failed or the library returned an error; 2 bad\n"
            "usage, or a request this machine cannot serve (no CUDA GPU, the memory check); 3 an I/O\n"
            "or system failure (--json not writable, out of host memory).\n",
            DEF_R, DEF_E, MF_MAX_TOPK, DEF_K, DEF_H, DEF_I, DEF_T, PRESET_T, DEF_ZIPF_S, DEF_SEED, DEF_LINK_GBPS,
            RUN_ITERS, RUN_WARMUP, BENCH_ITERS_CUDA, BENCH_WARMUP_CUDA, BENCH_ITERS_CPU,
            BENCH_WARMUP_CPU, 100 * SPREAD_FLAG, BENCH_ROUNDS, 100 * MEM_FRACTION);
}

#define die_usage(...) cli_die(EXIT_USAGE, "moeflow", __VA_ARGS__)
#define die_io(...) cli_die(EXIT_IO, "moeflow", __VA_ARGS__)

static int64_t parse_int(const char *flag, const char *v, int64_t lo, int64_t hi) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end) die_usage("%s: '%s' is not an integer", flag, v);
    if (x < lo || x > hi)
        die_usage("%s: %lld is outside [%lld, %lld]", flag, x, (long long)lo, (long long)hi);
    return x;
}

static double parse_double(const char *flag, const char *v) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (errno || end == v || *end || !isfinite(x)) die_usage("%s: '%s' is not a number", flag, v);
    return x;
}

static void parse_sizes(opts_t *o, const char *v) {
    o->nT = 0;
    const char *s = v;
    while (*s) {
        char buf[32];
        size_t n = strcspn(s, ",");
        if (n == 0 || n >= sizeof buf) die_usage("--tokens: bad list '%s'", v);
        if (o->nT == MAX_SIZES) die_usage("--tokens: at most %d sizes", MAX_SIZES);
        memcpy(buf, s, n);
        buf[n] = '\0';
        o->T[o->nT++] = (int32_t)parse_int("--tokens", buf, 0, INT32_MAX / 2);
        s += n + (s[n] == ',');
    }
    if (o->nT == 0) die_usage("--tokens: empty list");
}

/* -S: a list of capacities, each an integer >= 1 or T (the row's own T: S_OF_T). */
static void parse_capacities(opts_t *o, const char *v) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    o->nS = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (o->nS == MAX_CAPACITIES) die_usage("--capacity: at most %d entries", MAX_CAPACITIES);
        o->Sl[o->nS++] = !strcmp(t, "T") ? S_OF_T : (int32_t)parse_int("--capacity", t, 1, INT32_MAX / 2);
    }
    if (!o->nS) die_usage("--capacity: empty list");
}

/* --phases: on (phase events), off (none: --no-phases), or both as a list. */
static void parse_events(opts_t *o, const char *v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%s", v);
    o->nevents = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int e = !strcmp(t, "on") ? 1 : !strcmp(t, "off") ? 0 : -1;
        if (e < 0) die_usage("--phases: '%s' is not on or off", t);
        if (o->nevents == 2 || (o->nevents == 1 && o->events[0] == e)) die_usage("--phases: on, off or on,off");
        o->events[o->nevents++] = e;
    }
    if (!o->nevents) die_usage("--phases: empty list");
}

static void parse_routing(opts_t *o, const char *v) {
    const char *arg = strchr(v, ':');
    size_t n = arg ? (size_t)(arg - v) : strlen(v);
    if (n == 7 && !strncmp(v, "uniform", n) && !arg) o->routing = MFP_ROUTING_UNIFORM;
    else if (n == 4 && !strncmp(v, "zipf", n)) {
        o->routing = MFP_ROUTING_ZIPF;
        if (arg) o->zipf_s = parse_double("--routing zipf:s", arg + 1);
        if (!(o->zipf_s > 0.0)) die_usage("--routing zipf:s needs s > 0");
    } else if (n == 3 && !strncmp(v, "hot", n)) {
        o->routing = MFP_ROUTING_HOT;
        if (arg) o->hot = (int32_t)parse_int("--routing hot:e", arg + 1, 0, INT32_MAX);
    } else
        die_usage("--routing: '%s' is not uniform, zipf[:s] or hot[:e]", v);
}

static const char *const k_flow_names[] = {"auto", "direct", "pull", "unfused"};

static void parse_flows(opts_t *o, const char *v) {
    char buf[128];
    snprintf(buf, sizeof buf, "%s", v);
    o->nflows = 0;
    for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        int f = -1;
        for (int i = 0; i < 4; i++)
            if (!strcmp(t, k_flow_names[i])) f = i;
        if (f < 0) die_usage("--dataflow: '%s' is not auto, direct, pull or unfused", t);
        if (o->nflows == 4) die_usage("--dataflow: at most 4 entries");
        o->flows[o->nflows++] = f;
    }
    if (!o->nflows) die_usage("--dataflow: empty list");
}

static const preset_t *find_preset(const char *name) {
    for (int i = 0; i < NUM_PRESETS; i++)
        if (!strcmp(k_presets[i].name, name)) return &k_presets[i];
    die_usage("--preset: unknown '%s' (deepseek-v3, kimi-k2, qwen3-235b-a22b, glm-4.5, mixtral-8x7b)",
              name);
    return NULL;
}

/* Flags with a value; short aliases map to the long name. */
static const struct {
    char short_name;
    const char *name;
    int has_value;
} k_flags[] = {
    {'R', "ranks", 1},  {'E', "experts", 1}, {'K', "topk", 1},       {'H', "hidden", 1},
    {'I', "inter", 1},  {'T', "tokens", 1},  {'S', "capacity", 1},   {0, "dtype", 1},
    {0, "layout", 1},   {0, "routing", 1},   {0, "drop", 1},         {0, "seed", 1},
    {0, "backend", 1},  {0, "preset", 1},    {0, "ue8m0", 0},        {0, "iters", 1},
    {0, "warmup", 1},   {0, "json", 1},      {0, "timeout-ms", 1},   {0, "no-check", 0},
    {0, "dataflow", 1}, {0, "per-rank", 0}, {0, "gated", 0}, {0, "no-phases", 0}, {0, "transport", 1}, {0, "op", 1},
    {0, "balance", 1},  {0, "link-gbps", 1}, {0, "rebalance", 1}, {0, "memory-limit", 1},
    {0, "rounds", 1},   {0, "phases", 1},    {0, "timeline", 0},  {0, "timeline-raw", 1},
    {'h', "help", 0},   {0, "version", 0},
};
#define NUM_FLAGS ((int)(sizeof k_flags / sizeof k_flags[0]))

/* Splits argv[*i] into a long flag name and its value (from "=v" or the next argument). */
static const char *next_flag(int argc, char **argv, int *i, const char **value) {
    const char *a = argv[*i];
    static char name[64];
    *value = NULL;
    int f = -1;
    if (a[0] == '-' && a[1] == '-') {
        size_t n = strcspn(a + 2, "=");
        for (int j = 0; j < NUM_FLAGS; j++)
            if (strlen(k_flags[j].name) == n && !strncmp(k_flags[j].name, a + 2, n)) f = j;
        if (f >= 0 && a[2 + n] == '=') *value = a + 3 + n;
    } else if (a[0] == '-' && a[1]) {
        for (int j = 0; j < NUM_FLAGS; j++)
            if (k_flags[j].short_name == a[1]) f = j;
        if (f >= 0 && a[2]) *value = a + 2;
    }
    if (f < 0) die_usage("unknown option '%s' (see moeflow --help)", a);
    snprintf(name, sizeof name, "--%s", k_flags[f].name);
    if (!k_flags[f].has_value && *value) die_usage("%s takes no value", name);
    if (k_flags[f].has_value && !*value) {
        if (*i + 1 >= argc) die_usage("%s needs a value", name);
        *value = argv[++*i];
    }
    return name;
}

static void parse_args(int argc, char **argv, opts_t *o) {
    int first = 1;
    if (argc > 1 && argv[1][0] != '-') {
        if (!strcmp(argv[1], "run")) o->bench = 0;
        else if (!strcmp(argv[1], "bench")) o->bench = 1;
        else die_usage("unknown command '%s' (run or bench; see moeflow --help)", argv[1]);
        first = 2;
        if (o->bench && argc > 2 && !strcmp(argv[2], "layer")) first = 3; /* `bench layer` = `bench` */
    }
    o->R = DEF_R, o->E = DEF_E, o->K = DEF_K, o->H = DEF_H, o->I = DEF_I;
    o->T[0] = DEF_T, o->nT = 1;
    o->dtypes[0] = MF_DTYPE_BF16, o->dtypes[1] = MF_DTYPE_FP8_E4M3, o->ndtypes = 2;
    o->layout = MF_LAYOUT_EXPERT_MAJOR, o->routing = MFP_ROUTING_UNIFORM, o->zipf_s = DEF_ZIPF_S;
    o->flows[0] = MF_DATAFLOW_AUTO, o->nflows = 1;
    o->seed = DEF_SEED, o->backend_req = MF_BACKEND_AUTO, o->iters = -1, o->warmup = -1;
    o->check = 1;
    o->link_gbps = DEF_LINK_GBPS;
    o->rebalance = -1;
    o->memory_limit_gb = -1;
    o->events[0] = 1, o->nevents = 1;
    /* Pass 1: the preset, so that every other flag overrides it wherever it stands. */
    for (int i = first; i < argc; i++) {
        const char *v, *name = next_flag(argc, argv, &i, &v);
        if (!strcmp(name, "--help")) {
            usage(stdout);
            exit(0);
        }
        if (!strcmp(name, "--version")) {
            const int32_t lib = mf_get_version();
            printf("moeflow %d.%d.%d (libmoeflow %d.%d.%d, %s CUDA)\n", MOEFLOW_VERSION_MAJOR,
                   MOEFLOW_VERSION_MINOR, MOEFLOW_VERSION_PATCH, (int)(lib / 10000),
                   (int)(lib / 100 % 100), (int)(lib % 100), MF_WITH_CUDA ? "with" : "without");
            exit(0);
        }
        if (!strcmp(name, "--preset")) o->preset = find_preset(v);
    }
    if (o->preset) {
        const preset_t *p = o->preset;
        o->E = p->E, o->K = p->K, o->H = p->H, o->I = p->I, o->T[0] = PRESET_T;
        o->dtypes[0] = p->dtype, o->ndtypes = 1;
    }
    for (int i = first; i < argc; i++) {
        const char *v, *name = next_flag(argc, argv, &i, &v);
        if (!strcmp(name, "--ranks")) o->R = (int32_t)parse_int(name, v, 1, MF_MAX_RANKS);
        else if (!strcmp(name, "--experts")) o->E = (int32_t)parse_int(name, v, 1, INT32_MAX);
        else if (!strcmp(name, "--topk")) o->K = (int32_t)parse_int(name, v, 1, MF_MAX_TOPK);
        else if (!strcmp(name, "--hidden")) o->H = (int32_t)parse_int(name, v, 1, INT32_MAX);
        else if (!strcmp(name, "--inter")) o->I = (int32_t)parse_int(name, v, 1, INT32_MAX);
        else if (!strcmp(name, "--tokens")) parse_sizes(o, v);
        else if (!strcmp(name, "--capacity")) parse_capacities(o, v);
        else if (!strcmp(name, "--dtype")) {
            if (!strcmp(v, "bf16")) o->dtypes[0] = MF_DTYPE_BF16, o->ndtypes = 1;
            else if (!strcmp(v, "fp8")) o->dtypes[0] = MF_DTYPE_FP8_E4M3, o->ndtypes = 1;
            else if (!strcmp(v, "all"))
                o->dtypes[0] = MF_DTYPE_BF16, o->dtypes[1] = MF_DTYPE_FP8_E4M3, o->ndtypes = 2;
            else die_usage("--dtype: '%s' is not bf16, fp8 or all", v);
        } else if (!strcmp(name, "--layout")) {
            if (!strcmp(v, "expert_major")) o->layout = MF_LAYOUT_EXPERT_MAJOR;
            else if (!strcmp(v, "masked")) o->layout = MF_LAYOUT_MASKED;
            else die_usage("--layout: '%s' is not expert_major or masked", v);
        } else if (!strcmp(name, "--dataflow")) parse_flows(o, v);
        else if (!strcmp(name, "--routing")) parse_routing(o, v);
        else if (!strcmp(name, "--per-rank")) o->per_rank = 1;
        else if (!strcmp(name, "--gated")) o->gated = 1;
        else if (!strcmp(name, "--timeline")) o->timeline = 1;
        else if (!strcmp(name, "--timeline-raw")) o->timeline = 1, o->timeline_raw = v;
        else if (!strcmp(name, "--no-phases")) o->events[0] = 0, o->nevents = 1;
        else if (!strcmp(name, "--phases")) parse_events(o, v);
        else if (!strcmp(name, "--rounds")) o->rounds = (int32_t)parse_int(name, v, 1, MAX_ROUNDS);
        else if (!strcmp(name, "--transport")) {
            if (!strcmp(v, "local")) o->transport = MF_TRANSPORT_LOCAL;
            else if (!strcmp(v, "ipc")) o->transport = MF_TRANSPORT_IPC;
            else if (!strcmp(v, "nccl")) o->transport = MF_TRANSPORT_NCCL;
            else die_usage("--transport: '%s' is not local, ipc or nccl", v);
        } else if (!strcmp(name, "--op")) {
            if (!strcmp(v, "layer")) o->comm_op = 0;
            else if (!strcmp(v, "comm")) o->comm_op = 1;
            else die_usage("--op: '%s' is not layer or comm", v);
        }
        else if (!strcmp(name, "--drop")) {
            o->drop = parse_double(name, v);
            if (!(o->drop >= 0.0 && o->drop < 1.0)) die_usage("--drop: %g is outside [0, 1)", o->drop);
        } else if (!strcmp(name, "--seed")) o->seed = (uint64_t)parse_int(name, v, 0, INT64_MAX);
        else if (!strcmp(name, "--backend")) {
            if (!strcmp(v, "auto")) o->backend_req = MF_BACKEND_AUTO;
            else if (!strcmp(v, "cpu")) o->backend_req = MF_BACKEND_CPU;
            else if (!strcmp(v, "cuda")) o->backend_req = MF_BACKEND_CUDA;
            else die_usage("--backend: '%s' is not auto, cpu or cuda", v);
        } else if (!strcmp(name, "--ue8m0")) o->ue8m0 = 1;
        else if (!strcmp(name, "--iters")) o->iters = (int32_t)parse_int(name, v, 1, 1000000);
        else if (!strcmp(name, "--warmup")) o->warmup = (int32_t)parse_int(name, v, 0, 1000000);
        else if (!strcmp(name, "--json")) o->json = v;
        else if (!strcmp(name, "--timeout-ms")) o->timeout_ms = parse_int(name, v, 0, INT64_MAX);
        else if (!strcmp(name, "--no-check")) o->check = 0;
        else if (!strcmp(name, "--balance")) o->balance = (int32_t)parse_int(name, v, 0, MF_MAX_SPARE_SLOTS);
        else if (!strcmp(name, "--rebalance")) o->rebalance = (int32_t)parse_int(name, v, 0, 1000000);
        else if (!strcmp(name, "--memory-limit")) {
            o->memory_limit_gb = parse_double(name, v);
            if (!(o->memory_limit_gb >= 0)) die_usage("--memory-limit needs G >= 0 (GB; 0: no check)");
        }
        else if (!strcmp(name, "--link-gbps")) {
            o->link_gbps = parse_double(name, v);
            if (!(o->link_gbps > 0)) die_usage("--link-gbps needs a rate > 0");
        }
    }
}

/* Checks the combination of flags and resolves the defaults that depend on others. */
static void resolve(opts_t *o) {
    if (o->E % o->R)
        die_usage("-E %d is not a multiple of -R %d (every rank holds E/R experts)", o->E, o->R);
    if (o->K > o->E) die_usage("-K %d exceeds -E %d (a token's experts are distinct)", o->K, o->E);
    if (o->routing == MFP_ROUTING_HOT && o->hot >= o->E)
        die_usage("--routing hot:%d names no expert (E = %d)", o->hot, o->E);
    for (int d = 0; d < o->ndtypes; d++) {
        int fp8 = o->dtypes[d] == MF_DTYPE_FP8_E4M3, a = fp8 ? QBLOCK : BF16_ALIGN;
        if (o->H % a || o->I % a)
            die_usage("%s needs -H and -I multiples of %d (got H %d, I %d)%s", fp8 ? "FP8" : "BF16",
                      a, o->H, o->I, fp8 && o->ndtypes > 1 ? "; try --dtype bf16" : "");
    }
    int32_t maxT = 0;
    for (int i = 0; i < o->nT; i++) maxT = o->T[i] > maxT ? o->T[i] : maxT;
    if (!o->bench && o->nT > 1) die_usage("run takes one -T; sweeps are for bench");
    if (!o->bench && o->nS > 1) die_usage("run takes one -S; lists are for bench");
    if (!o->bench && o->rounds) die_usage("--rounds is for bench");
    if (!o->bench && o->nevents > 1) die_usage("--phases on,off is for bench");
    if (o->nS == 0) o->Sl[0] = maxT > 0 ? maxT : 1, o->nS = 1; /* S = the largest T */
    o->S = maxT > 0 ? maxT : 1;
    for (int i = 0; i < o->nS; i++) {
        if (o->Sl[i] != S_OF_T && o->Sl[i] < maxT)
            die_usage("-S %d is below -T %d (T <= S on every call)", o->Sl[i], maxT);
        if (o->Sl[i] > o->S) o->S = o->Sl[i];
    }
    for (int i = 0; i < o->nS; i++)
        for (int j = 0; j < i; j++)
            if (o->Sl[i] == o->Sl[j]) die_usage("-S: an entry repeats");
    if (!o->rounds) o->rounds = o->bench ? BENCH_ROUNDS : 1;
    o->no_phases = o->nevents == 1 && !o->events[0];
    /* With --transport ipc the rank processes are forked from this one, which must not have used
     * CUDA: a child process answers the question instead. */
    const mf_backend_t cuda_here = o->transport != MF_TRANSPORT_LOCAL ? mfp_probe_backend(MF_BACKEND_AUTO)
                                                                      : mfp_resolve_backend(MF_BACKEND_AUTO);
    if (o->backend_req == MF_BACKEND_CUDA && cuda_here != MF_BACKEND_CUDA)
        die_usage("--backend cuda: %s", MF_WITH_CUDA ? "no usable CUDA device found"
                                                     : "this build has no CUDA (nvcc not found or CUDA=0)");
    o->backend = o->backend_req == MF_BACKEND_AUTO ? cuda_here : o->backend_req;
    o->cuda_present = cuda_here == MF_BACKEND_CUDA;
    int cuda = o->backend == MF_BACKEND_CUDA;
    if (o->iters < 0) o->iters = !o->bench ? RUN_ITERS : cuda ? BENCH_ITERS_CUDA : BENCH_ITERS_CPU;
    if (o->warmup < 0) o->warmup = !o->bench ? RUN_WARMUP : cuda ? BENCH_WARMUP_CUDA : BENCH_WARMUP_CPU;
    if (!o->bench && !o->check) die_usage("--no-check is for bench; run always checks");
    if (o->transport == MF_TRANSPORT_NCCL && o->backend != MF_BACKEND_CUDA)
        die_usage("--transport nccl needs the CUDA backend");
    if (o->comm_op && !o->bench) die_usage("--op comm is for bench");
    if (o->timeline && (!o->bench || o->comm_op || o->backend != MF_BACKEND_CUDA || o->R != 1 ||
                        o->transport != MF_TRANSPORT_LOCAL))
        die_usage("--timeline is for bench of the layer on CUDA at R = 1 (local transport)");
    if (o->comm_op && o->nevents > 1) die_usage("--phases on,off is for the whole layer, not --op comm");
    if (o->comm_op) { /* nothing to check against the reference; one pass, no dataflows */
        o->check = 0;
        o->flows[0] = MF_DATAFLOW_AUTO, o->nflows = 1;
    }
    /* Balancing plans from the previous forward: at least one forward before the measured one. */
    if (o->balance && o->comm_op) die_usage("--balance is for the whole layer, not --op comm");
    if (o->balance && o->warmup < 1) o->warmup = 1;
    if (o->rebalance >= 0 && o->comm_op) die_usage("--rebalance is for the whole layer, not --op comm");
    if (o->rebalance >= 0 && o->warmup < 1) o->warmup = 1;
}

/* --rebalance: the identity map, and the staged one: slot p takes the expert of slot p + Lp / 2,
 * so that the second half of every rank's slots holds experts of the next rank (moved) and the
 * first half experts it already has (local copies). Returns the schedule's steps. */
static int32_t rebalance_maps(const opts_t *o, int32_t *prev, int32_t *next) {
    const int32_t P = o->E, Lp = P / o->R, shift = Lp / 2 > 0 ? Lp / 2 : 1;
    for (int32_t p = 0; p < P; p++) prev[p] = p, next[p] = (p + shift) % P;
    int32_t n = o->rebalance, most = 0;
    for (int32_t q = 0; q < o->R; q++) {
        int32_t m = mf__stage_moved(prev, next, Lp, q);
        most = m > most ? m : most;
    }
    mf__stage_slot_t *plan = malloc(sizeof *plan * (size_t)P);
    if (!plan) die_io("out of host memory");
    int32_t steps = mf__stage_schedule(prev, next, P, o->R, n ? n : (most ? most : 1), plan);
    free(plan);
    return steps;
}

/* ---- memory guard ----------------------------------------------------------------------------- */

/* Host bytes one dtype's problem needs at its largest: weights, their generation scratch, inputs,
 * the two outputs and, on the CPU backend, the library's receive buffers and symmetric heaps. */
static double estimate_bytes(const opts_t *o, int32_t dtype) {
    const double R = o->R, E = o->E, K = o->K, H = o->H, I = o->I, S = o->S, L = E / R;
    const double es = dtype == MF_DTYPE_FP8_E4M3 ? 1 : 2, kl = K < L ? K : L;
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    double bytes = E * 3 * I * H * es + (es == 1 ? E * 3 * I * H / (QBLOCK * QBLOCK) * 4 : 0);
    if (es == 1) bytes += (ncpu > 0 ? ncpu : 1) * 2 * I * H * 2;  /* bf16 scratch per drawing thread */
    bytes += R * S * (H * 2 + K * 8) + 2 * R * S * H * 2;         /* x, ids, weights; y and y_ref */
    if (o->backend == MF_BACKEND_CPU) {
        double rows = o->layout == MF_LAYOUT_MASKED ? L * R * S : R * S * kl + L * QBLOCK;
        bytes += R * (rows * (H * es + H / QBLOCK * 4) + S * (H * es + H / QBLOCK * 4 + K * 8 + K * H * 2));
    }
    return bytes;
}

/* Host bytes this process may count on: the kernel's MemAvailable (free pages plus the page cache
 * and reclaimable memory it would give back), else, where /proc/meminfo lacks it, free pages. */
static double host_available_bytes(const char **source) {
    FILE *f = fopen("/proc/meminfo", "r");
    if (f) {
        char line[256];
        unsigned long long kb;
        while (fgets(line, sizeof line, f))
            if (sscanf(line, "MemAvailable: %llu kB", &kb) == 1) {
                fclose(f);
                *source = "MemAvailable";
                return (double)kb * 1024.0;
            }
        fclose(f);
    }
    *source = "free pages";
    return (double)sysconf(_SC_AVPHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
}

/* Refuses (EXIT_USAGE) a problem whose estimate passes the limit; records the figures for the
 * `# memory` line. */
static void memory_guard(opts_t *o) {
    int bf16 = 0;
    for (int d = 0; d < o->ndtypes; d++) { /* dtypes run one after the other */
        double b = estimate_bytes(o, o->dtypes[d]);
        o->mem_need = b > o->mem_need ? b : o->mem_need;
        bf16 |= o->dtypes[d] == MF_DTYPE_BF16;
    }
    o->mem_avail = host_available_bytes(&o->mem_source);
    o->mem_limit = o->memory_limit_gb >= 0 ? o->memory_limit_gb * 1e9 : MEM_FRACTION * o->mem_avail;
    if (o->memory_limit_gb == 0 || o->mem_limit <= 0 || o->mem_need <= o->mem_limit) return;
    char limit[128];
    if (o->memory_limit_gb > 0) snprintf(limit, sizeof limit, "the --memory-limit of %.3g GB", o->memory_limit_gb);
    else snprintf(limit, sizeof limit, "%.0f%% of the %.1f GB available (%s)", MEM_FRACTION * 100,
                  o->mem_avail / 1e9, o->mem_source);
    die_usage("this problem needs about %.1f GB of host memory, more than %s.\n  Try fewer experts (-E), "
              "smaller -H / -I%s; or set the limit with --memory-limit G (GB; 0: no check).",
              o->mem_need / 1e9, limit, bf16 ? ", fewer tokens (-T / -S) or --dtype fp8 (half the weight bytes)"
                                             : " or fewer tokens (-T / -S)");
}

/* ---- progress on stderr ------------------------------------------------------------------------ */
typedef struct progress {
    const char *what;
    double t0, last;
    int tty, shown;
} progress_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void progress_start(progress_t *pg, const char *what) {
    pg->what = what;
    pg->t0 = pg->last = now_s();
    pg->tty = isatty(fileno(stderr));
    pg->shown = 0;
}

static void progress_update(progress_t *pg, double frac) {
    double t = now_s();
    if (t - pg->t0 < PROGRESS_AFTER_S) return;
    if (pg->tty && (t - pg->last >= PROGRESS_TTY_EVERY_S || frac >= 1.0)) {
        fprintf(stderr, "\r# %s: %3.0f%% (%.1f s)   ", pg->what, 100 * frac, t - pg->t0);
    } else if (!pg->tty && (t - pg->last >= PROGRESS_LINE_EVERY_S || !pg->shown)) {
        fprintf(stderr, "# %s: %3.0f%% (%.1f s)\n", pg->what, 100 * frac, t - pg->t0);
    } else
        return;
    pg->last = t;
    pg->shown = 1;
}

static void progress_end(progress_t *pg) {
    if (pg->tty && pg->shown) fprintf(stderr, "\r%60s\r", "");
}

static void on_ref_progress(void *ctx, int64_t done, int64_t total) {
    progress_update(ctx, total ? (double)done / total : 1.0);
}

static void on_run_progress(void *ctx, int32_t done, int32_t total) {
    progress_update(ctx, total ? (double)done / total : 1.0);
}

/* ---- one result row ------------------------------------------------------------------------- */
typedef struct row {
    int32_t dtype, T, flow, balance;
    int32_t S;             /* the layer's capacity in this row */
    int32_t events;        /* 1: phase events (CUDA: config.profile); 0: --phases off */
    int32_t stage_steps;   /* --rebalance: the schedule's prefetch steps */
    int32_t op;            /* ROW_LAYER, ROW_DISPATCH, ROW_COMBINE */
    double floor_rank_us;  /* the busiest rank's share alone; -1 on the CPU */
    double sel_per_rank;   /* --op comm: mean top-k selections (id != -1) per rank */
    double model_us;       /* --balance: the modelled R-GPU step (docs/PERFORMANCE.md) */
    int64_t model_rows;    /* the busiest rank's rows the model ran */
    int64_t rows;
    double rank_lb, expert_lb; /* max / mean of received rows */
    mf_result_t code;
    mfp_timing_t timing;   /* the median round's (bench --rounds) */
    double time_us, tflops, gbps, floor_us, pct; /* time_us: the median over the rounds */
    double flops, bytes;   /* the layer's, for the rates (count()) */
    /* --rounds: each round's time (the median over its iterations) and timing; the rounds' min,
     * max and spread (max - min) / median (NAN with one round); flagged above SPREAD_FLAG. */
    double *round_us;
    mfp_timing_t *round_timing;
    int32_t rounds_done;
    double min_us, max_us, spread;
    int flagged;
    double ph_flops[MF_NUM_PHASES], ph_bytes[MF_NUM_PHASES]; /* all ranks' work per phase */
    int checked;
    double diff, max_abs;
    int64_t wrong, first_wrong;
    int pass;
    /* The row's routing, rank after rank (T x K ids each), for the JSON record when it has at most
     * ROUTING_IN_RECORD ids in all (a Python bench then replays the same routing: --c-record). */
    int32_t *ids;
    int64_t nids;
} row_t;

#define ROUTING_IN_RECORD 65536

enum { ROW_LAYER = 0, ROW_DISPATCH = 1, ROW_COMBINE = 2 };
static const char *const k_row_ops[] = {"layer", "dispatch", "combine"};

static const char *transport_name(int32_t t) {
    return t == MF_TRANSPORT_IPC ? "ipc" : t == MF_TRANSPORT_NCCL ? "nccl" : "local";
}

/* The dataflow column: the dataflow of a layer row, the call of a comm row. */
static const char *row_flow_name(const row_t *r);

static const char *dtype_name(int32_t dtype) { return dtype == MF_DTYPE_BF16 ? "bf16" : "fp8"; }

static const char *row_flow_name(const row_t *r) {
    return r->op == ROW_LAYER ? k_flow_names[r->flow] : k_row_ops[r->op];
}

static const char *routing_name(const opts_t *o, char *buf, size_t n) {
    if (o->routing == MFP_ROUTING_ZIPF) snprintf(buf, n, "zipf:%g", o->zipf_s);
    else if (o->routing == MFP_ROUTING_HOT) snprintf(buf, n, "hot:%d", o->hot);
    else snprintf(buf, n, "uniform");
    return buf;
}

/* Load of the current inputs: max / mean received rows per rank and per expert. */
/* A copy of the row's routing for its JSON record (every rank's T x K ids, all ranks with the same
 * T), when it has at most ROUTING_IN_RECORD ids; layer rows only. */
static void keep_routing(const mfp_problem_t *p, row_t *row) {
    const int64_t per = (int64_t)row->T * p->spec.K, n = per * p->spec.R;
    if (row->op != ROW_LAYER || n > ROUTING_IN_RECORD) return;
    for (int32_t q = 0; q < p->spec.R; q++)
        if (p->T[q] != row->T) return;
    if (!(row->ids = malloc((size_t)(n > 0 ? n : 1) * sizeof *row->ids))) die_io("out of host memory");
    for (int32_t q = 0; q < p->spec.R; q++) memcpy(row->ids + q * per, p->topk_ids[q], (size_t)per * sizeof *row->ids);
    row->nids = n;
}

static void load_stats(const mfp_problem_t *p, row_t *row, int32_t *empty) {
    const int32_t R = p->spec.R, E = p->spec.E;
    int64_t *pr = calloc((size_t)R, sizeof *pr), *pe = calloc((size_t)E, sizeof *pe);
    if (!pr || !pe) die_io("out of host memory");
    row->rows = mfp_count_rows(p, pr, pe);
    int64_t mr = 0, me = 0;
    *empty = 0;
    for (int32_t r = 0; r < R; r++) mr = pr[r] > mr ? pr[r] : mr;
    for (int32_t e = 0; e < E; e++) {
        me = pe[e] > me ? pe[e] : me;
        *empty += pe[e] == 0;
    }
    row->rank_lb = row->rows ? (double)mr * R / row->rows : 0.0;
    row->expert_lb = row->rows ? (double)me * E / row->rows : 0.0;
    free(pr);
    free(pe);
}

/* max(FLOPs / peak, bytes / copy rate) in us on CUDA; -1 on the CPU (no ceiling). */
static double floor_of(const opts_t *o, int32_t dtype, double flops, double bytes) {
    if (o->backend != MF_BACKEND_CUDA) return -1;
    double a = flops / (dtype == MF_DTYPE_FP8_E4M3 ? H200_FP8_FLOPS : H200_BF16_FLOPS);
    double b = bytes / H200_COPY_BYTES_PER_S;
    return (a > b ? a : b) * 1e6;
}

/* FLOPs, bytes and floor of one row and of its phases (see the file comment). */
static void count(const opts_t *o, const mfp_problem_t *p, row_t *row) {
    const double H = o->H, I = o->I, rows = (double)row->rows;
    const int fp8 = row->dtype == MF_DTYPE_FP8_E4M3;
    const double es = fp8 ? 1 : 2;
    int64_t *pe = calloc((size_t)o->E, sizeof *pe);
    if (!pe) die_io("out of host memory");
    mfp_count_rows(p, NULL, pe);
    double used = 0;
    for (int32_t e = 0; e < o->E; e++) used += pe[e] > 0;
    free(pe);
    double flops = 2.0 * rows * H * I * 3;
    double bytes = used * 3 * I * H * (es + (fp8 ? 4.0 / (QBLOCK * QBLOCK) : 0)) +
                   2.0 * o->R * row->T * H * 2 + rows * H * (es + 2);
    row->flops = flops, row->bytes = bytes;
    row->floor_us = floor_of(o, row->dtype, flops, bytes);
    row->floor_rank_us = -1;
    { /* the busiest rank's share: its received rows, its routed experts, its own x and y */
        const int32_t L = o->E / o->R;
        int64_t *pe2 = calloc((size_t)o->E, sizeof *pe2);
        if (!pe2) die_io("out of host memory");
        mfp_count_rows(p, NULL, pe2);
        for (int32_t q = 0; q < o->R; q++) {
            double rq = 0, uq = 0;
            for (int32_t e = q * L; e < (q + 1) * L; e++) rq += (double)pe2[e], uq += pe2[e] > 0;
            double fq = 2.0 * rq * H * I * 3;
            double bq = uq * 3 * I * H * (es + (fp8 ? 4.0 / (QBLOCK * QBLOCK) : 0)) + 2.0 * p->T[q] * H * 2 + rq * H * (es + 2);
            double f = floor_of(o, row->dtype, fq, bq);
            if (f > row->floor_rank_us) row->floor_rank_us = f;
        }
        free(pe2);
    }

    /* Per phase, every rank's work (the ranks run their phases concurrently): bytes count reads
     * and writes, as the copy ceiling does; scales add 4 bytes per 128 FP8 elements. */
    const double ss = fp8 ? 4.0 / QBLOCK : 0, ws = fp8 ? 4.0 / (QBLOCK * QBLOCK) : 0, toks = (double)o->R * row->T;
    row->ph_flops[MF_PHASE_PREPARE] = 0;
    row->ph_bytes[MF_PHASE_PREPARE] = toks * H * (2 + es + ss);
    row->ph_flops[MF_PHASE_DISPATCH] = 0;
    row->ph_bytes[MF_PHASE_DISPATCH] = 2 * rows * H * (es + ss);
    row->ph_flops[MF_PHASE_W13] = 2 * rows * H * 2 * I;
    row->ph_bytes[MF_PHASE_W13] = used * 2 * I * H * (es + ws) + rows * H * (es + ss) + rows * I * (es + ss);
    row->ph_flops[MF_PHASE_W2] = 2 * rows * I * H;
    row->ph_bytes[MF_PHASE_W2] = used * H * I * (es + ws) + rows * I * (es + ss) + rows * H * 2;
    row->ph_flops[MF_PHASE_COMBINE] = 0;
    row->ph_bytes[MF_PHASE_COMBINE] = 3 * rows * H * 2 + toks * H * 2; /* return (read + write), sum */
}

/* One phase of a row: its time (slowest rank), rates and floor; 0 when the row has no phases. */
typedef struct phase_stat {
    double us, tflops, gbps, floor_us, pct;
} phase_stat_t;

static int phase_stat(const opts_t *o, const row_t *r, int f, phase_stat_t *ps) {
    if (r->code != MF_SUCCESS || !r->timing.have_phases || r->op != ROW_LAYER || !r->events) return 0;
    ps->us = r->timing.phase_max_us[f];
    double t = ps->us * 1e-6;
    ps->tflops = t > 0 ? r->ph_flops[f] / t / 1e12 : 0;
    ps->gbps = t > 0 ? r->ph_bytes[f] / t / 1e9 : 0;
    ps->floor_us = floor_of(o, r->dtype, r->ph_flops[f], r->ph_bytes[f]);
    ps->pct = ps->floor_us >= 0 && ps->us > 0 ? 100.0 * ps->floor_us / ps->us : 0;
    return 1;
}

/* ---- output ----------------------------------------------------------------------------------- */

/* Appends to a line buffer; print_line drops trailing blanks (empty unit columns). */
static void append(char *line, size_t n, const char *fmt, ...) {
    size_t used = strlen(line);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line + used, n - used, fmt, ap);
    va_end(ap);
}

static void print_line(char *line) {
    size_t n = strlen(line);
    while (n && line[n - 1] == ' ') line[--n] = '\0';
    printf("%s\n", line);
}

/* The optional columns: S where the -S list has several entries or T, events where --phases has
 * both; min / max / spread of the rounds where there are several. */
static int show_S(const opts_t *o) { return o->bench && (o->nS > 1 || o->Sl[0] == S_OF_T); }
static int show_events(const opts_t *o) { return o->bench && o->nevents > 1; }
static int show_rounds(const opts_t *o) { return o->bench && o->rounds > 1; }

static void print_header(const opts_t *o) {
    char l1[640] = "", l2[640] = "";
    append(l1, sizeof l1, "#%5s %8s %7s %8s", "dtype", "dataflow", "T", "rows");
    append(l2, sizeof l2, "#%5s %8s %7s %8s", "", "", "", "");
    if (o->balance) append(l1, sizeof l1, " %3s", "B"), append(l2, sizeof l2, " %3s", "");
    if (show_S(o)) append(l1, sizeof l1, " %7s", "S"), append(l2, sizeof l2, " %7s", "");
    if (show_events(o)) append(l1, sizeof l1, " %6s", "events"), append(l2, sizeof l2, " %6s", "");
    if (!o->bench) {
        append(l1, sizeof l1, " %7s %7s", "rank_lb", "exp_lb");
        append(l2, sizeof l2, " %7s %7s", "max/mn", "max/mn");
    } else {
        append(l1, sizeof l1, " %10s", "time");
        append(l2, sizeof l2, " %10s", show_rounds(o) ? "(us, med)" : "(us)");
    }
    if (show_rounds(o)) {
        append(l1, sizeof l1, " %10s %10s %8s", "min", "max", "spread");
        append(l2, sizeof l2, " %10s %10s %8s", "(us)", "(us)", "");
    }
    for (int f = 0; f < MF_NUM_PHASES; f++) {
        append(l1, sizeof l1, " %9s", k_phase_names[f]);
        append(l2, sizeof l2, " %9s", "(us)");
    }
    if (!o->bench) {
        append(l1, sizeof l1, " %10s %10s %9s %8s %7s", "total", "diff", "max_err", "#wrong", "result");
        append(l2, sizeof l2, " %10s", "(us)");
    } else {
        append(l1, sizeof l1, " %8s %8s %9s %7s %9s %10s %8s", "TFLOP/s", "GB/s", "floor", "%floor", "floor/rk",
               "diff", "#wrong");
        append(l2, sizeof l2, " %8s %8s %9s %7s %9s", "", "", "(us)", "", "(us)");
    }
    print_line(l1);
    print_line(l2);
}

static void print_row(const opts_t *o, const row_t *r) {
    char diff[32] = "-", wrong[32] = "-", max_err[32] = "-";
    if (r->checked && r->code == MF_SUCCESS) {
        snprintf(diff, sizeof diff, "%.2e", r->diff);
        snprintf(max_err, sizeof max_err, "%.2e", r->max_abs);
        snprintf(wrong, sizeof wrong, "%lld", (long long)r->wrong);
    }
    printf(" %5s %8s %7d %8lld", dtype_name(r->dtype), row_flow_name(r), r->T, (long long)r->rows);
    if (o->balance) printf(" %3d", r->balance);
    if (show_S(o)) printf(" %7d", r->S);
    if (show_events(o)) printf(" %6s", r->events ? "on" : "off");
    if (!o->bench) printf(" %7.2f %7.2f", r->rank_lb, r->expert_lb);
    else if (r->code == MF_SUCCESS) printf(" %10.1f", r->time_us);
    else printf(" %10s", "-");
    if (show_rounds(o) && r->code == MF_SUCCESS) /* '!': the spread passes SPREAD_FLAG */
        printf(" %10.1f %10.1f %6.1f%%%s", r->min_us, r->max_us, 100 * r->spread, r->flagged ? "!" : " ");
    else if (show_rounds(o))
        printf(" %10s %10s %7s ", "-", "-", "-");
    for (int f = 0; f < MF_NUM_PHASES; f++) {
        if (r->code == MF_SUCCESS && r->timing.have_phases && (r->events || r->op != ROW_LAYER))
            printf(" %9.1f", r->timing.phase_max_us[f]);
        else printf(" %9s", "-");
    }
    if (!o->bench) {
        if (r->code == MF_SUCCESS) printf(" %10.1f", r->time_us);
        else printf(" %10s", "-");
        printf(" %10s %9s %8s %7s\n", diff, max_err, wrong,
               r->code != MF_SUCCESS ? "ERROR" : r->pass ? "ok" : "FAIL");
        return;
    }
    if (r->code != MF_SUCCESS) {
        printf(" %8s %8s %9s %7s %9s %10s %8s\n", "-", "-", "-", "-", "-", "ERROR", "-");
        return;
    }
    if (r->op != ROW_LAYER) { /* GB/s as DeepEP counts it; no floor defined for a link here */
        printf(" %8s %8.1f %9s %7s %9s %10s %8s\n", "-", r->gbps, "-", "-", "-", diff, wrong);
        return;
    }
    printf(" %8.3f %8.1f", r->tflops, r->gbps);
    if (r->floor_us >= 0) printf(" %9.1f %6.1f%% %9.1f", r->floor_us, r->pct, r->floor_rank_us);
    else printf(" %9s %7s %9s", "-", "-", "-");
    printf(" %10s %8s\n", diff, wrong);
}

/* bench: each row's phases with their rates and floors, after the table. */
static void print_phases(const opts_t *o, const row_t *rows, int nrows) {
    int any = 0;
    for (int i = 0; i < nrows; i++) {
        for (int f = 0; f < MF_NUM_PHASES; f++) {
            phase_stat_t ps;
            if (!phase_stat(o, &rows[i], f, &ps)) break;
            if (!any) {
                printf("#\n# phases   slowest rank's time (bench --rounds: the median round's); FLOPs and bytes of all\n"
                       "#          ranks (reads + writes; see tools/moeflow.c)\n#%5s %8s %7s", "dtype", "dataflow", "T");
                if (show_S(o)) printf(" %7s", "S");
                printf(" %9s %9s %8s %8s %9s %7s\n", "phase", "time(us)", "TFLOP/s", "GB/s", "floor", "%floor");
                any = 1;
            }
            printf(" %5s %8s %7d", dtype_name(rows[i].dtype), row_flow_name(&rows[i]), rows[i].T);
            if (show_S(o)) printf(" %7d", rows[i].S);
            printf(" %9s %9.1f %8.1f %8.1f", k_phase_names[f], ps.us, ps.tflops, ps.gbps);
            if (ps.floor_us >= 0) printf(" %9.1f %6.1f%%\n", ps.floor_us, ps.pct);
            else printf(" %9s %7s\n", "-", "-");
        }
    }
}

/* bench --per-rank: each rank's own median phase times, to see which rank waits for which; on CUDA
 * also when its forward began after the earliest rank's (a timeline of the virtual ranks that
 * time-share one GPU: rank q's phase f ends near start + the sum of its phases up to f). */
static void print_rank_phases(const opts_t *o, const row_t *rows, int nrows) {
    printf("#\n# per rank  median of each rank's own phase times (us); waits on peers included; start: its\n"
           "#           begin on the device after the first rank's in the same iteration\n"
           "#%5s %8s %7s %5s %9s", "dtype", "dataflow", "T", "rank", "start");
    for (int f = 0; f < MF_NUM_PHASES; f++) printf(" %9s", k_phase_names[f]);
    printf(" %9s\n", "total");
    for (int i = 0; i < nrows; i++) {
        const row_t *r = &rows[i];
        if (r->code != MF_SUCCESS || !r->timing.have_phases || !r->events) continue;
        for (int32_t q = 0; q < o->R; q++) {
            printf(" %5s %8s %7d %5d", dtype_name(r->dtype), row_flow_name(r), r->T, q);
            if (r->timing.rank_start_us[q] >= 0) printf(" %9.1f", r->timing.rank_start_us[q]);
            else printf(" %9s", "-");
            for (int f = 0; f <= MF_NUM_PHASES; f++) printf(" %9.1f", r->timing.phase_rank_us[q][f]);
            printf("\n");
        }
    }
}

static int64_t max_rows(const int64_t *v, int32_t n);

static int write_json(const opts_t *o, const row_t *rows, int nrows, int argc, char **argv) {
    FILE *f = fopen(o->json, "w");
    if (!f) {
        fprintf(stderr, "moeflow: --json %s: %s\n", o->json, strerror(errno));
        return -1;
    }
    cli_json_meta(f, o->backend == MF_BACKEND_CUDA ? "cuda" : "cpu", argc, argv);
    int first = 1;
    for (int i = 0; i < nrows; i++) {
        const row_t *r = &rows[i];
        if (r->code != MF_SUCCESS) continue; /* no measurement */
        fprintf(f, "%s\n  {\"op\": \"%s\", \"dataflow\": \"%s\", \"dtype\": \"%s\", \"layout\": \"%s\", ",
                first ? "" : ",",
                r->op != ROW_LAYER ? k_row_ops[r->op] : r->flow == MF_DATAFLOW_UNFUSED ? "layer_unfused" : "layer",
                r->op != ROW_LAYER ? "-" : k_flow_names[r->flow], dtype_name(r->dtype),
                o->layout == MF_LAYOUT_MASKED ? "masked" : "expert_major");
        first = 0;
        fprintf(f, "\"transport\": \"%s\", \"gated\": %d, ", transport_name(o->transport), o->gated);
        if (r->op != ROW_LAYER) {
            fprintf(f, "\"counting\": \"deepep_low_latency\", \"selections_per_rank\": ");
            cli_json_number(f, r->sel_per_rank);
            fprintf(f, ", ");
        } else if (r->floor_rank_us >= 0) {
            fprintf(f, "\"floor_rank_us\": ");
            cli_json_number(f, r->floor_rank_us);
            fprintf(f, ", ");
        }
        fprintf(f, "\"shape\": {\"R\": %d, \"E\": %d, \"K\": %d, \"H\": %d, \"I\": %d, \"T\": %d, "
                   "\"L\": %d, \"M\": %lld, \"S\": %d}, ",
                o->R, o->E, o->K, o->H, o->I, r->T, o->E / o->R, (long long)r->rows, r->S);
        if (r->op == ROW_LAYER) fprintf(f, "\"phase_events\": %d, ", r->events);
        if (r->ids) { /* [R][T * K]: the routing, so that another bench can time the same one */
            fprintf(f, "\"topk_ids\": [");
            const int64_t per = r->nids / o->R;
            for (int32_t q = 0; q < o->R; q++) {
                fprintf(f, "%s[", q ? ", " : "");
                for (int64_t j = 0; j < per; j++) fprintf(f, "%s%d", j ? ", " : "", (int)r->ids[q * per + j]);
                fprintf(f, "]");
            }
            fprintf(f, "], ");
        }
        fprintf(f, "\"time_us\": ");
        cli_json_number(f, r->time_us);
        /* the rounds (docs/DESIGN.md "Benchmark records"): time_us is their median */
        fprintf(f, ", \"rounds\": %d, \"round_us\": [", r->rounds_done);
        for (int32_t k = 0; k < r->rounds_done; k++) {
            if (k) fprintf(f, ", ");
            cli_json_number(f, r->round_us[k]);
        }
        fprintf(f, "], \"min_us\": ");
        cli_json_number(f, r->min_us);
        fprintf(f, ", \"median_us\": ");
        cli_json_number(f, r->time_us);
        fprintf(f, ", \"max_us\": ");
        cli_json_number(f, r->max_us);
        fprintf(f, ", \"spread\": ");
        cli_json_number(f, r->spread);
        fprintf(f, ", \"spread_flagged\": %s", r->flagged ? "true" : "false");
        fprintf(f, ", \"tflops\": ");
        cli_json_number(f, r->tflops);
        fprintf(f, ", \"gbps\": ");
        cli_json_number(f, r->gbps);
        if (r->floor_us >= 0 && r->op == ROW_LAYER) {
            fprintf(f, ", \"floor_us\": ");
            cli_json_number(f, r->floor_us);
            fprintf(f, ", \"pct_of_floor\": ");
            cli_json_number(f, r->pct);
        }
        if (o->rebalance >= 0 && r->op == ROW_LAYER && r->code == MF_SUCCESS) { /* --rebalance */
            const mfp_timing_t *t = &r->timing;
            fprintf(f, ", \"rebalance\": {\"experts_per_step\": %d, \"steps\": %d, \"forwards_staging\": %d, "
                    "\"forward_off_us\": ", o->rebalance, t->stage_steps, t->stage_forwards);
            cli_json_number(f, t->plain_forward_max_ms * 1e3);
            fprintf(f, ", \"forward_on_us\": ");
            cli_json_number(f, t->stage_forward_max_ms * 1e3);
            fprintf(f, ", \"step_us\": ");
            cli_json_number(f, t->stage_prefetch_ms * 1e3);
            fprintf(f, ", \"pushed_step_max_bytes\": %lld, \"pushed_bytes\": %lld}",
                    (long long)t->stage_step_bytes_max, (long long)t->stage_bytes_total);
        }
        if (r->checked) {
            fprintf(f, ", \"wrong\": %lld, \"diff\": ", (long long)r->wrong);
            cli_json_number(f, r->diff);
        }
        if (r->timing.have_phases && (r->events || r->op != ROW_LAYER)) {
            fprintf(f, ", \"phases_us\": {");
            for (int p = 0; p < MF_NUM_PHASES; p++) {
                fprintf(f, "%s\"%s\": ", p ? ", " : "", k_phase_names[p]);
                cli_json_number(f, r->timing.phase_max_us[p]);
            }
            fprintf(f, "}");
        }
        if (o->balance && r->timing.have_balance) { /* --balance: rows per rank, bytes moved, model */
            const mf_moe_balance_stats_t *b = &r->timing.balance;
            double mean = r->rows ? (double)r->rows / o->R : 1.0;
            fprintf(f, ", \"balance\": {\"B\": %d, \"rank_max_over_mean_home\": ", r->balance);
            cli_json_number(f, (double)max_rows(b->home_rows, o->R) / mean);
            fprintf(f, ", \"rank_max_over_mean\": ");
            cli_json_number(f, (double)max_rows(b->recv_rows, o->R) / mean);
            fprintf(f, ", \"moved_first_bytes\": %lld, \"moved_last_bytes\": %lld, \"prefetch_ms\": ",
                    (long long)r->timing.prefetch_first_bytes, (long long)r->timing.prefetch_last_bytes);
            cli_json_number(f, r->timing.prefetch_ms);
            fprintf(f, ", \"model_us\": ");
            cli_json_number(f, r->model_us);
            fprintf(f, ", \"model_rows\": %lld, \"link_gbps\": ", (long long)r->model_rows);
            cli_json_number(f, o->link_gbps);
            fprintf(f, "}");
        }
        fprintf(f, ", \"iters\": %d, \"warmup\": %d, \"peers\": []}", o->iters, o->warmup);
        for (int p = 0; p < MF_NUM_PHASES; p++) { /* docs/DESIGN.md: op may be a phase name */
            phase_stat_t ps;
            if (!phase_stat(o, r, p, &ps)) break;
            fprintf(f, ",\n  {\"op\": \"%s\", \"dataflow\": \"%s\", \"dtype\": \"%s\", \"layout\": \"%s\", \"shape\": {\"R\": %d, "
                       "\"E\": %d, \"K\": %d, \"H\": %d, \"I\": %d, \"T\": %d, \"L\": %d, \"M\": %lld, \"S\": %d}, "
                       "\"phase_events\": %d, \"time_us\": ",
                    k_phase_names[p], row_flow_name(r), dtype_name(r->dtype),
                    o->layout == MF_LAYOUT_MASKED ? "masked" : "expert_major",
                    o->R, o->E, o->K, o->H, o->I, r->T, o->E / o->R, (long long)r->rows, r->S, r->events);
            cli_json_number(f, ps.us);
            if (r->ph_flops[p] > 0) {
                fprintf(f, ", \"tflops\": ");
                cli_json_number(f, ps.tflops);
            }
            fprintf(f, ", \"gbps\": ");
            cli_json_number(f, ps.gbps);
            if (ps.floor_us >= 0) {
                fprintf(f, ", \"floor_us\": ");
                cli_json_number(f, ps.floor_us);
                fprintf(f, ", \"pct_of_floor\": ");
                cli_json_number(f, ps.pct);
            }
            fprintf(f, ", \"peers\": []}");
        }
    }
    fprintf(f, "\n]}\n");
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        fprintf(stderr, "moeflow: --json %s: write failed\n", o->json);
        return -1;
    }
    return 0;
}

/* ---- the job ------------------------------------------------------------------------------------ */

static void print_meta(const opts_t *o) {
    char rbuf[64];
    int cuda_here = o->cuda_present;
    printf("# moeflow %s: EP MoE layer (dispatch, W13 -> SwiGLU -> W2, combine)%s\n",
           o->bench ? "bench" : "run", o->check ? ", checked against the fp64 reference" : "");
    printf("# backend  %s (%s; CUDA %s)  transport %s  ranks %d, one %s each\n",
           o->backend == MF_BACKEND_CUDA ? "cuda" : "cpu",
           o->backend_req == MF_BACKEND_AUTO ? "auto" : "requested",
           !MF_WITH_CUDA ? "not in this build" : cuda_here ? "present" : "no device",
           transport_name(o->transport), o->R, o->transport != MF_TRANSPORT_LOCAL ? "process" : "thread");
    if (o->comm_op)
        printf("# op       mf_dispatch and mf_combine alone (no GEMM between them); GB/s per rank as DeepEP counts:\n"
               "#          selections x (H + H/128*4 + 16) FP8 dispatch (2H BF16), x 2H combine\n");
    char sbuf[128] = "";
    for (int i = 0; i < o->nS; i++) {
        if (o->Sl[i] == S_OF_T) append(sbuf, sizeof sbuf, "%sT", i ? "," : "");
        else append(sbuf, sizeof sbuf, "%s%d", i ? "," : "", o->Sl[i]);
    }
    printf("# shape    R %d  E %d  L %d  K %d  H %d  I %d  S %s  layout %s  ue8m0 %d%s%s\n", o->R, o->E,
           o->E / o->R, o->K, o->H, o->I, sbuf, o->layout == MF_LAYOUT_MASKED ? "masked" : "expert_major",
           o->ue8m0, o->preset ? "  preset " : "", o->preset ? o->preset->name : "");
    if (o->preset) printf("# preset   %s: %s\n", o->preset->name, o->preset->why);
    printf("# routing  %s  drop %g  seed %llu\n", routing_name(o, rbuf, sizeof rbuf), o->drop,
           (unsigned long long)o->seed);
    if (o->memory_limit_gb == 0)
        printf("# memory   host estimate %.2f GB; no check (--memory-limit 0)\n", o->mem_need / 1e9);
    else if (o->memory_limit_gb > 0)
        printf("# memory   host estimate %.2f GB, limit %.2f GB (--memory-limit; %s %.1f GB)\n",
               o->mem_need / 1e9, o->mem_limit / 1e9, o->mem_source, o->mem_avail / 1e9);
    else
        printf("# memory   host estimate %.2f GB, limit %.2f GB (%.0f%% of %s %.1f GB)\n", o->mem_need / 1e9,
               o->mem_limit / 1e9, 100 * MEM_FRACTION, o->mem_source, o->mem_avail / 1e9);
    printf("# iters    %d timed after %d warm-up; times: median over iterations of the slowest rank\n"
           "#          (phases: mf_moe_get_phase_times; total: %s)\n",
           o->iters, o->warmup,
           o->backend == MF_BACKEND_CUDA ? "its device-event total"
                                         : "wall clock from a common start to the last rank's return");
    if (o->bench)
        printf("# rounds   %d: the whole sweep once per round, one round after the other; each row: the median\n"
               "#          round (time), min and max; spread (max - min) / median above %.0f%% is marked !\n",
               o->rounds, 100 * SPREAD_FLAG);
    if (o->bench && o->nevents > 1)
        printf("# events   on: phase events between the phases (they end programmatic dependent launches\n"
               "#          there); off: one event before and one after each forward (--no-phases)\n");
    if (o->backend == MF_BACKEND_CUDA)
        printf("# launch   %s\n", o->gated ? "gated: each stream held until its forward is enqueued (no host gaps)"
                                          : "eager: kernels start as the host enqueues them (host gaps count)");
    if (o->check)
        printf("# check    diff < %g (bf16) / %g (fp8); #wrong counts |y - ref| > atol + rtol |ref|, "
               "NaN always:\n#          bf16 atol %g rtol %g, fp8 atol %g rtol %g\n",
               MFREF_DIFF_MAX_BF16, MFREF_DIFF_MAX_FP8, MFREF_ATOL_BF16, MFREF_RTOL_BF16,
               MFREF_ATOL_FP8, MFREF_RTOL_FP8);
    if (o->bench) {
        if (o->backend == MF_BACKEND_CUDA)
            printf("# floor    max(FLOPs / peak, bytes / %.2f TB/s), peak %.0f (bf16) / %.0f (fp8) "
                   "TFLOP/s (H200, docs/DESIGN.md)\n",
                   H200_COPY_BYTES_PER_S / 1e12, H200_BF16_FLOPS / 1e12, H200_FP8_FLOPS / 1e12);
        else printf("# floor    - (no CPU ceiling is defined)\n");
        printf("# count    FLOPs = 2 rows H I 3; bytes = routed experts' weights + x + y + rows H "
               "(payload + 2)\n");
    }
}

static int ref_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > MAX_REF_THREADS ? MAX_REF_THREADS : (int)n;
}

/* One round's time of a row: the layer's device-event total (CUDA, STYLE.md: time with device
 * events) or wall clock (CPU); --op comm: the dispatch's or the combine's events. */
static double round_value(const opts_t *o, int32_t op, const mfp_timing_t *t) {
    if (op == ROW_DISPATCH) return t->phase_max_us[MF_PHASE_DISPATCH];
    if (op == ROW_COMBINE) return t->phase_max_us[MF_PHASE_COMBINE];
    return o->backend == MF_BACKEND_CUDA && t->have_phases ? t->phase_max_us[MF_NUM_PHASES] : t->forward_max_ms * 1e3;
}

/* A row's rates from its time_us (count() gave the FLOPs, bytes and floor in the first round). */
static void rates(const opts_t *o, row_t *row) {
    const double t = row->time_us * 1e-6;
    if (row->op != ROW_LAYER) { /* GB/s as DeepEP counts it (the file comment); no floor */
        const double per = row->op == ROW_COMBINE ? 2.0 * o->H
                           : row->dtype == MF_DTYPE_FP8_E4M3 ? o->H + o->H / 128 * 4 + 16 : 2.0 * o->H;
        row->gbps = t > 0 ? row->sel_per_rank * per / t / 1e9 : 0;
        row->tflops = NAN, row->floor_us = -1, row->pct = 0, row->floor_rank_us = -1; /* JSON null */
        return;
    }
    row->tflops = t > 0 ? row->flops / t / 1e12 : 0;
    row->gbps = t > 0 ? row->bytes / t / 1e9 : 0;
    row->pct = row->floor_us >= 0 && row->time_us > 0 ? 100.0 * row->floor_us / row->time_us : 0;
}

/* The rounds of a row, gathered: min, max, the median as time_us (the mean of the two middle rounds
 * when they are even), the spread (max - min) / median and its flag; the timing (phases, balance,
 * stage) of the median round (the lower middle one), so that a row's phases come from one round. */
static void aggregate_rounds(const opts_t *o, row_t *row) {
    const int32_t n = row->rounds_done;
    if (row->code != MF_SUCCESS || n < 1) return;
    int32_t order[MAX_ROUNDS];
    for (int32_t i = 0; i < n; i++) order[i] = i;
    for (int32_t i = 1; i < n; i++) /* insertion sort of the round indices by time (stable) */
        for (int32_t j = i; j > 0 && row->round_us[order[j]] < row->round_us[order[j - 1]]; j--) {
            int32_t t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    const int32_t mid = (n - 1) / 2;
    row->min_us = row->round_us[order[0]];
    row->max_us = row->round_us[order[n - 1]];
    row->time_us = n % 2 ? row->round_us[order[mid]] : 0.5 * (row->round_us[order[mid]] + row->round_us[order[mid + 1]]);
    row->spread = n > 1 && row->time_us > 0 ? (row->max_us - row->min_us) / row->time_us : NAN;
    row->flagged = n > 1 && row->spread > SPREAD_FLAG;
    row->timing = row->round_timing[order[mid]];
    rates(o, row);
}

/* ---- --timeline: the small-batch kernel's stamps (testing.h mf__gemm_small_set_timeline) -------- */

#define TIMELINE_CTAS 1024 /* stamp slots: the kernel's grid is at most the device's SMs */

#if MF_WITH_CUDA
/* The median of v[0, n), n >= 1; v is left sorted. */
static double median_of(double *v, int n) {
    for (int i = 1; i < n; i++) /* insertion sort: n <= TIMELINE_CTAS x MF__GEMM_SMALL_UNIT_STAMPS, once per row */
        for (int j = i; j > 0 && v[j - 1] > v[j]; j--) {
            const double x = v[j];
            v[j] = v[j - 1], v[j - 1] = x;
        }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static uint64_t *g_stamps; /* device: TIMELINE_CTAS x MF__GEMM_SMALL_STAMPS, zeroed before each run */
static const opts_t *g_timeline_opts; /* --timeline-raw's file and the preset's name */

static void timeline_begin(const opts_t *o) {
    g_timeline_opts = o;
    const size_t bytes = (size_t)TIMELINE_CTAS * MF__GEMM_SMALL_STAMPS * 8;
    if (!g_stamps && cudaMalloc((void **)&g_stamps, bytes) != cudaSuccess) die_io("--timeline: cudaMalloc failed");
    /* the ranks' streams do not wait for the legacy stream: the zeros land before the run starts */
    if (cudaMemset(g_stamps, 0, bytes) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess ||
        mf__gemm_small_set_timeline(g_stamps) != 0)
        die_io("--timeline: cannot set the stamps up");
}

/* The second line of a row's timeline: the CTAs that entered late (more than 2 us after the first)
 * and their SMs (on the H200 at T tokens: T CTAs on SMs 124-131, bench/NOTES.md), with its own plan
 * the producers' wait for publish after the tables and the time from there to the first full ring
 * position (not with its first rows, MF_SMALL=5, where that wait follows the CTA's first unit), the
 * time each producer spent per unit (from a ticket to its next: W13 and W2 apart, medians and p90
 * over the CTAs' first MF__GEMM_SMALL_UNIT_STAMPS tickets; with its own plan a CTA's first unit
 * includes the wait for publish; W2 units also apart by what the producer ran
 * before: the first W2 unit after W13 units, or none, holds the wait for its expert's W13, the seam,
 * and one after a W2 unit mostly streams) and the spread of the producers' last tickets (the walk's
 * end, where a CTA took fewer than that many units). */
static void timeline_units(const uint64_t *s, uint64_t first) {
    static double d13[TIMELINE_CTAS * MF__GEMM_SMALL_UNIT_STAMPS], d2[TIMELINE_CTAS * MF__GEMM_SMALL_UNIT_STAMPS];
    static double seam[TIMELINE_CTAS * MF__GEMM_SMALL_UNIT_STAMPS], after2[TIMELINE_CTAS * MF__GEMM_SMALL_UNIT_STAMPS];
    static double wait[TIMELINE_CTAS], rest[TIMELINE_CTAS];
    int n13 = 0, n2 = 0, nseam = 0, nafter2 = 0, nw = 0, late = 0, shown = 0;
    uint64_t end_lo = UINT64_MAX, end_hi = 0;
    char sms[128] = "";
    for (int b = 0; b < TIMELINE_CTAS; b++) {
        const uint64_t *x = s + (size_t)b * MF__GEMM_SMALL_STAMPS;
        if (!x[0] || !x[2] || !x[3]) continue;
        if (x[0] - first > 2000) {
            late++;
            if (shown < 16) {
                const size_t at = strlen(sms);
                snprintf(sms + at, sizeof sms - at, "%s%llu", shown ? " " : "", (unsigned long long)x[4]);
                shown++;
            }
        }
        if (x[5] >= x[1] && x[2] >= x[5] && x[5]) { /* its own plan: tables -> publish waited -> first position */
            wait[nw] = (x[5] - x[1]) * 1e-3;
            rest[nw++] = (x[2] - x[5]) * 1e-3;
        }
        const uint64_t *u = x + 6;
        for (int k = 0; k < MF__GEMM_SMALL_UNIT_STAMPS && u[2 * k + 1]; k++) {
            const uint64_t what = u[2 * k], when = u[2 * k + 1];
            if (what >> 33 & 1) { /* the ticket past the end */
                end_lo = when < end_lo ? when : end_lo;
                end_hi = when > end_hi ? when : end_hi;
                break;
            }
            if (k + 1 < MF__GEMM_SMALL_UNIT_STAMPS && u[2 * k + 3]) {
                const double us = (u[2 * k + 3] - when) * 1e-3;
                if (what >> 32 & 1) {
                    d2[n2++] = us;
                    if (k && (u[2 * k - 2] >> 32 & 1)) after2[nafter2++] = us;
                    else seam[nseam++] = us;
                } else {
                    d13[n13++] = us;
                }
            }
        }
    }
    printf("#          late entries (> 2 us after the first) %d%s%s%s; ", late, late ? " on SMs " : "", sms,
           late > shown ? " ..." : "");
    if (nw) {
        const double w = median_of(wait, nw), r = median_of(rest, nw);
        printf("publish waited for %.1f us after the tables, then %.1f to the first position; ", w, r);
    }
    if (n13 || n2) printf("per unit (a producer's ticket to its next): ");
    if (n13) {
        const double med = median_of(d13, n13); /* sorts d13: the p90 after it */
        printf("W13 %.1f us (p90 %.1f, %d units)", med, d13[(int)(0.9 * (n13 - 1))], n13);
    }
    if (n2) {
        const double med = median_of(d2, n2);
        printf("%sW2 %.1f us (p90 %.1f, %d units", n13 ? ", " : "", med, d2[(int)(0.9 * (n2 - 1))], n2);
        if (nseam) printf("; after W13 or first %.1f, %d", median_of(seam, nseam), nseam);
        if (nafter2) printf("; after W2 %.1f, %d", median_of(after2, nafter2), nafter2);
        printf(")");
    }
    if (end_hi) printf("; walk's end spread %.1f us", (end_hi - end_lo) * 1e-3);
    printf("\n");
}

/* --timeline-raw: one JSON line per run appended to the file: the row, the switches that shape the
 * kernel (MF_SMALL, MF_DECODE_TOKENS), and per CTA that ran [block, SM, entry, tables, first
 * position, consumers done, publish waited (0: none), [[unit, kind, when] ...]] with every time in ns
 * after the earliest entry and kind 0 W13, 1 W2, 2 the ticket past the end (3, a half W2 unit, only
 * in records of a removed switch): the first MF__GEMM_SMALL_UNIT_STAMPS tickets of each producer
 * (bench/summarize.py timeline). */
/* An environment switch's value for the JSON line: itself where it is a plain token, else "?". */
static const char *env_token(const char *name) {
    const char *v = getenv(name);
    if (!v) return "";
    for (const char *c = v; *c; c++)
        if (!((*c >= '0' && *c <= '9') || (*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || *c == '_' || *c == '-'))
            return "?";
    return v;
}

static void timeline_raw(const row_t *row, int32_t rnd, const uint64_t *s, uint64_t first) {
    const opts_t *o = g_timeline_opts;
    FILE *f = fopen(o->timeline_raw, "a");
    if (!f) die_io("--timeline-raw: cannot open '%s'", o->timeline_raw);
    const char *sw = env_token("MF_SMALL"), *dt = env_token("MF_DECODE_TOKENS");
    fprintf(f, "{\"preset\": \"%s\", \"dtype\": \"%s\", \"T\": %d, \"S\": %d, \"events\": %d, \"round\": %d, "
               "\"MF_SMALL\": \"%s\", \"MF_DECODE_TOKENS\": \"%s\", \"ctas\": [",
            o->preset ? o->preset->name : "-", dtype_name(row->dtype), row->T, row->S, row->events, rnd, sw, dt);
    int n = 0;
    for (int b = 0; b < TIMELINE_CTAS; b++) {
        const uint64_t *x = s + (size_t)b * MF__GEMM_SMALL_STAMPS;
        if (!x[0] || !x[2] || !x[3]) continue;
        const long long at = (long long)first;
        fprintf(f, "%s[%d, %llu, %lld, %lld, %lld, %lld, %lld, [", n++ ? ", " : "", b, (unsigned long long)x[4],
                (long long)x[0] - at, (long long)x[1] - at, (long long)x[2] - at, (long long)x[3] - at,
                x[5] ? (long long)x[5] - at : 0LL);
        const uint64_t *u = x + 6;
        for (int k = 0; k < MF__GEMM_SMALL_UNIT_STAMPS && u[2 * k + 1]; k++) {
            const uint64_t what = u[2 * k];
            fprintf(f, "%s[%u, %d, %lld]", k ? ", " : "", (unsigned)(what & 0xffffffffu),
                    (what >> 33 & 1) ? 2 : (int)(what >> 32 & 1), (long long)u[2 * k + 1] - at);
        }
        fprintf(f, "]]");
    }
    fprintf(f, "]}\n");
    if (fclose(f) != 0) die_io("--timeline-raw: cannot write '%s'", o->timeline_raw);
}

/* After a run: the last small-kernel launch's CTAs (us): when the last one entered after the first,
 * and medians (min - max over CTAs) of: tables built after entry (with the plan kernel: its PDL wait
 * included), first ring position full after that (with its own plan: the wait for publish included,
 * but not with its first rows, MF_SMALL=5), consumers done after that; the spread of the CTAs' ends; entry of the first to end of the last.
 * A row that ran no small kernel prints so. */
static void timeline_end(const row_t *row, int32_t rnd) {
    static uint64_t s[TIMELINE_CTAS * MF__GEMM_SMALL_STAMPS];
    mf__gemm_small_set_timeline(NULL);
    if (row->code != MF_SUCCESS) return;
    if (cudaMemcpy(s, g_stamps, sizeof s, cudaMemcpyDeviceToHost) != cudaSuccess) die_io("--timeline: cudaMemcpy failed");
    double d[3][TIMELINE_CTAS];
    uint64_t first = UINT64_MAX, last = 0, end_lo = UINT64_MAX, end_hi = 0;
    int n = 0;
    for (int b = 0; b < TIMELINE_CTAS; b++) {
        const uint64_t *x = s + (size_t)b * MF__GEMM_SMALL_STAMPS;
        if (!x[0] || !x[2] || !x[3]) continue; /* a CTA writes its four stamps, in order */
        first = x[0] < first ? x[0] : first;
        last = x[0] > last ? x[0] : last;
        end_lo = x[3] < end_lo ? x[3] : end_lo;
        end_hi = x[3] > end_hi ? x[3] : end_hi;
        d[0][n] = (x[1] - x[0]) * 1e-3;
        d[1][n] = (x[2] - x[1]) * 1e-3;
        d[2][n] = (x[3] - x[2]) * 1e-3;
        n++;
    }
    printf("# timeline %s T=%d S=%d %s round %d: ", dtype_name(row->dtype), row->T, row->S,
           row->events ? "events" : "no-events", rnd);
    if (!n) {
        printf("no small-batch kernel ran\n");
        return;
    }
    double lo[3], hi[3], med[3];
    for (int k = 0; k < 3; k++) {
        med[k] = median_of(d[k], n); /* sorts d[k] */
        lo[k] = d[k][0], hi[k] = d[k][n - 1];
    }
    printf("%d CTAs, entries %.1f apart; tables %.1f (%.1f-%.1f), first position %.1f (%.1f-%.1f), "
           "consumers %.1f (%.1f-%.1f); ends %.1f apart; span %.1f us\n",
           n, (last - first) * 1e-3, med[0], lo[0], hi[0], med[1], lo[1], hi[1], med[2], lo[2], hi[2],
           (end_hi - end_lo) * 1e-3, (end_hi - first) * 1e-3);
    timeline_units(s, first);
    if (g_timeline_opts && g_timeline_opts->timeline_raw) timeline_raw(row, rnd, s, first);
}
#else
static void timeline_begin(const opts_t *o) { (void)o; }
static void timeline_end(const row_t *row, int32_t rnd) { (void)row, (void)rnd; }
#endif

/* Runs round `rnd` of one (dtype, T, S, dataflow, events, B) row, and in round 0 checks it: the
 * problem's inputs are already drawn for T. */
static void run_row(const opts_t *o, mfp_problem_t *p, row_t *row, int32_t rnd, uint16_t **y, uint16_t **yref) {
    char err[512];
    progress_t pg;
    mfp_run_opts_t ro = MFP_RUN_OPTS_INIT;
    ro.backend = o->backend;
    ro.iters = o->iters;
    ro.warmup = o->warmup;
    ro.timeout_ms = o->timeout_ms;
    ro.profile = 1;
    ro.no_phases = !row->events && !o->comm_op;
    ro.max_tokens = row->S;
    ro.dataflow = row->flow;
    ro.gated = o->gated;
    ro.transport = o->transport;
    ro.op = o->comm_op ? MFP_OP_DISPATCH_COMBINE : MFP_OP_FORWARD;
    ro.progress = on_run_progress;
    ro.progress_ctx = &pg;
    ro.spare_slots = row->balance;
    ro.prefetch = row->balance > 0;
    int32_t *maps = NULL;
    if (o->rebalance >= 0) { /* stage a quarter into the timed forwards; enough forwards to switch */
        maps = malloc(sizeof(int32_t) * 2 * (size_t)o->E);
        if (!maps) die_io("out of host memory");
        row->stage_steps = rebalance_maps(o, maps, maps + o->E);
        ro.expert_map = maps, ro.num_physical = o->E, ro.prefetch = 1;
        ro.stage_map = maps + o->E, ro.stage_per_step = o->rebalance;
        ro.stage_at = o->warmup + o->iters / 4;
        if (ro.iters < o->iters / 4 + row->stage_steps + 2) ro.iters = o->iters / 4 + row->stage_steps + 2;
    }
    char what[96];
    snprintf(what, sizeof what, "%s T=%d: %d forward%s%s", dtype_name(row->dtype), row->T, o->warmup + o->iters,
             o->warmup + o->iters > 1 ? "s" : "", o->rounds > 1 ? " (a round)" : "");
    progress_start(&pg, what);
    mfp_timing_t *t = &row->round_timing[rnd];
    if (o->timeline) timeline_begin(o);
    row->code = mfp_run(p, &ro, y, t, err, sizeof err);
    progress_end(&pg);
    if (o->timeline) timeline_end(row, rnd);
    free(maps);
    if (row->code != MF_SUCCESS) {
        fprintf(stderr, "moeflow: %s T=%d S=%d: %s: %s\n", dtype_name(row->dtype), row->T, row->S,
                mf_result_string(row->code), err);
        row->pass = 0;
        return;
    }
    row->round_us[rnd] = round_value(o, row->op, t);
    row->rounds_done = rnd + 1;
    if (rnd > 0) return; /* counted and checked in the first round */
    row->timing = *t;
    row->time_us = row->round_us[0];
    count(o, p, row);
    if (o->comm_op) { /* the dispatch row; main() derives the combine row from the same runs */
        int64_t sel = 0;
        for (int32_t r = 0; r < o->R; r++)
            for (int64_t i = 0; i < (int64_t)p->T[r] * o->K; i++) sel += p->topk_ids[r][i] >= 0;
        row->op = ROW_DISPATCH;
        row->sel_per_rank = (double)sel / o->R;
    }
    rates(o, row);
    row->pass = 1;
    if (!o->check) return;

    snprintf(what, sizeof what, "%s T=%d: reference", dtype_name(row->dtype), row->T);
    progress_start(&pg, what);
    p->ref.progress = on_ref_progress;
    p->ref.progress_ctx = &pg;
    int rc = mfref_layer_mt(&p->ref, yref, ref_threads());
    p->ref.progress = NULL;
    progress_end(&pg);
    if (rc != 0) {
        fprintf(stderr, "moeflow: the reference failed (out of memory?)\n");
        row->pass = 0;
        return;
    }
    const int fp8 = row->dtype == MF_DTYPE_FP8_E4M3;
    const double atol = fp8 ? MFREF_ATOL_FP8 : MFREF_ATOL_BF16, rtol = fp8 ? MFREF_RTOL_FP8 : MFREF_RTOL_BF16;
    double ab = 0, sq = 0;
    row->checked = 1;
    row->wrong = 0;
    row->first_wrong = -1;
    row->max_abs = 0;
    int nan = 0;
    int64_t base = 0;
    for (int32_t r = 0; r < o->R; r++) { /* diff over all ranks: one sum, as for one tensor */
        const int64_t n = (int64_t)p->T[r] * o->H;
        for (int64_t i = 0; i < n; i++) {
            double a = mf_bf16_to_float(y[r][i]), b = mf_bf16_to_float(yref[r][i]);
            if (!isfinite(a) || !isfinite(b)) nan = 1;
            ab += a * b;
            sq += a * a + b * b;
        }
        int64_t first;
        double m;
        int64_t w = mfref_count_wrong_bf16(y[r], yref[r], n, atol, rtol, &first, &m);
        if (w && row->first_wrong < 0) {
            row->first_wrong = base + first;
            fprintf(stderr, "moeflow: %s T=%d: first wrong element: rank %d token %lld h %lld: "
                            "%.6g vs reference %.6g\n",
                    dtype_name(row->dtype), row->T, r, (long long)(first / o->H),
                    (long long)(first % o->H), mf_bf16_to_float(y[r][first]),
                    mf_bf16_to_float(yref[r][first]));
        }
        row->wrong += w;
        if (m != m || row->max_abs != row->max_abs) row->max_abs = NAN;
        else if (m > row->max_abs) row->max_abs = m;
        base += n;
    }
    row->diff = nan ? MFREF_DIFF_NAN : sq == 0 ? 0.0 : 1.0 - 2.0 * ab / sq;
    row->pass = row->diff < (fp8 ? MFREF_DIFF_MAX_FP8 : MFREF_DIFF_MAX_BF16) && row->wrong == 0;
}

/* ---- balancing: rows per rank and the modelled R-GPU step (docs/PERFORMANCE.md) ----------- */

/* The expert time (W13 + W2 phases, us) of one rank receiving `rows` rows: an R = 1 layer with
 * that rank's L experts, K' = min(K, L) and ceil(rows / K') tokens routed uniformly. */
static double share_expert_us(const opts_t *o, int32_t dtype, int64_t rows) {
    const int32_t L = o->E / o->R, K1 = o->K < L ? o->K : L;
    const int32_t T1 = (int32_t)((rows + K1 - 1) / K1);
    if (T1 <= 0) return 0.0;
    mfp_spec_t spec = {.R = 1, .E = L, .K = K1, .H = o->H, .I = o->I, .S = T1, .dtype = dtype, .layout = o->layout,
                       .ue8m0 = o->ue8m0, .T_per_rank = T1, .routing = MFP_ROUTING_UNIFORM, .seed = o->seed};
    mfp_problem_t p;
    if (mfp_generate(&spec, &p) != 0) return -1.0;
    uint16_t *y = malloc((size_t)T1 * o->H * 2 + 2);
    mfp_run_opts_t ro = MFP_RUN_OPTS_INIT;
    ro.backend = o->backend, ro.iters = o->iters, ro.warmup = o->warmup, ro.timeout_ms = o->timeout_ms;
    ro.profile = 1, ro.gated = o->gated;
    mfp_timing_t t;
    char err[512];
    double us = -1.0;
    if (y && mfp_run(&p, &ro, &y, &t, err, sizeof err) == MF_SUCCESS)
        us = t.phase_max_us[MF_PHASE_W13] + t.phase_max_us[MF_PHASE_W2];
    free(y);
    mfp_free(&p);
    return us;
}

static int64_t max_rows(const int64_t *v, int32_t n) {
    int64_t m = 0;
    for (int32_t i = 0; i < n; i++) m = v[i] > m ? v[i] : m;
    return m;
}

/* The model of one row: the busiest rank's expert time (measured at R = 1) plus its transfer at
 * the link rate: its received rows in (payload + scales), their partials back (BF16), and, when
 * balancing, its share of the weights the step copies. */
static void model_row(const opts_t *o, row_t *r, const row_t *balanced) {
    const mf_moe_balance_stats_t *b = &balanced->timing.balance;
    const int fp8 = r->dtype == MF_DTYPE_FP8_E4M3;
    const double row_bytes = o->H * ((fp8 ? 1.0 + 4.0 / QBLOCK : 2.0) + 2.0);
    r->model_rows = r->balance ? max_rows(b->recv_rows, o->R) : max_rows(b->home_rows, o->R);
    double us = share_expert_us(o, r->dtype, r->model_rows);
    double moved = r->balance ? (double)r->timing.prefetch_last_bytes / o->R : 0.0;
    r->model_us = us < 0 ? -1.0 : us + ((double)r->model_rows * row_bytes + moved) / (o->link_gbps * 1e3);
}

static void print_balance(const opts_t *o, row_t *rows, int nrows) {
    printf("#\n# balance  rows per rank max/mean, without replicas (off) and with B spare slots (on); moved:\n"
           "#          weight bytes all ranks copied in the first / the last prefetch (a steady routing copies\n"
           "#          once); cost: time on / off - 1; model: the busiest rank's expert time at R = 1 plus its\n"
           "#          transfer at %.0f GB/s (docs/PERFORMANCE.md)\n", o->link_gbps);
    printf("#%5s %8s %7s %3s %7s %7s %12s %12s %10s %10s %7s %10s %10s\n", "dtype", "dataflow", "T", "B", "off",
           "on", "moved_first", "moved_last", "time_off", "time_on", "cost", "model_off", "model_on");
    printf("#%5s %8s %7s %3s %7s %7s %12s %12s %10s %10s %7s %10s %10s\n", "", "", "", "", "max/mn", "max/mn",
           "(bytes)", "(bytes)", "(us)", "(us)", "", "(us)", "(us)");
    for (int i = 0; i + 1 < nrows; i += 2) {
        row_t *off = &rows[i], *on = &rows[i + 1];
        if (off->code != MF_SUCCESS || on->code != MF_SUCCESS || !on->timing.have_balance) continue;
        const mf_moe_balance_stats_t *b = &on->timing.balance;
        double mean = on->rows ? (double)on->rows / o->R : 1.0;
        model_row(o, off, on);
        model_row(o, on, on);
        printf(" %5s %8s %7d %3d %7.3f %7.3f %12lld %12lld %10.1f %10.1f %6.1f%% %10.1f %10.1f\n",
               dtype_name(on->dtype), k_flow_names[on->flow], on->T, on->balance,
               (double)max_rows(b->home_rows, o->R) / mean, (double)max_rows(b->recv_rows, o->R) / mean,
               (long long)on->timing.prefetch_first_bytes, (long long)on->timing.prefetch_last_bytes, off->time_us,
               on->time_us, off->time_us > 0 ? 100.0 * (on->time_us / off->time_us - 1.0) : 0.0, off->model_us,
               on->model_us);
    }
}

static void print_rebalance(const opts_t *o, const row_t *rows, int nrows) {
    printf("#\n# rebalance  a staged map (--rebalance %d experts per rank per step; half of each rank's experts\n"
           "#            move): forwards served while the stage was in flight (old map) and the others, medians\n"
           "#            of the slowest rank's wall time per forward (host-synchronised); step: mean wall time\n"
           "#            of a prefetch that made a stage step (synchronised); pushed: weight bytes all ranks\n"
           "#            pushed peer to peer in the largest step and in all\n", o->rebalance);
    printf("#%5s %8s %7s %3s %5s %6s %10s %10s %7s %10s %14s %14s\n", "dtype", "dataflow", "T", "B", "steps",
           "fwd_st", "fwd_off", "fwd_on", "cost", "step", "pushed_step", "pushed_all");
    printf("#%5s %8s %7s %3s %5s %6s %10s %10s %7s %10s %14s %14s\n", "", "", "", "", "", "", "(us)", "(us)", "",
           "(us)", "(bytes)", "(bytes)");
    for (int i = 0; i < nrows; i++) {
        const row_t *r = &rows[i];
        if (r->code != MF_SUCCESS || r->op != ROW_LAYER) continue;
        const mfp_timing_t *t = &r->timing;
        double off = t->plain_forward_max_ms * 1e3, on = t->stage_forward_max_ms * 1e3;
        printf(" %5s %8s %7d %3d %5d %6d %10.1f %10.1f %6.1f%% %10.1f %14lld %14lld\n", dtype_name(r->dtype),
               k_flow_names[r->flow], r->T, r->balance, t->stage_steps, t->stage_forwards, off, on,
               off > 0 && t->stage_forwards ? 100.0 * (on / off - 1.0) : 0.0, t->stage_prefetch_ms * 1e3,
               (long long)t->stage_step_bytes_max, (long long)t->stage_bytes_total);
    }
}

int main(int argc, char **argv) {
    mfp_cuda_env();
    if (argc > 2 && !strcmp(argv[1], "bench") && (!strcmp(argv[2], "gemm") || !strcmp(argv[2], "overlap"))) {
#if MF_WITH_CUDA
        return !strcmp(argv[2], "gemm") ? cli_bench_gemm_main(argc, argv) : cli_bench_overlap_main(argc, argv);
#else
        cli_die(EXIT_USAGE, argv[2][0] == 'g' ? "moeflow bench gemm" : "moeflow bench overlap",
                "needs a CUDA GPU (sm_90): this build has no CUDA (nvcc not found or CUDA=0)");
#endif
    }
    opts_t o;
    memset(&o, 0, sizeof o);
    parse_args(argc, argv, &o);
    resolve(&o);
    if (o.json && cli_json_check_writable(o.json) != 0) /* before any work, not after the run */
        die_io("--json %s: %s", o.json, strerror(errno));
    memory_guard(&o);
    setvbuf(stdout, NULL, _IOLBF, 0);

    print_meta(&o);
    const int passes = o.balance ? 2 : 1; /* --balance: every row without, then with spare slots */
    const int nops = o.comm_op ? 2 : 1;   /* --op comm: a dispatch and a combine row per run */
    const int per_dtype = o.nT * o.nS * o.nflows * o.nevents * passes * nops;
    row_t *rows = calloc((size_t)(per_dtype * o.ndtypes), sizeof *rows);
    uint16_t **y = calloc((size_t)o.R, sizeof *y), **yref = calloc((size_t)o.R, sizeof *yref);
    if (!rows || !y || !yref) die_io("out of host memory");
    for (int32_t r = 0; r < o.R; r++) {
        y[r] = malloc(sizeof(uint16_t) * (size_t)o.S * o.H + 1);
        yref[r] = malloc(sizeof(uint16_t) * (size_t)o.S * o.H + 1);
        if (!y[r] || !yref[r]) die_io("out of host memory");
    }
    for (int i = 0; i < per_dtype * o.ndtypes; i++) {
        rows[i].round_us = calloc((size_t)o.rounds, sizeof *rows[i].round_us);
        rows[i].round_timing = calloc((size_t)o.rounds, sizeof *rows[i].round_timing);
        if (!rows[i].round_us || !rows[i].round_timing) die_io("out of host memory");
    }

    int nrows = 0, all_pass = 1, header = 0;
    for (int d = 0; d < o.ndtypes; d++) {
        mfp_spec_t spec = {.R = o.R, .E = o.E, .K = o.K, .H = o.H, .I = o.I, .S = o.S,
                           .dtype = o.dtypes[d], .layout = o.layout, .ue8m0 = o.ue8m0,
                           .T_per_rank = o.T[0], .routing = o.routing, .zipf_s = o.zipf_s,
                           .hot_expert = o.hot, .drop_prob = o.drop, .seed = o.seed};
        double wbytes = (double)o.E * 3 * o.I * o.H * (o.dtypes[d] == MF_DTYPE_BF16 ? 2 : 1);
        double t0 = now_s();
        if (wbytes > 1e9)
            fprintf(stderr, "# drawing %.1f GB of %s weights...\n", wbytes / 1e9, dtype_name(o.dtypes[d]));
        mfp_problem_t p;
        if (mfp_generate(&spec, &p) != 0) {
            fprintf(stderr, "moeflow: could not generate the %s problem (%s)\n", dtype_name(o.dtypes[d]),
                    mf_last_error()[0] ? mf_last_error() : "out of host memory");
            return EXIT_IO;
        }
        if (wbytes > 1e9) fprintf(stderr, "# drawn in %.1f s\n", now_s() - t0);
        if (!header) { /* load lines (routing is the same for every dtype) */
            for (int i = 0; i < o.nT; i++) {
                row_t lr = {.T = o.T[i]};
                int32_t empty;
                if (mfp_set_tokens(&p, o.T[i], o.seed) != 0) die_io("out of host memory");
                load_stats(&p, &lr, &empty);
                printf("# load     T %d: rows %lld; received rows max/mean: per rank %.2f, per "
                       "expert %.2f; %d of %d experts empty\n",
                       o.T[i], (long long)lr.rows, lr.rank_lb, lr.expert_lb, empty, o.E);
            }
            header = 1;
        }
        /* This dtype's rows, in sweep order: T, S, dataflow, events, then B (without / with spare
         * slots next to each other); --op comm: each run's dispatch row, then its combine row. */
        const int first = nrows;
        for (int i = 0; i < o.nT; i++)
            for (int si = 0; si < o.nS; si++)
                for (int fl = 0; fl < o.nflows; fl++)
                    for (int ev = 0; ev < o.nevents; ev++)
                        for (int pass = 0; pass < passes; pass++)
                            for (int op = 0; op < nops; op++) {
                                row_t *row = &rows[nrows++];
                                row->dtype = o.dtypes[d];
                                row->T = o.T[i];
                                row->S = o.Sl[si] == S_OF_T ? (o.T[i] > 0 ? o.T[i] : 1) : o.Sl[si];
                                row->flow = o.flows[fl];
                                row->events = o.events[ev];
                                row->balance = pass ? o.balance : 0;
                                row->op = o.comm_op ? (op ? ROW_COMBINE : ROW_DISPATCH) : ROW_LAYER;
                                row->code = MF_SUCCESS;
                            }
        /* The rounds: the whole sweep once per round, so that a drift over the run shows as the
         * spread of every row, not as a difference between rows. */
        for (int32_t rnd = 0; rnd < o.rounds; rnd++)
            for (int i = first; i < nrows; i += nops) {
                row_t *row = &rows[i];
                if (row->code != MF_SUCCESS) continue; /* failed in an earlier round */
                int32_t empty;
                if (mfp_set_tokens(&p, row->T, o.seed) != 0) die_io("out of host memory");
                if (rnd == 0) {
                    load_stats(&p, row, &empty);
                    keep_routing(&p, row);
                }
                run_row(&o, &p, row, rnd, y, yref);
                if (o.comm_op) { /* the same runs' combine */
                    row_t *c = &rows[i + 1];
                    c->code = row->code;
                    if (row->code == MF_SUCCESS) {
                        c->round_timing[rnd] = row->round_timing[rnd];
                        c->round_us[rnd] = round_value(&o, ROW_COMBINE, &row->round_timing[rnd]);
                        c->rounds_done = row->rounds_done;
                        if (rnd == 0) {
                            c->rows = row->rows, c->rank_lb = row->rank_lb, c->expert_lb = row->expert_lb;
                            c->sel_per_rank = row->sel_per_rank, c->pass = row->pass;
                        }
                    } else
                        c->pass = 0;
                }
                if (o.rounds > 1 && row->code == MF_SUCCESS) { /* each round as it ends: drift shows */
                    printf("# round %d/%d  %s %s T %d S %d%s%s: %.1f us", rnd + 1, o.rounds, dtype_name(row->dtype),
                           row_flow_name(row), row->T, row->S, row->balance ? " B on" : "",
                           o.nevents > 1 ? (row->events ? " events on" : " events off") : "", row->round_us[rnd]);
                    if (o.comm_op) printf(", combine %.1f us", rows[i + 1].round_us[rnd]);
                    printf("\n");
                }
            }
        if (first == 0) {
            printf("#\n");
            print_header(&o);
        }
        for (int i = first; i < nrows; i++) {
            aggregate_rounds(&o, &rows[i]);
            print_row(&o, &rows[i]);
            all_pass &= rows[i].pass;
        }
        mfp_free(&p);
    }
    int passed = 0, flagged = 0, measured = 0;
    for (int i = 0; i < nrows; i++) {
        passed += rows[i].pass;
        flagged += rows[i].code == MF_SUCCESS && rows[i].flagged;
        measured += rows[i].code == MF_SUCCESS;
    }
    if (show_rounds(&o))
        printf("# spread   %d of %d rows above %.0f%% ((max - min) / median over %d rounds)%s\n", flagged, measured,
               100 * SPREAD_FLAG, o.rounds, flagged ? ": marked ! (not a measurement to quote alone)" : "");
    if (o.balance) print_balance(&o, rows, nrows);
    if (o.rebalance >= 0) print_rebalance(&o, rows, nrows);
    if (o.bench) print_phases(&o, rows, nrows);
    if (o.bench && o.per_rank) print_rank_phases(&o, rows, nrows);
    printf("# %s: %d of %d rows passed\n", all_pass ? "PASS" : "FAIL", passed, nrows);
    int rc = all_pass ? 0 : EXIT_FAIL;
    if (o.json && write_json(&o, rows, nrows, argc, argv) != 0) rc = EXIT_IO;
    for (int32_t r = 0; r < o.R; r++) {
        free(y[r]);
        free(yref[r]);
    }
    free(y);
    free(yref);
    for (int i = 0; i < per_dtype * o.ndtypes; i++) free(rows[i].round_us), free(rows[i].round_timing), free(rows[i].ids);
    free(rows);
    return rc;
}
