// The linear kernels built for the avx512 instruction set (see linear_impl.h).
#define BASE_ISA avx512
#define BASE_ISA_NAME "avx512"
#define BASE_VEC_FLOATS 16
#define BASE_MAX_MR 4
#include "linear_impl.h"
