/*
 * config.c — the library's version, the reader of config structs of any API version
 * (core/config.h) and the struct sizes a binding checks its mirror against.
 */
#include <string.h>

#include "core/config.h"
#include "core/errors.h"

int32_t mf_get_version(void) { return MOEFLOW_VERSION_CODE; }

/* Every config struct starts with these three fields. */
typedef struct mf__config_header {
    uint32_t size, magic, version;
} mf__config_header_t;

mf_result_t mf__read_config(const void *in, size_t lib_size, size_t min_size, uint32_t magic, const char *fn,
                            const char *init, void *out) {
    mf__config_header_t h;
    memcpy(&h, in, sizeof h);
    if (h.magic != magic)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: config header is wrong (magic 0x%x); initialise it with %s", fn,
                         h.magic, init);
    if (h.version < 1 || h.version > MF_API_VERSION)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: config version %u, this library reads versions 1 to %d (a newer "
                         "header needs a newer library)", fn, h.version, MF_API_VERSION);
    if (h.size < min_size || h.size > lib_size)
        return mf__error(MF_ERR_INVALID_USAGE, "%s: config size %u is outside [%zu, %zu] (version %u); initialise it "
                         "with %s", fn, h.size, min_size, lib_size, h.version, init);
    memset(out, 0, lib_size);
    memcpy(out, in, h.size);
    mf__config_header_t cur = {(uint32_t)lib_size, magic, MF_API_VERSION};
    memcpy(out, &cur, sizeof cur);
    return MF_SUCCESS;
}

int64_t mf_get_struct_size(mf_struct_t which) {
    switch (which) {
    case MF_STRUCT_TENSOR: return (int64_t)sizeof(mf_tensor_t);
    case MF_STRUCT_GROUP_CONFIG: return (int64_t)sizeof(mf_group_config_t);
    case MF_STRUCT_COMM_CONFIG: return (int64_t)sizeof(mf_comm_config_t);
    case MF_STRUCT_BOOTSTRAP: return (int64_t)sizeof(mf_bootstrap_t);
    case MF_STRUCT_MOE_CONFIG: return (int64_t)sizeof(mf_moe_config_t);
    case MF_STRUCT_MOE_INFO: return (int64_t)sizeof(mf_moe_info_t);
    case MF_STRUCT_MOE_WEIGHTS: return (int64_t)sizeof(mf_moe_weights_t);
    case MF_STRUCT_MOE_FORWARD_IN: return (int64_t)sizeof(mf_moe_forward_in_t);
    case MF_STRUCT_MOE_FORWARD_OUT: return (int64_t)sizeof(mf_moe_forward_out_t);
    case MF_STRUCT_DISPATCH_IN: return (int64_t)sizeof(mf_dispatch_in_t);
    case MF_STRUCT_DISPATCH_OUT: return (int64_t)sizeof(mf_dispatch_out_t);
    case MF_STRUCT_COMBINE_IN: return (int64_t)sizeof(mf_combine_in_t);
    case MF_STRUCT_COMBINE_OUT: return (int64_t)sizeof(mf_combine_out_t);
    case MF_STRUCT_PHASE_TIMES: return (int64_t)sizeof(mf_phase_times_t);
    case MF_STRUCT_MOE_BALANCE_STATS: return (int64_t)sizeof(mf_moe_balance_stats_t);
    case MF_STRUCT_EXPERTS_IN: return (int64_t)sizeof(mf_experts_in_t);
    case MF_STRUCT_EXPERTS_OUT: return (int64_t)sizeof(mf_experts_out_t);
    case MF_STRUCT_EXCHANGE_EVENTS: return (int64_t)sizeof(mf_exchange_events_t);
    case MF_NUM_STRUCTS: break;
    }
    return 0;
}
