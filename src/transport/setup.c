/*
 * setup.c — the setup-time collectives every transport and core use, over the comm's bootstrap
 * (the caller's allgather, the built-in rendezvous, the in-process one of mf_group_create, or an
 * ncclComm's). Never on the data path.
 */
#include <stdio.h>
#include <string.h>

#include "core/errors.h"
#include "core/handles.h"
#include "transport/transport.h"

mf_result_t mf__allgather(mf_comm_t comm, const void *mine, void *all, size_t bytes, const char *what) {
    if (comm->bootstrap_failed)
        return mf__error(MF_ERR_INVALID_USAGE, "rank %d: %s: the bootstrap failed earlier; destroy the comm",
                         comm->rank, what);
    if (comm->num_ranks == 1) {
        memcpy(all, mine, bytes);
        return MF_SUCCESS;
    }
    /* The allgather may report through mf_last_error (the built-in ones do): keep its words. */
    mf__clear_error();
    if (comm->bootstrap.allgather(comm->bootstrap.ctx, mine, all, bytes) != 0) {
        char why[256];
        snprintf(why, sizeof why, "%s", mf_last_error()[0] ? mf_last_error() : "the caller's allgather returned an error");
        comm->bootstrap_failed = 1;
        return mf__error(MF_ERR_SYSTEM, "rank %d: %s: bootstrap allgather of %zu bytes failed: %s", comm->rank, what,
                         bytes, why);
    }
    return MF_SUCCESS;
}

mf_result_t mf__barrier(mf_comm_t comm, const char *what) {
    uint8_t mine = 1, all[MF_MAX_RANKS];
    return mf__allgather(comm, &mine, all, 1, what);
}

mf_result_t mf__agree(mf_comm_t comm, mf_result_t mine, const char *what) {
    char keep[512];
    snprintf(keep, sizeof keep, "%s", mine != MF_SUCCESS ? mf_last_error() : "");
    int32_t codes[MF_MAX_RANKS];
    int32_t code = (int32_t)mine;
    MF_CHECK(mf__allgather(comm, &code, codes, sizeof code, what));
    for (int32_t q = 0; q < comm->num_ranks; q++) {
        if (codes[q] == MF_SUCCESS) continue;
        if (mine != MF_SUCCESS) return mf__error(mine, "%s", keep); /* a failing rank keeps its own words */
        return mf__error((mf_result_t)codes[q], "rank %d: %s: rank %d failed (%s); every rank fails", comm->rank,
                         what, q, mf_result_string((mf_result_t)codes[q]));
    }
    return MF_SUCCESS;
}
