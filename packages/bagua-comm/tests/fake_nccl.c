/* A stand-in libnccl for CPU tests of the binding: it exports the NCCL entry points by name
 * with their C signatures, so our dlopen/dlsym table, error paths and watchdog can be driven
 * without a GPU.  Built by the tests with `cc -shared -fPIC` (see _fake_nccl.py).
 *   -DFAKE_OLD   an NCCL 2.3.7: no ncclCommAbort, ncclCommGetAsyncError, ncclSend/Recv,
 *                ncclGetLastError (they arrived in 2.4, 2.7, 2.13).
 * Test controls (called through ctypes): fakeSetAsyncError, fakeAborts, fakeSetSleepUs,
 * fakeSetAbortBlocks (ncclCommAbort then blocks until it is cleared), fakeSetInitHangs (a
 * non-blocking ncclCommInitRankConfig then stays ncclInProgress: a peer that never joins),
 * fakeSetInProgress (ncclAllReduce returns ncclInProgress and ncclCommGetAsyncError keeps
 * saying so: a collective waiting for a dead peer), fakeUsesAfterFree (calls made with a
 * communicator after ncclCommAbort/ncclCommDestroy: those mark it freed and leak it, so that
 * a use after free is counted instead of crashing). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int ncclResult_t;
typedef struct { int nranks, rank, aborted, initializing, freed; } fakeComm;
typedef struct { size_t size; unsigned int magic, version; int blocking; } ncclConfig_t;
typedef fakeComm *ncclComm_t;
typedef struct { char internal[128]; } ncclUniqueId;

static int async_error = 0, aborts = 0, counter = 0;
static unsigned sleep_us = 0;
static int abort_blocks = 0, init_hangs = 0, in_progress = 0, uses_after_free = 0;
#define USE(c) do { if (__atomic_load_n(&(c)->freed, __ATOMIC_SEQ_CST)) \
    __atomic_add_fetch(&uses_after_free, 1, __ATOMIC_SEQ_CST); } while (0)

void fakeSetAsyncError(int status) { __atomic_store_n(&async_error, status, __ATOMIC_SEQ_CST); }
int fakeAborts(void) { return __atomic_load_n(&aborts, __ATOMIC_SEQ_CST); }
void fakeSetSleepUs(unsigned us) { sleep_us = us; }
void fakeSetAbortBlocks(int on) { __atomic_store_n(&abort_blocks, on, __ATOMIC_SEQ_CST); }
void fakeSetInitHangs(int on) { __atomic_store_n(&init_hangs, on, __ATOMIC_SEQ_CST); }
void fakeSetInProgress(int on) { __atomic_store_n(&in_progress, on, __ATOMIC_SEQ_CST); }
int fakeUsesAfterFree(void) { return __atomic_load_n(&uses_after_free, __ATOMIC_SEQ_CST); }

#ifdef FAKE_OLD
ncclResult_t ncclGetVersion(int *v) { *v = 2307; return 0; }
#else
ncclResult_t ncclGetVersion(int *v) { *v = 22703; return 0; }
#endif
const char *ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case 0: return "no error";
    case 3: return "fake internal error";
    case 6: return "fake remote error";
    default: return "fake unknown";
  }
}
ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id->internal, 0, 128);
  int c = __atomic_add_fetch(&counter, 1, __ATOMIC_SEQ_CST);
  memcpy(id->internal, &c, sizeof c);
  return 0;
}
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  (void)id;
  fakeComm *c = calloc(1, sizeof *c);
  c->nranks = nranks; c->rank = rank;
  *comm = c;
  return 0;
}
ncclResult_t ncclCommDestroy(ncclComm_t c) {
  USE(c);
  __atomic_store_n(&c->freed, 1, __ATOMIC_SEQ_CST);
  return 0;
}
ncclResult_t ncclCommCount(ncclComm_t c, int *n) { USE(c); *n = c->nranks; return 0; }
ncclResult_t ncclCommUserRank(ncclComm_t c, int *r) { USE(c); *r = c->rank; return 0; }
ncclResult_t ncclAllReduce(const void *s, void *r, size_t n, int t, int op, ncclComm_t c,
                           void *stream) {
  (void)s; (void)r; (void)n; (void)t; (void)op; (void)stream;
  USE(c);
  if (sleep_us) usleep(sleep_us);
  return __atomic_load_n(&in_progress, __ATOMIC_SEQ_CST) ? 7 : 0;
}
ncclResult_t ncclGroupStart(void) { return 0; }
ncclResult_t ncclGroupEnd(void) { return 0; }
#ifndef FAKE_OLD
ncclResult_t ncclCommAbort(ncclComm_t c) {
  __atomic_add_fetch(&aborts, 1, __ATOMIC_SEQ_CST);
  while (__atomic_load_n(&abort_blocks, __ATOMIC_SEQ_CST)) usleep(1000);
  USE(c);
  __atomic_store_n(&c->freed, 1, __ATOMIC_SEQ_CST);
  return 0;
}
ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *r) {
  USE(c);
  if (c->initializing || __atomic_load_n(&in_progress, __ATOMIC_SEQ_CST)) {
    *r = 7;                                    /* ncclInProgress */
    return 0;
  }
  *r = __atomic_load_n(&async_error, __ATOMIC_SEQ_CST);
  return 0;
}
ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t *config) {
  if (config->magic != 0xcafebeef || config->size < sizeof *config) return 4;
  ncclResult_t r = ncclCommInitRank(comm, nranks, id, rank);
  if (config->blocking == 0 && __atomic_load_n(&init_hangs, __ATOMIC_SEQ_CST)) {
    (*comm)->initializing = 1;
    return 7;
  }
  return r;
}
const char *ncclGetLastError(ncclComm_t c) { if (c) USE(c); return "fake detail"; }
#endif
