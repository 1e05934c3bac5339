// The integer-activation kernels built for the generic instruction set (see qdot_impl.h).
#define BASE_ISA generic
#define BASE_ISA_NAME "generic"
#include "qdot_impl.h"
