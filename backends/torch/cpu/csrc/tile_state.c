/* AMX: Linux hands the tile state to a process only on request (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA);
   amx_linear.c and paged_extend_amx.c run only after it was granted. */
#include "kernels.h"
#include "levels.h"

#if defined(TIERLM_AMX)
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int permitted = 0;

/* 1 once granted, -1 where Linux refused it */
int amx_request_permission(void) {
    if (!permitted) permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return permitted;
}
#endif
