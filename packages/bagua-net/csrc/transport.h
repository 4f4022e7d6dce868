/* Internals shared by transport.c (comms, data path) and handshake.c (connection set-up). */
#ifndef BAGUA_NET_TRANSPORT_H_
#define BAGUA_NET_TRANSPORT_H_

#include "bagua_net.h"

#define BN_MAGIC 0x42474e54u /* "BGNT" */
/* Wire version 2: the hello carries the listen handle's secret, and a chunk header names its
 * index among the message's chunks (the receiver accepts each range once). Version 1 (no
 * secret, byte-count accounting) is refused with a warning. */
#define BN_WIRE_VERSION 2u
#define BN_SECRET_BYTES 16

typedef struct {
  uint32_t magic, version;
  uint64_t conn_id;
  uint32_t stream, nstreams;
  uint8_t secret[BN_SECRET_BYTES]; /* the listen handle's, echoed by every stream */
} bn_hello_t;

/* Chunk i of n of a message of `total` bytes starts at i * (total / n) + min(i, total % n)
 * and is total / n bytes long, plus one for i < total % n. The receiver checks offset against
 * that rule and takes each index once. */
typedef struct {
  uint32_t magic, seq;
  uint64_t total, offset;
  uint32_t index, nchunks;
} bn_chunk_hdr_t;

typedef union {
  struct sockaddr sa;
  struct sockaddr_in in4;
  struct sockaddr_in6 in6;
} bn_addr_t;

typedef struct bn_connecting bn_connecting_t;

/* magic and addr stay where wire version 1 had them (version 1 left `version` zero), so that
 * either side of a mixed pair can tell what it is talking to. */
typedef struct {
  uint32_t magic;
  uint32_t version;
  bn_addr_t addr;
  bn_connecting_t *connecting; /* connect()'s progress, on the connecting side only */
  uint8_t secret[BN_SECRET_BYTES]; /* random per listen(); NCCL's bootstrap carries it */
} bn_handle_t;
_Static_assert(sizeof(bn_handle_t) <= BN_HANDLE_MAXSIZE, "handle too large");
_Static_assert(sizeof(bn_handle_t) == 64, "handle layout: secret at offset 48");
_Static_assert(sizeof(bn_chunk_hdr_t) == 32, "chunk header is 32 bytes on the wire");
_Static_assert(sizeof(bn_hello_t) == 40, "hello is 40 bytes on the wire");

typedef struct bn_comm bn_comm_t;

/* Build a comm over connected sockets (ownership passes to it) and start its stream threads. */
bn_comm_t *bn_comm_create(int is_send, int nstreams, const int *fds, size_t min_chunk);
const char *bn_comm_peer(const bn_comm_t *c);
int bn_comm_nstreams(const bn_comm_t *c);

/* Configuration read by init(), and the devices it found. */
void bn_config(int *nstreams, size_t *min_chunk);
uint64_t bn_greeting_timeout_ms(void);
bn_result_t bn_check_dev(int dev);
void bn_dev_addr(int dev, bn_addr_t *addr, char *name, size_t name_len);
socklen_t bn_addr_len(const bn_addr_t *a);

#endif /* BAGUA_NET_TRANSPORT_H_ */
