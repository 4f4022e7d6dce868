/* The exported NCCL net-plugin tables "ncclNetPlugin_v6" ... "ncclNetPlugin_v12", all named
 * "BaguaNet": thin shims that adapt each version's signatures to the one implementation in
 * transport.c. NCCL probes from the newest version down and uses the first symbol it finds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bagua_net.h"

static const char kName[] = "BaguaNet";
static int g_ctx_token; /* v11+ per-communicator context: the plugin keeps no per-comm state */

/* ---- properties: one filler per layout ---- */
#define FILL_COMMON(P, S)                                                                    \
  do {                                                                                       \
    memset((P), 0, sizeof(*(P)));                                                            \
    (P)->name = (S).name;                                                                    \
    (P)->pciPath = (S).pci_path;                                                             \
    (P)->guid = (S).guid;                                                                    \
    (P)->ptrSupport = BN_PTR_HOST;                                                           \
    (P)->speed = (S).speed;                                                                  \
    (P)->port = 0;                                                                           \
    (P)->latency = 0.0f;                                                                     \
    (P)->maxComms = (S).max_comms;                                                           \
    (P)->maxRecvs = 1;                                                                       \
  } while (0)

#define FILL_V9(P, S, NDEV)                                                                  \
  do {                                                                                       \
    FILL_COMMON(P, S);                                                                       \
    (P)->regIsGlobal = 0;                                                                    \
    (P)->forceFlush = 0;                                                                     \
    (P)->netDeviceType = BN_NET_DEVICE_HOST;                                                 \
    (P)->netDeviceVersion = 0;                                                               \
    (P)->vProps.ndevs = 1;                                                                   \
    (P)->vProps.devs[0] = (NDEV);                                                            \
    (P)->maxP2pBytes = BN_MAX_NET_SIZE;                                                      \
    (P)->maxCollBytes = BN_MAX_NET_SIZE;                                                     \
  } while (0)

static bn_result_t props_v6(int dev, bn_props_v6_t *p) {
  bn_props_t s;
  bn_result_t rc = bn_get_properties(dev, &s);
  if (rc == BN_OK) FILL_COMMON(p, s);
  return rc;
}

static bn_result_t props_v7(int dev, bn_props_v7_t *p) {
  bn_props_t s;
  bn_result_t rc = bn_get_properties(dev, &s);
  if (rc == BN_OK) {
    FILL_COMMON(p, s);
    p->netDeviceType = BN_NET_DEVICE_HOST;
  }
  return rc;
}

static bn_result_t props_v8(int dev, bn_props_v8_t *p) {
  bn_props_t s;
  bn_result_t rc = bn_get_properties(dev, &s);
  if (rc == BN_OK) {
    FILL_COMMON(p, s);
    p->netDeviceType = BN_NET_DEVICE_HOST;
  }
  return rc;
}

static bn_result_t props_v9(int dev, bn_props_v9_t *p) {
  bn_props_t s;
  bn_result_t rc = bn_get_properties(dev, &s);
  if (rc == BN_OK) FILL_V9(p, s, dev);
  return rc;
}

static bn_result_t props_v11(int dev, bn_props_v11_t *p) {
  bn_props_t s;
  bn_result_t rc = bn_get_properties(dev, &s);
  if (rc == BN_OK) {
    FILL_V9(p, s, dev);
    p->maxMultiRequestSize = 1;
  }
  return rc;
}

static bn_result_t props_v12(int dev, bn_props_v12_t *p) {
  bn_props_t s;
  bn_result_t rc = bn_get_properties(dev, &s);
  if (rc == BN_OK) {
    FILL_V9(p, s, dev);
    p->maxMultiRequestSize = 1;
    p->railId = BN_ID_UNDEF;
    p->planeId = BN_ID_UNDEF;
  }
  return rc;
}

/* ---- init / finalize ---- */
static bn_result_t init_v6(bn_logger_t log) { return bn_init(log); }

static bn_result_t init_v10(bn_logger_t log, bn_profiler_cb_t prof) {
  (void)prof;
  return bn_init(log);
}

static bn_result_t init_v11(void **ctx, uint64_t comm_id, bn_comm_config_t *config,
                            bn_logger_t log, bn_profiler_cb_t prof) {
  (void)comm_id; (void)config; (void)prof;
  bn_result_t rc = bn_init(log);
  *ctx = rc == BN_OK ? &g_ctx_token : NULL;
  return rc;
}

static bn_result_t finalize_v11(void *ctx) {
  (void)ctx;
  return BN_OK;
}

/* ---- connection set-up ---- */
static bn_result_t listen_v11(void *ctx, int dev, void *handle, void **listen_comm) {
  (void)ctx;
  return bn_listen(dev, handle, listen_comm);
}

static bn_result_t connect_v7(int dev, void *handle, void **send_comm, bn_dev_handle_t **dc) {
  (void)dc; /* no device offload: NCCL's handle is left as it is */
  return bn_connect(dev, handle, send_comm);
}

static bn_result_t connect_v10(int dev, bn_comm_config_t *config, void *handle,
                               void **send_comm, bn_dev_handle_t **dc) {
  (void)config; (void)dc;
  return bn_connect(dev, handle, send_comm);
}

static bn_result_t connect_v11(void *ctx, int dev, void *handle, void **send_comm,
                               bn_dev_handle_t **dc) {
  (void)ctx; (void)dc;
  return bn_connect(dev, handle, send_comm);
}

static bn_result_t accept_v7(void *listen_comm, void **recv_comm, bn_dev_handle_t **dc) {
  (void)dc;
  return bn_accept(listen_comm, recv_comm);
}

/* ---- memory registration ---- */
static bn_result_t reg_mr_int(void *comm, void *data, int size, int type, void **mhandle) {
  return bn_reg_mr(comm, data, size < 0 ? 0 : (size_t)size, type, mhandle);
}

/* ---- data path ---- */
static bn_result_t isend_int(void *comm, void *data, int size, int tag, void *mh, void **req) {
  (void)mh;
  if (size < 0) {
    BN_WARN("NET/BaguaNet: isend of a negative size %d", size);
    return BN_INVALID_ARGUMENT;
  }
  return bn_isend(comm, data, (size_t)size, tag, req);
}

static bn_result_t isend_v9(void *comm, void *data, size_t size, int tag, void *mh, void **req) {
  (void)mh;
  return bn_isend(comm, data, size, tag, req);
}

static bn_result_t isend_v10(void *comm, void *data, size_t size, int tag, void *mh, void *ph,
                             void **req) {
  (void)mh; (void)ph;
  return bn_isend(comm, data, size, tag, req);
}

static bn_result_t irecv_int(void *comm, int n, void **data, int *sizes, int *tags, void **mhs,
                             void **req) {
  (void)tags; (void)mhs;
  size_t s = 0;
  if (n == 1) s = sizes[0] < 0 ? 0 : (size_t)sizes[0];
  return bn_irecv(comm, n, data, &s, req);
}

static bn_result_t irecv_v9(void *comm, int n, void **data, size_t *sizes, int *tags,
                            void **mhs, void **req) {
  (void)tags; (void)mhs;
  return bn_irecv(comm, n, data, sizes, req);
}

static bn_result_t irecv_v10(void *comm, int n, void **data, size_t *sizes, int *tags,
                             void **mhs, void **phs, void **req) {
  (void)tags; (void)mhs; (void)phs;
  return bn_irecv(comm, n, data, sizes, req);
}

static bn_result_t iflush_any(void *comm, int n, void **data, int *sizes, void **mhs,
                              void **req) {
  (void)n; (void)data; (void)sizes; (void)mhs;
  return bn_iflush(comm, req);
}

static bn_result_t test_any(void *request, int *done, int *sizes) {
  size_t n = 0;
  bn_result_t rc = bn_test(request, done, &n);
  if (rc == BN_OK && *done && sizes != NULL) *sizes = n > 0x7fffffff ? 0x7fffffff : (int)n;
  return rc;
}

/* ---- the tables ---- */
#define COMMON_TAIL                                                                          \
  .regMrDmaBuf = NULL, .deregMr = bn_dereg_mr, .iflush = iflush_any, .test = test_any,       \
  .closeSend = bn_close_send, .closeRecv = bn_close_recv, .closeListen = bn_close_listen

BN_EXPORT const bn_net_v6_t ncclNetPlugin_v6 = {
  .name = kName, .init = init_v6, .devices = bn_devices, .getProperties = props_v6,
  .listen = bn_listen, .connect = bn_connect, .accept = bn_accept, .regMr = reg_mr_int,
  .isend = isend_int, .irecv = irecv_int, COMMON_TAIL,
};

BN_EXPORT const bn_net_v7_t ncclNetPlugin_v7 = {
  .name = kName, .init = init_v6, .devices = bn_devices, .getProperties = props_v7,
  .listen = bn_listen, .connect = connect_v7, .accept = accept_v7, .regMr = reg_mr_int,
  .isend = isend_int, .irecv = irecv_int, COMMON_TAIL,
  .getDeviceMr = NULL, .irecvConsumed = NULL,
};

BN_EXPORT const bn_net_v8_t ncclNetPlugin_v8 = {
  .name = kName, .init = init_v6, .devices = bn_devices, .getProperties = props_v8,
  .listen = bn_listen, .connect = connect_v7, .accept = accept_v7, .regMr = bn_reg_mr,
  .isend = isend_int, .irecv = irecv_int, COMMON_TAIL,
  .getDeviceMr = NULL, .irecvConsumed = NULL,
};

BN_EXPORT const bn_net_v9_t ncclNetPlugin_v9 = {
  .name = kName, .init = init_v6, .devices = bn_devices, .getProperties = props_v9,
  .listen = bn_listen, .connect = connect_v7, .accept = accept_v7, .regMr = bn_reg_mr,
  .isend = isend_v9, .irecv = irecv_v9, COMMON_TAIL,
  .getDeviceMr = NULL, .irecvConsumed = NULL, .makeVDevice = NULL,
};

BN_EXPORT const bn_net_v10_t ncclNetPlugin_v10 = {
  .name = kName, .init = init_v10, .devices = bn_devices, .getProperties = props_v9,
  .listen = bn_listen, .connect = connect_v10, .accept = accept_v7, .regMr = bn_reg_mr,
  .isend = isend_v10, .irecv = irecv_v10, COMMON_TAIL,
  .getDeviceMr = NULL, .irecvConsumed = NULL, .makeVDevice = NULL,
};

BN_EXPORT const bn_net_v11_t ncclNetPlugin_v11 = {
  .name = kName, .init = init_v11, .devices = bn_devices, .getProperties = props_v11,
  .listen = listen_v11, .connect = connect_v11, .accept = accept_v7, .regMr = bn_reg_mr,
  .isend = isend_v10, .irecv = irecv_v10, COMMON_TAIL,
  .getDeviceMr = NULL, .irecvConsumed = NULL, .makeVDevice = NULL,
  .finalize = finalize_v11, .setNetAttr = NULL,
};

BN_EXPORT const bn_net_v12_t ncclNetPlugin_v12 = {
  .name = kName, .init = init_v11, .devices = bn_devices, .getProperties = props_v12,
  .listen = listen_v11, .connect = connect_v11, .accept = accept_v7, .regMr = bn_reg_mr,
  .isend = isend_v10, .irecv = irecv_v10, COMMON_TAIL,
  .getDeviceMr = NULL, .irecvConsumed = NULL, .makeVDevice = NULL,
  .finalize = finalize_v11, .setNetAttr = NULL,
};

/* ---- helpers for bagua_net's Python side (not part of NCCL's interface) ---- */

/* The interfaces the plugin would use under the current environment, one "name address speed"
 * line each, written to buf (NUL-terminated). Returns how many. */
BN_EXPORT int baguaNetListInterfaces(char *buf, size_t len) {
  bn_dev_t devs[BN_MAX_DEVS];
  int n = bn_find_devices(devs, BN_MAX_DEVS);
  size_t used = 0;
  if (len > 0) buf[0] = '\0';
  for (int i = 0; i < n; i++) {
    char addr[80];
    bn_format_addr(&devs[i].addr.sa, addr, sizeof(addr));
    char *colon = strrchr(addr, ':'); /* the port of an interface address is meaningless */
    if (colon != NULL) *colon = '\0';
    if (used < len) {
      int w = snprintf(buf + used, len - used, "%s %s %d\n", devs[i].name, addr,
                       devs[i].speed_mbps);
      if (w > 0) used += (size_t)w;
    }
    free(devs[i].pci_path);
  }
  return n;
}

/* The plugin's name, for a quick identity check without reading a table. */
BN_EXPORT const char *baguaNetName(void) { return kName; }
