/*
 * tensor.h — checks of public tensor descriptors, and the dtypes' sizes and names (see tensor.c).
 */
#ifndef MF_CORE_TENSOR_H
#define MF_CORE_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "moeflow.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Checks dtype, ndim, dims (a negative entry in `dims` matches any size), that data is aligned to
 * its elements and, unless `data_optional`, non-NULL when the tensor has elements. */
mf_result_t mf__check_tensor(const mf_tensor_t *t, const char *name, int32_t dtype, int32_t ndim,
                             const int64_t *dims, int32_t data_optional);
int64_t mf__tensor_numel(const mf_tensor_t *t);
/* Row tensors (activations, payloads, weights) must be 16-byte aligned. */
mf_result_t mf__check_rows16(const mf_tensor_t *t, const char *name);

#define MF__DIMS(...) ((const int64_t[]){__VA_ARGS__})

size_t mf__dtype_size(int32_t dtype);
const char *mf__dtype_name(int32_t dtype);

#ifdef __cplusplus
}
#endif

#endif /* MF_CORE_TENSOR_H */
