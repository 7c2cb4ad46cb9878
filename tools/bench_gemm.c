/*
 * bench_gemm.c — `moeflow bench gemm`: the library's grouped expert GEMMs alone, every case timed
 * beside its floor and beside cuBLAS on the same total work, measured in the same run (issue 4).
 * Built into the CLI only with CUDA (tools/moeflow.c dispatches here); C11 on the CUDA runtime and
 * cuBLASLt C APIs; the GEMMs are reached through src/testing.h (src/cuda/gemm_bench.h).
 *
 * Cases: models (expert shapes) x L local experts x M rows per expert x counts (equal, uneven
 * +-30%, zipf; always M * L rows in all) x op (w13 = W13 with its fused SwiGLU, w2) x dtype
 * (bf16, fp8 with 1x128 activation and 128x128 weight scales) x layout (expert_major: segments
 * padded to 128 rows; masked: offsets e * C). Operands are drawn on the device
 * (mf__gemm_bench_fill); cases whose operands pass MAX_CASE_BYTES are skipped.
 *
 * Per case, in this order:
 *   check (--check)  rows no expert owns are filled with NaN bytes and the outputs poisoned (0xFF),
 *                    one launch, then sampled rows of sampled experts are recomputed on the host in
 *                    double from the operands copied back (FP8: per-128-K-block promotion; W13: SwiGLU
 *                    and the same 1x128 requantisation), compared by diff = 1 - 2 sum(xy) / sum(xx + yy)
 *                    plus the element bounds of docs/DESIGN.md "GEMM error bounds" (each element's
 *                    own forward-error bound from its products, cuda/gemm_bench.h; the table's
 *                    err/bnd is the largest |gpu - exact| / bound), and the rows past counts[e] must
 *                    still hold the poison;
 *   moeflow          --warmup untimed then --iters timed launches; each preceded by a 512 MB memset
 *                    (L2 flush) outside the cudaEvent pair; the median is reported;
 *   cublas_dense     the ceiling of the same total work: one dense GEMM [rows, K] . [K, N] -> bf16
 *                    with expert 0's weights (cublasLt, the heuristic's first algorithm), timed the
 *                    same way; FP8 with Hopper block scales (128x128 weights, 1x128 activations) when
 *                    cuBLASLt offers an algorithm for them, else tensor-wide scales (said in the output).
 *
 * Counting (docs/DESIGN.md "Performance doctrine"), rows = sum of counts, N / K the GEMM's output /
 * reduction sizes: FLOPs = 2 rows N K; weight bytes = N K (es + scales) of every expert with rows;
 * bytes = weight bytes + rows K (es + scales) + rows out_cols (es + scales); floor = max(FLOPs /
 * peak, bytes / copy rate) with the H200 ceilings of tools/bench.h; wTB/s = weight bytes / time.
 *
 * Output: nccl-tests style (`#` metadata, one fixed-column row per case); --json writes docs/DESIGN.md's
 * benchmark record (op "gemm"; extra fields: kernel, model, counts, rows, C, expert_rows,
 * weight_tbps). Exit status (tools/bench.h): 0 every case ran (or was skipped) and passed; 1 a case
 * failed; 2 usage, or no usable CUDA GPU (sm_90; the check `--backend cuda` makes); 3 an I/O or system
 * failure (--json not writable, checked before any work; CUDA setup; out of host memory).
 */
#include <cuda_runtime_api.h>
/* cublasLt.h declares cublasLtLoggerForceDisable() without a prototype */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstrict-prototypes"
#include <cublasLt.h>
#pragma GCC diagnostic pop
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "moeflow.h"
#include "testing.h" /* the GEMMs alone, their element bounds, the exact numerics (src/testing.h) */
#include "bench.h"

/* ---- defaults and limits ---------------------------------------------------------------------- */
#define DEF_ITERS 20
#define DEF_WARMUP 3
#define DEF_SEED 1
#define DEF_CAPACITY 1024          /* masked: C = max(this, the largest count rounded up to 128) */
#define ZIPF_S 1.2                 /* zipf counts: P(expert of popularity rank r) ~ 1 / (r + 1)^s */
#define UNEVEN_SPREAD 0.3          /* uneven counts: M (1 +- this), uniform */
#define MAX_CASE_BYTES 60e9        /* skip cases whose operands (a, weights, output) pass this */
#define FLUSH_BYTES ((size_t)512 << 20)
#define CUBLAS_WORKSPACE ((size_t)32 << 20)
#define MAX_LIST 32                /* entries of a -M / -L list */
#define MAX_MODEL_L 4
#define QBLOCK MF__QUANT_BLOCK     /* FP8 scale block edge */
#define SEGMENT_ALIGN 128           /* EXPERT_MAJOR segment starts: mf_moe_config_t.block_m's default */
#define CHECK_EXPERTS 8            /* --check: experts sampled per case (spread over [0, L)), + 1 empty */
#define CHECK_TAIL_ROWS 2          /* --check: rows past counts[e] that must still hold the poison */
#define CHECK_ROW_MAX 8            /* --check: sampled rows per expert (see pick_rows) */
#define MAX_REF_THREADS 64
#define POISON 0xFF                /* NaN in E4M3, BF16 and fp32 */

/* Check (docs/DESIGN.md "Numerics", "GEMM error bounds"): the diff measure against the reference
 * rounded as the kernel rounds, and element-wise |got - exact| <= bound, exact the fp64 value and
 * bound the forward-error bound of the arithmetic the kernels do (cuda/gemm_bench.h, mf__gemm_*). */
#define DIFF_MAX_BF16 1e-5
#define DIFF_MAX_FP8 1e-3

/* ---- models, ops, counts ---------------------------------------------------------------------- */
typedef struct model {
    const char *name;
    int32_t H, I, E;
    int32_t L[MAX_MODEL_L], nL; /* default local experts */
    const char *why;
} model_t;

static const model_t k_models[] = {
    {"deepseek-v3", 7168, 2048, 256, {32, 256}, 2, "E 256: L 32 at EP8, L 256 on one GPU"},
    {"qwen3-235b-a22b", 4096, 1536, 128, {16}, 1, "E 128: L 16 at EP8"},
    {"kimi-k2", 7168, 2048, 384, {48}, 1, "E 384: L 48 at EP8"},
};
#define NUM_MODELS ((int)(sizeof k_models / sizeof k_models[0]))

typedef struct op_info {
    int32_t op;         /* mf__gemm_op_t */
    const char *name;   /* --op */
    const char *column; /* the table's op column (4 wide) */
    const char *kernel; /* JSON "kernel" */
} op_info_t;

static const op_info_t k_ops[] = {
    {MF__GEMM_OP_W13_SWIGLU, "w13", "w13", "w13_swiglu"},
    {MF__GEMM_OP_W2, "w2", "w2", "w2"},
    {MF__GEMM_OP_W13, "w13_plain", "w13p", "w13"},
};
#define NUM_OPS ((int)(sizeof k_ops / sizeof k_ops[0]))

enum { COUNTS_EQUAL = 0, COUNTS_UNEVEN = 1, COUNTS_ZIPF = 2, NUM_COUNTS = 3 };
static const char *const k_counts_names[NUM_COUNTS] = {"equal", "uneven", "zipf"};

static const int32_t k_default_M[] = {8, 16, 32, 64, 128, 256, 1024, 4096, 8192};
static const int32_t k_quick_M[] = {8, 64, 256, 1024, 4096};
#define QUICK_L_DEEPSEEK 32

/* ---- options ---------------------------------------------------------------------------------- */
typedef struct gopts {
    int models[NUM_MODELS], nmodels;
    int ops[NUM_OPS], nops;
    int32_t M[MAX_LIST], nM;
    int32_t L[MAX_LIST], nL; /* 0: each model's default */
    int32_t dtypes[2], ndtypes;
    int32_t layouts[2], nlayouts;
    int32_t counts[NUM_COUNTS], ncounts;
    int32_t capacity;
    int32_t iters, warmup;
    int check, quick, dry_run, no_cublas, static_schedule;
    int32_t family; /* MF__GEMM_BENCH_AUTO, or the family --family forces (MF__GEMM_BENCH_DECODE, _TMA) */
    uint64_t seed;
    const char *json;
} gopts_t;

static void usage(FILE *f) {
    fprintf(f,
            "usage: moeflow bench gemm [options]\n"
            "\n"
            "Times the library's grouped expert GEMMs (W13 with its fused SwiGLU, W2) on real MoE expert\n"
            "shapes, each case beside its floor (H200 ceilings) and cuBLAS dense on the same total work.\n"
            "\n"
            "cases                                                                      [default]\n"
            "      --model LIST        deepseek-v3, qwen3-235b-a22b, kimi-k2 or all         [all]\n"
            "      --op w13|w2|w13_plain|all   all: every op the library has (w13, w2)     [all]\n"
            "  -M, --rows LIST         rows per expert          [8,16,32,64,128,256,1024,4096,8192]\n"
            "  -L, --experts LIST      local experts, for every model   [deepseek-v3 32,256;\n"
            "                                                 qwen3-235b-a22b 16; kimi-k2 48]\n"
            "      --dtype bf16|fp8|all                                                     [all]\n"
            "      --layout expert_major|masked|all   with all, masked cases that are the\n"
            "                          expert_major problem (equal counts, C = M) run once  [all]\n"
            "      --counts equal|uneven|zipf|all   rows per expert: M each; M +-%.0f%%; zipf s %.1f\n"
            "                          over a shuffled popularity order (all: M L rows)   [equal]\n"
            "  -C, --capacity N        masked: C = max(N, largest count rounded up to %d)  [%d]\n"
            "      --quick             -M %d,%d,%d,%d,%d and L %d for deepseek-v3 (est. < 1 min on H200)\n"
            "running\n"
            "      --iters N, --warmup N   timed and untimed launches per GEMM            [%d, %d]\n"
            "      --check             check every case against a double host reference first\n"
            "      --no-cublas         skip the cuBLAS dense ceiling\n"
            "      --static-schedule   the TMA kernel's static tile walk (b, b + grid, ...) instead of\n"
            "                          the dynamic schedule the layer uses (a ticket per tile)\n"
            "      --family auto|decode|tma   auto: the layer's choice for the rows; decode (its tile\n"
            "                          for min(M, 64)) or tma at any M: the families' A/B  [auto]\n"
            "      --seed N                                                                 [%d]\n"
            "      --json FILE         write docs/DESIGN.md's benchmark record (op \"gemm\")\n"
            "      --dry-run           list the cases with their sizes and floors; no GPU needed\n"
            "  -h, --help\n"
            "\n"
            "Cases whose operands pass %.0f GB are skipped. Exit status: 0 every case passed; 1 a case\n"
            "failed; 2 usage, or no usable CUDA GPU (sm_90); 3 an I/O or system failure (--json not\n"
            "writable, CUDA setup, out of host memory).\n",
            100 * UNEVEN_SPREAD, ZIPF_S, SEGMENT_ALIGN, DEF_CAPACITY, k_quick_M[0], k_quick_M[1],
            k_quick_M[2], k_quick_M[3], k_quick_M[4], QUICK_L_DEEPSEEK, DEF_ITERS, DEF_WARMUP, DEF_SEED,
            MAX_CASE_BYTES / 1e9);
}

#define die_usage(...) cli_die(EXIT_USAGE, "moeflow bench gemm", __VA_ARGS__)
#define die_io(...) cli_die(EXIT_IO, "moeflow bench gemm", __VA_ARGS__)

static int64_t parse_int(const char *flag, const char *v, int64_t lo, int64_t hi) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end) die_usage("%s: '%s' is not an integer", flag, v);
    if (x < lo || x > hi) die_usage("%s: %lld is outside [%lld, %lld]", flag, x, (long long)lo, (long long)hi);
    return x;
}

/* Splits a comma list; calls `item` on each entry (copied into a NUL-terminated buffer). */
static void parse_list(const char *flag, const char *v, void (*item)(const char *flag, const char *s, void *ctx),
                       void *ctx) {
    const char *s = v;
    if (!*s) die_usage("%s: empty list", flag);
    while (*s) {
        char buf[64];
        size_t n = strcspn(s, ",");
        if (n == 0 || n >= sizeof buf) die_usage("%s: bad list '%s'", flag, v);
        memcpy(buf, s, n);
        buf[n] = '\0';
        item(flag, buf, ctx);
        s += n + (s[n] == ',');
    }
}

typedef struct int_list {
    int32_t *v;
    int *n;
    int64_t lo, hi;
} int_list_t;

static void int_item(const char *flag, const char *s, void *ctx) {
    int_list_t *l = ctx;
    if (*l->n == MAX_LIST) die_usage("%s: at most %d entries", flag, MAX_LIST);
    l->v[(*l->n)++] = (int32_t)parse_int(flag, s, l->lo, l->hi);
}

static void model_item(const char *flag, const char *s, void *ctx) {
    gopts_t *o = ctx;
    if (!strcmp(s, "all")) {
        for (int m = 0; m < NUM_MODELS; m++) o->models[m] = m;
        o->nmodels = NUM_MODELS;
        return;
    }
    for (int m = 0; m < NUM_MODELS; m++)
        if (!strcmp(k_models[m].name, s)) {
            for (int j = 0; j < o->nmodels; j++)
                if (o->models[j] == m) return;
            o->models[o->nmodels++] = m;
            return;
        }
    die_usage("%s: unknown model '%s' (deepseek-v3, qwen3-235b-a22b, kimi-k2, all)", flag, s);
}

/* Flags with a value; short aliases map to the long name. */
static const struct {
    char short_name;
    const char *name;
    int has_value;
} k_flags[] = {
    {0, "model", 1},  {0, "op", 1},       {'M', "rows", 1},   {'L', "experts", 1}, {0, "dtype", 1},
    {0, "layout", 1}, {0, "counts", 1},   {'C', "capacity", 1}, {0, "quick", 0},   {0, "iters", 1},
    {0, "warmup", 1}, {0, "check", 0},    {0, "no-cublas", 0}, {0, "seed", 1},     {0, "json", 1},
    {0, "dry-run", 0}, {0, "static-schedule", 0}, {0, "family", 1}, {'h', "help", 0},
};
#define NUM_FLAGS ((int)(sizeof k_flags / sizeof k_flags[0]))

static const char *next_flag(int argc, char **argv, int *i, const char **value) {
    const char *a = argv[*i];
    static char name[64];
    int f = -1;
    *value = NULL;
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
    if (f < 0) die_usage("unknown option '%s' (see moeflow bench gemm --help)", a);
    snprintf(name, sizeof name, "--%s", k_flags[f].name);
    if (!k_flags[f].has_value && *value) die_usage("%s takes no value", name);
    if (k_flags[f].has_value && !*value) {
        if (*i + 1 >= argc) die_usage("%s needs a value", name);
        *value = argv[++*i];
    }
    return name;
}

static void parse_args(int argc, char **argv, gopts_t *o) {
    memset(o, 0, sizeof *o);
    o->dtypes[0] = MF_DTYPE_BF16, o->dtypes[1] = MF_DTYPE_FP8_E4M3, o->ndtypes = 2;
    o->layouts[0] = MF_LAYOUT_EXPERT_MAJOR, o->layouts[1] = MF_LAYOUT_MASKED, o->nlayouts = 2;
    o->counts[0] = COUNTS_EQUAL, o->ncounts = 1;
    o->capacity = DEF_CAPACITY, o->iters = DEF_ITERS, o->warmup = DEF_WARMUP, o->seed = DEF_SEED;
    o->family = MF__GEMM_BENCH_AUTO;
    int ops_all = 1;
    for (int i = 3; i < argc; i++) {
        const char *v, *name = next_flag(argc, argv, &i, &v);
        if (!strcmp(name, "--help")) {
            usage(stdout);
            exit(0);
        } else if (!strcmp(name, "--model")) {
            o->nmodels = 0;
            parse_list(name, v, model_item, o);
        } else if (!strcmp(name, "--op")) {
            ops_all = !strcmp(v, "all");
            o->nops = 0;
            for (int j = 0; !ops_all && j < NUM_OPS; j++)
                if (!strcmp(v, k_ops[j].name)) o->ops[o->nops++] = j;
            if (!ops_all && !o->nops) die_usage("--op: '%s' is not w13, w2, w13_plain or all", v);
        } else if (!strcmp(name, "--rows")) {
            int_list_t l = {o->M, &o->nM, 1, 1 << 20};
            o->nM = 0;
            parse_list(name, v, int_item, &l);
        } else if (!strcmp(name, "--experts")) {
            int_list_t l = {o->L, &o->nL, 1, 1023};
            o->nL = 0;
            parse_list(name, v, int_item, &l);
        } else if (!strcmp(name, "--dtype")) {
            if (!strcmp(v, "bf16")) o->dtypes[0] = MF_DTYPE_BF16, o->ndtypes = 1;
            else if (!strcmp(v, "fp8")) o->dtypes[0] = MF_DTYPE_FP8_E4M3, o->ndtypes = 1;
            else if (!strcmp(v, "all")) o->dtypes[0] = MF_DTYPE_BF16, o->dtypes[1] = MF_DTYPE_FP8_E4M3, o->ndtypes = 2;
            else die_usage("--dtype: '%s' is not bf16, fp8 or all", v);
        } else if (!strcmp(name, "--layout")) {
            if (!strcmp(v, "expert_major")) o->layouts[0] = MF_LAYOUT_EXPERT_MAJOR, o->nlayouts = 1;
            else if (!strcmp(v, "masked")) o->layouts[0] = MF_LAYOUT_MASKED, o->nlayouts = 1;
            else if (!strcmp(v, "all"))
                o->layouts[0] = MF_LAYOUT_EXPERT_MAJOR, o->layouts[1] = MF_LAYOUT_MASKED, o->nlayouts = 2;
            else die_usage("--layout: '%s' is not expert_major, masked or all", v);
        } else if (!strcmp(name, "--counts")) {
            o->ncounts = 0;
            for (int c = 0; c < NUM_COUNTS; c++)
                if (!strcmp(v, k_counts_names[c]) || !strcmp(v, "all")) o->counts[o->ncounts++] = c;
            if (!o->ncounts) die_usage("--counts: '%s' is not equal, uneven, zipf or all", v);
        } else if (!strcmp(name, "--capacity")) o->capacity = (int32_t)parse_int(name, v, 1, 1 << 20);
        else if (!strcmp(name, "--quick")) o->quick = 1;
        else if (!strcmp(name, "--iters")) o->iters = (int32_t)parse_int(name, v, 1, 100000);
        else if (!strcmp(name, "--warmup")) o->warmup = (int32_t)parse_int(name, v, 0, 100000);
        else if (!strcmp(name, "--check")) o->check = 1;
        else if (!strcmp(name, "--no-cublas")) o->no_cublas = 1;
        else if (!strcmp(name, "--static-schedule")) o->static_schedule = 1;
        else if (!strcmp(name, "--family")) {
            if (!strcmp(v, "auto")) o->family = MF__GEMM_BENCH_AUTO;
            else if (!strcmp(v, "decode")) o->family = MF__GEMM_BENCH_DECODE;
            else if (!strcmp(v, "tma")) o->family = MF__GEMM_BENCH_TMA;
            else die_usage("--family: '%s' is not auto, decode or tma", v);
        }
        else if (!strcmp(name, "--seed")) o->seed = (uint64_t)parse_int(name, v, 0, INT64_MAX);
        else if (!strcmp(name, "--json")) o->json = v;
        else if (!strcmp(name, "--dry-run")) o->dry_run = 1;
    }
    if (!o->nmodels) {
        for (int m = 0; m < NUM_MODELS; m++) o->models[m] = m;
        o->nmodels = NUM_MODELS;
    }
    if (ops_all) { /* every op the library has in some dtype */
        o->nops = 0;
        for (int j = 0; j < NUM_OPS; j++)
            if (mf__gemm_bench_supported(k_ops[j].op, MF_DTYPE_BF16) || mf__gemm_bench_supported(k_ops[j].op, MF_DTYPE_FP8_E4M3))
                o->ops[o->nops++] = j;
    }
    if (!o->nM) {
        const int32_t *src = o->quick ? k_quick_M : k_default_M;
        int n = o->quick ? (int)(sizeof k_quick_M / sizeof *k_quick_M) : (int)(sizeof k_default_M / sizeof *k_default_M);
        for (int j = 0; j < n; j++) o->M[o->nM++] = src[j];
    }
}

/* ---- cases ------------------------------------------------------------------------------------ */
enum { CASE_PENDING, CASE_OK, CASE_SKIP, CASE_UNSUPPORTED, CASE_ERROR, CASE_DRY };

typedef struct gcase {
    const model_t *model;
    const op_info_t *op;
    int32_t dtype, layout, counts_kind, L, M;
    int32_t N, K, out_cols, out_esz, out_scaled, esz; /* GEMM geometry (see gemm_bench.h) */
    int32_t *counts, *offsets;                         /* host [L], [L + 1] */
    int32_t C, max_rows;                               /* masked capacity (0: expert_major); grid bound */
    int64_t rows, buf_rows;                            /* sum of counts; rows of the receive tensor */
    int32_t used;                                      /* experts with rows */
    double flops, wbytes, bytes, floor_us, operand_bytes;
    /* results */
    int status;
    char note[160];
    double us, cublas_us;
    const char *cublas_mode; /* "bf16", "block", "block-t", "tensor" */
    int checked, check_pass;
    double diff, max_err, max_ratio; /* max |got - exact| and max |got - exact| / bound */
    double max_acc_ratio;            /* max (|got - exact| - output rounding) / accumulation bound */
    int64_t wrong, scale_bad, untouched_bad;
} gcase_t;

static const char *dtype_name(int32_t d) { return d == MF_DTYPE_BF16 ? "bf16" : "fp8"; }
static const char *layout_name(int32_t l) { return l == MF_LAYOUT_MASKED ? "masked" : "expert_major"; }
static int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

static void case_name(const gcase_t *c, char *buf, size_t n) {
    snprintf(buf, n, "%s %s %s %s %s L %d M %d", c->model->name, c->op->name, dtype_name(c->dtype),
             layout_name(c->layout), k_counts_names[c->counts_kind], c->L, c->M);
}

/* splitmix64: the counts' generator (bench/peers.py has the same one). */
static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) * (1.0 / 9007199254740992.0); }

/* counts[L] summing to M * L (see usage); depends only on (seed, kind, L, M). */
static void make_counts(int kind, int32_t L, int32_t M, uint64_t seed, int32_t *counts) {
    uint64_t s = seed ^ ((uint64_t)kind << 56) ^ ((uint64_t)L << 32) ^ (uint64_t)M;
    const int64_t total = (int64_t)M * L;
    for (int32_t e = 0; e < L; e++) counts[e] = M;
    if (kind == COUNTS_UNEVEN) {
        const int32_t lo = (int32_t)floor(M * (1 - UNEVEN_SPREAD)), hi = (int32_t)ceil(M * (1 + UNEVEN_SPREAD));
        int64_t sum = 0;
        for (int32_t e = 0; e < L; e++) {
            counts[e] = (int32_t)llround(M * (1 + UNEVEN_SPREAD * (2 * rng_unit(&s) - 1)));
            sum += counts[e];
        }
        /* back to M * L: one row at a time, round robin, within [lo, hi] (bounded: the mean is M) */
        for (int64_t step = 0, e = 0; sum != total && step < (int64_t)L * (hi - lo + 2); step++, e = (e + 1) % L) {
            if (sum > total && counts[e] > lo) counts[e]--, sum--;
            else if (sum < total && counts[e] < hi) counts[e]++, sum++;
        }
    } else if (kind == COUNTS_ZIPF) {
        int32_t *order = malloc(sizeof(int32_t) * (size_t)L);
        double *frac = malloc(sizeof(double) * (size_t)L);
        char *taken = calloc((size_t)L, 1);
        if (!order || !frac || !taken) die_io("out of host memory");
        for (int32_t e = 0; e < L; e++) order[e] = e;
        for (int32_t e = L - 1; e > 0; e--) { /* Fisher-Yates: order[r] = expert of popularity rank r */
            int32_t j = (int32_t)(rng_next(&s) % (uint64_t)(e + 1)), t = order[e];
            order[e] = order[j], order[j] = t;
        }
        double sum_w = 0;
        for (int32_t r = 0; r < L; r++) sum_w += pow((double)(r + 1), -ZIPF_S);
        int64_t assigned = 0;
        for (int32_t r = 0; r < L; r++) {
            double x = (double)total * (pow((double)(r + 1), -ZIPF_S) / sum_w);
            double fl = floor(x);
            counts[order[r]] = (int32_t)fl;
            frac[order[r]] = x - fl;
            assigned += (int64_t)fl;
        }
        for (int64_t left = total - assigned; left > 0; left--) { /* largest remainders, lowest e on ties */
            int32_t best = -1;
            for (int32_t e = 0; e < L; e++)
                if (!taken[e] && (best < 0 || frac[e] > frac[best])) best = e;
            taken[best] = 1;
            counts[best]++;
        }
        free(order), free(frac), free(taken);
    }
}

/* Fills the geometry, layout and counting of a case whose identity fields are set. */
static void plan_case(const gopts_t *o, gcase_t *c) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    const int32_t H = c->model->H, I = c->model->I, L = c->L;
    c->esz = fp8 ? 1 : 2;
    if (c->op->op == MF__GEMM_OP_W2) c->N = H, c->K = I, c->out_cols = H, c->out_esz = 2, c->out_scaled = 0;
    else if (c->op->op == MF__GEMM_OP_W13_SWIGLU)
        c->N = 2 * I, c->K = H, c->out_cols = I, c->out_esz = c->esz, c->out_scaled = fp8;
    else c->N = 2 * I, c->K = H, c->out_cols = 2 * I, c->out_esz = 2, c->out_scaled = 0;
    c->counts = malloc(sizeof(int32_t) * (size_t)L);
    c->offsets = malloc(sizeof(int32_t) * (size_t)(L + 1));
    if (!c->counts || !c->offsets) die_io("out of host memory");
    make_counts(c->counts_kind, L, c->M, o->seed, c->counts);
    int32_t maxc = 0;
    c->rows = 0, c->used = 0;
    for (int32_t e = 0; e < L; e++) {
        maxc = c->counts[e] > maxc ? c->counts[e] : maxc;
        c->rows += c->counts[e];
        c->used += c->counts[e] > 0;
    }
    int64_t at = 0;
    if (c->layout == MF_LAYOUT_MASKED) {
        int64_t cap = round_up(maxc, SEGMENT_ALIGN);
        c->C = (int32_t)(cap > o->capacity ? cap : o->capacity);
        for (int32_t e = 0; e <= L; e++) c->offsets[e] = (int32_t)((int64_t)e * c->C);
        at = (int64_t)L * c->C;
        c->max_rows = c->C;
    } else {
        for (int32_t e = 0; e < L; e++) {
            c->offsets[e] = (int32_t)at;
            at += round_up(c->counts[e], SEGMENT_ALIGN);
        }
        c->offsets[L] = (int32_t)at;
        c->C = 0;
        c->max_rows = maxc;
    }
    c->buf_rows = at;
    const double es = c->esz, ss = fp8 ? 4.0 / QBLOCK : 0, ws = fp8 ? 4.0 / (QBLOCK * QBLOCK) : 0;
    const double oss = c->out_scaled ? 4.0 / QBLOCK : 0, N = c->N, K = c->K, rows = (double)c->rows;
    c->flops = 2.0 * rows * N * K;
    c->wbytes = c->used * N * K * (es + ws);
    c->bytes = c->wbytes + rows * K * (es + ss) + rows * c->out_cols * (c->out_esz + oss);
    const double peak = fp8 ? H200_FP8_FLOPS : H200_BF16_FLOPS;
    const double t_math = c->flops / peak, t_mem = c->bytes / H200_COPY_BYTES_PER_S;
    c->floor_us = (t_math > t_mem ? t_math : t_mem) * 1e6;
    c->operand_bytes = (double)c->buf_rows * K * (es + ss) + (double)L * N * K * (es + ws) +
                       (double)c->buf_rows * c->out_cols * (c->out_esz + oss);
}

/* The sweep in run order: model, L, M (buffers grow), counts, op, dtype, layout. */
static gcase_t *build_cases(const gopts_t *o, int *ncases) {
    int cap = 64, n = 0;
    gcase_t *cs = malloc(sizeof *cs * (size_t)cap);
    if (!cs) die_io("out of host memory");
    for (int mi = 0; mi < o->nmodels; mi++) {
        const model_t *m = &k_models[o->models[mi]];
        int32_t Ls[MAX_LIST];
        int nL = 0;
        if (o->nL) memcpy(Ls, o->L, sizeof(int32_t) * (size_t)(nL = o->nL));
        else if (o->quick && !strcmp(m->name, "deepseek-v3")) Ls[nL++] = QUICK_L_DEEPSEEK;
        else memcpy(Ls, m->L, sizeof(int32_t) * (size_t)(nL = m->nL));
        for (int li = 0; li < nL; li++)
            for (int mj = 0; mj < o->nM; mj++)
                for (int ci = 0; ci < o->ncounts; ci++)
                    for (int oi = 0; oi < o->nops; oi++)
                        for (int di = 0; di < o->ndtypes; di++)
                            for (int yi = 0; yi < o->nlayouts; yi++) {
                                if (n == cap && !(cs = realloc(cs, sizeof *cs * (size_t)(cap *= 2))))
                                    die_io("out of host memory");
                                gcase_t *c = &cs[n];
                                memset(c, 0, sizeof *c);
                                c->model = m, c->op = &k_ops[o->ops[oi]], c->dtype = o->dtypes[di];
                                c->layout = o->layouts[yi], c->counts_kind = o->counts[ci];
                                c->L = Ls[li], c->M = o->M[mj];
                                plan_case(o, c);
                                /* masked with equal counts and C = M is the expert_major problem byte for byte */
                                if (o->nlayouts == 2 && c->layout == MF_LAYOUT_MASKED && c->counts_kind == COUNTS_EQUAL &&
                                    c->C == c->M) {
                                    free(c->counts), free(c->offsets);
                                    continue;
                                }
                                if (c->operand_bytes > MAX_CASE_BYTES) {
                                    c->status = CASE_SKIP;
                                    snprintf(c->note, sizeof c->note, "operands %.1f GB > %.0f GB", c->operand_bytes / 1e9,
                                             MAX_CASE_BYTES / 1e9);
                                }
                                n++;
                            }
    }
    *ncases = n;
    return cs;
}

/* ---- device state ----------------------------------------------------------------------------- */
typedef struct dbuf {
    void *p;
    size_t cap;
} dbuf_t;

enum { B_A, B_AS, B_W, B_WS, B_OUT, B_OS, B_COUNTS, B_OFFSETS, B_SCHED, B_CB_AS, B_CB_WS, B_CB_ONE, B_WORKSPACE, B_FLUSH, NUM_BUFS };

typedef struct dev {
    cudaStream_t stream;
    cudaEvent_t ev0, ev1;
    cublasLtHandle_t lt;
    dbuf_t b[NUM_BUFS];
    int fp8_block_ok; /* -1 unknown, 0 refused (fell back), 1 used */
    char fp8_block_why[160];
    float *times; /* [iters] */
} gdev_t;

static char g_case[160]; /* the case being run, for error messages */

/* A CUDA runtime call inside a case: on failure print it with the case and return -1. */
#define CK(call)                                                                                              \
    do {                                                                                                      \
        cudaError_t ck_ = (call);                                                                             \
        if (ck_ != cudaSuccess) {                                                                             \
            fprintf(stderr, "moeflow bench gemm: %s: %s failed: %s\n", g_case, #call, cudaGetErrorString(ck_)); \
            return -1;                                                                                        \
        }                                                                                                     \
    } while (0)

static void free_bufs(gdev_t *d) {
    for (int i = 0; i < NUM_BUFS; i++) {
        if (d->b[i].p) cudaFree(d->b[i].p);
        d->b[i].p = NULL, d->b[i].cap = 0;
    }
}

/* Grows buffer i to `bytes` (contents lost). 0 ok, 1 out of device memory, -1 other CUDA error. */
static int ensure(gdev_t *d, int i, size_t bytes) {
    if (bytes == 0) bytes = 16;
    if (d->b[i].cap >= bytes) return 0;
    if (d->b[i].p) CK(cudaFree(d->b[i].p));
    d->b[i].p = NULL, d->b[i].cap = 0;
    cudaError_t e = cudaMalloc(&d->b[i].p, bytes);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        d->b[i].p = NULL;
        return 1;
    }
    CK(e);
    d->b[i].cap = bytes;
    return 0;
}

/* Bytes of the buffers of a case (cuBLAS D shares the output buffer; its scales have their own). */
static void case_buffer_bytes(const gcase_t *c, size_t *bytes) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    const size_t R = (size_t)c->buf_rows, N = (size_t)c->N, K = (size_t)c->K, L = (size_t)c->L;
    const size_t out = R * (size_t)c->out_cols * (size_t)c->out_esz, dense = (size_t)c->rows * N * 2;
    memset(bytes, 0, sizeof(size_t) * NUM_BUFS);
    bytes[B_A] = R * K * (size_t)c->esz;
    bytes[B_AS] = fp8 ? R * (K / QBLOCK) * sizeof(float) : 0;
    bytes[B_W] = L * N * K * (size_t)c->esz;
    bytes[B_WS] = fp8 ? L * (N / QBLOCK) * (K / QBLOCK) * sizeof(float) : 0;
    bytes[B_OUT] = out > dense ? out : dense;
    bytes[B_OS] = c->out_scaled ? R * ((size_t)c->out_cols / QBLOCK) * sizeof(float) : 0;
    bytes[B_COUNTS] = sizeof(int32_t) * L;
    bytes[B_OFFSETS] = sizeof(int32_t) * (L + 1);
    bytes[B_SCHED] = 2 * sizeof(int32_t); /* the TMA kernel's schedule pair: zeroed here, zero after each launch */
    /* cuBLASLt block scales, generously padded: 1x128 activations [K/128, rows up to 128], 128x128
     * weights [K/128 up to 4, N/128 up to 4] */
    bytes[B_CB_AS] = fp8 ? (K / QBLOCK) * (size_t)round_up(c->rows, QBLOCK) * sizeof(float) : 0;
    bytes[B_CB_WS] = fp8 ? (size_t)round_up((int64_t)(K / QBLOCK), 4) * (size_t)round_up((int64_t)(N / QBLOCK), 4) * sizeof(float) : 0;
    bytes[B_CB_ONE] = 16 * sizeof(float);
    bytes[B_WORKSPACE] = CUBLAS_WORKSPACE;
    bytes[B_FLUSH] = FLUSH_BYTES;
}

/* Allocates a case's buffers (once more from nothing after an out-of-memory). 0 ok, 1 no memory. */
static int alloc_case(gdev_t *d, const gcase_t *c) {
    size_t bytes[NUM_BUFS];
    case_buffer_bytes(c, bytes);
    for (int attempt = 0; attempt < 2; attempt++) {
        int oom = 0;
        for (int i = 0; i < NUM_BUFS && !oom; i++) {
            int r = ensure(d, i, bytes[i]);
            if (r < 0) return -1;
            oom = r;
        }
        if (!oom) return 0;
        free_bufs(d);
    }
    return 1;
}

static int fill(gdev_t *d, int buf, size_t count, int kind, uint32_t seed, float mag) {
    mf_result_t r = mf__gemm_bench_fill(d->b[buf].p, (int64_t)count, kind, seed, mag, d->stream);
    if (r != MF_SUCCESS) {
        fprintf(stderr, "moeflow bench gemm: %s: fill: %s\n", g_case, mf_last_error());
        return -1;
    }
    return 0;
}

/* Operands: a [buf_rows, K] ~ O(1), weights ~ U(-1, 1) sqrt(3 / K) so that outputs are O(1). */
static int fill_case(gdev_t *d, const gcase_t *c, uint32_t seed) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    const size_t R = (size_t)c->buf_rows, N = (size_t)c->N, K = (size_t)c->K, L = (size_t)c->L;
    const float wmag = sqrtf(3.0f / (float)c->K);
    if (fp8) {
        /* codes are 2^-3 .. 15 in magnitude (rms ~ 4): scales bring values to O(1) and O(wmag) */
        if (fill(d, B_A, R * K, MF__BENCH_FILL_FP8, seed, 0) || fill(d, B_AS, R * (K / QBLOCK), MF__BENCH_FILL_SCALE, seed + 1, 0.25f) ||
            fill(d, B_W, L * N * K, MF__BENCH_FILL_FP8, seed + 2, 0) ||
            fill(d, B_WS, L * (N / QBLOCK) * (K / QBLOCK), MF__BENCH_FILL_SCALE, seed + 3, 0.25f * wmag) ||
            fill(d, B_CB_AS, d->b[B_CB_AS].cap / sizeof(float), MF__BENCH_FILL_SCALE, seed + 4, 0.25f) ||
            fill(d, B_CB_WS, d->b[B_CB_WS].cap / sizeof(float), MF__BENCH_FILL_SCALE, seed + 5, 0.25f * wmag))
            return -1;
    } else {
        if (fill(d, B_A, R * K, MF__BENCH_FILL_BF16, seed, 1.0f) || fill(d, B_W, L * N * K, MF__BENCH_FILL_BF16, seed + 2, wmag))
            return -1;
    }
    if (fill(d, B_CB_ONE, 16, MF__BENCH_FILL_SCALE, seed + 6, 1.0f)) return -1;
    CK(cudaMemcpyAsync(d->b[B_COUNTS].p, c->counts, sizeof(int32_t) * L, cudaMemcpyHostToDevice, d->stream));
    CK(cudaMemcpyAsync(d->b[B_OFFSETS].p, c->offsets, sizeof(int32_t) * (L + 1), cudaMemcpyHostToDevice, d->stream));
    CK(cudaMemsetAsync(d->b[B_SCHED].p, 0, 2 * sizeof(int32_t), d->stream));
    CK(cudaStreamSynchronize(d->stream));
    return 0;
}

static mf__gemm_bench_args_t case_args(const gdev_t *d, const gcase_t *c, int static_schedule, int32_t family) {
    mf__gemm_bench_args_t a;
    memset(&a, 0, sizeof a);
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    a.op = c->op->op, a.dtype = c->dtype, a.ue8m0 = 0, a.H = c->model->H, a.I = c->model->I;
    a.num_experts = c->L, a.max_rows_per_expert = c->max_rows, a.rows_hint = c->M;
    a.counts = d->b[B_COUNTS].p, a.offsets = d->b[B_OFFSETS].p;
    a.sched = static_schedule ? NULL : d->b[B_SCHED].p;
    a.a = d->b[B_A].p, a.a_scales = fp8 ? d->b[B_AS].p : NULL;
    a.w = d->b[B_W].p, a.w_scales = fp8 ? d->b[B_WS].p : NULL;
    a.out = d->b[B_OUT].p, a.out_scales = c->out_scaled ? d->b[B_OS].p : NULL;
    a.family = family;
    return a;
}

/* ---- timing ----------------------------------------------------------------------------------- */
typedef int (*launch_fn)(gdev_t *d, void *ctx); /* 0 ok, -1 failed (message printed) */

static int cmp_float(const void *x, const void *y) {
    float a = *(const float *)x, b = *(const float *)y;
    return (a > b) - (a < b);
}

/* Median time in us of `iters` launches after `warmup`, each after an L2 flush (untimed). */
static int time_launches(gdev_t *d, const gopts_t *o, launch_fn launch, void *ctx, double *us) {
    for (int it = 0; it < o->warmup + o->iters; it++) {
        CK(cudaMemsetAsync(d->b[B_FLUSH].p, it & 0xff, FLUSH_BYTES, d->stream));
        CK(cudaEventRecord(d->ev0, d->stream));
        if (launch(d, ctx)) return -1;
        CK(cudaEventRecord(d->ev1, d->stream));
        CK(cudaEventSynchronize(d->ev1));
        float ms;
        CK(cudaEventElapsedTime(&ms, d->ev0, d->ev1));
        if (it >= o->warmup) d->times[it - o->warmup] = ms;
    }
    qsort(d->times, (size_t)o->iters, sizeof(float), cmp_float);
    *us = 1e3 * (o->iters % 2 ? d->times[o->iters / 2] : 0.5 * (d->times[o->iters / 2 - 1] + d->times[o->iters / 2]));
    return 0;
}

typedef struct moeflow_launch {
    mf__gemm_bench_args_t args;
    mf_result_t code;
} moeflow_launch_t;

static int launch_moeflow(gdev_t *d, void *ctx) {
    moeflow_launch_t *m = ctx;
    m->code = mf__gemm_bench_run(&m->args, d->stream);
    if (m->code != MF_SUCCESS) {
        if (m->code != MF_ERR_NOT_SUPPORTED)
            fprintf(stderr, "moeflow bench gemm: %s: %s: %s\n", g_case, mf_result_string(m->code), mf_last_error());
        return -1;
    }
    return 0;
}

/* ---- cuBLAS dense ceiling --------------------------------------------------------------------- */
typedef struct lt_plan {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulHeuristicResult_t heur;
    const void *A, *B;
    void *D;
} lt_plan_t;

static void lt_destroy(lt_plan_t *p) {
    if (p->desc) cublasLtMatmulDescDestroy(p->desc);
    if (p->la) cublasLtMatrixLayoutDestroy(p->la);
    if (p->lb) cublasLtMatrixLayoutDestroy(p->lb);
    if (p->ld) cublasLtMatrixLayoutDestroy(p->ld);
    memset(p, 0, sizeof *p);
}

enum { LT_BF16, LT_FP8_BLOCK, LT_FP8_BLOCK_T, LT_FP8_TENSOR };
static const char *const k_lt_modes[] = {"bf16", "block", "block-t", "tensor"};

#define LT_OK(call)                                                          \
    do {                                                                     \
        cublasStatus_t st_ = (call);                                         \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                  \
            snprintf(why, why_len, "%s: status %d", #call, (int)st_);        \
            lt_destroy(p);                                                   \
            return 1;                                                        \
        }                                                                    \
    } while (0)

/* D[rows, N] = act[rows, K] . W[N, K]^T in column-major terms: D^T [N, rows] = W^T . act^T, i.e.
 * A = W stored K x N (op T), B = act stored K x rows (op N) — cuBLASLt's FP8 "TN" form. The
 * block-t mode swaps the roles (A = act with 1x128 scales, B = W with 128x128 scales, D [rows, N]
 * column-major) in case cuBLASLt only takes block scales that way round. 0 ok, 1 refused (why). */
static int lt_plan(gdev_t *d, const gcase_t *c, int mode, lt_plan_t *p, char *why, size_t why_len) {
    memset(p, 0, sizeof *p);
    const uint64_t rows = (uint64_t)c->rows, N = (uint64_t)c->N, K = (uint64_t)c->K;
    const cudaDataType_t in = mode == LT_BF16 ? CUDA_R_16BF : CUDA_R_8F_E4M3;
    const int swap = mode == LT_FP8_BLOCK_T;
    cublasOperation_t opT = CUBLAS_OP_T, opN = CUBLAS_OP_N;
    LT_OK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT_OK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opT, sizeof opT));
    LT_OK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opN, sizeof opN));
    const void *w = d->b[B_W].p, *act = d->b[B_A].p;
    p->A = swap ? act : w, p->B = swap ? w : act, p->D = d->b[B_OUT].p;
    if (mode != LT_BF16) {
        const void *w_scale = mode == LT_FP8_TENSOR ? d->b[B_CB_ONE].p : d->b[B_CB_WS].p;
        const void *a_scale = mode == LT_FP8_TENSOR ? (const float *)d->b[B_CB_ONE].p + 1 : d->b[B_CB_AS].p;
        int32_t w_mode = mode == LT_FP8_TENSOR ? CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F : CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F;
        int32_t a_mode = mode == LT_FP8_TENSOR ? CUBLASLT_MATMUL_MATRIX_SCALE_SCALAR_32F : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
        const void *sa = swap ? a_scale : w_scale, *sb = swap ? w_scale : a_scale;
        int32_t ma = swap ? a_mode : w_mode, mb = swap ? w_mode : a_mode;
        LT_OK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &ma, sizeof ma));
        LT_OK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mb, sizeof mb));
        LT_OK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof sa));
        LT_OK(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof sb));
    }
    const uint64_t a_cols = swap ? rows : N, b_cols = swap ? N : rows;
    LT_OK(cublasLtMatrixLayoutCreate(&p->la, in, K, a_cols, (int64_t)K));
    LT_OK(cublasLtMatrixLayoutCreate(&p->lb, in, K, b_cols, (int64_t)K));
    LT_OK(cublasLtMatrixLayoutCreate(&p->ld, CUDA_R_16BF, a_cols, b_cols, (int64_t)a_cols));
    cublasLtMatmulPreference_t pref = NULL;
    size_t ws = CUBLAS_WORKSPACE;
    int found = 0;
    cublasStatus_t st = cublasLtMatmulPreferenceCreate(&pref);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasLtMatmulAlgoGetHeuristic(d->lt, p->desc, p->la, p->lb, p->ld, p->ld, pref, 1, &p->heur, &found);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
        snprintf(why, why_len, "cublasLtMatmulAlgoGetHeuristic: %s",
                 st != CUBLAS_STATUS_SUCCESS ? "failed" : "no algorithm");
        if (st != CUBLAS_STATUS_SUCCESS) snprintf(why + strlen(why), why_len - strlen(why), " (status %d)", (int)st);
        lt_destroy(p);
        return 1;
    }
    return 0;
}

typedef struct lt_launch {
    lt_plan_t plan;
    cublasStatus_t status;
} lt_launch_t;

static int launch_cublas(gdev_t *d, void *ctx) {
    lt_launch_t *l = ctx;
    const float alpha = 1.0f, beta = 0.0f;
    l->status = cublasLtMatmul(d->lt, l->plan.desc, &alpha, l->plan.A, l->plan.la, l->plan.B, l->plan.lb, &beta,
                               l->plan.D, l->plan.ld, l->plan.D, l->plan.ld, &l->plan.heur.algo, d->b[B_WORKSPACE].p,
                               CUBLAS_WORKSPACE, d->stream);
    if (l->status != CUBLAS_STATUS_SUCCESS) {
        fprintf(stderr, "moeflow bench gemm: %s: cublasLtMatmul failed (status %d)\n", g_case, (int)l->status);
        return -1;
    }
    return 0;
}

/* Times the dense ceiling of a case: sets c->cublas_us and c->cublas_mode (NULL: none). */
static int run_cublas(gdev_t *d, const gopts_t *o, gcase_t *c) {
    static const int fp8_modes[] = {LT_FP8_BLOCK, LT_FP8_BLOCK_T, LT_FP8_TENSOR};
    const int bf16_modes[] = {LT_BF16};
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3, nmodes = fp8 ? 3 : 1;
    const int *modes = fp8 ? fp8_modes : bf16_modes;
    char why[160] = "", first_why[160] = "";
    lt_launch_t l;
    l.status = CUBLAS_STATUS_SUCCESS;
    int mode = -1;
    for (int i = 0; i < nmodes && mode < 0; i++) {
        if (fp8 && modes[i] != LT_FP8_TENSOR && d->fp8_block_ok == 0) continue; /* refused before */
        if (lt_plan(d, c, modes[i], &l.plan, why, sizeof why) == 0) mode = modes[i];
        else if (!first_why[0]) snprintf(first_why, sizeof first_why, "%s", why);
    }
    if (mode < 0) {
        fprintf(stderr, "moeflow bench gemm: %s: cuBLAS dense refused: %s\n", g_case, why);
        c->cublas_mode = NULL;
        return 0;
    }
    if (fp8 && d->fp8_block_ok < 0) {
        d->fp8_block_ok = mode != LT_FP8_TENSOR;
        if (!d->fp8_block_ok) {
            snprintf(d->fp8_block_why, sizeof d->fp8_block_why, "%s", first_why);
            printf("# cublas   fp8 block scales refused (%s): fp8 rows use tensor-wide scales\n", first_why);
        } else {
            printf("# cublas   fp8 uses block scales: 128x128 (weights) and 1x128 (activations)%s\n",
                   mode == LT_FP8_BLOCK_T ? " in the swapped (act . W) form" : "");
        }
    } else if (fp8 && d->fp8_block_ok == 1 && mode == LT_FP8_TENSOR) {
        printf("# cublas   %s: block scales refused (%s): tensor-wide scales for this case\n", g_case, first_why);
    }
    int r = time_launches(d, o, launch_cublas, &l, &c->cublas_us);
    lt_destroy(&l.plan);
    if (r) return l.status != CUBLAS_STATUS_SUCCESS ? 0 : -1; /* a cuBLAS refusal is not fatal */
    c->cublas_mode = k_lt_modes[mode];
    return 0;
}

/* ---- --check: the host reference -------------------------------------------------------------- */
typedef struct ref_job {
    const gcase_t *c;
    const uint8_t *w;  /* the expert's [N, K] (bf16 or E4M3 codes) */
    const float *ws;   /* FP8: [N/128, K/128] */
    const float *a;    /* [nrows, K] decoded: bf16 values or E4M3 code values */
    const float *as;   /* FP8: [nrows, K/128] */
    int nrows;
    int32_t n0, n1;
    double *acc;       /* [nrows, N] */
    double *err;       /* [nrows, N]: the accumulation bound of acc (mf__gemm_ref_dot) */
} ref_job_t;

/* acc[r, n] = sum over K blocks of (sum_k a[r, k] w[n, k]) (x a_scale[r, kb] w_scale[n/128, kb]),
 * exact in fp64, and err[r, n] its bound (cuda/gemm_bench.h). */
static void *ref_worker(void *arg) {
    const ref_job_t *j = arg;
    const int fp8 = j->c->dtype == MF_DTYPE_FP8_E4M3;
    const int32_t K = j->c->K, N = j->c->N, kbs = (K + QBLOCK - 1) / QBLOCK;
    float *wrow = malloc(sizeof(float) * (size_t)K);
    if (!wrow) return (void *)1;
    for (int32_t n = j->n0; n < j->n1; n++) {
        for (int32_t k = 0; k < K; k++) {
            if (fp8) wrow[k] = mf__fp8_to_float(j->w[(size_t)n * K + k]);
            else {
                uint16_t v;
                memcpy(&v, j->w + 2 * ((size_t)n * K + k), 2);
                wrow[k] = mf__bf16_to_float(v);
            }
        }
        for (int r = 0; r < j->nrows; r++) {
            const size_t at = (size_t)r * N + n;
            mf__gemm_ref_dot(j->a + (size_t)r * K, wrow, K, fp8 ? j->as + (size_t)r * kbs : NULL,
                             fp8 ? j->ws + (size_t)(n / QBLOCK) * kbs : NULL, &j->acc[at], &j->err[at], NULL);
        }
    }
    free(wrow);
    return NULL;
}

static int ref_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > MAX_REF_THREADS ? MAX_REF_THREADS : (int)n;
}

/* Runs the reference of `nrows` rows of one expert on all cores. 0 ok, -1 no memory / threads. */
static int ref_expert(ref_job_t *base) {
    int T = ref_threads();
    const int32_t N = base->c->N, chunk = (N + T - 1) / T;
    pthread_t th[MAX_REF_THREADS];
    ref_job_t jobs[MAX_REF_THREADS];
    int started = 0, bad = 0;
    for (int t = 0; t < T; t++) {
        jobs[t] = *base;
        jobs[t].n0 = t * chunk;
        jobs[t].n1 = (t + 1) * chunk < N ? (t + 1) * chunk : N;
        if (jobs[t].n0 >= jobs[t].n1) break;
        if (pthread_create(&th[t], NULL, ref_worker, &jobs[t]) != 0) {
            bad = 1;
            break;
        }
        started++;
    }
    for (int t = 0; t < started; t++) {
        void *ret;
        pthread_join(th[t], &ret);
        bad |= ret != NULL;
    }
    return bad ? -1 : 0;
}

/* Sampled rows of an expert with `count` rows: both ends, the 64/128-row tile edges, the middle. */
static int pick_rows(int32_t count, int32_t *rows) {
    const int32_t cand[CHECK_ROW_MAX] = {0, 63, 64, 127, 128, count / 2, count - 2, count - 1};
    int n = 0;
    for (int i = 0; i < CHECK_ROW_MAX; i++) {
        int dup = cand[i] < 0 || cand[i] >= count;
        for (int j = 0; j < n && !dup; j++) dup = rows[j] == cand[i];
        if (!dup) rows[n++] = cand[i];
    }
    return n;
}

/* Sampled experts: CHECK_EXPERTS spread over [0, L) (both ends), plus the first empty one. */
static int pick_experts(const gcase_t *c, int32_t *ex) {
    int n = 0;
    for (int i = 0; i < CHECK_EXPERTS; i++) {
        int32_t e = c->L == 1 ? 0 : (int32_t)((int64_t)i * (c->L - 1) / (CHECK_EXPERTS - 1));
        int dup = 0;
        for (int j = 0; j < n && !dup; j++) dup = ex[j] == e;
        if (!dup) ex[n++] = e;
    }
    for (int32_t e = 0; e < c->L; e++)
        if (c->counts[e] == 0) {
            int dup = 0;
            for (int j = 0; j < n && !dup; j++) dup = ex[j] == e;
            if (!dup) ex[n++] = e;
            break;
        }
    return n;
}

typedef struct cmp_acc {
    double sxy, sxx, syy, max_err, max_ratio, max_acc_ratio;
    int64_t n, wrong;
    int nonfinite;
} cmp_acc_t;

/* One element: got x, the reference rounded as the kernel rounds y (for the diff measure), the
 * exact value and its bound: wrong when !(|x - exact| <= bound) (NaN never passes). */
static void cmp_one(cmp_acc_t *s, const char *what, const char *where, double x, double y, double exact, double bound,
                    double eacc, double rout) {
    if (!isfinite(x) || !isfinite(y)) s->nonfinite = 1;
    s->sxy += x * y, s->sxx += x * x, s->syy += y * y, s->n++;
    const double err = fabs(x - exact), ratio = bound > 0 ? err / bound : err > 0 ? INFINITY : 0;
    if (!(err <= bound)) {
        if (s->wrong < 4)
            fprintf(stderr, "moeflow bench gemm: %s: %s outside its bound at %s: gpu %.9g exact %.9g |diff| %.3g bound %.3g\n",
                    g_case, what, where, x, exact, err, bound);
        s->wrong++;
    }
    if (err > s->max_err || err != err) s->max_err = err;
    if (ratio > s->max_ratio || ratio != ratio) s->max_ratio = ratio != ratio ? INFINITY : ratio;
    /* what the accumulation must have contributed at least, against its own bound */
    const double acc_err = err - rout > 0 ? err - rout : 0, acc_ratio = eacc > 0 ? acc_err / eacc : 0;
    if (acc_ratio > s->max_acc_ratio || acc_ratio != acc_ratio) s->max_acc_ratio = acc_ratio != acc_ratio ? INFINITY : acc_ratio;
}

/* Poison-check of the rows [row0, row1) of the output (and its scales): every byte POISON. */
static int64_t count_touched(gdev_t *d, const gcase_t *c, int64_t row0, int64_t row1, uint8_t *buf, int *fail) {
    const size_t rb = (size_t)c->out_cols * (size_t)c->out_esz, sb = c->out_scaled ? (size_t)c->out_cols / QBLOCK * sizeof(float) : 0;
    int64_t touched = 0;
    for (int64_t r = row0; r < row1; r++) {
        if (cudaMemcpy(buf, (uint8_t *)d->b[B_OUT].p + (size_t)r * rb, rb, cudaMemcpyDeviceToHost) != cudaSuccess ||
            (sb && cudaMemcpy(buf + rb, (uint8_t *)d->b[B_OS].p + (size_t)r * sb, sb, cudaMemcpyDeviceToHost) != cudaSuccess)) {
            *fail = 1;
            return touched;
        }
        for (size_t b = 0; b < rb + sb; b++)
            if (buf[b] != POISON) {
                touched++;
                break;
            }
    }
    return touched;
}

/* The checked elements of a case: what the GPU wrote, the reference rounded as the kernel rounds
 * (the diff measure), the exact fp64 value and the element's bound on |got - exact|. */
typedef struct check_set {
    double *got, *want, *exact, *bound;
    double *eacc, *rout; /* the bound before output rounding; the most the output's rounding can move got */
    int32_t *where; /* [n, 3]: expert, row of the expert, column */
    size_t n, cap;
    int64_t scale_bad; /* FP8 h scales no amax within the bounds gives (mf__gemm_fp8_scale_ok) */
} check_set_t;

static int check_set_init(check_set_t *s, size_t cap) {
    memset(s, 0, sizeof *s);
    s->cap = cap ? cap : 1;
    s->got = malloc(sizeof(double) * s->cap), s->want = malloc(sizeof(double) * s->cap);
    s->exact = malloc(sizeof(double) * s->cap), s->bound = malloc(sizeof(double) * s->cap);
    s->eacc = malloc(sizeof(double) * s->cap), s->rout = malloc(sizeof(double) * s->cap);
    s->where = malloc(sizeof(int32_t) * 3 * s->cap);
    return s->got && s->want && s->exact && s->bound && s->eacc && s->rout && s->where ? 0 : -1;
}

static void check_set_free(check_set_t *s) {
    free(s->got), free(s->want), free(s->exact), free(s->bound), free(s->eacc), free(s->rout), free(s->where);
    memset(s, 0, sizeof *s);
}

static void check_set_add(check_set_t *s, double got, double want, double exact, double bound, double eacc, double rout,
                          int32_t e, int32_t row, int32_t col) {
    if (s->n == s->cap) return; /* sized for every sampled row: never */
    s->got[s->n] = got, s->want[s->n] = want, s->exact[s->n] = exact, s->bound[s->n] = bound;
    s->eacc[s->n] = eacc, s->rout[s->n] = rout;
    s->where[3 * s->n] = e, s->where[3 * s->n + 1] = row, s->where[3 * s->n + 2] = col;
    s->n++;
}

/* Half a BF16 ulp at x's binade: no fp32 value that rounds to the BF16 x is further from it. */
static double bf16_half_ulp(double x) {
    int ex;
    frexp(x, &ex); /* 2^(ex-1) <= |x| < 2^ex */
    return x == 0 ? 0x1p-134 : ldexp(1.0, ex - 1 - 8);
}

/* Half an E4M3 step at code c (subnormal step below 2^-6), in code units. */
static double e4m3_half_step(uint8_t c) {
    const int e = (c >> 3) & 15;
    return e == 0 ? 0x1p-10 : ldexp(1.0, e - 7 - 4);
}

/* One sampled output row: acc [N] are the row's exact fp64 GEMM sums and err [N] their bounds; out
 * the row the GPU wrote ([out_cols] E4M3 codes or bf16) and gs its h scales (FP8 W13). W13: h =
 * silu(gate) * up exactly with its bound (mf__gemm_swiglu), the FP8 element bound taken at the
 * scale the kernel wrote, which must itself be one the block's amax allows. The diff measure's
 * reference is h rounded to fp32 and then, as the kernel does, to BF16 or to E4M3 in 1x128 blocks
 * (mf__fp8_block_scale over the fp32 amax); the comparison is of dequantised values. */
static void collect_row(const gcase_t *c, int32_t ue8m0, const double *acc, const double *err, const uint8_t *out,
                        const float *gs, int32_t e, int32_t row, check_set_t *set) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    const int32_t I = c->model->I;
    if (c->op->op != MF__GEMM_OP_W13_SWIGLU) { /* bf16 out [rows, out_cols] */
        for (int32_t col = 0; col < c->out_cols; col++) {
            uint16_t v;
            memcpy(&v, out + 2 * (size_t)col, 2);
            const double got = mf__bf16_to_float(v);
            check_set_add(set, got, mf__bf16_to_float(mf__bf16_from_float((float)acc[col])), acc[col],
                          mf__gemm_bound_bf16_out(acc[col], err[col]), err[col], bf16_half_ulp(got), e, row, col);
        }
        return;
    }
    float h[QBLOCK];
    double hx[QBLOCK], eh[QBLOCK];
    for (int32_t b0 = 0; b0 < I; b0 += QBLOCK) {
        const int32_t bn = I - b0 < QBLOCK ? I - b0 : QBLOCK;
        float amax = 0;
        double amax_x = 0, eh_max = 0;
        for (int32_t j = 0; j < bn; j++) {
            mf__gemm_swiglu(acc[b0 + j], err[b0 + j], acc[I + b0 + j], err[I + b0 + j], &hx[j], &eh[j]);
            h[j] = (float)hx[j];
            amax = fabsf(h[j]) > amax ? fabsf(h[j]) : amax;
            amax_x = fabs(hx[j]) > amax_x ? fabs(hx[j]) : amax_x;
            eh_max = eh[j] > eh_max ? eh[j] : eh_max;
        }
        float scale = 1, inv = 1;
        if (fp8) {
            mf__fp8_block_scale(amax, ue8m0, &scale, &inv);
            const double g = gs[b0 / QBLOCK];
            if (!mf__gemm_fp8_scale_ok(amax_x, eh_max, ue8m0, g, MF__FP8_AMAX_MIN, MF__FP8_MAX)) {
                if (set->scale_bad < 4)
                    fprintf(stderr, "moeflow bench gemm: %s: h scale outside its bound at expert %d row %d block %d: gpu %.9g, "
                                    "exact amax / 448 %.9g (amax within %.3g)\n",
                            g_case, e, row, b0 / QBLOCK, g, amax_x / MF__FP8_MAX, eh_max);
                set->scale_bad++;
            }
        }
        for (int32_t j = 0; j < bn; j++) {
            const int32_t col = b0 + j;
            if (fp8) {
                const double g = gs[col / QBLOCK];
                check_set_add(set, (double)mf__fp8_to_float(out[col]) * g,
                              (double)mf__fp8_to_float(mf__fp8_from_float(h[j] * inv)) * scale, hx[j],
                              mf__gemm_bound_fp8_h(hx[j], eh[j], g), eh[j], e4m3_half_step(out[col]) * g * (1 + 0x1p-20),
                              e, row, col);
            } else {
                uint16_t v;
                memcpy(&v, out + 2 * (size_t)col, 2);
                const double got = mf__bf16_to_float(v);
                check_set_add(set, got, mf__bf16_to_float(mf__bf16_from_float(h[j])), hx[j],
                              mf__gemm_bound_bf16_out(hx[j], eh[j]), eh[j], bf16_half_ulp(got), e, row, col);
            }
        }
    }
}

/* Judges a check set (diff measure + element-wise bounds): sets c->checked, diff, wrong, scale_bad,
 * max_err, max_ratio and check_pass (which also needs c->untouched_bad == 0). */
static void judge(gcase_t *c, const check_set_t *set) {
    cmp_acc_t s;
    memset(&s, 0, sizeof s);
    for (size_t i = 0; i < set->n; i++) {
        char at[96];
        snprintf(at, sizeof at, "expert %d row %d col %d", set->where[3 * i], set->where[3 * i + 1], set->where[3 * i + 2]);
        cmp_one(&s, c->op->name, at, set->got[i], set->want[i], set->exact[i], set->bound[i], set->eacc[i], set->rout[i]);
    }
    c->checked = 1;
    c->diff = s.nonfinite ? INFINITY : (s.sxx + s.syy) == 0 ? 0.0 : 1.0 - 2.0 * s.sxy / (s.sxx + s.syy);
    c->wrong = s.wrong;
    c->scale_bad = set->scale_bad;
    c->max_err = s.max_err;
    c->max_ratio = s.max_ratio;
    c->max_acc_ratio = s.max_acc_ratio;
    c->check_pass = !s.nonfinite && c->diff < (c->dtype == MF_DTYPE_FP8_E4M3 ? DIFF_MAX_FP8 : DIFF_MAX_BF16) &&
                    s.wrong == 0 && set->scale_bad == 0 && c->untouched_bad == 0 && set->n > 0;
}

/* --check of one case: NaN garbage in unowned input rows, poisoned outputs, one launch, then the
 * sampled rows against the reference and the rows past counts against the poison. Sets c->checked
 * and c->check_pass. 0 checked, 1 could not check (message printed), -1 a CUDA error. */
static int check_case(gdev_t *d, gcase_t *c, const mf__gemm_bench_args_t *args) {
    const int fp8 = c->dtype == MF_DTYPE_FP8_E4M3;
    const int32_t K = c->K, N = c->N, I = c->model->I, kbs = K / QBLOCK, ocols = c->out_cols;
    const size_t arow = (size_t)K * c->esz, asrow = fp8 ? (size_t)kbs * sizeof(float) : 0;
    const size_t orow = (size_t)ocols * c->out_esz, osrow = c->out_scaled ? (size_t)ocols / QBLOCK * sizeof(float) : 0;
    for (int32_t e = 0; e < c->L; e++) { /* rows [offsets[e] + counts[e], end of e's slot) */
        const int64_t r0 = (int64_t)c->offsets[e] + c->counts[e], r1 = c->offsets[e + 1];
        if (r1 <= r0) continue;
        CK(cudaMemsetAsync((uint8_t *)d->b[B_A].p + r0 * arow, POISON, (size_t)(r1 - r0) * arow, d->stream));
        if (fp8) CK(cudaMemsetAsync((uint8_t *)d->b[B_AS].p + r0 * asrow, POISON, (size_t)(r1 - r0) * asrow, d->stream));
    }
    CK(cudaMemsetAsync(d->b[B_OUT].p, POISON, (size_t)c->buf_rows * orow, d->stream));
    if (osrow) CK(cudaMemsetAsync(d->b[B_OS].p, POISON, (size_t)c->buf_rows * osrow, d->stream));
    mf_result_t r = mf__gemm_bench_run(args, d->stream);
    if (r != MF_SUCCESS) {
        fprintf(stderr, "moeflow bench gemm: %s: %s: %s\n", g_case, mf_result_string(r), mf_last_error());
        return r == MF_ERR_CUDA ? -1 : 1;
    }
    CK(cudaStreamSynchronize(d->stream));

    int32_t ex[CHECK_EXPERTS + 1], rws[CHECK_ROW_MAX];
    const int nex = pick_experts(c, ex);
    const size_t wbytes = (size_t)N * K * c->esz, wsn = fp8 ? (size_t)(N / QBLOCK) * kbs : 0;
    uint8_t *w = malloc(wbytes), *raw = malloc(CHECK_ROW_MAX * (arow + asrow + orow + osrow) + orow + osrow);
    float *ws = malloc(sizeof(float) * (wsn ? wsn : 1)), *a = malloc(sizeof(float) * CHECK_ROW_MAX * (size_t)K);
    float *as = malloc(sizeof(float) * CHECK_ROW_MAX * (size_t)(kbs ? kbs : 1));
    double *acc = malloc(sizeof(double) * CHECK_ROW_MAX * (size_t)N), *err = malloc(sizeof(double) * CHECK_ROW_MAX * (size_t)N);
    check_set_t set;
    int rc = 0, io_fail = 0;
    if (check_set_init(&set, (size_t)nex * CHECK_ROW_MAX * (size_t)ocols) || !w || !raw || !ws || !a || !as || !acc || !err) {
        fprintf(stderr, "moeflow bench gemm: %s: --check: out of host memory\n", g_case);
        rc = 1;
        goto done;
    }
    c->untouched_bad = 0;
    for (int xi = 0; xi < nex; xi++) {
        const int32_t e = ex[xi], cnt = c->counts[e];
        const int64_t off = c->offsets[e];
        /* rows past counts[e]: still the poison */
        const int64_t t0 = off + cnt, t1 = t0 + CHECK_TAIL_ROWS < c->offsets[e + 1] ? t0 + CHECK_TAIL_ROWS : c->offsets[e + 1];
        c->untouched_bad += count_touched(d, c, t0, t1, raw, &io_fail);
        const int nr = pick_rows(cnt, rws);
        if (nr == 0 || io_fail) continue;
        CK(cudaMemcpy(w, (const uint8_t *)d->b[B_W].p + (size_t)e * wbytes, wbytes, cudaMemcpyDeviceToHost));
        if (fp8) CK(cudaMemcpy(ws, (const float *)d->b[B_WS].p + (size_t)e * wsn, wsn * sizeof(float), cudaMemcpyDeviceToHost));
        for (int i = 0; i < nr; i++) {
            const int64_t row = off + rws[i];
            uint8_t *ar = raw + (size_t)i * arow;
            CK(cudaMemcpy(ar, (const uint8_t *)d->b[B_A].p + (size_t)row * arow, arow, cudaMemcpyDeviceToHost));
            for (int32_t k = 0; k < K; k++) {
                if (fp8) a[(size_t)i * K + k] = mf__fp8_to_float(ar[k]);
                else {
                    uint16_t v;
                    memcpy(&v, ar + 2 * (size_t)k, 2);
                    a[(size_t)i * K + k] = mf__bf16_to_float(v);
                }
            }
            if (fp8) CK(cudaMemcpy(as + (size_t)i * kbs, (const uint8_t *)d->b[B_AS].p + (size_t)row * asrow, asrow, cudaMemcpyDeviceToHost));
        }
        ref_job_t job = {c, w, ws, a, as, nr, 0, N, acc, err};
        if (ref_expert(&job)) {
            fprintf(stderr, "moeflow bench gemm: %s: --check: reference threads failed\n", g_case);
            rc = 1;
            goto done;
        }
        uint8_t *orow_buf = raw + CHECK_ROW_MAX * (arow + asrow);
        for (int i = 0; i < nr; i++) {
            const int64_t row = off + rws[i];
            CK(cudaMemcpy(orow_buf, (const uint8_t *)d->b[B_OUT].p + (size_t)row * orow, orow, cudaMemcpyDeviceToHost));
            float gs[MF__QUANT_BLOCK]; /* the row's h scales (FP8 W13: I / 128 of them; I <= 128 x 128) */
            const int32_t nsb = ocols / QBLOCK;
            if (osrow) {
                if (nsb > MF__QUANT_BLOCK) {
                    fprintf(stderr, "moeflow bench gemm: %s: --check: I %d too large for the checker\n", g_case, I);
                    rc = 1;
                    goto done;
                }
                CK(cudaMemcpy(gs, (const uint8_t *)d->b[B_OS].p + (size_t)row * osrow, osrow, cudaMemcpyDeviceToHost));
            }
            collect_row(c, args->ue8m0, acc + (size_t)i * N, err + (size_t)i * N, orow_buf, gs, e, rws[i], &set);
        }
    }
    if (io_fail) {
        fprintf(stderr, "moeflow bench gemm: %s: --check: copying the output back failed\n", g_case);
        rc = -1;
        goto done;
    }
    {
        judge(c, &set);
        if (c->scale_bad)
            fprintf(stderr, "moeflow bench gemm: %s: %lld h scales outside their bounds\n", g_case, (long long)c->scale_bad);
        if (c->untouched_bad)
            fprintf(stderr, "moeflow bench gemm: %s: %lld rows past counts[e] were written\n", g_case, (long long)c->untouched_bad);
    }
done:
    free(w), free(raw), free(ws), free(a), free(as), free(acc), free(err);
    check_set_free(&set);
    return rc;
}

/* ---- output ----------------------------------------------------------------------------------- */
static void print_header(void) {
    printf("#%-15s %-4s %-4s %-12s %-6s %4s %5s %6s %10s %8s %6s %9s %7s %10s %8s %7s %9s %8s %8s %6s\n", "model", "op",
           "type", "layout", "counts", "L", "M", "C", "time", "TFLOP/s", "wTB/s", "floor", "%floor", "cublas", "TFLOP/s",
           "%cublas", "diff", "err/bnd", "acc/bnd", "#wrong");
    printf("#%-15s %-4s %-4s %-12s %-6s %4s %5s %6s %10s %8s %6s %9s %7s %10s %8s %7s %9s %8s %8s %6s\n", "", "", "", "", "", "",
           "", "", "(us)", "", "", "(us)", "", "(us)", "", "", "", "(max)", "(max)", "");
}

static void print_row(const gcase_t *c) {
    char C[16] = "-";
    if (c->layout == MF_LAYOUT_MASKED) snprintf(C, sizeof C, "%d", c->C);
    printf(" %-15s %-4s %-4s %-12s %-6s %4d %5d %6s", c->model->name, c->op->column, dtype_name(c->dtype),
           layout_name(c->layout), k_counts_names[c->counts_kind], c->L, c->M, C);
    if (c->status != CASE_OK) { /* the status in the time column, the reason after the row */
        const char *what = c->status == CASE_SKIP ? "skip" : c->status == CASE_UNSUPPORTED ? "n/a"
                           : c->status == CASE_DRY  ? "dry-run" : "ERROR";
        printf(" %10s %8s %6s %9.1f %7s %10s %8s %7s %9s %8s %8s %6s%s%s%s\n", what, "-", "-", c->floor_us, "-", "-", "-",
               "-", "-", "-", "-", "-", c->note[0] ? "  (" : "", c->note, c->note[0] ? ")" : "");
        return;
    }
    const double t = c->us * 1e-6;
    printf(" %10.1f %8.1f %6.2f %9.1f %6.1f%%", c->us, c->flops / t / 1e12, c->wbytes / t / 1e12, c->floor_us,
           100.0 * c->floor_us / c->us);
    if (c->cublas_mode)
        printf(" %10.1f %8.1f %6.1f%%", c->cublas_us, c->flops / (c->cublas_us * 1e-6) / 1e12, 100.0 * c->cublas_us / c->us);
    else printf(" %10s %8s %7s", "-", "-", "-");
    if (c->checked)
        printf(" %9.2e %8.2e %8.2e %6lld%s\n", c->diff, c->max_ratio, c->max_acc_ratio, (long long)(c->wrong + c->scale_bad),
               c->check_pass ? "" : "  FAIL");
    else printf(" %9s %8s %8s %6s\n", "-", "-", "-", "-");
}

static int write_json(const gopts_t *o, const gcase_t *cs, int n, int argc, char **argv) {
    FILE *f = fopen(o->json, "w");
    if (!f) {
        fprintf(stderr, "moeflow bench gemm: --json %s: %s\n", o->json, strerror(errno));
        return -1;
    }
    cli_json_meta(f, "cuda", argc, argv);
    int first = 1;
    for (int i = 0; i < n; i++) {
        const gcase_t *c = &cs[i];
        if (c->status != CASE_OK) continue;
        const double t = c->us * 1e-6;
        fprintf(f, "%s\n  {\"op\": \"gemm\", \"kernel\": \"%s\", \"model\": \"%s\", \"dtype\": \"%s\", \"layout\": \"%s\", "
                   "\"counts\": \"%s\", ",
                first ? "" : ",", c->op->kernel, c->model->name, dtype_name(c->dtype), layout_name(c->layout),
                k_counts_names[c->counts_kind]);
        first = 0;
        fprintf(f, "\"shape\": {\"E\": %d, \"H\": %d, \"I\": %d, \"L\": %d, \"M\": %d}, \"rows\": %lld, ", c->model->E,
                c->model->H, c->model->I, c->L, c->M, (long long)c->rows);
        if (c->layout == MF_LAYOUT_MASKED) fprintf(f, "\"C\": %d, ", c->C);
        fprintf(f, "\"time_us\": ");
        cli_json_number(f, c->us);
        fprintf(f, ", \"tflops\": ");
        cli_json_number(f, c->flops / t / 1e12);
        fprintf(f, ", \"gbps\": ");
        cli_json_number(f, c->bytes / t / 1e9);
        fprintf(f, ", \"weight_tbps\": ");
        cli_json_number(f, c->wbytes / t / 1e12);
        fprintf(f, ", \"floor_us\": ");
        cli_json_number(f, c->floor_us);
        fprintf(f, ", \"pct_of_floor\": ");
        cli_json_number(f, 100.0 * c->floor_us / c->us);
        if (c->checked) {
            fprintf(f, ", \"wrong\": %lld, \"diff\": ", (long long)(c->wrong + c->scale_bad + c->untouched_bad));
            cli_json_number(f, c->diff);
            fprintf(f, ", \"max_err_ratio\": ");
            cli_json_number(f, c->max_ratio);
            fprintf(f, ", \"max_acc_ratio\": ");
            cli_json_number(f, c->max_acc_ratio);
        }
        fprintf(f, ", \"iters\": %d, \"warmup\": %d, \"expert_rows\": [", o->iters, o->warmup);
        for (int32_t e = 0; e < c->L; e++) fprintf(f, "%s%d", e ? "," : "", c->counts[e]);
        fprintf(f, "], \"peers\": [");
        if (c->cublas_mode) {
            fprintf(f, "{\"name\": \"cublas_dense\", \"time_us\": ");
            cli_json_number(f, c->cublas_us);
            if (c->dtype == MF_DTYPE_FP8_E4M3) fprintf(f, ", \"scaling\": \"%s\"", c->cublas_mode);
            fprintf(f, "}");
        }
        fprintf(f, "]}");
    }
    fprintf(f, "\n]}\n");
    int bad = ferror(f);
    if (fclose(f) != 0 || bad) {
        fprintf(stderr, "moeflow bench gemm: --json %s: write failed\n", o->json);
        return -1;
    }
    return 0;
}

static void print_meta(const gopts_t *o, const char *device, int ncases) {
    printf("# moeflow bench gemm: grouped expert GEMMs (src/cuda/grouped_gemm.h) beside their floor and cuBLAS dense\n");
    printf("# device   %s\n", device);
    for (int mi = 0; mi < o->nmodels; mi++) {
        const model_t *m = &k_models[o->models[mi]];
        printf("# model    %-15s H %d  I %d  E %d  (%s)\n", m->name, m->H, m->I, m->E, m->why);
    }
    printf("# ops      w13: a[rows, H] . w13[e]^T -> SwiGLU -> h[rows, I] (N = 2I, K = H; fp8 h requantised 1x128)\n"
           "#          w2:  h[rows, I] . w2[e]^T -> out[rows, H] bf16 (N = H, K = I)\n");
    for (int i = 0; i < o->nops; i++)
        if (k_ops[o->ops[i]].op == MF__GEMM_OP_W13)
            printf("#          w13p: a[rows, H] . w13[e]^T -> out[rows, 2I] bf16, no SwiGLU (N = 2I, K = H)\n");
    printf("# counts   equal: M per expert; uneven: M +-%.0f%%; zipf: s %.1f over a shuffled popularity order; all sum to "
           "M L; seed %llu\n",
           100 * UNEVEN_SPREAD, ZIPF_S, (unsigned long long)o->seed);
    printf("# layouts  expert_major: segments padded to %d rows; masked: offsets e C, C = max(%d, largest count rounded up "
           "to %d)%s\n",
           SEGMENT_ALIGN, o->capacity, SEGMENT_ALIGN,
           o->nlayouts == 2 ? ";\n#          masked cases equal to their expert_major case (equal counts, C = M) run once"
                            : "");
    printf("# timing   cudaEvents, median of %d after %d warm-up; a %zu MB memset before every launch (outside the "
           "events)\n",
           o->iters, o->warmup, FLUSH_BYTES >> 20);
    printf("# schedule %s\n", o->static_schedule ? "static (--static-schedule): the TMA kernel's CTA b takes tiles b, b + grid, ..."
                                                   : "dynamic, as the layer runs it: the TMA kernel hands out tiles by ticket");
    printf("# family   %s\n", o->family == MF__GEMM_BENCH_AUTO ? "auto: the layer's choice (decode at M <= 64, else tma)"
                           : o->family == MF__GEMM_BENCH_DECODE ? "decode at every M (--family decode; its tile for min(M, 64))"
                                                            : "tma at every M (--family tma)");
    printf("# floor    max(FLOPs / peak, bytes / %.2f TB/s), peak %.0f (bf16) / %.0f (fp8) TFLOP/s (H200, docs/DESIGN.md);\n"
           "#          FLOPs = 2 rows N K; bytes = weights + scales of experts with rows + a + out; wTB/s = those "
           "weight bytes / time\n",
           H200_COPY_BYTES_PER_S / 1e12, H200_BF16_FLOPS / 1e12, H200_FP8_FLOPS / 1e12);
    if (!o->no_cublas)
        printf("# cublas   one dense GEMM [rows, K] . [K, N] -> bf16 with expert 0's weights (cublasLt, first heuristic "
               "algorithm);\n#          %%cublas = cublas time / moeflow time (100%% = as fast as the dense ceiling)\n");
    if (o->check)
        printf("# check    every case first: sampled rows of sampled experts vs a double host reference; diff < %g "
               "(bf16) / %g (fp8);\n#          element bounds of docs/DESIGN.md \"GEMM error bounds\": err/bnd = max "
               "|gpu - exact| / bound (< 1 passes; output rounding alone can reach ~1);\n#          acc/bnd = max (|gpu - exact| - the "
               "output's rounding) / accumulation bound (the kernel's accumulation error at least);\n#          #wrong: elements (and FP8 h scales) outside their "
               "bounds; rows past counts[e] must stay poisoned\n",
               DIFF_MAX_BF16, DIFF_MAX_FP8);
    printf("# cases    %d (operands over %.0f GB skipped)\n", ncases, MAX_CASE_BYTES / 1e9);
}

/* ---- main ------------------------------------------------------------------------------------- */

/* One case: allocate, fill, check, time moeflow and cuBLAS. -1 on a fatal CUDA error. */
static int run_case(gdev_t *d, const gopts_t *o, gcase_t *c, uint32_t seed) {
    if (!mf__gemm_bench_supported(c->op->op, c->dtype)) {
        c->status = CASE_UNSUPPORTED;
        snprintf(c->note, sizeof c->note, "not in the library yet");
        return 0;
    }
    int r = alloc_case(d, c);
    if (r < 0) return -1;
    if (r > 0) {
        c->status = CASE_SKIP;
        snprintf(c->note, sizeof c->note, "out of device memory");
        return 0;
    }
    if (fill_case(d, c, seed)) return -1;
    moeflow_launch_t m;
    m.args = case_args(d, c, o->static_schedule, o->family);
    m.code = MF_SUCCESS;
    if (o->check) {
        if ((r = check_case(d, c, &m.args)) != 0) {
            c->status = CASE_ERROR;
            return r < 0 ? -1 : 0;
        }
        if (fill_case(d, c, seed)) return -1; /* the check left NaN rows behind */
    }
    if (time_launches(d, o, launch_moeflow, &m, &c->us)) {
        c->status = m.code == MF_ERR_NOT_SUPPORTED ? CASE_UNSUPPORTED : CASE_ERROR;
        if (m.code == MF_ERR_NOT_SUPPORTED) snprintf(c->note, sizeof c->note, "%s", mf_last_error());
        return m.code == MF_SUCCESS || m.code == MF_ERR_CUDA ? -1 : 0;
    }
    c->status = CASE_OK;
    if (!o->no_cublas && run_cublas(d, o, c)) return -1;
    return 0;
}

int cli_bench_gemm_main(int argc, char **argv) {
    gopts_t o;
    parse_args(argc, argv, &o);
    if (o.json && !o.dry_run && cli_json_check_writable(o.json) != 0) /* before any work */
        die_io("--json %s: %s", o.json, strerror(errno));
    setvbuf(stdout, NULL, _IOLBF, 0);
    int n = 0;
    gcase_t *cs = build_cases(&o, &n);

    if (o.dry_run) {
        print_meta(&o, "(dry run: none used)", n);
        printf("#\n");
        print_header();
        double floor_total = 0;
        for (int i = 0; i < n; i++) {
            if (cs[i].status == CASE_PENDING) {
                cs[i].status = mf__gemm_bench_supported(cs[i].op->op, cs[i].dtype) ? CASE_DRY : CASE_UNSUPPORTED;
                if (cs[i].status == CASE_DRY) {
                    snprintf(cs[i].note, sizeof cs[i].note, "operands %.1f GB", cs[i].operand_bytes / 1e9);
                    floor_total += cs[i].floor_us;
                }
            }
            print_row(&cs[i]);
        }
        printf("# dry run: %d cases; GEMM time at the floor, moeflow + cuBLAS, %d launches each: %.1f s (a lower bound)\n", n,
               o.iters + o.warmup, 2e-6 * floor_total * (o.iters + o.warmup));
        for (int i = 0; i < n; i++) free(cs[i].counts), free(cs[i].offsets);
        free(cs);
        return 0;
    }

    /* The test `moeflow --backend cuda` makes: device 0 present and sm_90. */
    if (!mf_backend_available(MF_BACKEND_CUDA)) {
        int ndev = 0;
        cudaError_t ce = cudaGetDeviceCount(&ndev);
        (void)cudaGetLastError();
        die_usage("needs a CUDA GPU (sm_90): no usable CUDA device found (%s); --dry-run lists the cases "
                  "without one", ce != cudaSuccess ? cudaGetErrorString(ce)
                                                   : ndev == 0 ? "0 devices" : "device 0 is not sm_90");
    }
    struct cudaDeviceProp prop;
    cudaError_t e = cudaGetDeviceProperties(&prop, 0);
    if (e != cudaSuccess) die_io("cudaGetDeviceProperties: %s", cudaGetErrorString(e));
    gdev_t d;
    memset(&d, 0, sizeof d);
    d.fp8_block_ok = -1;
    snprintf(g_case, sizeof g_case, "setup");
    d.times = malloc(sizeof(float) * (size_t)o.iters);
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    if (!d.times || cudaStreamCreateWithFlags(&d.stream, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreate(&d.ev0) != cudaSuccess || cudaEventCreate(&d.ev1) != cudaSuccess ||
        cublasLtCreate(&d.lt) != CUBLAS_STATUS_SUCCESS) {
        die_io("setup failed (stream, events, cublasLt handle)");
    }
    char device[512];
    snprintf(device, sizeof device, "%.200s, sm_%d%d, %d SMs, %.0f MB L2, %.0f GB; CUDA runtime %d, driver %d, cuBLASLt %zu",
             prop.name, prop.major, prop.minor, prop.multiProcessorCount, prop.l2CacheSize / 1e6, prop.totalGlobalMem / 1e9,
             rt, drv, cublasLtGetVersion());
    print_meta(&o, device, n);
    printf("#\n");
    print_header();

    int fatal = 0, failed = 0, ran = 0;
    for (int i = 0; i < n && !fatal; i++) {
        gcase_t *c = &cs[i];
        case_name(c, g_case, sizeof g_case);
        if (c->status == CASE_PENDING) {
            if (run_case(&d, &o, c, (uint32_t)(o.seed * 1000003u + (uint64_t)i)) < 0) {
                fatal = 1;
                c->status = CASE_ERROR;
            }
            ran += c->status == CASE_OK;
        }
        failed += c->status == CASE_ERROR || (c->checked && !c->check_pass);
        print_row(c);
    }
    int checked = 0, passed = 0;
    for (int i = 0; i < n; i++) checked += cs[i].checked, passed += cs[i].checked && cs[i].check_pass;
    if (fatal) printf("# stopped at a CUDA error (see stderr): later cases not run\n");
    if (o.check) printf("# check: %d of %d checked cases passed\n", passed, checked);
    printf("# %s: %d cases ran, %d failed\n", failed || fatal ? "FAIL" : "PASS", ran, failed);
    int rc = failed || fatal ? EXIT_FAIL : 0;
    if (o.json && write_json(&o, cs, n, argc, argv) != 0) rc = EXIT_IO;

    free_bufs(&d);
    cublasLtDestroy(d.lt);
    cudaEventDestroy(d.ev0), cudaEventDestroy(d.ev1);
    cudaStreamDestroy(d.stream);
    free(d.times);
    for (int i = 0; i < n; i++) free(cs[i].counts), free(cs[i].offsets);
    free(cs);
    return rc;
}
