// The linear kernels built for the avx2 instruction set (see linear_impl.h).
#define BASE_ISA avx2
#define BASE_ISA_NAME "avx2"
#define BASE_VEC_FLOATS 8
#define BASE_MAX_MR 2
#include "linear_impl.h"
