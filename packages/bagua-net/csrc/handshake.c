/* Connection set-up: listen(), and the non-blocking connect() / accept() handshake.
 *
 * listen() puts 16 random bytes (a secret) in the handle, which NCCL hands to the connecting
 * rank through its own bootstrap. connect() opens BAGUA_NET_NSTREAMS sockets without blocking
 * and, once each is connected, sends a 40-byte hello {magic, wire version, connection id,
 * stream index, stream count, the handle's secret}. NCCL calls connect() again with the same
 * handle until it returns a comm, so its progress is kept in the handle (on the connecting
 * side only). accept() takes waiting sockets, reads hellos without blocking, and returns a
 * receive comm once all streams of one connection id have arrived, ordered by stream index.
 *
 * A connection that is not the peer's is dropped with a warning naming its address and the
 * rule it broke: a wrong magic, wire version or secret, a stream claimed twice (the whole
 * connection is refused), a greeting not complete within BAGUA_NET_GREETING_TIMEOUT_MS. At
 * most BN_MAX_UNGREETED connections may be waiting for their greeting; beyond that, or when
 * accept() finds the process out of file descriptors, the oldest of them is shed. Streams that
 * proved the secret are never shed. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "transport.h"

#define BN_CONNECT_RETRIES 50
#define BN_MAX_UNGREETED 128 /* connections waiting for their greeting, per listen comm */
#define BN_ACCEPT_BATCH (2 * BN_MAX_UNGREETED + BN_MAX_STREAMS) /* accept()s per call */
#define BN_RECENT_IDS 16     /* connection ids accepted or refused, remembered per listen comm */
#define BN_HELLO_HEAD 8      /* magic and version: enough to refuse another protocol or version */

struct bn_connecting {
  int nstreams;
  size_t min_chunk;
  uint64_t conn_id;
  uint8_t secret[BN_SECRET_BYTES];
  int fds[BN_MAX_STREAMS];
  int state[BN_MAX_STREAMS]; /* 0 not started, 1 connecting, 2 greeting, 3 ready */
  size_t sent[BN_MAX_STREAMS];
  int retries;
};

typedef struct {
  int fd;
  int proved;        /* a complete, valid hello with the right secret */
  size_t got;
  uint64_t since_ms; /* when accept() took it: the greeting timeout runs from here */
  uint64_t arrival;  /* the order accept() took it in (one call takes many in the same ms) */
  bn_hello_t hello;
  char peer[64];
} bn_pending_t;

typedef struct {
  int fd;
  int dev;
  int npending, cap;
  bn_pending_t *pending; /* in no particular order: removing one moves the last into its place */
  uint64_t arrivals;     /* connections taken so far: the next one's arrival number */
  uint8_t secret[BN_SECRET_BYTES];
  uint64_t recent_ids[BN_RECENT_IDS];
  int nrecent;
  int fd_warned; /* "out of file descriptors, nothing to shed" said once */
} bn_listen_t;

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* len bytes from the kernel's CSPRNG; 0, or -1 when there is none. */
static int fill_random(void *buf, size_t len) {
  size_t got = 0;
  while (got < len) {
    ssize_t n = getrandom((char *)buf + got, len - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      break;
    }
    got += (size_t)n;
  }
  if (got == len) return 0;
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  got = 0;
  while (got < len) {
    ssize_t n = read(fd, (char *)buf + got, len - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += (size_t)n;
  }
  close(fd);
  return got == len ? 0 : -1;
}

/* Constant-time comparison: how long it takes says nothing about where the bytes differ. */
static int secret_equal(const uint8_t *a, const uint8_t *b) {
  uint8_t diff = 0;
  for (int i = 0; i < BN_SECRET_BYTES; i++) diff |= (uint8_t)(a[i] ^ b[i]);
  return diff == 0;
}

/* ---------------------------------------------------------------- listen / accept ----- */
bn_result_t bn_listen(int dev, void *handle, void **listen_comm) {
  *listen_comm = NULL;
  if (bn_check_dev(dev) != BN_OK) return BN_INVALID_ARGUMENT;
  bn_addr_t addr;
  char ifname[64];
  bn_dev_addr(dev, &addr, ifname, sizeof(ifname));
  if (addr.sa.sa_family == AF_INET) addr.in4.sin_port = 0;
  else addr.in6.sin6_port = 0;
  bn_listen_t *l = calloc(1, sizeof(*l));
  if (l == NULL) return BN_SYSTEM_ERROR;
  if (fill_random(l->secret, sizeof(l->secret)) != 0) {
    BN_WARN("NET/BaguaNet: no random bytes for the listen secret (getrandom, /dev/urandom): %s",
            strerror(errno));
    free(l);
    return BN_SYSTEM_ERROR;
  }
  int fd = socket(addr.sa.sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    BN_WARN("NET/BaguaNet: socket() failed: %s", strerror(errno));
    free(l);
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
    free(l);
    return BN_SYSTEM_ERROR;
  }
  l->fd = fd;
  l->dev = dev;
  bn_handle_t *h = handle;
  memset(h, 0, BN_HANDLE_MAXSIZE);
  h->magic = BN_MAGIC;
  h->version = BN_WIRE_VERSION;
  memcpy(&h->addr, &addr, sizeof(addr));
  memcpy(h->secret, l->secret, sizeof(h->secret));
  *listen_comm = l;
  return BN_OK;
}

static void remember_id(bn_listen_t *l, uint64_t id) {
  l->recent_ids[l->nrecent++ % BN_RECENT_IDS] = id;
}

static int recent_id(const bn_listen_t *l, uint64_t id) {
  int n = l->nrecent < BN_RECENT_IDS ? l->nrecent : BN_RECENT_IDS;
  for (int i = 0; i < n; i++) {
    if (l->recent_ids[i] == id) return 1;
  }
  return 0;
}

static void remove_pending(bn_listen_t *l, int i) {
  l->pending[i] = l->pending[--l->npending];
}

static void drop_pending(bn_listen_t *l, int i, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void drop_pending(bn_listen_t *l, int i, const char *fmt, ...) {
  char why[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof(why), fmt, ap);
  va_end(ap);
  BN_WARN("NET/BaguaNet: dropping the connection from %s: %s", l->pending[i].peer, why);
  close(l->pending[i].fd);
  remove_pending(l, i);
}

/* Shed the connection that has waited longest for its greeting (the first taken of those that
 * have not proved the secret); 0 if there is none. */
static int shed_oldest(bn_listen_t *l, const char *why) {
  int oldest = -1, waiting = 0;
  for (int i = 0; i < l->npending; i++) {
    if (l->pending[i].proved) continue;
    waiting++;
    if (oldest < 0 || l->pending[i].arrival < l->pending[oldest].arrival) oldest = i;
  }
  if (oldest < 0) return 0;
  drop_pending(l, oldest, "%s; it is the oldest of %d that have not greeted", why, waiting);
  return 1;
}

static int count_ungreeted(const bn_listen_t *l) {
  int n = 0;
  for (int i = 0; i < l->npending; i++) n += !l->pending[i].proved;
  return n;
}

/* Refuse every stream of connection `id` (one of them broke a rule that binds them all). */
static void refuse_connection(bn_listen_t *l, uint64_t id, const char *why) {
  for (int j = l->npending - 1; j >= 0; j--) {
    if (l->pending[j].proved && l->pending[j].hello.conn_id == id)
      drop_pending(l, j, "connection %016" PRIx64 " refused: %s", id, why);
  }
  remember_id(l, id);
}

/* Pending i proved the secret: it joins its connection unless that breaks the connection. */
static void admit(bn_listen_t *l, int i) {
  bn_hello_t *h = &l->pending[i].hello;
  if (recent_id(l, h->conn_id)) {
    drop_pending(l, i, "connection %016" PRIx64 " was already accepted or refused",
                 h->conn_id);
    return;
  }
  for (int j = 0; j < l->npending; j++) {
    bn_pending_t *q = &l->pending[j];
    if (j == i || !q->proved || q->hello.conn_id != h->conn_id) continue;
    if (q->hello.stream == h->stream || q->hello.nstreams != h->nstreams) {
      char why[160];
      snprintf(why, sizeof(why), "stream %u of %u claimed twice (also by %.64s as %u of %u)",
               h->stream, h->nstreams, q->peer, q->hello.stream, q->hello.nstreams);
      l->pending[i].proved = 1;
      refuse_connection(l, h->conn_id, why);
      return;
    }
  }
  l->pending[i].proved = 1;
}

/* Read what has arrived of pending i's hello and judge it as soon as it can be judged. */
static void read_greeting(bn_listen_t *l, int i, uint64_t now, uint64_t timeout_ms) {
  bn_pending_t *p = &l->pending[i];
  ssize_t n = recv(p->fd, (char *)&p->hello + p->got, sizeof(p->hello) - p->got, MSG_DONTWAIT);
  if (n > 0) p->got += (size_t)n;
  if (n == 0) {
    drop_pending(l, i, "closed after %zu of the hello's %zu bytes", p->got, sizeof(p->hello));
  } else if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
    drop_pending(l, i, "%s before its hello", strerror(errno));
  } else if (p->got >= BN_HELLO_HEAD && p->hello.magic != BN_MAGIC) {
    drop_pending(l, i, "it did not greet as bagua-net (magic %08x)", p->hello.magic);
  } else if (p->got >= BN_HELLO_HEAD && p->hello.version != BN_WIRE_VERSION) {
    drop_pending(l, i, "it speaks bagua-net wire version %u, expected %u (upgrade both sides)",
                 p->hello.version, BN_WIRE_VERSION);
  } else if (p->got == sizeof(p->hello)) {
    const bn_hello_t *h = &p->hello;
    if (h->nstreams < 1 || h->nstreams > BN_MAX_STREAMS || h->stream >= h->nstreams)
      drop_pending(l, i, "its hello announces stream %u of %u (at most %d streams)", h->stream,
                   h->nstreams, BN_MAX_STREAMS);
    else if (!secret_equal(h->secret, l->secret))
      drop_pending(l, i, "its hello does not carry this listen handle's secret");
    else
      admit(l, i);
  } else if (now - p->since_ms > timeout_ms) {
    drop_pending(l, i, "no complete hello within %" PRIu64 " ms (%zu of %zu bytes)", timeout_ms,
                 p->got, sizeof(p->hello));
  }
}

static int add_pending(bn_listen_t *l, int fd, const bn_addr_t *addr, uint64_t now) {
  if (l->npending == l->cap) {
    int cap = l->cap ? 2 * l->cap : 16;
    bn_pending_t *p = realloc(l->pending, (size_t)cap * sizeof(*p));
    if (p == NULL) return -1;
    l->pending = p;
    l->cap = cap;
  }
  bn_pending_t *p = &l->pending[l->npending++];
  memset(p, 0, sizeof(*p));
  p->fd = fd;
  p->since_ms = now;
  p->arrival = l->arrivals++;
  if (bn_format_addr(&addr->sa, p->peer, sizeof(p->peer)) <= 0)
    snprintf(p->peer, sizeof(p->peer), "?");
  return 0;
}

/* Take connections waiting in the backlog; BN_OK, or BN_SYSTEM_ERROR on a fatal failure. */
static bn_result_t take_backlog(bn_listen_t *l, uint64_t now, uint64_t timeout_ms) {
  for (int k = 0; k < BN_ACCEPT_BATCH; k++) {
    bn_addr_t addr;
    socklen_t alen = sizeof(addr);
    memset(&addr, 0, sizeof(addr));
    int fd = accept4(l->fd, &addr.sa, &alen, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      int err = errno;
      if (err == EINTR || err == ECONNABORTED) continue;
      if (err == EMFILE || err == ENFILE) {
        /* Transient: make room by shedding a stranger; the peer's streams stay queued. */
        if (shed_oldest(l, "the process is out of file descriptors")) continue;
        if (!l->fd_warned) {
          l->fd_warned = 1;
          BN_WARN("NET/BaguaNet: accept() is out of file descriptors (%s) and no connection "
                  "is waiting that could be shed; trying again on the next call",
                  strerror(err));
        }
        return BN_OK;
      }
      /* Nothing waiting, or a network error on a connection being set up (accept(2) says to
       * treat those like EAGAIN). */
      if (err == EAGAIN || err == EWOULDBLOCK || err == ENETDOWN || err == EPROTO ||
          err == ENOPROTOOPT || err == EHOSTDOWN || err == ENONET || err == EHOSTUNREACH ||
          err == EOPNOTSUPP || err == ENETUNREACH || err == ENOBUFS || err == ENOMEM)
        return BN_OK;
      BN_WARN("NET/BaguaNet: accept() failed: %s", strerror(err));
      return BN_SYSTEM_ERROR;
    }
    l->fd_warned = 0;
    if (count_ungreeted(l) >= BN_MAX_UNGREETED)
      shed_oldest(l, "too many connections are waiting for their greeting");
    if (add_pending(l, fd, &addr, now) != 0) {
      close(fd);
      return BN_SYSTEM_ERROR;
    }
    read_greeting(l, l->npending - 1, now, timeout_ms); /* the peer's hello is often here */
  }
  return BN_OK;
}

bn_result_t bn_accept(void *listen_comm, void **recv_comm) {
  bn_listen_t *l = listen_comm;
  *recv_comm = NULL;
  uint64_t now = now_ms(), timeout_ms = bn_greeting_timeout_ms();
  for (int i = l->npending - 1; i >= 0; i--) { /* greetings that were not complete yet */
    if (i < l->npending && !l->pending[i].proved) read_greeting(l, i, now, timeout_ms);
  }
  if (take_backlog(l, now, timeout_ms) != BN_OK) return BN_SYSTEM_ERROR;
  for (int i = 0; i < l->npending; i++) { /* a connection whose streams are all here */
    bn_pending_t *p = &l->pending[i];
    if (!p->proved) continue;
    uint64_t id = p->hello.conn_id;
    int n = (int)p->hello.nstreams;
    int fds[BN_MAX_STREAMS], found = 0;
    for (int s = 0; s < n; s++) fds[s] = -1;
    for (int j = 0; j < l->npending; j++) { /* admit() keeps one stream per index */
      bn_pending_t *q = &l->pending[j];
      if (q->proved && q->hello.conn_id == id) {
        fds[q->hello.stream] = q->fd;
        found++;
      }
    }
    if (found != n) continue;
    for (int j = l->npending - 1; j >= 0; j--) { /* the comm owns these sockets now */
      if (l->pending[j].proved && l->pending[j].hello.conn_id == id) remove_pending(l, j);
    }
    remember_id(l, id);
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
                        (uint32_t)st->nstreams, {0}};
    memcpy(hello.secret, st->secret, sizeof(hello.secret));
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
  if (h->version != BN_WIRE_VERSION) { /* wire version 1 left this field zero */
    BN_WARN("NET/BaguaNet: connect() got a handle of bagua-net wire version %u, expected %u "
            "(the listening rank runs another bagua-net: upgrade both sides)",
            h->version ? h->version : 1u, BN_WIRE_VERSION);
    return BN_INVALID_ARGUMENT;
  }
  bn_connecting_t *st = h->connecting;
  if (st == NULL) {
    st = calloc(1, sizeof(*st));
    if (st == NULL) return BN_SYSTEM_ERROR;
    bn_config(&st->nstreams, &st->min_chunk);
    st->conn_id = new_conn_id();
    memcpy(st->secret, h->secret, sizeof(st->secret));
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

