/* The NCCL net-plugin ABI that bagua-net implements, restated from NCCL's documented plugin
 * interface (versions 6 to 12, the ones NCCL 2.20 ... 2.32 probe with dlsym). Only what a
 * host-memory, point-to-point plugin needs is spelled out; collective-network tables are not
 * exported, so they are not declared. Nothing here includes an NCCL header.
 *
 * Layout rules that matter: every table is a struct of function pointers in a fixed order,
 * looked up by the symbol name "ncclNetPlugin_v<N>"; the properties struct is filled by the
 * plugin in the caller's memory, so its field order and types must match exactly. */
#ifndef BAGUA_NET_ABI_H_
#define BAGUA_NET_ABI_H_

#include <stddef.h>
#include <stdint.h>

/* Return codes (ncclResult_t). */
typedef enum {
  BN_OK = 0,
  BN_SYSTEM_ERROR = 2,
  BN_INTERNAL_ERROR = 3,
  BN_INVALID_ARGUMENT = 4,
  BN_INVALID_USAGE = 5,
  BN_REMOTE_ERROR = 6,
} bn_result_t;

/* Logger levels and subsystem flags NCCL passes to / expects from its logger. */
enum { BN_LOG_WARN = 2, BN_LOG_INFO = 3, BN_LOG_TRACE = 5 };
enum { BN_SUBSYS_INIT = 1, BN_SUBSYS_NET = 16, BN_SUBSYS_ENV = 128 };

/* void logger(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) */
typedef void (*bn_logger_t)(int level, unsigned long flags, const char *file, int line,
                            const char *fmt, ...);
/* Profiler callback (v10+); bagua-net never calls it. */
typedef bn_result_t (*bn_profiler_cb_t)(void **event, int type, void *phandle, int64_t plugin_id,
                                        void *ext);

#define BN_HANDLE_MAXSIZE 128 /* bytes of the listen handle NCCL exchanges between ranks */
#define BN_PTR_HOST 0x1       /* ptrSupport / regMr type: host memory */
#define BN_MAX_REQUESTS 32    /* outstanding requests NCCL keeps per comm at most */
#define BN_MAX_NET_SIZE ((size_t)1 << 40)
#define BN_NET_DEVICE_HOST 0  /* netDeviceType: no device offload */
#define BN_ID_UNDEF (-1)

/* Device offload handle (v7+); bagua-net never offers offload and leaves it untouched. */
typedef struct {
  int type;
  int version;
  void *handle;
  size_t size;
  int needs_proxy_progress;
} bn_dev_handle_t;

/* ---- properties, one layout per version ---- */
typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int speed; int port;
  float latency; int maxComms; int maxRecvs;
} bn_props_v6_t;

typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int speed; int port;
  float latency; int maxComms; int maxRecvs; int netDeviceType; int netDeviceVersion;
} bn_props_v7_t;

typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int speed;
  int port; float latency; int maxComms; int maxRecvs; int netDeviceType; int netDeviceVersion;
} bn_props_v8_t;

typedef struct { int ndevs; int devs[4]; } bn_vprops4_t;   /* v9 ... v11 */
typedef struct { int ndevs; int devs[8]; } bn_vprops8_t;   /* v12 */

typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; bn_vprops4_t vProps; size_t maxP2pBytes; size_t maxCollBytes;
} bn_props_v9_t; /* also v10 */

typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; bn_vprops4_t vProps; size_t maxP2pBytes; size_t maxCollBytes;
  int maxMultiRequestSize;
} bn_props_v11_t;

typedef struct {
  char *name; char *pciPath; uint64_t guid; int ptrSupport; int regIsGlobal; int forceFlush;
  int speed; int port; float latency; int maxComms; int maxRecvs; int netDeviceType;
  int netDeviceVersion; bn_vprops8_t vProps; size_t maxP2pBytes; size_t maxCollBytes;
  int maxMultiRequestSize; int16_t railId; int16_t planeId;
} bn_props_v12_t;

typedef struct { int trafficClass; } bn_comm_config_t; /* v10+ */
typedef struct { int32_t v[4]; } bn_comm_attr_t;
typedef struct { bn_comm_attr_t send, recv; uint32_t op, algo, proto; } bn_net_attr_t; /* v11+ */

/* ---- function tables. Slots are in NCCL's order; comments give the differences. ---- */
#define BN_TABLE_TAIL_V6(PROPS)                                                              \
  bn_result_t (*devices)(int *ndev);                                                         \
  bn_result_t (*getProperties)(int dev, PROPS *props);

typedef struct {
  const char *name;
  bn_result_t (*init)(bn_logger_t log);
  BN_TABLE_TAIL_V6(bn_props_v6_t)
  bn_result_t (*listen)(int dev, void *handle, void **listen_comm);
  bn_result_t (*connect)(int dev, void *handle, void **send_comm);
  bn_result_t (*accept)(void *listen_comm, void **recv_comm);
  bn_result_t (*regMr)(void *comm, void *data, int size, int type, void **mhandle);
  bn_result_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                             int fd, void **mhandle);
  bn_result_t (*deregMr)(void *comm, void *mhandle);
  bn_result_t (*isend)(void *send_comm, void *data, int size, int tag, void *mhandle,
                       void **request);
  bn_result_t (*irecv)(void *recv_comm, int n, void **data, int *sizes, int *tags,
                       void **mhandles, void **request);
  bn_result_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                        void **request);
  bn_result_t (*test)(void *request, int *done, int *sizes);
  bn_result_t (*closeSend)(void *send_comm);
  bn_result_t (*closeRecv)(void *recv_comm);
  bn_result_t (*closeListen)(void *listen_comm);
} bn_net_v6_t;

/* v7: connect/accept gain a device-offload handle; getDeviceMr and irecvConsumed appended. */
typedef struct {
  const char *name;
  bn_result_t (*init)(bn_logger_t log);
  BN_TABLE_TAIL_V6(bn_props_v7_t)
  bn_result_t (*listen)(int dev, void *handle, void **listen_comm);
  bn_result_t (*connect)(int dev, void *handle, void **send_comm, bn_dev_handle_t **dev_comm);
  bn_result_t (*accept)(void *listen_comm, void **recv_comm, bn_dev_handle_t **dev_comm);
  bn_result_t (*regMr)(void *comm, void *data, int size, int type, void **mhandle);
  bn_result_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                             int fd, void **mhandle);
  bn_result_t (*deregMr)(void *comm, void *mhandle);
  bn_result_t (*isend)(void *send_comm, void *data, int size, int tag, void *mhandle,
                       void **request);
  bn_result_t (*irecv)(void *recv_comm, int n, void **data, int *sizes, int *tags,
                       void **mhandles, void **request);
  bn_result_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                        void **request);
  bn_result_t (*test)(void *request, int *done, int *sizes);
  bn_result_t (*closeSend)(void *send_comm);
  bn_result_t (*closeRecv)(void *recv_comm);
  bn_result_t (*closeListen)(void *listen_comm);
  bn_result_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
  bn_result_t (*irecvConsumed)(void *recv_comm, int n, void *request);
} bn_net_v7_t;

/* v8: regMr takes a size_t size. */
typedef struct {
  const char *name;
  bn_result_t (*init)(bn_logger_t log);
  BN_TABLE_TAIL_V6(bn_props_v8_t)
  bn_result_t (*listen)(int dev, void *handle, void **listen_comm);
  bn_result_t (*connect)(int dev, void *handle, void **send_comm, bn_dev_handle_t **dev_comm);
  bn_result_t (*accept)(void *listen_comm, void **recv_comm, bn_dev_handle_t **dev_comm);
  bn_result_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);
  bn_result_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                             int fd, void **mhandle);
  bn_result_t (*deregMr)(void *comm, void *mhandle);
  bn_result_t (*isend)(void *send_comm, void *data, int size, int tag, void *mhandle,
                       void **request);
  bn_result_t (*irecv)(void *recv_comm, int n, void **data, int *sizes, int *tags,
                       void **mhandles, void **request);
  bn_result_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                        void **request);
  bn_result_t (*test)(void *request, int *done, int *sizes);
  bn_result_t (*closeSend)(void *send_comm);
  bn_result_t (*closeRecv)(void *recv_comm);
  bn_result_t (*closeListen)(void *listen_comm);
  bn_result_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
  bn_result_t (*irecvConsumed)(void *recv_comm, int n, void *request);
} bn_net_v8_t;

/* v9: isend/irecv sizes become size_t; makeVDevice appended. */
typedef struct {
  const char *name;
  bn_result_t (*init)(bn_logger_t log);
  BN_TABLE_TAIL_V6(bn_props_v9_t)
  bn_result_t (*listen)(int dev, void *handle, void **listen_comm);
  bn_result_t (*connect)(int dev, void *handle, void **send_comm, bn_dev_handle_t **dev_comm);
  bn_result_t (*accept)(void *listen_comm, void **recv_comm, bn_dev_handle_t **dev_comm);
  bn_result_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);
  bn_result_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                             int fd, void **mhandle);
  bn_result_t (*deregMr)(void *comm, void *mhandle);
  bn_result_t (*isend)(void *send_comm, void *data, size_t size, int tag, void *mhandle,
                       void **request);
  bn_result_t (*irecv)(void *recv_comm, int n, void **data, size_t *sizes, int *tags,
                       void **mhandles, void **request);
  bn_result_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                        void **request);
  bn_result_t (*test)(void *request, int *done, int *sizes);
  bn_result_t (*closeSend)(void *send_comm);
  bn_result_t (*closeRecv)(void *recv_comm);
  bn_result_t (*closeListen)(void *listen_comm);
  bn_result_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
  bn_result_t (*irecvConsumed)(void *recv_comm, int n, void *request);
  bn_result_t (*makeVDevice)(int *d, bn_vprops4_t *props);
} bn_net_v9_t;

/* v10: init takes a profiler callback, connect a comm config, isend/irecv profiler handles. */
typedef struct {
  const char *name;
  bn_result_t (*init)(bn_logger_t log, bn_profiler_cb_t prof);
  BN_TABLE_TAIL_V6(bn_props_v9_t)
  bn_result_t (*listen)(int dev, void *handle, void **listen_comm);
  bn_result_t (*connect)(int dev, bn_comm_config_t *config, void *handle, void **send_comm,
                         bn_dev_handle_t **dev_comm);
  bn_result_t (*accept)(void *listen_comm, void **recv_comm, bn_dev_handle_t **dev_comm);
  bn_result_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);
  bn_result_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type, uint64_t offset,
                             int fd, void **mhandle);
  bn_result_t (*deregMr)(void *comm, void *mhandle);
  bn_result_t (*isend)(void *send_comm, void *data, size_t size, int tag, void *mhandle,
                       void *phandle, void **request);
  bn_result_t (*irecv)(void *recv_comm, int n, void **data, size_t *sizes, int *tags,
                       void **mhandles, void **phandles, void **request);
  bn_result_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                        void **request);
  bn_result_t (*test)(void *request, int *done, int *sizes);
  bn_result_t (*closeSend)(void *send_comm);
  bn_result_t (*closeRecv)(void *recv_comm);
  bn_result_t (*closeListen)(void *listen_comm);
  bn_result_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);
  bn_result_t (*irecvConsumed)(void *recv_comm, int n, void *request);
  bn_result_t (*makeVDevice)(int *d, bn_vprops4_t *props);
} bn_net_v10_t;

/* v11 (and v12 with bigger properties): a per-communicator context from init, passed to
 * listen/connect/finalize; finalize and setNetAttr appended. */
#define BN_TABLE_V11(NAME, PROPS, VPROPS)                                                     \
  typedef struct {                                                                           \
    const char *name;                                                                        \
    bn_result_t (*init)(void **ctx, uint64_t comm_id, bn_comm_config_t *config,              \
                        bn_logger_t log, bn_profiler_cb_t prof);                             \
    BN_TABLE_TAIL_V6(PROPS)                                                                  \
    bn_result_t (*listen)(void *ctx, int dev, void *handle, void **listen_comm);             \
    bn_result_t (*connect)(void *ctx, int dev, void *handle, void **send_comm,               \
                           bn_dev_handle_t **dev_comm);                                      \
    bn_result_t (*accept)(void *listen_comm, void **recv_comm, bn_dev_handle_t **dev_comm);  \
    bn_result_t (*regMr)(void *comm, void *data, size_t size, int type, void **mhandle);     \
    bn_result_t (*regMrDmaBuf)(void *comm, void *data, size_t size, int type,                \
                               uint64_t offset, int fd, void **mhandle);                     \
    bn_result_t (*deregMr)(void *comm, void *mhandle);                                       \
    bn_result_t (*isend)(void *send_comm, void *data, size_t size, int tag, void *mhandle,   \
                         void *phandle, void **request);                                     \
    bn_result_t (*irecv)(void *recv_comm, int n, void **data, size_t *sizes, int *tags,      \
                         void **mhandles, void **phandles, void **request);                  \
    bn_result_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles,  \
                          void **request);                                                   \
    bn_result_t (*test)(void *request, int *done, int *sizes);                               \
    bn_result_t (*closeSend)(void *send_comm);                                               \
    bn_result_t (*closeRecv)(void *recv_comm);                                               \
    bn_result_t (*closeListen)(void *listen_comm);                                           \
    bn_result_t (*getDeviceMr)(void *comm, void *mhandle, void **dptr_mhandle);              \
    bn_result_t (*irecvConsumed)(void *recv_comm, int n, void *request);                     \
    bn_result_t (*makeVDevice)(int *d, VPROPS *props);                                       \
    bn_result_t (*finalize)(void *ctx);                                                      \
    bn_result_t (*setNetAttr)(void *ctx, bn_net_attr_t *attr);                               \
  } NAME;

BN_TABLE_V11(bn_net_v11_t, bn_props_v11_t, bn_vprops4_t)
BN_TABLE_V11(bn_net_v12_t, bn_props_v12_t, bn_vprops8_t)

#endif /* BAGUA_NET_ABI_H_ */
