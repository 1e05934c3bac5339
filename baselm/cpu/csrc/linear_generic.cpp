// The linear kernels built for the generic instruction set (see linear_impl.h).
#define BASE_ISA generic
#define BASE_ISA_NAME "generic"
#define BASE_VEC_FLOATS 4
#define BASE_MAX_MR 2
#include "linear_impl.h"
