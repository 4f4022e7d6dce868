/* The multi-stream TCP transport behind every exported plugin version: comms and the data
 * path (configuration is in config.c, connection set-up in handshake.c).
 *
 * A connection is BAGUA_NET_NSTREAMS TCP streams. A message (one isend) is cut into
 * floor(size / BAGUA_NET_MIN_CHUNKSIZE) chunks of equal size (give or take a byte), so none is
 * smaller than the minimum (one chunk when the message is smaller). Each stream has a thread
 * that takes the next chunk from the comm's queue (so faster streams carry more) and writes a
 * 32-byte header {magic, sequence number, message size, offset, chunk index, chunk count}
 * followed by the bytes. A sender's close ends each stream with a header whose offset is
 * BN_END_OF_STREAM.
 *
 * On the receiving side each stream has a thread that reads a header, checks that its offset
 * is the one its index implies, waits for the matching irecv (k-th isend matches k-th irecv),
 * claims the chunk's index under the comm's lock (an index claimed twice, or a chunk for a
 * message already complete, fails the comm before a byte of its payload is read), and reads
 * the bytes straight into the posted buffer at that offset; a message is done when the
 * payload of each of its chunks has been read. Threads sleep on a
 * condition variable or in a blocking socket call when there is nothing to do. test() reads
 * one flag. A request takes any of the 32 slots; threads find it by sequence number.
 *
 * A failure on any stream (peer gone, reset, bad header) marks the whole comm failed: pending
 * and later requests report it through test()'s return code, and the logger names the cause.
 * A receiving comm reports it only once no stream thread is still copying a payload, so no byte
 * lands in a buffer after its request was reported failed.
 * The wire format is in host byte order (peers are the same architecture in practice). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "transport.h"

#define BN_END_OF_STREAM UINT64_MAX /* offset of the header that closes a stream */

typedef struct {
  bn_comm_t *comm;
  int used;
  int done;            /* read by test() without the lock (atomic) */
  uint32_t seq;
  char *data;
  size_t size;         /* send: message size; recv: capacity of the posted buffer */
  size_t total;        /* recv: message size read from the wire, SIZE_MAX until known */
  uint64_t nchunks, chunks_done; /* chunks of the message, and those sent / read in full */
  uint64_t next_chunk; /* send: next chunk to hand to a stream */
  uint64_t *seen;      /* recv: one bit per chunk index claimed; kept when the slot is reused */
  size_t seen_words;
} bn_req_t;

struct bn_comm {
  int is_send;
  int nstreams;
  int fds[BN_MAX_STREAMS];
  pthread_t threads[BN_MAX_STREAMS];
  int nthreads;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bn_req_t reqs[BN_MAX_REQUESTS];
  uint32_t next_seq; /* sequence number of the next isend / irecv */
  uint32_t head;     /* send: oldest message whose chunks are not all handed out */
  size_t min_chunk;
  int closing;
  int ended;         /* recv: streams the sender closed in order */
  int readers;       /* recv: threads reading a payload into a posted buffer, outside the lock */
  int error;         /* bn_result_t, set once (atomic) */
  int error_logged;
  char errmsg[256];
  char peer[64];
};

typedef struct {
  bn_comm_t *comm;
  int stream;
} bn_worker_arg_t;

/* ---------------------------------------------------------------- global state -------- */
static int g_mr_token; /* regMr hands out its address: host memory needs no registration */

const char *bn_comm_peer(const bn_comm_t *c) { return c->peer; }
int bn_comm_nstreams(const bn_comm_t *c) { return c->nstreams; }

/* ---------------------------------------------------------------- socket helpers ------ */
static void tune_socket(int fd) {
  int one = 1, idle = 60, intvl = 10, cnt = 6;
  unsigned int user_timeout_ms = 120000; /* unacknowledged data for 2 min: the peer is gone */
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

static int set_blocking(int fd) {
  int flags = fcntl(fd, F_GETFL);
  return flags < 0 ? -1 : fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
}

socklen_t bn_addr_len(const bn_addr_t *a) {
  return a->sa.sa_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
}

/* Write a header and a payload completely; 0 or an errno. */
static int write_all(int fd, const void *hdr, size_t hdr_len, const char *data, size_t len) {
  struct iovec iov[2] = {{(void *)hdr, hdr_len}, {(void *)data, len}};
  struct iovec *v = iov;
  int nv = len > 0 ? 2 : 1;
  while (nv > 0) {
    struct msghdr msg = {0};
    msg.msg_iov = v;
    msg.msg_iovlen = (size_t)nv;
    ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    while (nv > 0 && (size_t)n >= v->iov_len) {
      n -= (ssize_t)v->iov_len;
      v++;
      nv--;
    }
    if (nv > 0) {
      v->iov_base = (char *)v->iov_base + n;
      v->iov_len -= (size_t)n;
    }
  }
  return 0;
}

/* Read exactly len bytes; 0, -1 on end of stream, or an errno. */
static int read_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len > 0) {
    ssize_t n = recv(fd, p, len, 0);
    if (n == 0) return -1;
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Read a chunk's payload into a posted buffer, stopping between reads once the comm has failed
 * (its failure is reported only after every such reader has returned). 0, -1 on end of stream,
 * ECANCELED when the comm failed, or an errno. */
static int read_payload(bn_comm_t *c, int fd, char *dst, size_t len) {
  while (len > 0) {
    if (__atomic_load_n(&c->error, __ATOMIC_ACQUIRE) != 0) return ECANCELED;
    ssize_t n = recv(fd, dst, len, 0);
    if (n == 0) return -1;
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    dst += n;
    len -= (size_t)n;
  }
  return 0;
}

static const char *io_error(int rc) {
  return rc == -1 ? "connection closed by peer" : strerror(rc);
}

/* Where chunk i of n of a message of `total` bytes lies (the rule of transport.h). */
static inline void chunk_range(uint64_t total, uint64_t n, uint64_t i, uint64_t *off,
                               uint64_t *len) {
  uint64_t base = total / n, extra = total % n;
  *off = i * base + (i < extra ? i : extra);
  *len = base + (i < extra ? 1 : 0);
}

/* ---------------------------------------------------------------- comms --------------- */
/* Mark the comm failed (first cause wins) and wake every thread. A receiving comm also shuts
 * its sockets down, so that the sender learns of it and blocked readers wake; a reader copying
 * a payload stops at its next read, and the failure is reported (report_error) only once none
 * is left, so nothing lands in a buffer after test() said the request failed. Caller holds
 * comm->mu. */
static void comm_fail(bn_comm_t *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void comm_fail(bn_comm_t *c, int code, const char *fmt, ...) {
  if (c->error == 0 && !c->closing) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->errmsg, sizeof(c->errmsg), fmt, ap);
    va_end(ap);
    __atomic_store_n(&c->error, code, __ATOMIC_RELEASE);
    if (!c->is_send) {
      for (int i = 0; i < c->nstreams; i++) shutdown(c->fds[i], SHUT_RDWR);
    }
  }
  pthread_cond_broadcast(&c->cv);
}

/* The outstanding request for message ``seq``, or NULL if it is not posted (yet). Requests
 * take any free slot, so a slow message never keeps a newer one from being posted. Caller
 * holds c->mu. */
static bn_req_t *find_req(bn_comm_t *c, uint32_t seq) {
  for (int i = 0; i < BN_MAX_REQUESTS; i++) {
    if (c->reqs[i].used && c->reqs[i].seq == seq) return &c->reqs[i];
  }
  return NULL;
}

static bn_req_t *send_work(bn_comm_t *c) {
  bn_req_t *r = find_req(c, c->head);
  return r != NULL && r->next_chunk < r->nchunks ? r : NULL;
}

static void *send_worker(void *p) {
  bn_worker_arg_t *arg = p;
  bn_comm_t *c = arg->comm;
  int stream = arg->stream, fd = c->fds[stream];
  free(arg);
  pthread_mutex_lock(&c->mu);
  for (;;) {
    bn_req_t *r;
    while (!c->closing && c->error == 0 && (r = send_work(c)) == NULL)
      pthread_cond_wait(&c->cv, &c->mu);
    if (c->closing || c->error != 0) break;
    uint64_t i = r->next_chunk++;
    if (r->next_chunk == r->nchunks) c->head++;
    if (send_work(c) != NULL) pthread_cond_signal(&c->cv); /* more chunks: wake a stream */
    /* Chunk i of n: sizes differ by at most one byte, none below the minimum. */
    uint64_t off, len;
    chunk_range(r->size, r->nchunks, i, &off, &len);
    bn_chunk_hdr_t hdr = {BN_MAGIC, r->seq, r->size, off, (uint32_t)i, (uint32_t)r->nchunks};
    pthread_mutex_unlock(&c->mu);
    int rc = write_all(fd, &hdr, sizeof(hdr), r->data + off, len);
    pthread_mutex_lock(&c->mu);
    if (rc != 0) {
      comm_fail(c, BN_REMOTE_ERROR, "send to %s failed on stream %d: %s", c->peer, stream,
                io_error(rc));
      break;
    }
    if (++r->chunks_done == r->nchunks) __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
  }
  if (c->closing && c->error == 0) {
    /* Orderly close: tell the receiver this stream ends here, so that its end of stream is not
     * taken for a dead peer. Never blocks; if the peer is not reading, it sees a plain EOF. */
    bn_chunk_hdr_t end = {BN_MAGIC, c->next_seq, 0, BN_END_OF_STREAM, 0, 0};
    pthread_mutex_unlock(&c->mu);
    send(fd, &end, sizeof(end), MSG_NOSIGNAL | MSG_DONTWAIT);
    return NULL;
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

/* The rule a chunk header breaks on its own, or NULL; its range in *off, *len. */
static const char *chunk_header_fault(const bn_chunk_hdr_t *h, uint64_t *off, uint64_t *len) {
  if (h->magic != BN_MAGIC) return "bad magic";
  if (h->total > BN_MAX_NET_SIZE) return "message size above the plugin's maximum";
  if (h->nchunks == 0 || h->index >= h->nchunks) return "chunk index out of range";
  if (h->nchunks > 1 && h->nchunks > h->total / BN_MIN_CHUNK_FLOOR)
    return "more chunks than the minimum chunk size allows";
  chunk_range(h->total, h->nchunks, h->index, off, len);
  if (h->offset != *off) return "offset is not the one its chunk index implies";
  return NULL;
}

/* Make r ready for a message of `total` bytes in `nchunks` chunks (its first header); 0, or
 * -1 with the comm failed. Caller holds c->mu. */
static int recv_start(bn_comm_t *c, bn_req_t *r, const bn_chunk_hdr_t *h) {
  if (h->total > r->size) {
    comm_fail(c, BN_INVALID_USAGE,
              "message %u from %s has %llu bytes but the posted receive holds %zu", h->seq,
              c->peer, (unsigned long long)h->total, r->size);
    return -1;
  }
  size_t words = ((size_t)h->nchunks + 63) / 64; /* at most size / 32 KiB words */
  if (words > r->seen_words) {
    uint64_t *seen = realloc(r->seen, words * sizeof(*seen));
    if (seen == NULL) {
      comm_fail(c, BN_SYSTEM_ERROR, "out of memory for message %u from %s", h->seq, c->peer);
      return -1;
    }
    r->seen = seen;
    r->seen_words = words;
  }
  memset(r->seen, 0, words * sizeof(*r->seen));
  r->total = h->total;
  r->nchunks = h->nchunks;
  return 0;
}

static void *recv_worker(void *p) {
  bn_worker_arg_t *arg = p;
  bn_comm_t *c = arg->comm;
  int stream = arg->stream, fd = c->fds[stream];
  free(arg);
  for (;;) {
    bn_chunk_hdr_t hdr;
    int rc = read_all(fd, &hdr, sizeof(hdr));
    pthread_mutex_lock(&c->mu);
    if (rc != 0) {
      comm_fail(c, BN_REMOTE_ERROR, "receive from %s failed on stream %d: %s", c->peer, stream,
                io_error(rc));
      break;
    }
    if (hdr.magic == BN_MAGIC && hdr.offset == BN_END_OF_STREAM) {
      /* The sender closed this stream in order. Once all have closed, messages that are not
       * complete never will be. */
      if (++c->ended == c->nstreams)
        comm_fail(c, BN_REMOTE_ERROR, "%s closed the connection", c->peer);
      break;
    }
    uint64_t off = 0, len = 0;
    const char *fault = chunk_header_fault(&hdr, &off, &len);
    if (fault != NULL) {
      comm_fail(c, BN_REMOTE_ERROR, "corrupt chunk header from %s on stream %d: %s", c->peer,
                stream, fault);
      break;
    }
    bn_req_t *r;
    while (!c->closing && c->error == 0 && (r = find_req(c, hdr.seq)) == NULL) {
      if ((int32_t)(hdr.seq - c->next_seq) < 0) { /* posted, completed and handed back */
        comm_fail(c, BN_REMOTE_ERROR,
                  "chunk %u of message %u from %s on stream %d arrived after the message was "
                  "complete", hdr.index, hdr.seq, c->peer, stream);
        break;
      }
      pthread_cond_wait(&c->cv, &c->mu);
    }
    if (c->closing || c->error != 0) break;
    if (r->total == SIZE_MAX) {
      if (recv_start(c, r, &hdr) != 0) break;
    } else if (r->total != hdr.total || r->nchunks != hdr.nchunks) {
      comm_fail(c, BN_REMOTE_ERROR, "inconsistent size for message %u from %s on stream %d",
                hdr.seq, c->peer, stream);
      break;
    }
    uint64_t bit = 1ull << (hdr.index % 64), *word = &r->seen[hdr.index / 64];
    if (*word & bit) { /* a range already written, or being written, by another chunk */
      comm_fail(c, BN_REMOTE_ERROR, "chunk %u of message %u from %s arrived twice (stream %d)",
                hdr.index, hdr.seq, c->peer, stream);
      break;
    }
    *word |= bit; /* claimed: no other chunk may write this range, nor complete the message */
    char *dst = r->data + off;
    c->readers++;
    pthread_mutex_unlock(&c->mu);
    rc = read_payload(c, fd, dst, len);
    pthread_mutex_lock(&c->mu);
    c->readers--;
    if (rc != 0) {
      comm_fail(c, BN_REMOTE_ERROR, "receive from %s failed on stream %d: %s", c->peer, stream,
                io_error(rc));
      break;
    }
    if (++r->chunks_done == r->nchunks) __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

static void comm_destroy(bn_comm_t *c) {
  pthread_mutex_lock(&c->mu);
  c->closing = 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  if (c->is_send) {
    /* Idle senders exit at once (and mark their stream's end). One still blocked writing a
     * message nobody will complete is woken by shutting its socket down after a grace period;
     * bytes already queued still go out before the FIN. */
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += 2;
    for (int i = 0; i < c->nthreads; i++) {
      if (pthread_timedjoin_np(c->threads[i], NULL, &deadline) == 0) continue;
      shutdown(c->fds[i], SHUT_RDWR);
      pthread_join(c->threads[i], NULL);
    }
  } else {
    for (int i = 0; i < c->nstreams; i++) shutdown(c->fds[i], SHUT_RDWR); /* wake readers */
    for (int i = 0; i < c->nthreads; i++) pthread_join(c->threads[i], NULL);
  }
  for (int i = 0; i < c->nstreams; i++) {
    if (c->fds[i] >= 0) close(c->fds[i]);
  }
  for (int i = 0; i < BN_MAX_REQUESTS; i++) free(c->reqs[i].seen);
  pthread_cond_destroy(&c->cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

/* Build a comm over connected sockets (ownership passes to it) and start its threads. */
bn_comm_t *bn_comm_create(int is_send, int nstreams, const int *fds, size_t min_chunk) {
  bn_comm_t *c = calloc(1, sizeof(*c));
  if (c == NULL) {
    for (int i = 0; i < nstreams; i++) close(fds[i]);
    return NULL;
  }
  c->is_send = is_send;
  c->nstreams = nstreams;
  c->min_chunk = min_chunk;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  for (int i = 0; i < nstreams; i++) {
    c->fds[i] = fds[i];
    set_blocking(fds[i]);
    tune_socket(fds[i]);
  }
  bn_addr_t peer;
  socklen_t plen = sizeof(peer);
  if (getpeername(fds[0], &peer.sa, &plen) == 0) bn_format_addr(&peer.sa, c->peer, sizeof(c->peer));
  else snprintf(c->peer, sizeof(c->peer), "?");
  pthread_attr_t attr; /* stream threads need little stack; NCCL may open hundreds of them */
  pthread_attr_init(&attr);
  pthread_attr_setstacksize(&attr, 256 * 1024);
  for (int i = 0; i < nstreams; i++) {
    bn_worker_arg_t *arg = malloc(sizeof(*arg));
    if (arg == NULL) break;
    arg->comm = c;
    arg->stream = i;
    if (pthread_create(&c->threads[i], &attr, is_send ? send_worker : recv_worker, arg) != 0) {
      free(arg);
      break;
    }
    pthread_setname_np(c->threads[i], is_send ? "bagua-net-tx" : "bagua-net-rx");
    c->nthreads++;
  }
  pthread_attr_destroy(&attr);
  if (c->nthreads != nstreams) {
    BN_WARN("NET/BaguaNet: could not start %d stream threads", nstreams);
    comm_destroy(c);
    return NULL;
  }
  return c;
}

/* ---------------------------------------------------------------- data path ----------- */
bn_result_t bn_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle) {
  (void)comm; (void)data; (void)size;
  if (type != BN_PTR_HOST) {
    BN_WARN("NET/BaguaNet: only host memory is supported (regMr type %d)", type);
    *mhandle = NULL;
    return BN_INTERNAL_ERROR;
  }
  *mhandle = &g_mr_token;
  return BN_OK;
}

bn_result_t bn_dereg_mr(void *comm, void *mhandle) {
  (void)comm; (void)mhandle;
  return BN_OK;
}

/* The comm's failure, if any, logged once through NCCL's logger. Not before every stream
 * thread has stopped writing into posted buffers: until then the caller is told to wait (test()
 * says not done, irecv() takes no request), so a buffer it frees or reuses after the error is
 * never written. */
static bn_result_t report_error(bn_comm_t *c) {
  int err = __atomic_load_n(&c->error, __ATOMIC_ACQUIRE);
  if (err == 0) return BN_OK;
  pthread_mutex_lock(&c->mu);
  if (c->readers > 0) { /* they stop at their next read (the sockets are shut down) */
    pthread_mutex_unlock(&c->mu);
    return BN_OK;
  }
  if (!c->error_logged) {
    c->error_logged = 1;
    BN_WARN("NET/BaguaNet: %s", c->errmsg);
  }
  pthread_mutex_unlock(&c->mu);
  return (bn_result_t)err;
}

/* A free request slot for the next message, or NULL when NCCL_NET_MAX_REQUESTS requests are
 * still outstanding. Caller holds c->mu. */
static bn_req_t *take_slot(bn_comm_t *c) {
  bn_req_t *r = NULL;
  for (int i = 0; i < BN_MAX_REQUESTS && r == NULL; i++) {
    if (!c->reqs[i].used) r = &c->reqs[i];
  }
  if (r == NULL) return NULL;
  uint64_t *seen = r->seen;
  size_t seen_words = r->seen_words;
  memset(r, 0, sizeof(*r));
  r->seen = seen;
  r->seen_words = seen_words;
  r->comm = c;
  r->used = 1;
  r->seq = c->next_seq++;
  return r;
}

bn_result_t bn_isend(void *send_comm, void *data, size_t size, int tag, void **request) {
  (void)tag;
  bn_comm_t *c = send_comm;
  *request = NULL;
  pthread_mutex_lock(&c->mu);
  bn_req_t *r = c->error == 0 ? take_slot(c) : NULL;
  if (r != NULL) {
    r->data = data;
    r->size = size;
    uint64_t n = size / c->min_chunk;
    r->nchunks = n > 0 ? n : 1;
    pthread_cond_signal(&c->cv); /* one stream takes it; it wakes another if chunks remain */
  }
  pthread_mutex_unlock(&c->mu);
  *request = r;
  /* A request taken is reported through test() (it may complete even if the comm fails). */
  return r != NULL ? BN_OK : report_error(c);
}

bn_result_t bn_irecv(void *recv_comm, int n, void **data, const size_t *sizes, void **request) {
  bn_comm_t *c = recv_comm;
  *request = NULL;
  if (n != 1) {
    BN_WARN("NET/BaguaNet: irecv of %d buffers; this plugin advertises maxRecvs = 1", n);
    return BN_INTERNAL_ERROR;
  }
  pthread_mutex_lock(&c->mu);
  bn_req_t *r = c->error == 0 ? take_slot(c) : NULL;
  if (r != NULL) {
    r->data = data[0];
    r->size = sizes[0];
    r->total = SIZE_MAX;
    pthread_cond_broadcast(&c->cv);
  }
  pthread_mutex_unlock(&c->mu);
  *request = r;
  /* A request taken is reported through test() (it may complete even if the comm fails). */
  return r != NULL ? BN_OK : report_error(c);
}

bn_result_t bn_iflush(void *recv_comm, void **request) {
  (void)recv_comm;
  *request = NULL;
  BN_WARN("NET/BaguaNet: iflush is only needed for GPU memory, which this plugin does not take");
  return BN_INTERNAL_ERROR;
}

bn_result_t bn_test(void *request, int *done, size_t *size) {
  bn_req_t *r = request;
  if (r == NULL) return BN_OK;
  bn_comm_t *c = r->comm;
  if (__atomic_load_n(&r->done, __ATOMIC_ACQUIRE)) {
    pthread_mutex_lock(&c->mu);
    size_t n = c->is_send ? r->size : r->total;
    r->used = 0;
    pthread_mutex_unlock(&c->mu);
    *done = 1;
    if (size != NULL) *size = n;
    return BN_OK;
  }
  *done = 0;
  return report_error(c);
}

bn_result_t bn_close_send(void *send_comm) {
  if (send_comm != NULL) comm_destroy(send_comm);
  return BN_OK;
}

bn_result_t bn_close_recv(void *recv_comm) {
  if (recv_comm != NULL) comm_destroy(recv_comm);
  return BN_OK;
}
