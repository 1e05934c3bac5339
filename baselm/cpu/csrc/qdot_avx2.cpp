// The integer-activation kernels built for the avx2 instruction set (see qdot_impl.h).
#define BASE_ISA avx2
#define BASE_ISA_NAME "avx2"
#include "qdot_impl.h"
