/* Interface selection with NCCL_SOCKET_IFNAME's syntax:
 *   "eth,ib"     interfaces whose name starts with eth or ib
 *   "=eth0"      exactly eth0 (the '=' applies to every item of the list)
 *   "^docker,lo" every interface except those starting with docker or lo
 * An item may carry ":port", which is ignored. Unset (or one character, as NCCL reads it):
 * "ib" interfaces, else everything but docker*, lo* and virbr*, else docker*, else lo, else
 * virbr*. Only running interfaces count. NCCL_SOCKET_FAMILY=AF_INET|AF_INET6 restricts the
 * address family. Each interface is one device, with its first usable address (IPv6 loopback
 * and link-local addresses are skipped: a peer could not reach them). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bagua_net.h"

#define MAX_ITEMS 32

typedef struct {
  int exclude;
  int exact;
  int count;
  char items[MAX_ITEMS][64];
} if_filter_t;

static void parse_filter(const char *spec, if_filter_t *f) {
  memset(f, 0, sizeof(*f));
  if (*spec == '^') { f->exclude = 1; spec++; }
  if (*spec == '=') { f->exact = 1; spec++; }
  while (*spec && f->count < MAX_ITEMS) {
    size_t n = strcspn(spec, ",");
    size_t name_len = strcspn(spec, ",:");
    if (name_len > 63) name_len = 63;
    if (name_len > 0) {
      memcpy(f->items[f->count], spec, name_len);
      f->items[f->count][name_len] = '\0';
      f->count++;
    }
    spec += n;
    if (*spec == ',') spec++;
  }
}

static int filter_accepts(const if_filter_t *f, const char *name) {
  int match = 0;
  for (int i = 0; i < f->count && !match; i++) {
    match = f->exact ? strcmp(name, f->items[i]) == 0
                     : strncmp(name, f->items[i], strlen(f->items[i])) == 0;
  }
  return f->exclude ? !match : match;
}

static int read_speed(const char *ifname) {
  char path[PATH_MAX];
  snprintf(path, sizeof(path), "/sys/class/net/%s/speed", ifname);
  FILE *fp = fopen(path, "r");
  int speed = -1;
  if (fp != NULL) {
    if (fscanf(fp, "%d", &speed) != 1) speed = -1;
    fclose(fp);
  }
  return speed > 0 ? speed : 10000; /* virtual links report nothing: assume 10 Gb/s, as NCCL */
}

static int find_with(const char *spec, int family, bn_dev_t *devs, int max_devs) {
  if_filter_t f;
  parse_filter(spec, &f);
  struct ifaddrs *list = NULL;
  if (getifaddrs(&list) != 0) return 0;
  int n = 0;
  for (struct ifaddrs *it = list; it != NULL && n < max_devs; it = it->ifa_next) {
    if (it->ifa_addr == NULL || !(it->ifa_flags & IFF_RUNNING)) continue;
    int fam = it->ifa_addr->sa_family;
    if (fam != AF_INET && fam != AF_INET6) continue;
    if (family != 0 && fam != family) continue;
    if (fam == AF_INET6) {
      const struct in6_addr *a6 = &((const struct sockaddr_in6 *)it->ifa_addr)->sin6_addr;
      if (IN6_IS_ADDR_LOOPBACK(a6) || IN6_IS_ADDR_LINKLOCAL(a6)) continue;
    }
    if (!filter_accepts(&f, it->ifa_name)) continue;
    int seen = 0;
    for (int i = 0; i < n && !seen; i++) seen = strcmp(devs[i].name, it->ifa_name) == 0;
    if (seen) continue;
    bn_dev_t *d = &devs[n++];
    memset(d, 0, sizeof(*d));
    snprintf(d->name, sizeof(d->name), "%s", it->ifa_name);
    memcpy(&d->addr, it->ifa_addr,
           fam == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6));
    d->speed_mbps = read_speed(d->name);
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "/sys/class/net/%s/device", d->name);
    d->pci_path = realpath(path, NULL);
  }
  freeifaddrs(list);
  return n;
}

int bn_find_devices(bn_dev_t *devs, int max_devs) {
  int family = 0;
  const char *fam = getenv("NCCL_SOCKET_FAMILY");
  if (fam != NULL && strcmp(fam, "AF_INET") == 0) family = AF_INET;
  if (fam != NULL && strcmp(fam, "AF_INET6") == 0) family = AF_INET6;
  const char *spec = getenv("NCCL_SOCKET_IFNAME");
  if (spec != NULL && strlen(spec) > 1) return find_with(spec, family, devs, max_devs);
  static const char *const fallbacks[] = {"ib", "^docker,lo,virbr", "docker", "lo", "virbr"};
  for (size_t i = 0; i < sizeof(fallbacks) / sizeof(fallbacks[0]); i++) {
    int n = find_with(fallbacks[i], family, devs, max_devs);
    if (n > 0) return n;
  }
  return 0;
}

int bn_format_addr(const struct sockaddr *sa, char *buf, size_t len) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)sa;
    inet_ntop(AF_INET, &a->sin_addr, host, sizeof(host));
    port = ntohs(a->sin_port);
    return snprintf(buf, len, "%s:%d", host, port);
  }
  const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)sa;
  inet_ntop(AF_INET6, &a->sin6_addr, host, sizeof(host));
  port = ntohs(a->sin6_port);
  return snprintf(buf, len, "[%s]:%d", host, port);
}
