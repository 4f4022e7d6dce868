/* Connection set-up: listen(), and the non-blocking connect() / accept() handshake.
 *
 * connect() opens BAGUA_NET_NSTREAMS sockets without blocking and, once each is connected,
 * sends a 24-byte hello {magic, wire version, connection id, stream index, stream count}.
 * NCCL calls connect() again with the same handle until it returns a comm, so its progress is
 * kept in the handle (on the connecting side only). accept() takes every waiting socket,
 * reads hellos without blocking, and returns a receive comm once all streams of one
 * connection id have arrived, ordered by stream index. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "transport.h"

#define BN_CONNECT_RETRIES 50

struct bn_connecting {
  int nstreams;
  size_t min_chunk;
  uint64_t conn_id;
  int fds[BN_MAX_STREAMS];
  int state[BN_MAX_STREAMS]; /* 0 not started, 1 connecting, 2 greeting, 3 ready */
  size_t sent[BN_MAX_STREAMS];
  int retries;
};

typedef struct {
  int fd;
  size_t got;
  bn_hello_t hello;
} bn_pending_t;

typedef struct {
  int fd;
  int dev;
  int npending, cap;
  bn_pending_t *pending;
} bn_listen_t;

/* ---------------------------------------------------------------- listen / accept ----- */
bn_result_t bn_listen(int dev, void *handle, void **listen_comm) {
  *listen_comm = NULL;
  if (bn_check_dev(dev) != BN_OK) return BN_INVALID_ARGUMENT;
  bn_addr_t addr;
  char ifname[64];
  bn_dev_addr(dev, &addr, ifname, sizeof(ifname));
  if (addr.sa.sa_family == AF_INET) addr.in4.sin_port = 0;
  else addr.in6.sin6_port = 0;
  int fd = socket(addr.sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    BN_WARN("NET/BaguaNet: socket() failed: %s", strerror(errno));
    return BN_SYSTEM_ERROR;
  }
  socklen_t len = bn_addr_len(&addr);
  if (bind(fd, &addr.sa, len) != 0 || listen(fd, SOMAXCONN) != 0 ||
      getsockname(fd, &addr.sa, &len) != 0) {
    char where[80];
    bn_format_addr(&addr.sa, where, sizeof(where));
    BN_WARN("NET/BaguaNet: cannot listen on %s (%s): %s", ifname, where,
            strerror(errno));
    close(fd);
    return BN_SYSTEM_ERROR;
  }
  bn_listen_t *l = calloc(1, sizeof(*l));
  if (l == NULL) {
    close(fd);
    return BN_SYSTEM_ERROR;
  }
  l->fd = fd;
  l->dev = dev;
  bn_handle_t *h = handle;
  memset(h, 0, BN_HANDLE_MAXSIZE);
  h->magic = BN_MAGIC;
  memcpy(&h->addr, &addr, sizeof(addr));
  *listen_comm = l;
  return BN_OK;
}

static void drop_pending(bn_listen_t *l, int i) {
  close(l->pending[i].fd);
  l->pending[i] = l->pending[--l->npending];
}

static int hello_valid(const bn_hello_t *h) {
  return h->magic == BN_MAGIC && h->version == BN_WIRE_VERSION && h->nstreams >= 1 &&
         h->nstreams <= BN_MAX_STREAMS && h->stream < h->nstreams;
}

bn_result_t bn_accept(void *listen_comm, void **recv_comm) {
  bn_listen_t *l = listen_comm;
  *recv_comm = NULL;
  for (;;) { /* take every connection waiting in the backlog */
    int fd = accept4(l->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) break;
      BN_WARN("NET/BaguaNet: accept() failed: %s", strerror(errno));
      return BN_SYSTEM_ERROR;
    }
    if (l->npending == l->cap) {
      int cap = l->cap ? 2 * l->cap : 16;
      bn_pending_t *p = realloc(l->pending, (size_t)cap * sizeof(*p));
      if (p == NULL) {
        close(fd);
        return BN_SYSTEM_ERROR;
      }
      l->pending = p;
      l->cap = cap;
    }
    l->pending[l->npending++] = (bn_pending_t){.fd = fd, .got = 0};
  }
  for (int i = l->npending - 1; i >= 0; i--) { /* read greetings that are not complete yet */
    bn_pending_t *p = &l->pending[i];
    if (p->got == sizeof(p->hello)) continue;
    ssize_t n = recv(p->fd, (char *)&p->hello + p->got, sizeof(p->hello) - p->got, MSG_DONTWAIT);
    if (n > 0) p->got += (size_t)n;
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      drop_pending(l, i);
    } else if (p->got == sizeof(p->hello) && !hello_valid(&p->hello)) {
      BN_WARN("NET/BaguaNet: dropping a connection that did not greet as bagua-net");
      drop_pending(l, i);
    }
  }
  for (int i = 0; i < l->npending; i++) { /* a connection whose streams are all here */
    bn_pending_t *p = &l->pending[i];
    if (p->got != sizeof(p->hello)) continue;
    uint64_t id = p->hello.conn_id;
    int n = (int)p->hello.nstreams;
    int fds[BN_MAX_STREAMS], found = 0;
    for (int s = 0; s < n; s++) fds[s] = -1;
    for (int j = 0; j < l->npending; j++) {
      bn_pending_t *q = &l->pending[j];
      if (q->got == sizeof(q->hello) && q->hello.conn_id == id && (int)q->hello.nstreams == n &&
          fds[q->hello.stream] < 0) {
        fds[q->hello.stream] = q->fd;
        found++;
      }
    }
    if (found != n) continue;
    for (int j = l->npending - 1; j >= 0; j--) { /* the comm owns these sockets now */
      for (int s = 0; s < n; s++) {
        if (j < l->npending && l->pending[j].fd == fds[s]) {
          l->pending[j] = l->pending[--l->npending];
          break;
        }
      }
    }
    bn_comm_t *c = bn_comm_create(0, n, fds, 0);
    if (c == NULL) return BN_SYSTEM_ERROR;
    BN_INFO("NET/BaguaNet: accepted a connection from %s with %d streams", bn_comm_peer(c), n);
    *recv_comm = c;
    return BN_OK;
  }
  return BN_OK;
}

bn_result_t bn_close_listen(void *listen_comm) {
  bn_listen_t *l = listen_comm;
  if (l == NULL) return BN_OK;
  for (int i = 0; i < l->npending; i++) close(l->pending[i].fd);
  free(l->pending);
  close(l->fd);
  free(l);
  return BN_OK;
}

/* ---------------------------------------------------------------- connect ------------- */
static void connecting_free(bn_connecting_t *st) {
  for (int i = 0; i < st->nstreams; i++) {
    if (st->fds[i] >= 0) close(st->fds[i]);
  }
  free(st);
}

static uint64_t new_conn_id(void) {
  uint64_t id = 0;
  if (getrandom(&id, sizeof(id), GRND_NONBLOCK) != (ssize_t)sizeof(id)) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    id = ((uint64_t)getpid() << 40) ^ (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^
         (uint64_t)(uintptr_t)&id;
  }
  return id;
}

/* Advance stream i of a connection being set up; 0 on progress (or none yet), else errno. */
static int connect_step(bn_connecting_t *st, const bn_addr_t *addr, int i) {
  if (st->state[i] == 0) {
    int fd = socket(addr->sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) return errno;
    st->fds[i] = fd;
    if (connect(fd, &addr->sa, bn_addr_len(addr)) == 0) st->state[i] = 2;
    else if (errno == EINPROGRESS || errno == EINTR) st->state[i] = 1;
    else return errno;
  }
  if (st->state[i] == 1) {
    struct pollfd pfd = {st->fds[i], POLLOUT, 0};
    if (poll(&pfd, 1, 0) <= 0) return 0;
    int err = 0;
    socklen_t len = sizeof(err);
    if (getsockopt(st->fds[i], SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno;
    if (err == ECONNREFUSED && st->retries < BN_CONNECT_RETRIES) {
      st->retries++; /* a listener that is not accepting yet: try again on the next call */
      close(st->fds[i]);
      st->fds[i] = -1;
      st->state[i] = 0;
      return 0;
    }
    if (err != 0) return err;
    st->state[i] = 2;
  }
  if (st->state[i] == 2) {
    bn_hello_t hello = {BN_MAGIC, BN_WIRE_VERSION, st->conn_id, (uint32_t)i,
                        (uint32_t)st->nstreams};
    ssize_t n = send(st->fds[i], (char *)&hello + st->sent[i], sizeof(hello) - st->sent[i],
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : errno;
    st->sent[i] += (size_t)n;
    if (st->sent[i] == sizeof(hello)) st->state[i] = 3;
  }
  return 0;
}

bn_result_t bn_connect(int dev, void *handle, void **send_comm) {
  *send_comm = NULL;
  if (bn_check_dev(dev) != BN_OK) return BN_INVALID_ARGUMENT;
  bn_handle_t *h = handle;
  if (h->magic != BN_MAGIC) {
    BN_WARN("NET/BaguaNet: connect() got a handle that listen() did not make");
    return BN_INVALID_ARGUMENT;
  }
  bn_connecting_t *st = h->connecting;
  if (st == NULL) {
    st = calloc(1, sizeof(*st));
    if (st == NULL) return BN_SYSTEM_ERROR;
    bn_config(&st->nstreams, &st->min_chunk);
    st->conn_id = new_conn_id();
    for (int i = 0; i < BN_MAX_STREAMS; i++) st->fds[i] = -1;
    h->connecting = st;
  }
  int ready = 0;
  for (int i = 0; i < st->nstreams; i++) {
    int err = connect_step(st, &h->addr, i);
    if (err != 0) {
      char where[80];
      bn_format_addr(&h->addr.sa, where, sizeof(where));
      BN_WARN("NET/BaguaNet: connect to %s failed on stream %d: %s", where, i, strerror(err));
      h->connecting = NULL;
      connecting_free(st);
      return BN_SYSTEM_ERROR;
    }
    ready += st->state[i] == 3;
  }
  if (ready < st->nstreams) return BN_OK; /* NCCL calls again */
  bn_comm_t *c = bn_comm_create(1, st->nstreams, st->fds, st->min_chunk);
  for (int i = 0; i < st->nstreams; i++) st->fds[i] = -1; /* owned by the comm (or closed) */
  h->connecting = NULL;
  free(st);
  if (c == NULL) return BN_SYSTEM_ERROR;
  BN_INFO("NET/BaguaNet: connected to %s with %d streams", bn_comm_peer(c), bn_comm_nstreams(c));
  *send_comm = c;
  return BN_OK;
}

