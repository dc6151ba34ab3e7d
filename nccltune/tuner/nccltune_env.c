/*
 * nccltune_env.c - nccltune's NCCL env plugin: answers NCCL's variable lookups with the values
 * nccltune measured for the running NCCL version and the job's shape, and leaves every other lookup
 * to the environment, as NCCL's own default plugin does.
 *
 * Exports ncclEnvPlugin_v1 (NCCL 2.28.7 and newer read NCCL_ENV_PLUGIN). Needs no CUDA and does not
 * link libnccl. Build:
 *   cc -std=c11 -O2 -fPIC -shared -Wall -Wextra -Werror -o libnccl-env-nccltune.so nccltune_env.c
 *
 * Environment, read once at init:
 *   NCCLTUNE_ENV_TABLE     path of the env file (unset or empty: every lookup is the environment's)
 *   NCCLTUNE_JOB_NNODES, then SLURM_JOB_NUM_NODES, then WORLD_SIZE / LOCAL_WORLD_SIZE (torchrun),
 *   then OMPI_COMM_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE: the job's node count; none of them: the
 *   shape is unknown and only `all` values apply.
 *   NCCL_DEBUG            INFO or TRACE: the plugin says on stderr what it loaded and answered.
 *
 * getEnv(name), the precedence rule: the job's own environment first (NCCL put its conf files there
 * before loading the plugin, so their values count as the job's), then the tuned value of the section
 * for the running NCCL version and the job's shape, else NULL (unset), which is NCCL's own answer.
 *
 * Env file format, version 1 (a text file, one record per line, fields separated by spaces or tabs):
 *
 *   nccltune-env-table 1
 *   nccl 2.28.9
 *   # scope  name                         value
 *   all      NCCL_MIN_NCHANNELS           16
 *   multi    NCCL_IB_QPS_PER_CONNECTION   4
 *   end 2
 *
 * - The first line is exactly the magic and the format version; `#` comments and blank lines as in
 *   the tuner table; printable ASCII and tabs only; every line ends with '\n'; lines of at most 512
 *   bytes; at most 64 KiB, 1024 values and 64 sections.
 * - `nccl <major.minor.patch>` starts a section; only the one equal to the running NCCL (major, minor
 *   and patch) applies. Every value is in a section; no version has two sections.
 * - A value: scope `all` (any job), `single` (a job on one node) or `multi` (on two or more); the
 *   variable's name, NCCL_ followed by capitals, digits and '_', not ending in _PLUGIN or _FILE
 *   (those load code or open files: never from here); one value token of at most 256 characters.
 *   One name appears once per section and scope, and never both under `all` and a narrower scope.
 * - The last record is `end <number of values>`.
 * Any violation makes the whole file malformed; it is never applied in part.
 *
 * Trust: the file and the directory holding it must be owned by root or by this process's effective
 * user and writable by neither group nor others (the rule nccltune publishes under); the file must be
 * a regular file. Otherwise nothing from it is answered.
 */
#define _GNU_SOURCE /* strcasecmp */

#include "nccltune_env.h"
#include "nccltune_text.h"
#include "nccltune_version.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define ENV_MAGIC "nccltune-env-table"
#define ENV_VERSION "1"
#define ENV_MAX_BYTES (64L * 1024L)
#define ENV_MAX_VALUES 1024
#define ENV_MAX_SECTIONS 64
#define ENV_MAX_LINE 512
#define ENV_MAX_NAME 128
#define ENV_MAX_VALUE 256
#define ENV_MAX_FIELDS 4

typedef enum { SCOPE_ALL = 0, SCOPE_SINGLE = 1, SCOPE_MULTI = 2 } scope_t;
static const char *const SCOPE_NAMES[3] = {"all", "single", "multi"};

typedef struct {
  int nccl;
  scope_t scope;
  char name[ENV_MAX_NAME + 1];
  char value[ENV_MAX_VALUE + 1];
  int line;
  int told; /* 1 once the answer was logged */
} value_t;

/* Everything init decided; read-only afterwards except the `told` flags (atomic). */
static struct {
  int debug;
  int version;
  long nnodes; /* 0: unknown */
  char nnodes_from[64];
  value_t *values; /* the values that apply: the running version's section, the job's scope */
  size_t n_values;
} plugin;

static int debug_enabled(void) {
  const char *d = getenv("NCCL_DEBUG");
  return d != NULL && (strcasecmp(d, "INFO") == 0 || strcasecmp(d, "TRACE") == 0);
}

/* NCCL's v1 env plugin gets no logger: the plugin writes its own lines, with NCCL's prefix style,
 * to stderr, and only when the job asked NCCL for INFO. */
#if defined(__GNUC__)
__attribute__((format(printf, 1, 2)))
#endif
static void say(const char *fmt, ...) {
  char msg[768];
  char host[64] = "?";
  va_list ap;
  if (!plugin.debug) return;
  gethostname(host, sizeof host - 1);
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fprintf(stderr, "%s:%d NCCL INFO nccltune env: %s\n", host, (int)getpid(), msg);
}

static int positive(const char *text, long *out) {
  char *end;
  long v;
  if (text == NULL || *text < '0' || *text > '9') return 0;
  errno = 0;
  v = strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < 1) return 0;
  *out = v;
  return 1;
}

/* The job's node count and where it came from; 0 when no launcher variable says. */
static long job_nodes(char *from, size_t from_size) {
  static const char *const counts[] = {"NCCLTUNE_JOB_NNODES", "SLURM_JOB_NUM_NODES"};
  static const char *const per_node[][2] = {{"WORLD_SIZE", "LOCAL_WORLD_SIZE"},
                                            {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"}};
  long n, world, local;
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
    if (positive(getenv(counts[i]), &n)) {
      snprintf(from, from_size, "%s", counts[i]);
      return n;
    }
  for (size_t i = 0; i < sizeof per_node / sizeof per_node[0]; i++)
    if (positive(getenv(per_node[i][0]), &world) && positive(getenv(per_node[i][1]), &local) && world % local == 0) {
      snprintf(from, from_size, "%s/%s", per_node[i][0], per_node[i][1]);
      return world / local;
    }
  snprintf(from, from_size, "no launcher variable");
  return 0;
}

/* Whether a stat result passes the trust rule: owned by root or this user, not group/other-writable. */
static const char *untrusted(const struct stat *st) {
  if (st->st_uid != 0 && st->st_uid != geteuid()) return "owned by another user";
  if (st->st_mode & (S_IWGRP | S_IWOTH)) return "writable by group or others";
  return NULL;
}

static int name_ok(const char *name) {
  size_t n = strlen(name);
  if (n <= 5 || n > ENV_MAX_NAME || strncmp(name, "NCCL_", 5) != 0) return 0;
  for (const char *p = name; *p; p++)
    if (!((*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == '_')) return 0;
  if (n >= 7 && strcmp(name + n - 7, "_PLUGIN") == 0) return 0;
  if (n >= 5 && strcmp(name + n - 5, "_FILE") == 0) return 0;
  return 1;
}

typedef struct {
  char why[256];
  int line;
  value_t *values;
  size_t n_values;
  int sections[ENV_MAX_SECTIONS];
  int n_sections;
} parse_t;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void fail(parse_t *ps, int line, const char *fmt, ...) {
  va_list ap;
  ps->line = line;
  va_start(ap, fmt);
  vsnprintf(ps->why, sizeof ps->why, fmt, ap);
  va_end(ap);
}

/* Parses the whole file; 0 on success (ps->values holds every value of every section), -1 with
 * ps->why and ps->line on the first problem. */
static int parse(parse_t *ps, const char *buf, size_t size) {
  enum { WANT_HEADER, IN_VALUES, AFTER_END } state = WANT_HEADER;
  int lineno = 0;
  size_t pos = 0;
  if (size == 0 || buf[size - 1] != '\n') {
    fail(ps, 0, "truncated: the file does not end with a newline");
    return -1;
  }
  ps->values = calloc(ENV_MAX_VALUES, sizeof *ps->values);
  if (ps->values == NULL) {
    fail(ps, 0, "out of memory");
    return -1;
  }
  while (pos < size) {
    char line[ENV_MAX_LINE + 1];
    char *tok[ENV_MAX_FIELDS];
    int ntok;
    lineno++;
    if (nccltune_line_fields(buf, size, &pos, line, ENV_MAX_LINE, tok, ENV_MAX_FIELDS, &ntok, ps->why,
                             sizeof ps->why) != 0) {
      ps->line = lineno;
      return -1;
    }
    if (state == WANT_HEADER) {
      if (ntok != 2 || strcmp(tok[0], ENV_MAGIC) != 0 || strcmp(tok[1], ENV_VERSION) != 0) {
        fail(ps, lineno, "not a nccltune env file of format version %s (the first line must be '%s %s')",
             ENV_VERSION, ENV_MAGIC, ENV_VERSION);
        return -1;
      }
      state = IN_VALUES;
      continue;
    }
    if (ntok == 0) continue;
    if (state == AFTER_END) {
      fail(ps, lineno, "content after the 'end' line");
      return -1;
    }
    if (strcmp(tok[0], "nccl") == 0) {
      int code = ntok == 2 ? nccltune_parse_version(tok[1]) : -1;
      if (code < 0) {
        fail(ps, lineno, "expected 'nccl <major.minor.patch>' (a section's NCCL version)");
        return -1;
      }
      for (int i = 0; i < ps->n_sections; i++)
        if (ps->sections[i] == code) {
          fail(ps, lineno, "a second section for NCCL %.20s", tok[1]);
          return -1;
        }
      if (ps->n_sections == ENV_MAX_SECTIONS) {
        fail(ps, lineno, "more than %d sections", ENV_MAX_SECTIONS);
        return -1;
      }
      ps->sections[ps->n_sections++] = code;
      continue;
    }
    if (strcmp(tok[0], "end") == 0) {
      long n = 0;
      if (ntok != 2 || !(strcmp(tok[1], "0") == 0 || positive(tok[1], &n))) {
        fail(ps, lineno, "expected 'end <number of values>'");
        return -1;
      }
      if ((size_t)n != ps->n_values) {
        fail(ps, lineno, "the 'end' line counts %ld values, the file has %zu", n, ps->n_values);
        return -1;
      }
      state = AFTER_END;
      continue;
    }
    if (ps->n_sections == 0) {
      fail(ps, lineno, "value before the first 'nccl <version>' section line");
      return -1;
    }
    if (ntok != 3) {
      fail(ps, lineno, "expected 3 fields (scope name value), got %d", ntok);
      return -1;
    }
    if (ps->n_values == ENV_MAX_VALUES) {
      fail(ps, lineno, "more than %d values", ENV_MAX_VALUES);
      return -1;
    }
    value_t *v = &ps->values[ps->n_values];
    int scope = -1;
    for (int i = 0; i < 3; i++)
      if (strcmp(tok[0], SCOPE_NAMES[i]) == 0) scope = i;
    if (scope < 0) {
      fail(ps, lineno, "unknown scope '%.40s' (all, single or multi)", tok[0]);
      return -1;
    }
    if (!name_ok(tok[1])) {
      fail(ps, lineno, "'%.60s' is not a variable this plugin answers (NCCL_ and capitals, digits, '_'; "
           "not *_PLUGIN or *_FILE)", tok[1]);
      return -1;
    }
    if (strlen(tok[2]) > ENV_MAX_VALUE) {
      fail(ps, lineno, "value longer than %d characters", ENV_MAX_VALUE);
      return -1;
    }
    v->nccl = ps->sections[ps->n_sections - 1];
    v->scope = (scope_t)scope;
    v->line = lineno;
    snprintf(v->name, sizeof v->name, "%s", tok[1]);
    snprintf(v->value, sizeof v->value, "%s", tok[2]);
    for (size_t i = 0; i < ps->n_values; i++) {
      const value_t *o = &ps->values[i];
      if (o->nccl == v->nccl && strcmp(o->name, v->name) == 0 &&
          (o->scope == v->scope || o->scope == SCOPE_ALL || v->scope == SCOPE_ALL)) {
        fail(ps, lineno, "%s is already given on line %d of this section", v->name, o->line);
        return -1;
      }
    }
    ps->n_values++;
  }
  if (state != AFTER_END) {
    fail(ps, lineno, "truncated: no 'end' line");
    return -1;
  }
  return 0;
}

/* Reads the file under the trust rule, bounded in size; NULL with why set when it cannot be used. */
static char *read_trusted(const char *path, size_t *size, char *why, size_t why_size) {
  struct stat st;
  const char *bad;
  char dir[4096];
  char *buf, *slash;
  int too_large;
  int fd = nccltune_open_regular(path, O_NOFOLLOW, &st, why, why_size);
  *size = 0;
  if (fd < 0) return NULL;
  if ((bad = untrusted(&st)) != NULL) {
    snprintf(why, why_size, "the file is %s", bad);
    close(fd);
    return NULL;
  }
  snprintf(dir, sizeof dir, "%s", path);
  slash = strrchr(dir, '/');
  if (slash == dir) slash[1] = '\0';
  else if (slash != NULL) *slash = '\0';
  else snprintf(dir, sizeof dir, ".");
  if (stat(dir, &st) != 0 || (bad = untrusted(&st)) != NULL) {
    snprintf(why, why_size, "its directory %.300s is %s", dir, bad ? bad : "not readable");
    close(fd);
    return NULL;
  }
  buf = nccltune_read_bounded(fd, (size_t)ENV_MAX_BYTES, size, &too_large, why, why_size);
  close(fd);
  return buf;
}

static void load(const char *path) {
  char why[400];
  char version[16];
  size_t size;
  parse_t ps;
  char *buf = read_trusted(path, &size, why, sizeof why);
  nccltune_version_text(plugin.version, version, sizeof version);
  if (buf == NULL) {
    say("env file %.400s not used (%s); every variable is the environment's", path, why);
    return;
  }
  memset(&ps, 0, sizeof ps);
  if (parse(&ps, buf, size) != 0) {
    if (ps.line > 0)
      say("env file %.400s:%d is malformed (%s); every variable is the environment's", path, ps.line, ps.why);
    else
      say("env file %.400s is malformed (%s); every variable is the environment's", path, ps.why);
    free(ps.values);
    free(buf);
    return;
  }
  free(buf);
  /* Keep what applies to this process: the running version's section, the job's scope. */
  int has_section = 0;
  for (int i = 0; i < ps.n_sections; i++)
    if (ps.sections[i] == plugin.version) has_section = 1;
  size_t kept = 0;
  for (size_t i = 0; i < ps.n_values; i++) {
    const value_t *v = &ps.values[i];
    int fits = v->scope == SCOPE_ALL || (v->scope == SCOPE_SINGLE && plugin.nnodes == 1) ||
               (v->scope == SCOPE_MULTI && plugin.nnodes > 1);
    if (v->nccl == plugin.version && fits) ps.values[kept++] = *v;
  }
  plugin.values = ps.values;
  plugin.n_values = kept;
  if (!has_section) {
    say("env file %.400s has no section for NCCL %s; every variable is the environment's", path, version);
    return;
  }
  if (plugin.nnodes > 0)
    say("env file %.400s: NCCL %s section, a job of %ld node%s (%s): %zu tuned variable%s", path, version,
        plugin.nnodes, plugin.nnodes == 1 ? "" : "s", plugin.nnodes_from, kept, kept == 1 ? "" : "s");
  else
    say("env file %.400s: NCCL %s section, job shape unknown (%s): %zu tuned variable%s of scope all", path,
        version, plugin.nnodes_from, kept, kept == 1 ? "" : "s");
}

static ncclResult_t env_init(uint8_t ncclMajor, uint8_t ncclMinor, uint8_t ncclPatch, const char *suffix) {
  const char *path = getenv("NCCLTUNE_ENV_TABLE");
  char version[16];
  (void)suffix;
  memset(&plugin, 0, sizeof plugin);
  plugin.debug = debug_enabled();
  plugin.version = ncclMajor * 10000 + ncclMinor * 100 + ncclPatch;
  plugin.nnodes = job_nodes(plugin.nnodes_from, sizeof plugin.nnodes_from);
  nccltune_version_text(plugin.version, version, sizeof version);
  if (path == NULL || path[0] == '\0') {
    say("NCCL %s; no env file (NCCLTUNE_ENV_TABLE is not set); every variable is the environment's", version);
    return ncclSuccess;
  }
  load(path);
  return ncclSuccess; /* a failed init would fail NCCL's init: never, the environment still answers */
}

static ncclResult_t env_finalize(void) {
  free(plugin.values);
  plugin.values = NULL;
  plugin.n_values = 0;
  return ncclSuccess;
}

static const char *env_get(const char *name) {
  const char *own;
  if (name == NULL) return NULL;
  own = getenv(name);
  for (size_t i = 0; i < plugin.n_values; i++) {
    value_t *v = &plugin.values[i];
    if (strcmp(v->name, name) != 0) continue;
    if (own != NULL) {
      if (__atomic_exchange_n(&v->told, 1, __ATOMIC_RELAXED) == 0)
        say("%s=%.200s from the job's environment (the job's value wins over the tuned %s)", name, own, v->value);
      return own;
    }
    if (__atomic_exchange_n(&v->told, 1, __ATOMIC_RELAXED) == 0)
      say("%s=%s (tuned, %s)", name, v->value, SCOPE_NAMES[v->scope]);
    return v->value;
  }
  return own;
}

__attribute__((visibility("default"))) const ncclEnv_v1_t ncclEnvPlugin_v1 = {"nccltune", env_init, env_finalize,
                                                                             env_get};
