/* bagua-net's one implementation; plugin.c adapts it to each NCCL net-plugin version. */
#ifndef BAGUA_NET_H_
#define BAGUA_NET_H_

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "net_abi.h"

#define BN_EXPORT __attribute__((visibility("default")))
#define BN_MAX_DEVS 16
#define BN_MAX_STREAMS 64
#define BN_DEFAULT_NSTREAMS 8
#define BN_DEFAULT_MIN_CHUNK ((size_t)1 << 20)
#define BN_MIN_CHUNK_FLOOR 4096 /* smallest BAGUA_NET_MIN_CHUNKSIZE; receivers rely on it */
#define BN_DEFAULT_GREETING_MS 10000 /* a connection must greet within this (accept side) */

/* One network device: an interface selected by NCCL_SOCKET_IFNAME. */
typedef struct {
  char name[64];
  char *pci_path; /* realpath of /sys/class/net/<name>/device, or NULL for virtual links */
  union {
    struct sockaddr sa;
    struct sockaddr_in in4;
    struct sockaddr_in6 in6;
  } addr;
  int speed_mbps;
} bn_dev_t;

/* The plugin's own view of a device's properties; plugin.c copies it into each version's. */
typedef struct {
  char *name;
  char *pci_path;
  uint64_t guid;
  int speed;
  int max_comms;
} bn_props_t;

/* logging (log.c) */
void bn_set_logger(bn_logger_t log);
void bn_log(int level, unsigned long flags, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
#define BN_WARN(...) bn_log(BN_LOG_WARN, BN_SUBSYS_NET, __FILE__, __LINE__, __VA_ARGS__)
#define BN_INFO(...) bn_log(BN_LOG_INFO, BN_SUBSYS_NET, __FILE__, __LINE__, __VA_ARGS__)

/* interfaces (ifaces.c): select devices following NCCL_SOCKET_IFNAME's syntax */
int bn_find_devices(bn_dev_t *devs, int max_devs);
int bn_format_addr(const struct sockaddr *sa, char *buf, size_t len);

/* the transport (transport.c) */
bn_result_t bn_init(bn_logger_t log);
bn_result_t bn_devices(int *ndev);
bn_result_t bn_get_properties(int dev, bn_props_t *props);
bn_result_t bn_listen(int dev, void *handle, void **listen_comm);
bn_result_t bn_connect(int dev, void *handle, void **send_comm);
bn_result_t bn_accept(void *listen_comm, void **recv_comm);
bn_result_t bn_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle);
bn_result_t bn_dereg_mr(void *comm, void *mhandle);
bn_result_t bn_isend(void *send_comm, void *data, size_t size, int tag, void **request);
bn_result_t bn_irecv(void *recv_comm, int n, void **data, const size_t *sizes, void **request);
bn_result_t bn_iflush(void *recv_comm, void **request);
bn_result_t bn_test(void *request, int *done, size_t *size);
bn_result_t bn_close_send(void *send_comm);
bn_result_t bn_close_recv(void *recv_comm);
bn_result_t bn_close_listen(void *listen_comm);

#endif /* BAGUA_NET_H_ */
