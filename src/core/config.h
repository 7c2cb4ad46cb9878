/*
 * config.h — the reader of the public config structs (size, magic, version and an INIT macro:
 * NCCL's habit), so that a caller built against an older header still works (config.c).
 */
#ifndef MF_CORE_CONFIG_H
#define MF_CORE_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Copies a caller's config into the library's current layout (NCCL's habit): checks magic and
 * version (1..MF_API_VERSION), accepts any size from the oldest layout's (`min_size`) to the
 * current one (`lib_size`), copies the caller's bytes and gives the newer fields 0 (their
 * defaults); out->size and out->version then read as current. `init` names the INIT macro for
 * the message. INVALID_USAGE on a bad header. */
mf_result_t mf__read_config(const void *in, size_t lib_size, size_t min_size, uint32_t magic, const char *fn,
                            const char *init, void *out);

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_CONFIG_H */
