/*
 * test_api.c — the public API's contract under misuse (docs/DESIGN.md "Bad input and faults"): every
 * rejected call returns its documented code, leaves a non-empty mf_last_error() naming the problem,
 * and leaves its outputs untouched (outputs are poisoned first and must still read as poison).
 *
 * Covered: versions and result strings; NULL handles and out-pointers; config headers (magic, size,
 * version); group and layer config values; weights shapes and dtypes; forward/dispatch argument
 * checks (ids outside [-1, E), repeated ids, T > S, shapes, dtypes, NULL data); call order;
 * user-set capacities (MF_ERR_CAPACITY, then the layer still works); a peer that never arrives
 * (MF_ERR_TIMEOUT naming phase and rank, in dispatch and in combine, then the comm reports itself
 * broken); profiling switched off; every host allocation failing in turn (OUT_OF_MEMORY, no leak).
 * Validation that needs no peer runs with R = 1; collective outcomes use mft_run_ranks.
 */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/alloc.h" /* mf__test_fail_alloc_after: the allocator's failure switch */
#include "core/params.h"
#include "harness.h"

#define API_TIMEOUT_MS 15000

/* ---- version, strings, trivial calls ------------------------------------------------------ */

static int test_version_strings(void) {
    MFT_CHECK_EQ_INT(mf_get_version(), MOEFLOW_VERSION_CODE);
    MFT_CHECK_EQ_INT(mf_backend_available(MF_BACKEND_CPU), 1);
    for (int code = 0; code <= (int)MF_ERR_ABORTED + 1; code++) {
        const char *s = mf_result_string((mf_result_t)code);
        MFT_CHECK_MSG(s != NULL && s[0] != '\0', "mf_result_string(%d) is NULL or empty", code);
        mft_verbose("  %d: %s\n", code, s);
    }
    MFT_CHECK(mf_result_string((mf_result_t)99) != NULL);
    MFT_CHECK(mf_result_string((mf_result_t)-1) != NULL);
    /* Each known code's string names it. */
    for (int code = 0; code <= (int)MF_ERR_ABORTED; code++) {
        const char *s = mf_result_string((mf_result_t)code);
        MFT_CHECK_MSG(strstr(s, mft_result_name((mf_result_t)code)) != NULL,
                      "mf_result_string(%d) = \"%s\" does not name %s", code, s,
                      mft_result_name((mf_result_t)code));
    }
    MFT_CHECK(mf_last_error() != NULL);
    return 0;
}

/* A config from the version-1 header (moeflow 0.1: mf_group_config_t ended before heap_bytes) is
 * still accepted, its newer field taken as 0; and a binding can ask every struct's size. */
static int test_abi(void) {
    typedef struct v1_group_config { /* moeflow 0.1's layout */
        uint32_t size, magic, version;
        int32_t backend, transport, num_ranks, device, num_sms;
        int64_t timeout_ms;
    } v1_group_config_t;
    unsigned char raw[sizeof(mf_group_config_t) + 16];
    memset(raw, 0x5a, sizeof raw); /* bytes past the old struct must not be read */
    v1_group_config_t old = {(uint32_t)sizeof(v1_group_config_t), MF_GROUP_CONFIG_MAGIC, 1, MF_BACKEND_CPU,
                             MF_TRANSPORT_LOCAL, 2, 0, 0, 0};
    memcpy(raw, &old, sizeof old);
    mf_group_t g = NULL;
    MFT_CHECK_OK(mf_group_create((const mf_group_config_t *)(const void *)raw, &g));
    mf_comm_t comm;
    MFT_CHECK_OK(mf_group_get_comm(g, 1, &comm));
    int32_t n = 0;
    MFT_CHECK_OK(mf_comm_get_size(comm, &n));
    MFT_CHECK_EQ_INT(n, 2);
    MFT_CHECK_OK(mf_group_destroy(g));
    old.version = 0;
    memcpy(raw, &old, sizeof old);
    MFT_CHECK_ERR(mf_group_create((const mf_group_config_t *)(const void *)raw, &g), MF_ERR_INVALID_USAGE);

    static const struct { mf_struct_t which; size_t size; } sizes[] = {
        {MF_STRUCT_TENSOR, sizeof(mf_tensor_t)},
        {MF_STRUCT_GROUP_CONFIG, sizeof(mf_group_config_t)},
        {MF_STRUCT_COMM_CONFIG, sizeof(mf_comm_config_t)},
        {MF_STRUCT_BOOTSTRAP, sizeof(mf_bootstrap_t)},
        {MF_STRUCT_MOE_CONFIG, sizeof(mf_moe_config_t)},
        {MF_STRUCT_MOE_INFO, sizeof(mf_moe_info_t)},
        {MF_STRUCT_MOE_WEIGHTS, sizeof(mf_moe_weights_t)},
        {MF_STRUCT_MOE_FORWARD_IN, sizeof(mf_moe_forward_in_t)},
        {MF_STRUCT_MOE_FORWARD_OUT, sizeof(mf_moe_forward_out_t)},
        {MF_STRUCT_DISPATCH_IN, sizeof(mf_dispatch_in_t)},
        {MF_STRUCT_DISPATCH_OUT, sizeof(mf_dispatch_out_t)},
        {MF_STRUCT_COMBINE_IN, sizeof(mf_combine_in_t)},
        {MF_STRUCT_COMBINE_OUT, sizeof(mf_combine_out_t)},
        {MF_STRUCT_PHASE_TIMES, sizeof(mf_phase_times_t)},
        {MF_STRUCT_MOE_BALANCE_STATS, sizeof(mf_moe_balance_stats_t)},
        {MF_STRUCT_EXPERTS_IN, sizeof(mf_experts_in_t)},
        {MF_STRUCT_EXPERTS_OUT, sizeof(mf_experts_out_t)},
        {MF_STRUCT_EXCHANGE_EVENTS, sizeof(mf_exchange_events_t)},
    };
    MFT_CHECK_EQ_INT(sizeof sizes / sizeof sizes[0], MF_NUM_STRUCTS);
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
        MFT_CHECK_MSG(mf_get_struct_size(sizes[i].which) == (int64_t)sizes[i].size, "struct %d: library says %lld, "
                      "header %zu", (int)sizes[i].which, (long long)mf_get_struct_size(sizes[i].which), sizes[i].size);
    MFT_CHECK_EQ_INT(mf_get_struct_size(MF_NUM_STRUCTS), 0);
    MFT_CHECK_EQ_INT(mf_get_struct_size((mf_struct_t)-1), 0);
    return 0;
}

static int test_destroy_null(void) {
    MFT_CHECK_OK(mf_group_destroy(NULL));
    MFT_CHECK_OK(mf_moe_destroy(NULL));
    return 0;
}

/* ---- group -------------------------------------------------------------------------------- */

static int expect_group_rejected(const mf_group_config_t *cfg, mf_result_t code, const char *what) {
    mf_group_t sentinel = (mf_group_t)(uintptr_t)0x1234, g = sentinel;
    mf_result_t r = mf_group_create(cfg, &g);
    if (r != code)
        MFT_FAIL("%s: mf_group_create -> %s (%s), expected %s", what, mft_result_name(r),
                 mf_last_error(), mft_result_name(code));
    if (!mf_last_error()[0]) MFT_FAIL("%s: empty mf_last_error()", what);
    if (g != sentinel) MFT_FAIL("%s: the group out-pointer was written on failure", what);
    mft_verbose("  %s: %s\n", what, mf_last_error());
    return 0;
}

static int test_group_config(void) {
    mf_group_config_t cfg = MF_GROUP_CONFIG_INIT;
    cfg.backend = MF_BACKEND_CPU;
    MFT_CHECK_ERR(mf_group_create(NULL, NULL), MF_ERR_INVALID_ARGUMENT);
    {
        mf_group_t sentinel = (mf_group_t)(uintptr_t)0x1234, g = sentinel;
        MFT_CHECK_ERR(mf_group_create(NULL, &g), MF_ERR_INVALID_ARGUMENT);
        MFT_CHECK(g == sentinel);
    }
    MFT_CHECK_ERR(mf_group_create(&cfg, NULL), MF_ERR_INVALID_ARGUMENT);

    mf_group_config_t bad = cfg;
    bad.magic = 0xdeadbeefu;
    if (expect_group_rejected(&bad, MF_ERR_INVALID_USAGE, "wrong magic")) return 1;
    bad = cfg;
    bad.size = 12; /* smaller than any version's layout */
    if (expect_group_rejected(&bad, MF_ERR_INVALID_USAGE, "too small")) return 1;
    bad = cfg;
    bad.size = (uint32_t)sizeof(mf_group_config_t) + 8; /* from a newer header than the library */
    if (expect_group_rejected(&bad, MF_ERR_INVALID_USAGE, "too large")) return 1;
    bad = cfg;
    bad.version = MF_API_VERSION + 1;
    if (expect_group_rejected(&bad, MF_ERR_INVALID_USAGE, "wrong version")) return 1;
    bad = cfg;
    bad.num_ranks = 0;
    if (expect_group_rejected(&bad, MF_ERR_INVALID_ARGUMENT, "num_ranks 0")) return 1;
    bad.num_ranks = -3;
    if (expect_group_rejected(&bad, MF_ERR_INVALID_ARGUMENT, "num_ranks -3")) return 1;
    bad.num_ranks = MF_MAX_RANKS + 1;
    if (expect_group_rejected(&bad, MF_ERR_INVALID_ARGUMENT, "num_ranks MF_MAX_RANKS + 1")) return 1;
    bad = cfg;
    bad.backend = 77;
    if (expect_group_rejected(&bad, MF_ERR_INVALID_ARGUMENT, "backend 77")) return 1;

    /* The largest group is accepted, and its comms answer for themselves. */
    cfg.num_ranks = MF_MAX_RANKS;
    mf_group_t g = NULL;
    MFT_CHECK_OK(mf_group_create(&cfg, &g));
    mf_backend_t be = MF_BACKEND_AUTO;
    MFT_CHECK_OK(mf_group_get_backend(g, &be));
    MFT_CHECK_EQ_INT(be, MF_BACKEND_CPU);
    for (int32_t r = 0; r < MF_MAX_RANKS; r += 21) {
        mf_comm_t comm = NULL;
        int32_t rank = -1, size = -1;
        MFT_CHECK_OK(mf_group_get_comm(g, r, &comm));
        MFT_CHECK_OK(mf_comm_get_rank(comm, &rank));
        MFT_CHECK_OK(mf_comm_get_size(comm, &size));
        MFT_CHECK_EQ_INT(rank, r);
        MFT_CHECK_EQ_INT(size, MF_MAX_RANKS);
        MFT_CHECK_OK(mf_comm_get_async_error(comm));
    }
    mf_comm_t sentinel = (mf_comm_t)(uintptr_t)0x99, comm = sentinel;
    MFT_CHECK_ERR(mf_group_get_comm(g, MF_MAX_RANKS, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_group_get_comm(g, -1, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(comm == sentinel);
    MFT_CHECK_ERR(mf_group_get_comm(g, 0, NULL), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_group_get_comm(NULL, 0, &comm), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_group_get_backend(g, NULL), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_OK(mf_group_destroy(g));
    return 0;
}

/* ---- layer config ------------------------------------------------------------------------- */

static mf_moe_config_t small_config(int32_t dtype, int32_t layout) {
    mf_moe_config_t c = MF_MOE_CONFIG_INIT;
    c.num_experts = 4;
    c.num_topk = 2;
    c.hidden = 128;
    c.intermediate = 128;
    c.max_tokens_per_rank = 8;
    c.dtype = dtype;
    c.layout = layout;
    return c;
}

static int expect_create_rejected(mf_comm_t comm, const mf_moe_config_t *cfg, mf_result_t code,
                                  const char *what) {
    mf_moe_t sentinel = (mf_moe_t)(uintptr_t)0x4321, moe = sentinel;
    mf_result_t r = mf_moe_create(comm, cfg, &moe);
    if (r == MF_SUCCESS && moe != sentinel) mf_moe_destroy(moe); /* not leaked on failure */
    if (r != code)
        MFT_FAIL("%s: mf_moe_create -> %s (%s), expected %s", what, mft_result_name(r),
                 mf_last_error(), mft_result_name(code));
    if (!mf_last_error()[0]) MFT_FAIL("%s: empty mf_last_error()", what);
    if (moe != sentinel) MFT_FAIL("%s: the moe out-pointer was written on failure", what);
    mft_verbose("  %s: %s\n", what, mf_last_error());
    return 0;
}

static int moe_config_body(mf_comm_t comm) {
    const mf_moe_config_t ok = small_config(MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR);
    mf_moe_config_t c;
    mf_moe_t moe = NULL;
    MFT_CHECK_ERR(mf_moe_create(comm, NULL, &moe), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_moe_create(comm, &ok, NULL), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_moe_create(NULL, &ok, &moe), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK(moe == NULL);
#define BAD(field, value, code, what)                                   \
    do {                                                                \
        c = ok;                                                         \
        c.field = value;                                                \
        if (expect_create_rejected(comm, &c, code, what)) return 1;     \
    } while (0)
    BAD(magic, 0u, MF_ERR_INVALID_USAGE, "moe config magic 0");
    BAD(magic, MF_GROUP_CONFIG_MAGIC, MF_ERR_INVALID_USAGE, "moe config with the group's magic");
    BAD(size, 8u, MF_ERR_INVALID_USAGE, "moe config size 8");
    BAD(size, (uint32_t)sizeof(mf_moe_config_t) + 8, MF_ERR_INVALID_USAGE, "moe config size + 8");
    BAD(version, 0u, MF_ERR_INVALID_USAGE, "moe config version 0");
    BAD(version, MF_API_VERSION + 1, MF_ERR_INVALID_USAGE, "moe config version + 1");
    BAD(num_experts, 0, MF_ERR_INVALID_ARGUMENT, "E = 0");
    BAD(num_topk, 0, MF_ERR_INVALID_ARGUMENT, "K = 0");
    BAD(num_topk, -1, MF_ERR_INVALID_ARGUMENT, "K = -1");
    BAD(num_topk, 5, MF_ERR_INVALID_ARGUMENT, "K = 5 > E = 4");
    c = ok;
    c.num_experts = 64;
    c.num_topk = MF_MAX_TOPK + 1;
    if (expect_create_rejected(comm, &c, MF_ERR_INVALID_ARGUMENT, "K = MF_MAX_TOPK + 1")) return 1;
    BAD(hidden, 200, MF_ERR_INVALID_ARGUMENT, "FP8 H = 200 (not a multiple of 128)");
    BAD(hidden, 0, MF_ERR_INVALID_ARGUMENT, "H = 0");
    BAD(intermediate, 200, MF_ERR_INVALID_ARGUMENT, "FP8 I = 200 (not a multiple of 128)");
    BAD(intermediate, -128, MF_ERR_INVALID_ARGUMENT, "I = -128");
    BAD(max_tokens_per_rank, 0, MF_ERR_INVALID_ARGUMENT, "S = 0");
    BAD(dtype, MF_DTYPE_FP32, MF_ERR_INVALID_ARGUMENT, "dtype FP32");
    BAD(layout, 7, MF_ERR_INVALID_ARGUMENT, "layout 7");
    BAD(block_m, -1, MF_ERR_INVALID_ARGUMENT, "block_m -1");
    BAD(expert_capacity, -1, MF_ERR_INVALID_ARGUMENT, "expert_capacity -1");
    BAD(max_recv_rows, -5, MF_ERR_INVALID_ARGUMENT, "max_recv_rows -5");
    BAD(ue8m0_scales, 2, MF_ERR_INVALID_ARGUMENT, "ue8m0_scales 2");
    BAD(dataflow, -1, MF_ERR_INVALID_ARGUMENT, "dataflow -1");
    BAD(dataflow, MF_DATAFLOW_UNFUSED + 1, MF_ERR_INVALID_ARGUMENT, "dataflow past UNFUSED");
    BAD(placement, -1, MF_ERR_INVALID_ARGUMENT, "placement -1");
    BAD(placement, MF_PLACEMENT_ROUND_ROBIN + 1, MF_ERR_INVALID_ARGUMENT, "placement past ROUND_ROBIN");
    c = small_config(MF_DTYPE_BF16, MF_LAYOUT_MASKED);
    c.hidden = 100;
    if (expect_create_rejected(comm, &c, MF_ERR_INVALID_ARGUMENT, "BF16 H = 100 (not a multiple of 8)"))
        return 1;
#undef BAD
    /* After all of that, the comm still creates a valid layer, with defaults resolved. */
    MFT_CHECK_OK(mf_moe_create(comm, &ok, &moe));
    mf_moe_info_t info;
    MFT_CHECK_ERR(mf_moe_get_info(moe, NULL), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_OK(mf_moe_get_info(moe, &info));
    MFT_CHECK_EQ_INT(info.num_ranks, 1);
    MFT_CHECK_EQ_INT(info.num_local_experts, 4);
    MFT_CHECK_EQ_INT(info.num_local_slots, 4);
    MFT_CHECK_EQ_INT(info.first_expert, 0);
    MFT_CHECK_EQ_INT(info.placement, MF_PLACEMENT_LINEAR);
    MFT_CHECK_EQ_INT(info.block_m, 128);
    MFT_CHECK_EQ_INT(info.expert_capacity, 8); /* R * S */
    MFT_CHECK(info.max_recv_rows >= 8 * 2); /* at least R * S * min(K, L) routed rows */
    MFT_CHECK(info.heap_bytes > 0);
    MFT_CHECK_OK(mf_moe_destroy(moe));
    return 0;
}

static int test_moe_config(void) {
    mf_group_t g = mft_cpu_group(1, API_TIMEOUT_MS);
    if (!g) return 1;
    mf_comm_t comm = NULL;
    MFT_CHECK_OK(mf_group_get_comm(g, 0, &comm));
    int rc = moe_config_body(comm);
    MFT_CHECK_OK(mf_group_destroy(g));
    return rc;
}

/* R = 2: E below R is rejected on both ranks (E = 5 is an uneven placement: 3 and 2 experts); so
 * are configs that differ between ranks; then a valid layer is created by both. */
typedef struct two_rank_ctx {
    mf_group_t group;
} two_rank_ctx_t;

static int create_ranks_fn(int32_t rank, void *arg) {
    two_rank_ctx_t *c = (two_rank_ctx_t *)arg;
    mf_comm_t comm = NULL;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = small_config(MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR);
    cfg.num_experts = 1;
    cfg.num_topk = 1;
    if (expect_create_rejected(comm, &cfg, MF_ERR_INVALID_ARGUMENT, "E = 1 on R = 2")) return 1;
    MFT_CHECK(mft_contains_ci(mf_last_error(), "at least one expert"));
    cfg.num_experts = 5;
    cfg.num_topk = 2;
    mf_moe_t uneven = NULL;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &uneven));
    mf_moe_info_t ui;
    MFT_CHECK_OK(mf_moe_get_info(uneven, &ui));
    MFT_CHECK_EQ_INT(ui.num_local_experts, rank ? 2 : 3);
    MFT_CHECK_EQ_INT(ui.num_local_slots, ui.num_local_experts);
    MFT_CHECK_EQ_INT(ui.first_expert, rank ? 3 : 0);
    MFT_CHECK_EQ_INT(ui.placement, MF_PLACEMENT_LINEAR);
    MFT_CHECK_OK(mf_moe_destroy(uneven));
    cfg.num_experts = 6;
    cfg.hidden = rank ? 256 : 128;
    if (expect_create_rejected(comm, &cfg, MF_ERR_INVALID_ARGUMENT, "H differs between ranks"))
        return 1;
    cfg.hidden = 128;
    mf_moe_t moe = NULL;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    mf_moe_info_t info;
    MFT_CHECK_OK(mf_moe_get_info(moe, &info));
    MFT_CHECK_EQ_INT(info.num_local_experts, 3);
    MFT_CHECK_EQ_INT(info.num_local_slots, 3);
    MFT_CHECK_EQ_INT(info.first_expert, 3 * rank);
    MFT_CHECK_EQ_INT(info.expert_capacity, 2 * 8);
    MFT_CHECK_OK(mf_moe_destroy(moe));
    return 0;
}

static int test_moe_config_ranks(void) {
    two_rank_ctx_t c;
    c.group = mft_cpu_group(2, API_TIMEOUT_MS);
    if (!c.group) return 1;
    int rc = mft_run_ranks(2, create_ranks_fn, &c);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    return rc;
}

/* ---- a small R = 1 layer with host buffers ------------------------------------------------ */

typedef struct fixture {
    mf_group_t group;
    mf_comm_t comm;
    mf_moe_t moe;
    mf_moe_config_t cfg;
    int32_t L, E, K, H, I, S;
    void *w13, *w2;
    float *s13, *s2;
    uint16_t *x;  /* [S + 1, H] (one spare row for T > S) */
    int32_t *ids; /* [S + 1, K] */
    float *w;     /* [S + 1, K] */
    uint16_t *y;  /* [S + 1, H] */
    mf_moe_weights_t weights;
} fixture_t;

static void fixture_free(fixture_t *f) {
    mf_moe_destroy(f->moe);
    mf_group_destroy(f->group);
    free(f->w13);
    free(f->w2);
    free(f->s13);
    free(f->s2);
    free(f->x);
    free(f->ids);
    free(f->w);
    free(f->y);
    memset(f, 0, sizeof *f);
}

/* Creates the layer; weights are allocated and described in f->weights but not set. */
static int fixture_open(fixture_t *f, const mf_moe_config_t *cfg) {
    memset(f, 0, sizeof *f);
    f->cfg = *cfg;
    f->E = cfg->num_experts;
    f->K = cfg->num_topk;
    f->H = cfg->hidden;
    f->I = cfg->intermediate;
    f->S = cfg->max_tokens_per_rank;
    f->L = f->E;
    f->group = mft_cpu_group(1, API_TIMEOUT_MS);
    if (!f->group) return 1;
    MFT_CHECK_OK(mf_group_get_comm(f->group, 0, &f->comm));
    MFT_CHECK_OK(mf_moe_create(f->comm, cfg, &f->moe));
    int fp8 = cfg->dtype == MF_DTYPE_FP8_E4M3;
    size_t elem = fp8 ? 1 : 2, L = (size_t)f->L, H = (size_t)f->H, I = (size_t)f->I;
    mft_rng_t rng = {42};
    f->w13 = mft_alloc(L * 2 * I * H * elem);
    f->w2 = mft_alloc(L * H * I * elem);
    for (size_t i = 0; i < L * 2 * I * H; i++) {
        float v = (float)(mft_rng_uniform(&rng) - 0.5) * (fp8 ? 200.0f : 0.1f);
        if (fp8) ((uint8_t *)f->w13)[i] = mf_fp8_e4m3_from_float(v);
        else ((uint16_t *)f->w13)[i] = mf_bf16_from_float(v);
        if (i < L * H * I) {
            if (fp8) ((uint8_t *)f->w2)[i] = mf_fp8_e4m3_from_float(v);
            else ((uint16_t *)f->w2)[i] = mf_bf16_from_float(v);
        }
    }
    f->weights.w13 = mft_t3(f->w13, (mf_dtype_t)cfg->dtype, f->L, 2 * f->I, f->H);
    f->weights.w2 = mft_t3(f->w2, (mf_dtype_t)cfg->dtype, f->L, f->H, f->I);
    if (fp8) {
        size_t n13 = L * (2 * I / 128) * (H / 128), n2 = L * (H / 128) * (I / 128);
        f->s13 = (float *)mft_alloc(n13 * 4);
        f->s2 = (float *)mft_alloc(n2 * 4);
        for (size_t i = 0; i < n13; i++) f->s13[i] = 1.0f / 448.0f;
        for (size_t i = 0; i < n2; i++) f->s2[i] = 1.0f / 448.0f;
        f->weights.w13_scales = mft_t3(f->s13, MF_DTYPE_FP32, f->L, 2 * f->I / 128, f->H / 128);
        f->weights.w2_scales = mft_t3(f->s2, MF_DTYPE_FP32, f->L, f->H / 128, f->I / 128);
    }
    size_t S1 = (size_t)f->S + 1;
    f->x = (uint16_t *)mft_alloc(S1 * H * 2);
    f->ids = (int32_t *)mft_alloc(S1 * (size_t)f->K * 4);
    f->w = (float *)mft_alloc(S1 * (size_t)f->K * 4);
    f->y = (uint16_t *)mft_alloc(S1 * H * 2);
    for (size_t i = 0; i < S1 * H; i++) f->x[i] = mf_bf16_from_float((float)(mft_rng_uniform(&rng) - 0.5));
    for (size_t t = 0; t < S1; t++)
        for (int32_t k = 0; k < f->K; k++) {
            f->ids[t * (size_t)f->K + (size_t)k] = (int32_t)((t + (size_t)k) % (size_t)f->E);
            f->w[t * (size_t)f->K + (size_t)k] = 0.5f;
        }
    return 0;
}

typedef struct fwd_args {
    mf_moe_forward_in_t in;
    mf_moe_forward_out_t out;
} fwd_args_t;

static fwd_args_t fixture_args(const fixture_t *f, int32_t T) {
    fwd_args_t a;
    a.in.x = mft_t2(f->x, MF_DTYPE_BF16, T, f->H);
    a.in.topk_ids = mft_t2(f->ids, MF_DTYPE_INT32, T, f->K);
    a.in.topk_weights = mft_t2(f->w, MF_DTYPE_FP32, T, f->K);
    a.out.y = mft_t2(f->y, MF_DTYPE_BF16, T, f->H);
    return a;
}

/* mf_moe_forward must return `code` with a message and leave all of f->y poisoned. */
static int expect_forward(fixture_t *f, mf_moe_t moe, const mf_moe_forward_in_t *in,
                          const mf_moe_forward_out_t *out, mf_result_t code, const char *what) {
    size_t ybytes = ((size_t)f->S + 1) * (size_t)f->H * 2;
    mft_poison(f->y, ybytes);
    mf_result_t r = mf_moe_forward(moe, in, out, NULL);
    if (r != code)
        MFT_FAIL("%s: mf_moe_forward -> %s (%s), expected %s", what, mft_result_name(r),
                 mf_last_error(), mft_result_name(code));
    if (!mf_last_error()[0]) MFT_FAIL("%s: empty mf_last_error()", what);
    int64_t at = mft_first_unpoisoned(f->y, ybytes);
    if (at >= 0) MFT_FAIL("%s: y was written (byte %lld) by a rejected call", what, (long long)at);
    mft_verbose("  %s: %s\n", what, mf_last_error());
    return 0;
}

/* ---- weights ------------------------------------------------------------------------------ */

static int weights_body(fixture_t *f) {
    fwd_args_t a = fixture_args(f, 4);
    int fp8 = f->cfg.dtype == MF_DTYPE_FP8_E4M3;
    if (expect_forward(f, f->moe, &a.in, &a.out, MF_ERR_INVALID_USAGE, "forward before weights"))
        return 1;
    MFT_CHECK_ERR(mf_moe_set_weights(f->moe, NULL), MF_ERR_INVALID_ARGUMENT);
    MFT_CHECK_ERR(mf_moe_set_weights(NULL, &f->weights), MF_ERR_INVALID_ARGUMENT);
    mf_dtype_t dt = (mf_dtype_t)f->cfg.dtype, other = fp8 ? MF_DTYPE_BF16 : MF_DTYPE_FP8_E4M3;
    int32_t L = f->L, H = f->H, I = f->I;
    mf_moe_weights_t w;
#define BADW(stmt, what)                                                                 \
    do {                                                                                 \
        w = f->weights;                                                                  \
        stmt;                                                                            \
        mf_result_t r_ = mf_moe_set_weights(f->moe, &w);                                 \
        if (r_ != MF_ERR_INVALID_ARGUMENT)                                               \
            MFT_FAIL("%s: mf_moe_set_weights -> %s (%s), expected INVALID_ARGUMENT", what, \
                     mft_result_name(r_), mf_last_error());                              \
        if (!mf_last_error()[0]) MFT_FAIL("%s: empty message", what);                    \
        mft_verbose("  %s: %s\n", what, mf_last_error());                                \
    } while (0)
    BADW(w.w13 = mft_t3(f->w13, dt, L, 2 * I, H + 128), "w13 [L, 2I, H + 128]");
    BADW(w.w13 = mft_t3(f->w13, dt, L, I, H), "w13 [L, I, H]");
    BADW(w.w13 = mft_t3(f->w13, dt, L + 1, 2 * I, H), "w13 [L + 1, 2I, H]");
    BADW(w.w13 = mft_t2(f->w13, dt, L * 2 * I, H), "w13 flattened to 2 dims");
    BADW(w.w2 = mft_t3(f->w2, dt, L, I, H), "w2 transposed: [L, I, H] (I != H)");
    BADW(w.w2 = mft_t3(f->w2, dt, L, H, I + 128), "w2 [L, H, I + 128]");
    BADW(w.w13.dtype = (int32_t)other, "w13 of the other dtype");
    BADW(w.w2.dtype = MF_DTYPE_FP32, "w2 FP32");
    BADW(w.w13.data = NULL, "w13 NULL data");
    BADW(w.w2.data = NULL, "w2 NULL data");
    if (fp8) {
        BADW(w.w13_scales = mft_none(), "FP8 without w13_scales");
        BADW(w.w2_scales.data = NULL, "w2_scales NULL data");
        BADW(w.w13_scales = mft_t3(f->s13, MF_DTYPE_FP32, L, 2 * I / 128, H / 128 + 1),
             "w13_scales one column too many");
        BADW(w.w2_scales = mft_t3(f->s2, MF_DTYPE_FP32, L, I / 128, H / 128 * 2),
             "w2_scales [L, I/128, 2H/128]");
        BADW(w.w13_scales.dtype = MF_DTYPE_BF16, "w13_scales BF16");
    }
#undef BADW
    /* Rejected weights leave the layer without weights. */
    if (expect_forward(f, f->moe, &a.in, &a.out, MF_ERR_INVALID_USAGE,
                       "forward after only rejected weights"))
        return 1;
    MFT_CHECK_OK(mf_moe_set_weights(f->moe, &f->weights));
    MFT_CHECK_OK(mf_moe_forward(f->moe, &a.in, &a.out, NULL));
    return 0;
}

static int test_weights(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++) {
        mf_moe_config_t cfg = small_config(dtype, MF_LAYOUT_EXPERT_MAJOR);
        cfg.intermediate = 256; /* I != H, so a transposed w2 has a different shape */
        fixture_t f;
        int rc = fixture_open(&f, &cfg);
        if (!rc) rc = weights_body(&f);
        fixture_free(&f);
        if (rc) return 1;
    }
    return 0;
}

/* ---- forward arguments -------------------------------------------------------------------- */

static int forward_args_body(fixture_t *f) {
    int32_t T = 4, K = f->K, H = f->H, E = f->E, S = f->S;
    MFT_CHECK_OK(mf_moe_set_weights(f->moe, &f->weights));
    fwd_args_t ok = fixture_args(f, T), a;
    MFT_CHECK_OK(mf_moe_forward(f->moe, &ok.in, &ok.out, NULL)); /* the valid baseline */

    /* Bad ids, each in an otherwise valid call; the ids are restored after each. */
    const struct {
        int32_t t, k, value;
        const char *what;
    } bad_ids[] = {{0, 0, E, "id = E"},
                   {3, 1, E + 100, "id = E + 100"},
                   {1, 0, -2, "id = -2"},
                   {2, 1, INT32_MIN, "id = INT32_MIN"},
                   {0, 1, -1000, "id = -1000"}};
    for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++) {
        int32_t *slot = &f->ids[bad_ids[i].t * K + bad_ids[i].k], saved = *slot;
        *slot = bad_ids[i].value;
        int rc = expect_forward(f, f->moe, &ok.in, &ok.out, MF_ERR_INVALID_ARGUMENT, bad_ids[i].what);
        *slot = saved;
        if (rc) return 1;
    }
    {
        int32_t saved = f->ids[2 * K + 1];
        f->ids[2 * K + 1] = f->ids[2 * K + 0];
        int rc = expect_forward(f, f->moe, &ok.in, &ok.out, MF_ERR_INVALID_ARGUMENT,
                                "token 2 repeats an id");
        f->ids[2 * K + 1] = saved;
        if (rc) return 1;
    }

    a = fixture_args(f, S + 1);
    if (expect_forward(f, f->moe, &a.in, &a.out, MF_ERR_INVALID_ARGUMENT, "T = S + 1")) return 1;
#define BADF(stmt, what)                                                                  \
    do {                                                                                  \
        a = ok;                                                                           \
        stmt;                                                                             \
        if (expect_forward(f, f->moe, &a.in, &a.out, MF_ERR_INVALID_ARGUMENT, what)) return 1; \
    } while (0)
    BADF(a.in.x = mft_t2(f->x, MF_DTYPE_BF16, T, H + 8), "x [T, H + 8]");
    BADF(a.in.x = mft_t3(f->x, MF_DTYPE_BF16, 1, T, H), "x [1, T, H]");
    BADF(a.in.x.dtype = MF_DTYPE_FP32, "x FP32");
    BADF(a.in.x.dtype = MF_DTYPE_FP8_E4M3, "x FP8");
    BADF(a.in.topk_ids = mft_t2(f->ids, MF_DTYPE_INT32, T, K + 1), "topk_ids [T, K + 1]");
    BADF(a.in.topk_ids = mft_t2(f->ids, MF_DTYPE_INT32, T - 1, K), "topk_ids [T - 1, K]");
    BADF(a.in.topk_ids.dtype = MF_DTYPE_FP32, "topk_ids FP32");
    BADF(a.in.topk_weights = mft_t2(f->w, MF_DTYPE_FP32, T + 1, K), "topk_weights [T + 1, K]");
    BADF(a.in.topk_weights.dtype = MF_DTYPE_BF16, "topk_weights BF16");
    BADF(a.in.topk_weights = mft_t1(f->w, MF_DTYPE_FP32, T * K), "topk_weights flat");
    BADF(a.out.y = mft_t2(f->y, MF_DTYPE_BF16, T - 1, H), "y [T - 1, H]");
    BADF(a.out.y = mft_t2(f->y, MF_DTYPE_BF16, T, 2 * H), "y [T, 2H]");
    BADF(a.out.y.dtype = MF_DTYPE_FP32, "y FP32");
    BADF(a.in.x.data = NULL, "x NULL data");
    BADF(a.in.topk_ids.data = NULL, "topk_ids NULL data");
    BADF(a.in.topk_weights.data = NULL, "topk_weights NULL data");
    BADF(a.out.y.data = NULL, "y NULL data");
#undef BADF
    if (expect_forward(f, f->moe, NULL, &ok.out, MF_ERR_INVALID_ARGUMENT, "NULL in")) return 1;
    if (expect_forward(f, f->moe, &ok.in, NULL, MF_ERR_INVALID_ARGUMENT, "NULL out")) return 1;
    if (expect_forward(f, NULL, &ok.in, &ok.out, MF_ERR_INVALID_ARGUMENT, "NULL layer")) return 1;

    /* -1 may repeat within a token (several skipped slots), and T = 0 is a valid call. */
    f->ids[1 * K + 0] = -1;
    f->ids[1 * K + 1] = -1;
    MFT_CHECK_OK(mf_moe_forward(f->moe, &ok.in, &ok.out, NULL));
    for (int32_t h = 0; h < H; h++) MFT_CHECK_EQ_INT(f->y[1 * H + h] & 0x7fff, 0);
    a = fixture_args(f, 0);
    MFT_CHECK_OK(mf_moe_forward(f->moe, &a.in, &a.out, NULL));
    return 0;
}

static int test_forward_args(void) {
    for (int32_t dtype = 0; dtype < 2; dtype++) {
        mf_moe_config_t cfg = small_config(dtype, dtype ? MF_LAYOUT_MASKED : MF_LAYOUT_EXPERT_MAJOR);
        fixture_t f;
        int rc = fixture_open(&f, &cfg);
        if (!rc) rc = forward_args_body(&f);
        fixture_free(&f);
        if (rc) return 1;
    }
    return 0;
}

/* mf_dispatch validates like forward; a rejected dispatch leaves its outputs untouched and nothing
 * pending (so a combine after it is INVALID_USAGE). */
static int dispatch_args_body(fixture_t *f) {
    int32_t T = 4, K = f->K, H = f->H, E = f->E, S = f->S;
    size_t rows = (size_t)E * (size_t)S; /* MASKED: [L, C = S, H] */
    uint16_t *recv_x = (uint16_t *)mft_alloc(rows * (size_t)H * 2);
    int32_t *recv_src = (int32_t *)mft_alloc(rows * 12), counts[16];
    mf_dispatch_in_t din = {mft_t2(f->x, MF_DTYPE_BF16, T, H), mft_t2(f->ids, MF_DTYPE_INT32, T, K)};
    mf_dispatch_out_t dout;
    memset(&dout, 0, sizeof dout);
    dout.recv_x = mft_t3(recv_x, MF_DTYPE_BF16, E, S, H);
    dout.recv_src = mft_t3(recv_src, MF_DTYPE_INT32, E, S, 3);
    dout.expert_counts = mft_t1(counts, MF_DTYPE_INT32, E);
    mf_combine_in_t cin = {mft_t3(recv_x, MF_DTYPE_BF16, E, S, H), mft_t2(f->w, MF_DTYPE_FP32, T, K)};
    mf_combine_out_t cout = {mft_t2(f->y, MF_DTYPE_BF16, T, H)};
    int rc = 1;
    const char *what = "";
    mf_result_t r;
    mft_poison(recv_x, rows * (size_t)H * 2);
    mft_poison(recv_src, rows * 12);
    mft_poison(counts, sizeof counts);
    f->ids[K + 1] = E; /* token 1: an id out of range */
    what = "dispatch with id = E";
    if ((r = mf_dispatch(f->moe, &din, &dout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0])
        goto fail;
    f->ids[K + 1] = f->ids[K];
    what = "dispatch with a repeated id";
    if ((r = mf_dispatch(f->moe, &din, &dout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0])
        goto fail;
    f->ids[K + 1] = (f->ids[K] + 1) % E;
    din.x = mft_t2(f->x, MF_DTYPE_BF16, S + 1, H);
    din.topk_ids = mft_t2(f->ids, MF_DTYPE_INT32, S + 1, K);
    what = "dispatch with T = S + 1";
    if ((r = mf_dispatch(f->moe, &din, &dout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0])
        goto fail;
    din.x = mft_t2(f->x, MF_DTYPE_BF16, T, H);
    din.topk_ids = mft_t2(f->ids, MF_DTYPE_INT32, T, K);
    dout.recv_x = mft_t3(recv_x, MF_DTYPE_BF16, E, S - 1, H);
    what = "dispatch with recv_x [L, C - 1, H]";
    if ((r = mf_dispatch(f->moe, &din, &dout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0])
        goto fail;
    dout.recv_x = mft_t3(recv_x, MF_DTYPE_BF16, E, S, H);
    dout.expert_counts = mft_t1(counts, MF_DTYPE_INT32, E + 1);
    what = "dispatch with expert_counts [L + 1]";
    if ((r = mf_dispatch(f->moe, &din, &dout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0])
        goto fail;
    dout.expert_counts = mft_t1(counts, MF_DTYPE_INT32, E);
    dout.recv_src.data = NULL;
    what = "dispatch with NULL recv_src data";
    if ((r = mf_dispatch(f->moe, &din, &dout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0])
        goto fail;
    dout.recv_src.data = recv_src;
    if (mft_first_unpoisoned(recv_x, rows * (size_t)H * 2) >= 0 ||
        mft_first_unpoisoned(recv_src, rows * 12) >= 0 ||
        mft_first_unpoisoned(counts, sizeof counts) >= 0) {
        mft_fail(__FILE__, __LINE__, "a rejected mf_dispatch wrote an output");
        goto out;
    }
    what = "combine after only rejected dispatches";
    if ((r = mf_combine(f->moe, &cin, &cout, NULL)) != MF_ERR_INVALID_USAGE || !mf_last_error()[0])
        goto fail;
    /* The valid pair still works, and a combine with the wrong T is rejected while it waits. */
    if (mf_dispatch(f->moe, &din, &dout, NULL) != MF_SUCCESS) {
        mft_fail(__FILE__, __LINE__, "valid mf_dispatch: %s", mf_last_error());
        goto out;
    }
    cout.y = mft_t2(f->y, MF_DTYPE_BF16, T + 1, H);
    what = "combine with y [T + 1, H] (T of the dispatch is 4)";
    if ((r = mf_combine(f->moe, &cin, &cout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0])
        goto fail;
    /* A rejected combine still takes part in the collective (its peers fail theirs with it), so it
     * consumes the dispatch: a combine now has none to finish, and a new pair works. */
    cout.y = mft_t2(f->y, MF_DTYPE_BF16, T, H);
    what = "combine after a rejected combine consumed the dispatch";
    if ((r = mf_combine(f->moe, &cin, &cout, NULL)) != MF_ERR_INVALID_USAGE || !mf_last_error()[0])
        goto fail;
    if (mf_dispatch(f->moe, &din, &dout, NULL) != MF_SUCCESS || mf_combine(f->moe, &cin, &cout, NULL) != MF_SUCCESS) {
        mft_fail(__FILE__, __LINE__, "valid pair after a rejected combine: %s", mf_last_error());
        goto out;
    }
    /* mf_moe_experts between a dispatch and its combine: refused before the weights, with a count
     * past C or a wrong shape (expert_out untouched); then the valid triple. */
    uint16_t *eo = (uint16_t *)mft_alloc(rows * (size_t)H * 2);
    mf_experts_in_t ein = {dout.recv_x, dout.recv_scales, dout.expert_counts};
    mf_experts_out_t eout = {mft_t3(eo, MF_DTYPE_BF16, E, S, H)};
    mft_poison(eo, rows * (size_t)H * 2);
    if (mf_dispatch(f->moe, &din, &dout, NULL) != MF_SUCCESS) {
        mft_fail(__FILE__, __LINE__, "mf_dispatch before mf_moe_experts: %s", mf_last_error());
        free(eo);
        goto out;
    }
    what = "mf_moe_experts before mf_moe_set_weights";
    if ((r = mf_moe_experts(f->moe, &ein, &eout, NULL)) != MF_ERR_INVALID_USAGE || !mf_last_error()[0]) goto fail_eo;
    MFT_CHECK_OK(mf_moe_set_weights(f->moe, &f->weights));
    const int32_t saved = counts[1];
    counts[1] = S + 1;
    what = "mf_moe_experts with expert_counts[1] = C + 1";
    if ((r = mf_moe_experts(f->moe, &ein, &eout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0]) goto fail_eo;
    counts[1] = saved;
    eout.expert_out = mft_t3(eo, MF_DTYPE_BF16, E, S - 1, H);
    what = "mf_moe_experts with expert_out [L, C - 1, H]";
    if ((r = mf_moe_experts(f->moe, &ein, &eout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0]) goto fail_eo;
    what = "mf_moe_experts with NULL in";
    if ((r = mf_moe_experts(f->moe, NULL, &eout, NULL)) != MF_ERR_INVALID_ARGUMENT || !mf_last_error()[0]) goto fail_eo;
    if (mft_first_unpoisoned(eo, rows * (size_t)H * 2) >= 0) {
        mft_fail(__FILE__, __LINE__, "a rejected mf_moe_experts wrote expert_out");
        free(eo);
        goto out;
    }
    eout.expert_out = mft_t3(eo, MF_DTYPE_BF16, E, S, H);
    cin.expert_out = eout.expert_out;
    if (mf_moe_experts(f->moe, &ein, &eout, NULL) != MF_SUCCESS || mf_combine(f->moe, &cin, &cout, NULL) != MF_SUCCESS) {
        mft_fail(__FILE__, __LINE__, "dispatch + mf_moe_experts + combine: %s", mf_last_error());
        free(eo);
        goto out;
    }
    free(eo);
    rc = 0;
    goto out;
fail_eo:
    free(eo);
fail:
    mft_fail(__FILE__, __LINE__, "%s -> %s (\"%s\")", what, mft_result_name(r), mf_last_error());
out:
    free(recv_x);
    free(recv_src);
    return rc;
}

static int test_dispatch_args(void) {
    mf_moe_config_t cfg = small_config(MF_DTYPE_BF16, MF_LAYOUT_MASKED);
    fixture_t f;
    int rc = fixture_open(&f, &cfg);
    if (!rc) rc = dispatch_args_body(&f);
    fixture_free(&f);
    if (rc) return rc;
    /* mf_moe_experts runs on the MASKED layout only */
    cfg = small_config(MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR);
    if ((rc = fixture_open(&f, &cfg)) != 0) return rc;
    uint16_t row[128];
    int32_t one = 0;
    mf_experts_in_t ein = {mft_t3(row, MF_DTYPE_BF16, 1, 1, 128), {0}, mft_t1(&one, MF_DTYPE_INT32, 1)};
    mf_experts_out_t eout = {mft_t3(row, MF_DTYPE_BF16, 1, 1, 128)};
    if (mf_moe_set_weights(f.moe, &f.weights) != MF_SUCCESS) rc = mft_fail(__FILE__, __LINE__, "%s", mf_last_error());
    else if (mf_moe_experts(f.moe, &ein, &eout, NULL) != MF_ERR_NOT_SUPPORTED || !strstr(mf_last_error(), "MASKED"))
        rc = mft_fail(__FILE__, __LINE__, "mf_moe_experts on EXPERT_MAJOR: %s", mf_last_error());
    fixture_free(&f);
    return rc;
}

/* ---- capacity ----------------------------------------------------------------------------- */

/* MASKED with expert_capacity 4: 5 tokens to expert 0 is CAPACITY (y untouched), 4 is fine.
 * EXPERT_MAJOR with max_recv_rows 128 (one block): two busy experts is CAPACITY, one is fine. */
static int capacity_body(fixture_t *f, int masked) {
    int32_t K = f->K, E = f->E;
    MFT_CHECK_OK(mf_moe_set_weights(f->moe, &f->weights));
    for (int32_t t = 0; t < f->S; t++) {
        f->ids[t * K + 0] = 0;
        f->ids[t * K + 1] = masked ? -1 : (t < 2 ? 1 : -1);
    }
    (void)E;
    fwd_args_t a = fixture_args(f, masked ? 5 : 4);
    if (expect_forward(f, f->moe, &a.in, &a.out, MF_ERR_CAPACITY,
                       masked ? "5 rows for expert capacity 4" : "2 segments in 128 rows"))
        return 1;
    if (masked) {
        a = fixture_args(f, 4);
    } else {
        f->ids[0 * K + 1] = -1;
        f->ids[1 * K + 1] = -1;
    }
    MFT_CHECK_OK(mf_moe_forward(f->moe, &a.in, &a.out, NULL));
    return 0;
}

static int test_capacity(void) {
    for (int masked = 0; masked < 2; masked++) {
        mf_moe_config_t cfg = small_config(MF_DTYPE_BF16, masked ? MF_LAYOUT_MASKED
                                                                 : MF_LAYOUT_EXPERT_MAJOR);
        if (masked) cfg.expert_capacity = 4;
        else cfg.max_recv_rows = 128;
        fixture_t f;
        int rc = fixture_open(&f, &cfg);
        if (!rc) {
            mf_moe_info_t info;
            MFT_CHECK_OK(mf_moe_get_info(f.moe, &info));
            if (masked) MFT_CHECK_EQ_INT(info.expert_capacity, 4);
            else MFT_CHECK_EQ_INT(info.max_recv_rows, 128);
            rc = capacity_body(&f, masked);
        }
        fixture_free(&f);
        if (rc) return 1;
    }
    return 0;
}

/* R = 2, MASKED, expert_capacity 4: both ranks send 3 tokens to expert 0 (6 > 4): both ranks get
 * CAPACITY and neither y is written; then a call within capacity succeeds on both. */
typedef struct cap2_ctx {
    mf_group_t group;
} cap2_ctx_t;

static int capacity_rank(int32_t rank, void *arg) {
    cap2_ctx_t *c = (cap2_ctx_t *)arg;
    enum { E = 4, K = 1, H = 128, I = 128, S = 4, T = 3 };
    static uint16_t w13[2][2 * 2 * I * H], w2[2][2 * H * I];
    uint16_t x[S * H], y[S * H];
    int32_t ids[S * K];
    float w[S * K];
    for (int i = 0; i < S * H; i++) x[i] = mf_bf16_from_float((float)(i % 5) * 0.25f);
    for (int t = 0; t < S; t++) {
        ids[t] = 0;
        w[t] = 1.0f;
    }
    mf_comm_t comm = NULL;
    mf_moe_t moe = NULL;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = small_config(MF_DTYPE_BF16, MF_LAYOUT_MASKED);
    cfg.num_topk = K;
    cfg.max_tokens_per_rank = S;
    cfg.expert_capacity = 4;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    mf_moe_weights_t wt;
    memset(&wt, 0, sizeof wt);
    wt.w13 = mft_t3(w13[rank], MF_DTYPE_BF16, 2, 2 * I, H);
    wt.w2 = mft_t3(w2[rank], MF_DTYPE_BF16, 2, H, I);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &wt));
    mf_moe_forward_in_t in = {mft_t2(x, MF_DTYPE_BF16, T, H), mft_t2(ids, MF_DTYPE_INT32, T, K),
                              mft_t2(w, MF_DTYPE_FP32, T, K)};
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    mft_poison(y, sizeof y);
    mf_result_t r = mf_moe_forward(moe, &in, &out, NULL);
    int rc = 0;
    if (r != MF_ERR_CAPACITY)
        rc = mft_fail(__FILE__, __LINE__, "rank %d: 6 rows for capacity 4 -> %s (%s), expected "
                      "MF_ERR_CAPACITY", (int)rank, mft_result_name(r), mf_last_error());
    else if (!mf_last_error()[0])
        rc = mft_fail(__FILE__, __LINE__, "rank %d: CAPACITY with an empty message", (int)rank);
    else if (mft_first_unpoisoned(y, sizeof y) >= 0)
        rc = mft_fail(__FILE__, __LINE__, "rank %d: y written by a CAPACITY failure", (int)rank);
    mft_verbose("  rank %d: %s\n", (int)rank, mf_last_error());
    /* Both ranks go on (the protocol must still be in step): 2 + 2 rows fit. */
    in.x.dims[0] = in.topk_ids.dims[0] = in.topk_weights.dims[0] = out.y.dims[0] = 2;
    r = mf_moe_forward(moe, &in, &out, NULL);
    if (r != MF_SUCCESS && !rc)
        rc = mft_fail(__FILE__, __LINE__, "rank %d: forward within capacity after CAPACITY -> %s: %s",
                      (int)rank, mft_result_name(r), mf_last_error());
    mf_moe_destroy(moe);
    return rc;
}

static int test_capacity_ranks(void) {
    cap2_ctx_t c;
    c.group = mft_cpu_group(2, API_TIMEOUT_MS);
    if (!c.group) return 1;
    int rc = mft_run_ranks(2, capacity_rank, &c);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    return rc;
}

/* ---- profiling ---------------------------------------------------------------------------- */

static int test_phase_times(void) {
    for (int profile = 0; profile < 2; profile++) {
        mf_moe_config_t cfg = small_config(MF_DTYPE_FP8_E4M3, MF_LAYOUT_EXPERT_MAJOR);
        cfg.profile = profile;
        fixture_t f;
        int rc = fixture_open(&f, &cfg);
        if (rc) {
            fixture_free(&f);
            return 1;
        }
        mf_phase_times_t times;
        memset(&times, 0, sizeof times);
        fwd_args_t a = fixture_args(&f, 5);
        mf_result_t r = mf_moe_set_weights(f.moe, &f.weights);
        if (r == MF_SUCCESS) r = mf_moe_forward(f.moe, &a.in, &a.out, NULL);
        if (r != MF_SUCCESS) {
            rc = mft_fail(__FILE__, __LINE__, "forward: %s", mf_last_error());
        } else if (!profile) {
            mf_phase_times_t poison;
            mft_poison(&poison, sizeof poison);
            times = poison;
            r = mf_moe_get_phase_times(f.moe, &times);
            if (r != MF_ERR_INVALID_USAGE || !mf_last_error()[0])
                rc = mft_fail(__FILE__, __LINE__, "phase times without profile -> %s (%s)",
                              mft_result_name(r), mf_last_error());
            else if (memcmp(&times, &poison, sizeof times) != 0)
                rc = mft_fail(__FILE__, __LINE__, "phase times written on failure");
        } else {
            r = mf_moe_get_phase_times(f.moe, &times);
            if (r != MF_SUCCESS)
                rc = mft_fail(__FILE__, __LINE__, "phase times with profile -> %s (%s)",
                              mft_result_name(r), mf_last_error());
            double sum = 0;
            for (int p = 0; p < MF_NUM_PHASES && !rc; p++) {
                if (!(times.us[p] >= 0 && isfinite(times.us[p])))
                    rc = mft_fail(__FILE__, __LINE__, "phase %d time %g", p, times.us[p]);
                sum += times.us[p];
            }
            if (!rc && !(times.total_us > 0 && isfinite(times.total_us)))
                rc = mft_fail(__FILE__, __LINE__, "total_us %g", times.total_us);
            mft_verbose("  phases us: %.1f %.1f %.1f %.1f %.1f total %.1f (sum %.1f)\n",
                        times.us[0], times.us[1], times.us[2], times.us[3], times.us[4],
                        times.total_us, sum);
        }
        if (!rc) {
            r = mf_moe_get_phase_times(f.moe, NULL);
            if (r != MF_ERR_INVALID_ARGUMENT)
                rc = mft_fail(__FILE__, __LINE__, "NULL times -> %s", mft_result_name(r));
        }
        fixture_free(&f);
        if (rc) return 1;
    }
    return 0;
}

/* ---- timeout ------------------------------------------------------------------------------ */

#define SHORT_TIMEOUT_MS 250

/* Does `msg` contain the integer `value` as a whole number somewhere after `keyword`? */
static int names_number_after(const char *msg, const char *keyword, long value) {
    const char *p = msg;
    size_t n = strlen(keyword);
    for (; *p; p++) {
        size_t i = 0;
        while (i < n && p[i] && (p[i] | 32) == (keyword[i] | 32)) i++;
        if (i == n) break;
    }
    if (!*p) return 0;
    for (; *p; p++) {
        if (*p >= '0' && *p <= '9' && (p == msg || !(p[-1] >= '0' && p[-1] <= '9'))) {
            char *end;
            long v = strtol(p, &end, 10);
            if (v == value) return 1;
        }
    }
    return 0;
}

typedef struct timeout_ctx {
    mf_group_t group;
} timeout_ctx_t;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

/* Rank 0 calls forward alone; rank 1 creates its layer (collective) and then never calls. */
static int timeout_rank(int32_t rank, void *arg) {
    timeout_ctx_t *c = (timeout_ctx_t *)arg;
    enum { E = 4, K = 2, H = 128, I = 128, S = 4, T = 2 };
    static uint16_t w13[2 * 2 * I * H], w2[2 * H * I];
    uint16_t x[S * H], y[S * H];
    int32_t ids[S * K] = {0, 3, 2, 1, 0, 1, 2, 3};
    float w[S * K] = {1, 1, 1, 1, 1, 1, 1, 1};
    memset(x, 0, sizeof x);
    mf_comm_t comm = NULL;
    mf_moe_t moe = NULL;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = small_config(MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR);
    cfg.max_tokens_per_rank = S;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    mf_moe_weights_t wt;
    memset(&wt, 0, sizeof wt);
    wt.w13 = mft_t3(w13, MF_DTYPE_BF16, 2, 2 * I, H);
    wt.w2 = mft_t3(w2, MF_DTYPE_BF16, 2, H, I);
    MFT_CHECK_OK(mf_moe_set_weights(moe, &wt));
    if (rank == 1) {
        MFT_CHECK_OK(mf_moe_destroy(moe));
        return 0;
    }
    mf_moe_forward_in_t in = {mft_t2(x, MF_DTYPE_BF16, T, H), mft_t2(ids, MF_DTYPE_INT32, T, K),
                              mft_t2(w, MF_DTYPE_FP32, T, K)};
    mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
    double t0 = now_ms();
    mft_poison(y, sizeof y);
    mf_result_t r = mf_moe_forward(moe, &in, &out, NULL);
    double waited = now_ms() - t0;
    int rc = 0;
    const char *msg = mf_last_error();
    mft_verbose("  rank 0 after %.0f ms: %s: %s\n", waited, mft_result_name(r), msg);
    if (r != MF_ERR_TIMEOUT)
        rc = mft_fail(__FILE__, __LINE__, "lone forward -> %s (%s), expected MF_ERR_TIMEOUT",
                      mft_result_name(r), msg);
    else if (!mft_contains_ci(msg, "dispatch"))
        rc = mft_fail(__FILE__, __LINE__, "the timeout message does not name the phase "
                      "(dispatch): \"%s\"", msg);
    else if (!names_number_after(msg, "missing", 1) && !names_number_after(msg, "rank 1", 1))
        rc = mft_fail(__FILE__, __LINE__, "the timeout message does not name missing rank 1: \"%s\"",
                      msg);
    else if (waited < SHORT_TIMEOUT_MS * 0.9)
        rc = mft_fail(__FILE__, __LINE__, "timed out after %.0f ms, before the %d ms bound", waited,
                      SHORT_TIMEOUT_MS);
    else if (mft_first_unpoisoned(y, sizeof y) >= 0)
        rc = mft_fail(__FILE__, __LINE__, "y written by a timed-out forward");
    if (rc) {
        mf_moe_destroy(moe);
        return rc;
    }
    /* The comm is broken now: every data-path call says so at once instead of waiting. */
    t0 = now_ms();
    r = mf_moe_forward(moe, &in, &out, NULL);
    waited = now_ms() - t0;
    msg = mf_last_error();
    if (r != MF_ERR_INVALID_USAGE)
        rc = mft_fail(__FILE__, __LINE__, "forward on a broken comm -> %s (%s), expected "
                      "MF_ERR_INVALID_USAGE", mft_result_name(r), msg);
    else if (!mft_contains_ci(msg, "broken"))
        rc = mft_fail(__FILE__, __LINE__, "the message does not say the comm is broken: \"%s\"", msg);
    else if (waited > SHORT_TIMEOUT_MS / 2)
        rc = mft_fail(__FILE__, __LINE__, "forward on a broken comm waited %.0f ms", waited);
    if (!rc) {
        mf_dispatch_in_t din = {in.x, in.topk_ids};
        mf_dispatch_out_t dout;
        memset(&dout, 0, sizeof dout);
        r = mf_dispatch(moe, &din, &dout, NULL);
        if (r != MF_ERR_INVALID_USAGE)
            rc = mft_fail(__FILE__, __LINE__, "dispatch on a broken comm -> %s (%s)",
                          mft_result_name(r), mf_last_error());
        mf_moe_t moe2 = NULL;
        r = mf_moe_create(comm, &cfg, &moe2);
        if (!rc && r != MF_ERR_INVALID_USAGE)
            rc = mft_fail(__FILE__, __LINE__, "mf_moe_create on a broken comm -> %s (%s)",
                          mft_result_name(r), mf_last_error());
    }
    MFT_CHECK_OK(mf_moe_destroy(moe));
    return rc;
}

/* Both ranks dispatch; only rank 0 combines: MF_ERR_TIMEOUT in the combine phase, naming rank 1. */
static int timeout_combine_rank(int32_t rank, void *arg) {
    timeout_ctx_t *c = (timeout_ctx_t *)arg;
    enum { E = 4, K = 2, H = 128, S = 4, T = 2, L = 2 };
    uint16_t x[S * H], recv_x[L * 2 * S * H], y[S * H];
    int32_t ids[S * K] = {0, 3, 2, 1, 0, 1, 2, 3}, recv_src[L * 2 * S * 3], counts[L];
    float w[S * K] = {1, 1, 1, 1, 1, 1, 1, 1};
    memset(x, 0, sizeof x);
    memset(recv_x, 0, sizeof recv_x);
    mf_comm_t comm = NULL;
    mf_moe_t moe = NULL;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = small_config(MF_DTYPE_BF16, MF_LAYOUT_MASKED);
    cfg.max_tokens_per_rank = S;
    MFT_CHECK_OK(mf_moe_create(comm, &cfg, &moe));
    mf_dispatch_in_t din = {mft_t2(x, MF_DTYPE_BF16, T, H), mft_t2(ids, MF_DTYPE_INT32, T, K)};
    mf_dispatch_out_t dout;
    memset(&dout, 0, sizeof dout);
    dout.recv_x = mft_t3(recv_x, MF_DTYPE_BF16, L, 2 * S, H);
    dout.recv_src = mft_t3(recv_src, MF_DTYPE_INT32, L, 2 * S, 3);
    dout.expert_counts = mft_t1(counts, MF_DTYPE_INT32, L);
    mf_result_t r = mf_dispatch(moe, &din, &dout, NULL);
    int rc = 0;
    if (r != MF_SUCCESS)
        rc = mft_fail(__FILE__, __LINE__, "rank %d: dispatch -> %s: %s", (int)rank, mft_result_name(r),
                      mf_last_error());
    if (rank == 0 && !rc) {
        mf_combine_in_t cin = {mft_t3(recv_x, MF_DTYPE_BF16, L, 2 * S, H), mft_t2(w, MF_DTYPE_FP32, T, K)};
        mf_combine_out_t cout = {mft_t2(y, MF_DTYPE_BF16, T, H)};
        mft_poison(y, sizeof y);
        r = mf_combine(moe, &cin, &cout, NULL);
        const char *msg = mf_last_error();
        mft_verbose("  rank 0: %s: %s\n", mft_result_name(r), msg);
        if (r != MF_ERR_TIMEOUT)
            rc = mft_fail(__FILE__, __LINE__, "lone combine -> %s (%s), expected MF_ERR_TIMEOUT",
                          mft_result_name(r), msg);
        else if (!mft_contains_ci(msg, "combine"))
            rc = mft_fail(__FILE__, __LINE__, "the timeout message does not name the phase (combine): "
                          "\"%s\"", msg);
        else if (!names_number_after(msg, "missing", 1) && !names_number_after(msg, "rank 1", 1))
            rc = mft_fail(__FILE__, __LINE__, "the timeout message does not name missing rank 1: "
                          "\"%s\"", msg);
        else if (mft_first_unpoisoned(y, sizeof y) >= 0)
            rc = mft_fail(__FILE__, __LINE__, "y written by a timed-out combine");
        else if (mf_combine(moe, &cin, &cout, NULL) != MF_ERR_INVALID_USAGE)
            rc = mft_fail(__FILE__, __LINE__, "a second combine on the broken comm was not "
                          "INVALID_USAGE: %s", mf_last_error());
    }
    MFT_CHECK_OK(mf_moe_destroy(moe));
    return rc;
}

static int test_timeout_combine(void) {
    timeout_ctx_t c;
    c.group = mft_cpu_group(2, SHORT_TIMEOUT_MS);
    if (!c.group) return 1;
    int rc = mft_run_ranks(2, timeout_combine_rank, &c);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    return rc;
}

static int test_timeout(void) {
    timeout_ctx_t c;
    c.group = mft_cpu_group(2, SHORT_TIMEOUT_MS);
    if (!c.group) return 1;
    int rc = mft_run_ranks(2, timeout_rank, &c);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    return rc;
}

/* ---- host allocation failures --------------------------------------------------------------- */

/* The library's allocator can be told to fail its n-th allocation (src/core/alloc.h). For
 * n = 1, 2, ... the whole life of a small layer (group, comms, layer, weights, forward, teardown)
 * runs with that allocation failing: every call either succeeds or fails with OUT_OF_MEMORY and a
 * message, out-pointers stay untouched, every rank of a collective reaches the same verdict, and
 * nothing leaks (LeakSanitizer in `make SAN=1 test`). Stops after several clean runs in a row
 * (n past the last allocation). */

typedef struct oom_ctx {
    mf_group_t group;
    int32_t R;
    pthread_barrier_t barrier;
    mf_result_t create_result[2];
    int fired; /* some call failed with OUT_OF_MEMORY */
} oom_ctx_t;

static int oom_rank(int32_t rank, void *arg) {
    oom_ctx_t *c = (oom_ctx_t *)arg;
    enum { E = 4, K = 2, H = 128, I = 128, S = 4, T = 3 };
    static uint16_t w13[2][4 * 2 * I * H], w2[2][4 * H * I];
    uint16_t x[S * H], y[S * H];
    int32_t ids[S * K] = {0, 1, 2, 3, 3, -1, 1, 2};
    float w[S * K] = {1, 1, 1, 1, 1, 1, 1, 1};
    memset(x, 0, sizeof x);
    int32_t L = E / c->R;
    mf_comm_t comm = NULL;
    MFT_CHECK_OK(mf_group_get_comm(c->group, rank, &comm));
    mf_moe_config_t cfg = small_config(MF_DTYPE_BF16, MF_LAYOUT_EXPERT_MAJOR);
    cfg.max_tokens_per_rank = S;
    mf_moe_t sentinel = (mf_moe_t)(uintptr_t)0x77, moe = sentinel;
    mf_result_t r = mf_moe_create(comm, &cfg, &moe);
    c->create_result[rank] = r;
    pthread_barrier_wait(&c->barrier);
    int rc = 0;
    if (r != MF_SUCCESS) {
        if (moe != sentinel)
            rc = mft_fail(__FILE__, __LINE__, "rank %d: failed create wrote *moe", (int)rank);
        if (r == MF_ERR_OUT_OF_MEMORY) c->fired = 1;
        if (!mf_last_error()[0])
            rc = mft_fail(__FILE__, __LINE__, "rank %d: create failed without a message", (int)rank);
    }
    for (int32_t q = 0; q < c->R; q++)
        if ((c->create_result[q] == MF_SUCCESS) != (r == MF_SUCCESS))
            rc = mft_fail(__FILE__, __LINE__, "mf_moe_create: rank %d -> %s but rank %d -> %s", (int)rank,
                          mft_result_name(r), (int)q, mft_result_name(c->create_result[q]));
    if (r != MF_SUCCESS || rc) {
        if (r == MF_SUCCESS) mf_moe_destroy(moe);
        return rc;
    }
    mf_moe_weights_t wt;
    memset(&wt, 0, sizeof wt);
    wt.w13 = mft_t3(w13[rank], MF_DTYPE_BF16, L, 2 * I, H);
    wt.w2 = mft_t3(w2[rank], MF_DTYPE_BF16, L, H, I);
    r = mf_moe_set_weights(moe, &wt);
    if (r == MF_ERR_OUT_OF_MEMORY) c->fired = 1;
    else if (r != MF_SUCCESS) rc = mft_fail(__FILE__, __LINE__, "set_weights -> %s", mft_result_name(r));
    /* Every rank calls forward unless its set_weights failed; a lone failure there would leave the
     * peer to time out, so the verdicts are shared first. */
    c->create_result[rank] = r;
    pthread_barrier_wait(&c->barrier);
    int all_ok = 1;
    for (int32_t q = 0; q < c->R; q++) all_ok &= c->create_result[q] == MF_SUCCESS;
    if (all_ok) {
        mf_moe_forward_in_t in = {mft_t2(x, MF_DTYPE_BF16, T, H), mft_t2(ids, MF_DTYPE_INT32, T, K),
                                  mft_t2(w, MF_DTYPE_FP32, T, K)};
        mf_moe_forward_out_t out = {mft_t2(y, MF_DTYPE_BF16, T, H)};
        r = mf_moe_forward(moe, &in, &out, NULL);
        if (r == MF_ERR_OUT_OF_MEMORY) c->fired = 1;
        else if (r != MF_SUCCESS)
            rc = mft_fail(__FILE__, __LINE__, "forward -> %s: %s", mft_result_name(r), mf_last_error());
    }
    mf_moe_destroy(moe);
    return rc;
}

static int oom_once(int32_t R, int64_t n, int *fired) {
    oom_ctx_t c;
    memset(&c, 0, sizeof c);
    c.R = R;
    mf_group_config_t cfg = MF_GROUP_CONFIG_INIT;
    cfg.backend = MF_BACKEND_CPU;
    cfg.num_ranks = R;
    cfg.timeout_ms = API_TIMEOUT_MS;
    mf_group_t sentinel = (mf_group_t)(uintptr_t)0x55;
    c.group = sentinel;
    mf__test_fail_alloc_after(n);
    mf_result_t r = mf_group_create(&cfg, &c.group);
    int rc = 0;
    if (r != MF_SUCCESS) {
        mf__test_fail_alloc_after(0);
        if (r != MF_ERR_OUT_OF_MEMORY || !mf_last_error()[0] || c.group != sentinel)
            MFT_FAIL("n = %lld: mf_group_create -> %s (\"%s\"), out-pointer %s", (long long)n,
                     mft_result_name(r), mf_last_error(), c.group == sentinel ? "untouched" : "written");
        *fired = 1;
        return 0;
    }
    pthread_barrier_init(&c.barrier, NULL, (unsigned)R);
    rc = mft_run_ranks(R, oom_rank, &c);
    mf__test_fail_alloc_after(0);
    pthread_barrier_destroy(&c.barrier);
    MFT_CHECK_OK(mf_group_destroy(c.group));
    if (rc) MFT_FAIL("n = %lld (R = %d): see above", (long long)n, (int)R);
    *fired = c.fired;
    return 0;
}

static int test_alloc_failure(void) {
    for (int32_t R = 1; R <= 2; R++) {
        int clean_in_a_row = 0, failures = 0;
        int64_t n;
        for (n = 1; n < 500 && clean_in_a_row < 8; n++) {
            int fired = 0;
            if (oom_once(R, n, &fired)) return 1;
            clean_in_a_row = fired ? 0 : clean_in_a_row + 1;
            failures += fired;
        }
        mft_verbose("  R=%d: %d injected allocation failures reported as OUT_OF_MEMORY, %lld runs\n",
                    (int)R, failures, (long long)n - 1);
        MFT_CHECK_MSG(failures > 0, "R = %d: no injected allocation failure was ever reported", (int)R);
    }
    return 0;
}

/* The A/B switches' parsing (core/params.c): MF_SMALL 0..5 (5 above 5, -1 unset or invalid: the
 * backend's default stays),
 * MF_DECODE_TOKENS one of the decode tiles below 64 or else 64, MF_DECODE_L2 on only at 1,
 * MF_TMA_TAILS off only at 0; the variables are put back. */
static int test_params(void) {
    static const struct { const char *name, *value; int32_t want; } cases[] = {
        {"MF_SMALL", NULL, -1},         {"MF_SMALL", "0", 0},          {"MF_SMALL", "5", 5},
        {"MF_SMALL", "9", 5},           {"MF_SMALL", "-1", -1},        {"MF_SMALL", "x", -1},
        {"MF_DECODE_TOKENS", NULL, 64}, {"MF_DECODE_TOKENS", "8", 8},  {"MF_DECODE_TOKENS", "16", 16},
        {"MF_DECODE_TOKENS", "32", 32}, {"MF_DECODE_TOKENS", "24", 64}, {"MF_DECODE_TOKENS", "128", 64},
        {"MF_DECODE_TOKENS", "4", 64},  {"MF_DECODE_TOKENS", "", 64},
        {"MF_DECODE_L2", NULL, 0},      {"MF_DECODE_L2", "1", 1},      {"MF_DECODE_L2", "0", 0},
        {"MF_DECODE_L2", "2", 0},       {"MF_DECODE_L2", "on", 0},
        {"MF_TMA_TAILS", NULL, 1},      {"MF_TMA_TAILS", "0", 0},      {"MF_TMA_TAILS", "1", 1},
        {"MF_TMA_TAILS", "off", 1},     {"MF_TMA_TAILS", "-1", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *old = getenv(cases[i].name);
        char *keep = old ? strdup(old) : NULL;
        MFT_CHECK(cases[i].value ? setenv(cases[i].name, cases[i].value, 1) == 0 : unsetenv(cases[i].name) == 0);
        const int32_t got = strcmp(cases[i].name, "MF_SMALL") == 0           ? mf__param_small()
                            : strcmp(cases[i].name, "MF_DECODE_TOKENS") == 0 ? mf__param_decode_tokens()
                            : strcmp(cases[i].name, "MF_DECODE_L2") == 0     ? mf__param_decode_l2()
                                                                             : mf__param_tma_tails();
        MFT_CHECK(keep ? setenv(cases[i].name, keep, 1) == 0 : unsetenv(cases[i].name) == 0);
        free(keep);
        MFT_CHECK_MSG(got == cases[i].want, "%s=%s read as %d, want %d", cases[i].name,
                      cases[i].value ? cases[i].value : "(unset)", got, cases[i].want);
    }
    return 0;
}

const mft_test_t mft_tests_api[] = {
    {"api_params", test_params, 5},
    {"api_abi", test_abi, 0},
    {"api_version_strings", test_version_strings, 10},
    {"api_destroy_null", test_destroy_null, 10},
    {"api_group_config", test_group_config, 20},
    {"api_moe_config", test_moe_config, 20},
    {"api_moe_config_ranks", test_moe_config_ranks, 30},
    {"api_weights", test_weights, 20},
    {"api_forward_args", test_forward_args, 30},
    {"api_dispatch_args", test_dispatch_args, 20},
    {"api_capacity", test_capacity, 20},
    {"api_capacity_ranks", test_capacity_ranks, 30},
    {"api_phase_times", test_phase_times, 20},
    {"api_timeout", test_timeout, 30},
    {"api_timeout_combine", test_timeout_combine, 30},
    {"api_alloc_failure", test_alloc_failure, 60},
    {NULL, NULL, 0},
};
