/*
 * tensor.c — validation of the non-owning tensor descriptors that cross the public API: one
 * function checks dtype, rank, every dimension and the data pointer, and names the tensor and
 * the mismatch in the error message.
 */
#include <stdio.h>
#include <string.h>

#include "core/errors.h"
#include "core/layout.h"
#include "core/tensor.h"

static void mf__format_dims(char *buf, size_t len, int32_t ndim, const int64_t *dims) {
    size_t used = 0;
    used += (size_t)snprintf(buf + used, len - used, "[");
    for (int32_t i = 0; i < ndim && used < len; i++)
        used += (size_t)snprintf(buf + used, len - used, "%s%lld", i ? ", " : "", (long long)dims[i]);
    if (used < len) snprintf(buf + used, len - used, "]");
}

mf_result_t mf__check_tensor(const mf_tensor_t *t, const char *name, int32_t dtype, int32_t ndim,
                             const int64_t *dims, int32_t data_optional) {
    char want[96], got[96];
    if (!t) return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: tensor descriptor is NULL", name);
    mf__format_dims(want, sizeof want, ndim, dims);
    if (t->ndim < 0 || t->ndim > MF_MAX_DIMS)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: ndim %d is outside [0, %d]", name, t->ndim,
                         MF_MAX_DIMS);
    mf__format_dims(got, sizeof got, t->ndim, t->dims);
    if (t->dtype != dtype)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: expected dtype %s, got %s", name,
                         mf__dtype_name(dtype), mf__dtype_name(t->dtype));
    int ok = t->ndim == ndim;
    for (int32_t i = 0; ok && i < ndim; i++) ok = dims[i] < 0 ? t->dims[i] >= 0 : t->dims[i] == dims[i];
    if (!ok)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: expected shape %s, got %s", name, want, got);
    if (!t->data && !data_optional && mf__tensor_numel(t) > 0)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: data is NULL", name);
    if ((uintptr_t)t->data % mf__dtype_size(dtype) != 0)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: data %p is not aligned to its %zu-byte elements", name,
                         t->data, mf__dtype_size(dtype));
    return MF_SUCCESS;
}

int64_t mf__tensor_numel(const mf_tensor_t *t) {
    int64_t n = 1;
    for (int32_t i = 0; i < t->ndim; i++) n *= t->dims[i];
    return n;
}

mf_result_t mf__check_rows16(const mf_tensor_t *t, const char *name) {
    if ((uintptr_t)t->data % MF__ROW_ALIGN != 0)
        return mf__error(MF_ERR_INVALID_ARGUMENT, "%s: data %p is not %d-byte aligned (rows move as 16-byte vectors)",
                         name, t->data, MF__ROW_ALIGN);
    return MF_SUCCESS;
}

/* ---- dtypes ------------------------------------------------------------------------------- */

size_t mf__dtype_size(int32_t dtype) {
    switch (dtype) {
    case MF_DTYPE_BF16: return 2;
    case MF_DTYPE_FP8_E4M3: return 1;
    case MF_DTYPE_FP32: return 4;
    case MF_DTYPE_INT32: return 4;
    default: return 0;
    }
}

const char *mf__dtype_name(int32_t dtype) {
    switch (dtype) {
    case MF_DTYPE_BF16: return "bf16";
    case MF_DTYPE_FP8_E4M3: return "fp8_e4m3";
    case MF_DTYPE_FP32: return "fp32";
    case MF_DTYPE_INT32: return "int32";
    default: return "unknown dtype";
    }
}
