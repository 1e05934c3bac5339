// The integer-activation kernels built for the avx512 instruction set (see qdot_impl.h).
#define BASE_ISA avx512
#define BASE_ISA_NAME "avx512-vnni"
#include "qdot_impl.h"
