/* Logging through NCCL's logger. Messages are formatted here and handed over as one "%s"
 * argument, so a logger that reads only the format string and one string still works. */
#include <stdarg.h>
#include <stdio.h>

#include "bagua_net.h"

static bn_logger_t g_logger = NULL;

void bn_set_logger(bn_logger_t log) {
  if (log != NULL) g_logger = log;
}

void bn_log(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  bn_logger_t log = g_logger;
  if (log != NULL) {
    log(level, flags, file, line, "%s", msg);
  } else if (level == BN_LOG_WARN) {
    fprintf(stderr, "bagua-net WARN %s\n", msg);
  }
}
