/* Configuration read by init() (BAGUA_NET_* variables) and the devices it found. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static bn_dev_t g_devs[BN_MAX_DEVS];
static int g_ndevs = 0;
static int g_nstreams = BN_DEFAULT_NSTREAMS;
static size_t g_min_chunk = BN_DEFAULT_MIN_CHUNK;
static uint64_t g_greeting_ms = BN_DEFAULT_GREETING_MS;

static bn_result_t parse_env_u64(const char *name, uint64_t lo, uint64_t hi, int suffixes,
                                 uint64_t *out) {
  const char *s = getenv(name);
  if (s == NULL || *s == '\0') return BN_OK;
  char *end = NULL;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  uint64_t mult = 1;
  if (suffixes && end != NULL && *end != '\0' && end[1] == '\0') {
    if (*end == 'K' || *end == 'k') mult = 1ull << 10;
    else if (*end == 'M' || *end == 'm') mult = 1ull << 20;
    else if (*end == 'G' || *end == 'g') mult = 1ull << 30;
    if (mult != 1) end++;
  }
  if (errno != 0 || end == s || *end != '\0' || *s == '-' || v > hi / mult || v * mult < lo) {
    bn_log(BN_LOG_WARN, BN_SUBSYS_NET | BN_SUBSYS_ENV, __FILE__, __LINE__,
           "NET/BaguaNet: %s=%s is invalid: expected an integer%s from %llu to %llu", name, s,
           suffixes ? " (optional K/M/G suffix)" : "", (unsigned long long)lo,
           (unsigned long long)hi);
    return BN_INVALID_ARGUMENT;
  }
  *out = v * mult;
  return BN_OK;
}

bn_result_t bn_init(bn_logger_t log) {
  bn_set_logger(log);
  uint64_t nstreams = BN_DEFAULT_NSTREAMS, min_chunk = BN_DEFAULT_MIN_CHUNK;
  uint64_t greeting_ms = BN_DEFAULT_GREETING_MS;
  if (parse_env_u64("BAGUA_NET_NSTREAMS", 1, BN_MAX_STREAMS, 0, &nstreams) != BN_OK ||
      parse_env_u64("BAGUA_NET_MIN_CHUNKSIZE", BN_MIN_CHUNK_FLOOR, BN_MAX_NET_SIZE, 1,
                    &min_chunk) != BN_OK ||
      parse_env_u64("BAGUA_NET_GREETING_TIMEOUT_MS", 100, 3600000, 0, &greeting_ms) != BN_OK) {
    return BN_INVALID_ARGUMENT;
  }
  pthread_mutex_lock(&g_mu);
  g_nstreams = (int)nstreams;
  g_min_chunk = (size_t)min_chunk;
  g_greeting_ms = greeting_ms;
  /* Devices are found once: comms keep their device index for their lifetime. */
  if (g_ndevs == 0) g_ndevs = bn_find_devices(g_devs, BN_MAX_DEVS);
  int ndevs = g_ndevs;
  pthread_mutex_unlock(&g_mu);
  if (ndevs == 0) {
    const char *spec = getenv("NCCL_SOCKET_IFNAME");
    BN_WARN("NET/BaguaNet: no usable network interface (NCCL_SOCKET_IFNAME=%s)",
            spec ? spec : "(unset)");
    return BN_SYSTEM_ERROR;
  }
  for (int i = 0; i < ndevs; i++) {
    char addr[80];
    bn_format_addr(&g_devs[i].addr.sa, addr, sizeof(addr));
    BN_INFO("NET/BaguaNet: device %d %s %s, %d streams per connection, chunks >= %zu bytes", i,
            g_devs[i].name, addr, (int)nstreams, (size_t)min_chunk);
  }
  return BN_OK;
}

bn_result_t bn_devices(int *ndev) {
  pthread_mutex_lock(&g_mu);
  *ndev = g_ndevs;
  pthread_mutex_unlock(&g_mu);
  return BN_OK;
}

bn_result_t bn_check_dev(int dev) {
  if (dev < 0 || dev >= g_ndevs) {
    BN_WARN("NET/BaguaNet: device %d out of range (%d devices)", dev, g_ndevs);
    return BN_INVALID_ARGUMENT;
  }
  return BN_OK;
}

bn_result_t bn_get_properties(int dev, bn_props_t *props) {
  if (bn_check_dev(dev) != BN_OK) return BN_INVALID_ARGUMENT;
  props->name = g_devs[dev].name;
  props->pci_path = g_devs[dev].pci_path;
  props->guid = (uint64_t)dev;
  props->speed = g_devs[dev].speed_mbps;
  props->max_comms = 65536;
  return BN_OK;
}

void bn_config(int *nstreams, size_t *min_chunk) {
  pthread_mutex_lock(&g_mu);
  *nstreams = g_nstreams;
  *min_chunk = g_min_chunk;
  pthread_mutex_unlock(&g_mu);
}

uint64_t bn_greeting_timeout_ms(void) {
  pthread_mutex_lock(&g_mu);
  uint64_t ms = g_greeting_ms;
  pthread_mutex_unlock(&g_mu);
  return ms;
}

void bn_dev_addr(int dev, bn_addr_t *addr, char *name, size_t name_len) {
  memcpy(addr, &g_devs[dev].addr, sizeof(*addr));
  snprintf(name, name_len, "%s", g_devs[dev].name);
}
