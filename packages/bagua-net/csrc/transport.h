/* Internals shared by transport.c (comms, data path) and handshake.c (connection set-up). */
#ifndef BAGUA_NET_TRANSPORT_H_
#define BAGUA_NET_TRANSPORT_H_

#include "bagua_net.h"

#define BN_MAGIC 0x42474e54u /* "BGNT" */
#define BN_WIRE_VERSION 1u

typedef struct {
  uint32_t magic, version;
  uint64_t conn_id;
  uint32_t stream, nstreams;
} bn_hello_t;

typedef struct {
  uint32_t magic, seq;
  uint64_t total, offset, len;
} bn_chunk_hdr_t;

typedef union {
  struct sockaddr sa;
  struct sockaddr_in in4;
  struct sockaddr_in6 in6;
} bn_addr_t;

typedef struct bn_connecting bn_connecting_t;

typedef struct {
  uint32_t magic;
  uint32_t reserved;
  bn_addr_t addr;
  bn_connecting_t *connecting; /* connect()'s progress, on the connecting side only */
} bn_handle_t;
_Static_assert(sizeof(bn_handle_t) <= BN_HANDLE_MAXSIZE, "handle too large");
_Static_assert(sizeof(bn_chunk_hdr_t) == 32, "chunk header is 32 bytes on the wire");
_Static_assert(sizeof(bn_hello_t) == 24, "hello is 24 bytes on the wire");

typedef struct bn_comm bn_comm_t;

/* Build a comm over connected sockets (ownership passes to it) and start its stream threads. */
bn_comm_t *bn_comm_create(int is_send, int nstreams, const int *fds, size_t min_chunk);
const char *bn_comm_peer(const bn_comm_t *c);
int bn_comm_nstreams(const bn_comm_t *c);

/* Configuration read by init(), and the devices it found. */
void bn_config(int *nstreams, size_t *min_chunk);
bn_result_t bn_check_dev(int dev);
void bn_dev_addr(int dev, bn_addr_t *addr, char *name, size_t name_len);
socklen_t bn_addr_len(const bn_addr_t *a);

#endif /* BAGUA_NET_TRANSPORT_H_ */
