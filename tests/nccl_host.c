/*
 * nccl_host.c - plays the two parts of libnccl that nccltune's tuner plugin reaches into: the logger
 * NCCL hands to init (variadic, as NCCL's is) and ncclGetVersion, which the plugin finds through
 * dladdr on that logger. The tests load one copy RTLD_LOCAL (as torch loads libnccl) and, for the
 * global-scope fallback, another RTLD_GLOBAL; each reports the version the test set.
 */
#include <stdarg.h>
#include <stdio.h>

typedef void (*sink_t)(int level, unsigned long flags, const char *fmt, const char *msg);

static int version = 22809;
static int answers = 1; /* 0: ncclGetVersion fails, as a broken library's would */
static sink_t sink;

void host_set_version(int v, int ok) {
  version = v;
  answers = ok;
}

void host_set_sink(sink_t s) { sink = s; }

int ncclGetVersion(int *v) {
  if (v == NULL || !answers) return 4; /* ncclInvalidArgument */
  *v = version;
  return 0;
}

void host_log(int level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  (void)file;
  (void)line;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (sink != NULL) sink(level, flags, fmt, msg);
}
