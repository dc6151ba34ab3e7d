/*
 * nccltune_tuner.c - nccltune's NCCL tuner plugin: per-collective, per-size, per-shape choices read
 * from a table that nccltune publishes; every call the table does not cover is left to NCCL.
 *
 * Exports ncclTunerPlugin_v5 (NCCL 2.28.3 and newer), ncclTunerPlugin_v6 (2.30.3 and newer; no
 * chunk-size hook) and ncclTunerPlugin_v7 (2.32.6 and newer; v6's functions, other constants layout).
 * NCCL binds the highest version it knows. Needs no CUDA and does not link libnccl. Build:
 *   cc -std=c11 -O2 -fPIC -shared -Wall -Wextra -Werror -o libnccl-tuner-nccltune.so nccltune_tuner.c
 *
 * Environment, read at each communicator's init:
 *   NCCLTUNE_TUNER_TABLE        path of the table (unset or empty: no table, the plugin defers)
 *   NCCLTUNE_TUNER_FINGERPRINT  the tuning fingerprint the table must carry (unset: the table is not applied)
 *
 * The running NCCL's version: ncclGetVersion of the library whose logger init was given (the NCCL
 * that loaded this plugin, found with dladdr even when it was loaded RTLD_LOCAL, as torch does),
 * else ncclGetVersion from the global scope; neither: the plugin defers.
 *
 * Table format, version 2 (a text file, one record per line, fields separated by spaces or tabs):
 *
 *   nccltune-tuner-table 2
 *   fingerprint 0123abcd4567ef89
 *   nccl 2.28.9
 *   # collective  min_bytes max_bytes nnodes nranks ranks_per_node algo proto channels
 *   allreduce     0         1048575   1      2      2              ring ll128 16
 *   allreduce     1048576   1073741824 1     2      2              ring simple 32
 *   nccl 2.27.7
 *   allreduce     0         1073741824 1     2      2              tree ll 0
 *   end 3
 *
 * - The first line is exactly the magic and the format version. A different version is refused.
 * - `#` starts a comment that runs to the end of the line; blank lines are ignored. Only printable
 *   ASCII and tabs are allowed, every line ends with '\n' (also the last), and a line holds at most
 *   512 bytes before its newline.
 * - `fingerprint` follows the header: 8 to 128 lowercase hex digits.
 * - `nccl <major.minor.patch>` starts the section of entries measured with that NCCL version; every
 *   entry is in a section, no version has two sections, at most 64 sections. Only the section whose
 *   version equals the running NCCL's exactly (major, minor and patch) applies; without one the
 *   plugin defers. All sections are checked, whichever applies.
 * - Entries: collective is allreduce, allgather, reducescatter, broadcast or reduce. min_bytes and
 *   max_bytes are decimal, inclusive on both edges (an entry applies when min_bytes <= nBytes <=
 *   max_bytes, nBytes as NCCL passes it to getCollInfo), min_bytes <= max_bytes. nnodes, nranks and
 *   ranks_per_node are >= 1 with nnodes * ranks_per_node == nranks. algo is tree, ring,
 *   collnet_direct, collnet_chain, nvls, nvls_tree or pat; proto is ll, ll128 or simple. channels is
 *   0..256, 0 leaving the channel count to NCCL (which caps any count at the communicator's channels).
 * - Two entries of the same section, collective and shape may not overlap in size.
 * - The last record is `end <number of entries>` (all sections together): a table cut short at a line boundary is caught.
 * - At most 4096 entries and 1 MiB.
 * Any violation makes the whole table malformed; it is never applied in part.
 *
 * Behaviour: each init gets its own context (no state shared between communicators) and logs exactly
 * one line through NCCL's logger: INFO when there is no table or the table is in use, WARN when the
 * table is unreadable, malformed, of another version or stale. init never fails for a table problem
 * (a failed init fails the communicator); it defers instead. getCollInfo marks a choice by setting
 * that one cost-table cell to 0.0, only when the single entry that matches the collective, size and
 * exact communicator shape names a cell NCCL has not marked unavailable; otherwise it writes nothing.
 * The answer depends only on the table and the call's inputs, so every rank of a communicator gets
 * the same one. getCollInfo always returns success.
 */
#define _GNU_SOURCE /* dladdr */

#include "nccltune_text.h"
#include "nccltune_tuner.h"
#include "nccltune_version.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define TABLE_MAGIC "nccltune-tuner-table"
#define TABLE_VERSION "2"
#define TABLE_MAX_SECTIONS 64
#define TABLE_MAX_BYTES (1024L * 1024L)
#define TABLE_MAX_ENTRIES 4096
#define TABLE_MAX_LINE 512
#define TABLE_MAX_FIELDS 10
#define TABLE_MAX_CHANNELS 256
#define TABLE_MAX_SHAPE 2147483647ULL
#define FINGERPRINT_MIN 8
#define FINGERPRINT_MAX 128
#define LOG_MAX 768
#define INIT_FLAGS (NCCLTUNE_LOG_FLAG_INIT | NCCLTUNE_LOG_FLAG_TUNING)

typedef struct {
  int coll;
  uint64_t min_bytes;
  uint64_t max_bytes;
  uint64_t nnodes;
  uint64_t nranks;
  uint64_t ranks_per_node;
  int algo;
  int proto;
  int channels;
  int line;
  int nccl; /* the NCCL version code of the entry's section */
} entry_t;

typedef struct {
  int active;         /* 1: the table applies to this communicator; 0: every call is deferred */
  uint64_t nnodes;    /* this communicator's shape */
  uint64_t nranks;
  uint64_t ranks_per_node;
  size_t n_entries;
  entry_t *entries;
} context_t;

/* What went wrong while loading; decides the log level and wording. */
typedef enum { LOAD_OK, LOAD_NO_TABLE, LOAD_UNREADABLE, LOAD_MALFORMED, LOAD_VERSION } load_status_t;

typedef struct {
  load_status_t status;
  int line;          /* 0: the problem is not on one line */
  char why[256];
  char fingerprint[FINGERPRINT_MAX + 1];
  entry_t *entries;
  size_t n_entries;
  int sections[TABLE_MAX_SECTIONS]; /* the sections' NCCL version codes, in file order */
  int n_sections;
} load_t;

static const char *const COLL_NAMES[NCCLTUNE_NUM_FUNCS] = {"broadcast", "reduce", "allgather", "reducescatter",
                                                            "allreduce"};
static const char *const ALGO_NAMES[NCCL_NUM_ALGORITHMS] = {"tree", "ring", "collnet_direct", "collnet_chain",
                                                             "nvls", "nvls_tree", "pat"};
static const char *const PROTO_NAMES[NCCL_NUM_PROTOCOLS] = {"ll", "ll128", "simple"};

/* NCCL's logger is variadic, but a callback written against a fixed signature (or a foreign-language
 * one) can only read a plain string: format here and pass the text through "%s". */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static void tlog(ncclDebugLogger_t fn, ncclDebugLogLevel level, int line, const char *fmt, ...) {
  char msg[LOG_MAX];
  va_list ap;
  if (fn == NULL) return;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  fn(level, INIT_FLAGS, __FILE__, line, "%s", msg);
}

#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static void fail(load_t *ld, load_status_t status, int line, const char *fmt, ...) {
  va_list ap;
  ld->status = status;
  ld->line = line;
  va_start(ap, fmt);
  vsnprintf(ld->why, sizeof ld->why, fmt, ap);
  va_end(ap);
}

static int name_index(const char *tok, const char *const *names, int n) {
  for (int i = 0; i < n; i++)
    if (strcmp(tok, names[i]) == 0) return i;
  return -1;
}

/* Decimal digits only (no sign, no spaces), at most 2^64-1. Returns 0 on success. */
static int parse_u64(const char *tok, uint64_t *out) {
  uint64_t v = 0;
  if (*tok == '\0') return -1;
  for (const char *p = tok; *p; p++) {
    if (*p < '0' || *p > '9') return -1;
    uint64_t d = (uint64_t)(*p - '0');
    if (v > (UINT64_MAX - d) / 10) return -1;
    v = v * 10 + d;
  }
  *out = v;
  return 0;
}

static int is_digits(const char *tok) {
  if (*tok == '\0') return 0;
  for (const char *p = tok; *p; p++)
    if (*p < '0' || *p > '9') return 0;
  return 1;
}

/* Parses one entry's fields into e; on a problem fills ld and returns -1. */
static int parse_entry(load_t *ld, int lineno, char **tok, int ntok, entry_t *e) {
  static const char *const shape_names[3] = {"nnodes", "nranks", "ranks_per_node"};
  uint64_t *shape[3];
  uint64_t ch;
  if (ntok != 9) {
    fail(ld, LOAD_MALFORMED, lineno, "expected 9 fields (collective min_bytes max_bytes nnodes nranks "
         "ranks_per_node algo proto channels), got %d", ntok);
    return -1;
  }
  e->line = lineno;
  e->coll = name_index(tok[0], COLL_NAMES, NCCLTUNE_NUM_FUNCS);
  if (e->coll < 0) {
    fail(ld, LOAD_MALFORMED, lineno, "unknown collective '%.40s'", tok[0]);
    return -1;
  }
  if (parse_u64(tok[1], &e->min_bytes) != 0) {
    fail(ld, LOAD_MALFORMED, lineno, "min_bytes '%.40s' is not a byte count", tok[1]);
    return -1;
  }
  if (parse_u64(tok[2], &e->max_bytes) != 0) {
    fail(ld, LOAD_MALFORMED, lineno, "max_bytes '%.40s' is not a byte count", tok[2]);
    return -1;
  }
  if (e->min_bytes > e->max_bytes) {
    fail(ld, LOAD_MALFORMED, lineno, "min_bytes is larger than max_bytes");
    return -1;
  }
  shape[0] = &e->nnodes;
  shape[1] = &e->nranks;
  shape[2] = &e->ranks_per_node;
  for (int i = 0; i < 3; i++) {
    if (parse_u64(tok[3 + i], shape[i]) != 0 || *shape[i] < 1 || *shape[i] > TABLE_MAX_SHAPE) {
      fail(ld, LOAD_MALFORMED, lineno, "%s '%.40s' is not a count from 1 to %llu", shape_names[i], tok[3 + i],
           (unsigned long long)TABLE_MAX_SHAPE);
      return -1;
    }
  }
  if (e->nnodes * e->ranks_per_node != e->nranks) { /* both <= 2^31-1: the product cannot overflow */
    fail(ld, LOAD_MALFORMED, lineno, "nnodes x ranks_per_node is not nranks");
    return -1;
  }
  e->algo = name_index(tok[6], ALGO_NAMES, NCCL_NUM_ALGORITHMS);
  if (e->algo < 0) {
    fail(ld, LOAD_MALFORMED, lineno, "unknown algorithm '%.40s'", tok[6]);
    return -1;
  }
  e->proto = name_index(tok[7], PROTO_NAMES, NCCL_NUM_PROTOCOLS);
  if (e->proto < 0) {
    fail(ld, LOAD_MALFORMED, lineno, "unknown protocol '%.40s'", tok[7]);
    return -1;
  }
  if (parse_u64(tok[8], &ch) != 0 || ch > TABLE_MAX_CHANNELS) {
    fail(ld, LOAD_MALFORMED, lineno, "channels '%.40s' is not a count from 0 to %d", tok[8], TABLE_MAX_CHANNELS);
    return -1;
  }
  e->channels = (int)ch;
  return 0;
}

static int is_lower_hex(const char *tok) {
  size_t n = strlen(tok);
  if (n < FINGERPRINT_MIN || n > FINGERPRINT_MAX) return 0;
  for (const char *p = tok; *p; p++)
    if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return 0;
  return 1;
}

/* Parses the whole text (not NUL-terminated; may contain any byte). On success ld->entries holds the
 * entries (caller frees); on failure ld says why and holds nothing. */
static void parse_table(load_t *ld, const char *buf, size_t size) {
  enum { WANT_HEADER, WANT_FINGERPRINT, IN_ENTRIES, AFTER_END } state = WANT_HEADER;
  size_t cap = 0;
  int lineno = 0;
  size_t pos = 0;

  if (size == 0 || buf[size - 1] != '\n') {
    int lines = 1;
    for (size_t i = 0; i < size; i++)
      if (buf[i] == '\n') lines++;
    fail(ld, LOAD_MALFORMED, lines, "truncated: the file does not end with a newline");
    return;
  }
  while (pos < size) {
    char line[TABLE_MAX_LINE + 1];
    char *tok[TABLE_MAX_FIELDS];
    char why[64];
    int ntok;
    lineno++;
    if (nccltune_line_fields(buf, size, &pos, line, TABLE_MAX_LINE, tok, TABLE_MAX_FIELDS, &ntok, why,
                             sizeof why) != 0) {
      fail(ld, LOAD_MALFORMED, lineno, "%s", why);
      goto bad;
    }
    if (state == WANT_HEADER) {
      /* The header is the very first line, blank or not. */
      if (ntok != 2 || strcmp(tok[0], TABLE_MAGIC) != 0 || !is_digits(tok[1])) {
        fail(ld, LOAD_MALFORMED, lineno, "not a nccltune tuner table (the first line must be '%s %s')",
             TABLE_MAGIC, TABLE_VERSION);
        goto bad;
      }
      if (strcmp(tok[1], TABLE_VERSION) != 0) {
        fail(ld, LOAD_VERSION, lineno, "format version %.20s, this plugin reads version %s", tok[1], TABLE_VERSION);
        goto bad;
      }
      state = WANT_FINGERPRINT;
      continue;
    }
    if (ntok == 0) continue;
    if (state == AFTER_END) {
      fail(ld, LOAD_MALFORMED, lineno, "content after the 'end' line");
      goto bad;
    }
    if (state == WANT_FINGERPRINT) {
      if (ntok != 2 || strcmp(tok[0], "fingerprint") != 0 || !is_lower_hex(tok[1])) {
        fail(ld, LOAD_MALFORMED, lineno, "expected 'fingerprint <%d to %d lowercase hex digits>'", FINGERPRINT_MIN,
             FINGERPRINT_MAX);
        goto bad;
      }
      memcpy(ld->fingerprint, tok[1], strlen(tok[1]) + 1);
      state = IN_ENTRIES;
      continue;
    }
    if (strcmp(tok[0], "nccl") == 0) {
      int code = ntok == 2 ? nccltune_parse_version(tok[1]) : -1;
      if (code < 0) {
        fail(ld, LOAD_MALFORMED, lineno, "expected 'nccl <major.minor.patch>' (a section's NCCL version)");
        goto bad;
      }
      for (int i = 0; i < ld->n_sections; i++)
        if (ld->sections[i] == code) {
          fail(ld, LOAD_MALFORMED, lineno, "a second section for NCCL %.20s", tok[1]);
          goto bad;
        }
      if (ld->n_sections == TABLE_MAX_SECTIONS) {
        fail(ld, LOAD_MALFORMED, lineno, "more than %d sections", TABLE_MAX_SECTIONS);
        goto bad;
      }
      ld->sections[ld->n_sections++] = code;
      continue;
    }
    if (strcmp(tok[0], "end") == 0) {
      uint64_t n;
      if (ntok != 2 || parse_u64(tok[1], &n) != 0) {
        fail(ld, LOAD_MALFORMED, lineno, "expected 'end <number of entries>'");
        goto bad;
      }
      if (n != (uint64_t)ld->n_entries) {
        fail(ld, LOAD_MALFORMED, lineno, "the 'end' line counts %llu entries, the table has %zu",
             (unsigned long long)n, ld->n_entries);
        goto bad;
      }
      state = AFTER_END;
      continue;
    }
    if (ld->n_sections == 0) {
      fail(ld, LOAD_MALFORMED, lineno, "entry before the first 'nccl <version>' section line");
      goto bad;
    }
    if (ld->n_entries == TABLE_MAX_ENTRIES) {
      fail(ld, LOAD_MALFORMED, lineno, "more than %d entries", TABLE_MAX_ENTRIES);
      goto bad;
    }
    if (ld->n_entries == cap) {
      size_t ncap = cap ? cap * 2 : 16;
      entry_t *grown = realloc(ld->entries, ncap * sizeof *grown);
      if (grown == NULL) {
        fail(ld, LOAD_UNREADABLE, 0, "out of memory");
        goto bad;
      }
      ld->entries = grown;
      cap = ncap;
    }
    entry_t *e = &ld->entries[ld->n_entries];
    if (parse_entry(ld, lineno, tok, ntok, e) != 0) goto bad;
    e->nccl = ld->sections[ld->n_sections - 1];
    for (size_t i = 0; i < ld->n_entries; i++) {
      const entry_t *o = &ld->entries[i];
      if (o->nccl == e->nccl && o->coll == e->coll && o->nnodes == e->nnodes && o->nranks == e->nranks &&
          o->ranks_per_node == e->ranks_per_node && o->min_bytes <= e->max_bytes && e->min_bytes <= o->max_bytes) {
        fail(ld, LOAD_MALFORMED, lineno, "size range overlaps the entry on line %d (same section, collective and shape)",
             o->line);
        goto bad;
      }
    }
    ld->n_entries++;
  }
  if (state != AFTER_END) {
    fail(ld, LOAD_MALFORMED, lineno, "truncated: no 'end' line");
    goto bad;
  }
  ld->status = LOAD_OK;
  return;
bad:
  free(ld->entries);
  ld->entries = NULL;
  ld->n_entries = 0;
}

/* Reads the table at path, bounded in size, refusing anything that is not a regular file (a FIFO or
 * a device would block or never end). */
static void load_table(load_t *ld, const char *path) {
  struct stat st;
  char why[128];
  char *buf;
  size_t size;
  int too_large;
  int fd = nccltune_open_regular(path, 0, &st, why, sizeof why);
  if (fd < 0) {
    fail(ld, errno == ENOENT ? LOAD_NO_TABLE : LOAD_UNREADABLE, 0, "%s", why);
    return;
  }
  if (st.st_size > TABLE_MAX_BYTES) {
    fail(ld, LOAD_MALFORMED, 0, "larger than %ld bytes", TABLE_MAX_BYTES);
    close(fd);
    return;
  }
  buf = nccltune_read_bounded(fd, (size_t)TABLE_MAX_BYTES, &size, &too_large, why, sizeof why);
  close(fd);
  if (buf == NULL) {
    fail(ld, too_large ? LOAD_MALFORMED : LOAD_UNREADABLE, 0, "%s", why);
    return;
  }
  parse_table(ld, buf, size);
  free(buf);
}

/* The communicator's ranks per node, or 0 when the layout is uneven (or inconsistent), which no
 * entry matches. */
static uint64_t ranks_per_node(size_t nRanks, size_t nNodes, const ncclNvlDomainInfo_v5_t *nvl) {
  uint64_t rpn;
  if (nNodes == 0 || nRanks == 0) return 0;
  if (nvl != NULL && nvl->minRanksPerNvlDomain > 0 && nvl->maxRanksPerNvlDomain > 0) {
    if (nvl->minRanksPerNvlDomain != nvl->maxRanksPerNvlDomain) return 0;
    rpn = (uint64_t)nvl->minRanksPerNvlDomain;
  } else {
    if (nRanks % nNodes != 0) return 0;
    rpn = (uint64_t)(nRanks / nNodes);
  }
  if (rpn * (uint64_t)nNodes != (uint64_t)nRanks) return 0;
  return rpn;
}

typedef ncclResult_t (*get_version_t)(int *version);

/* The version of the NCCL that loaded this plugin, as ncclGetVersion reports it, or -1. NCCL opens
 * plugins RTLD_LOCAL and torch loads libnccl into its own local scope, where a global lookup does not
 * reach; the logger NCCL hands to init lives in that very library, so dladdr on it names the library
 * to ask. The global scope is the fallback (a logger-less caller with libnccl loaded globally). */
static int running_nccl_version(ncclDebugLogger_t logFunction, char *where, size_t where_size) {
  get_version_t get = NULL;
  Dl_info info;
  int version = -1;
  snprintf(where, where_size, "no ncclGetVersion found");
  if (logFunction != NULL && dladdr((void *)logFunction, &info) != 0 && info.dli_fname != NULL) {
    void *lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (lib != NULL) {
      get = (get_version_t)dlsym(lib, "ncclGetVersion");
      if (get != NULL) snprintf(where, where_size, "ncclGetVersion of %.300s", info.dli_fname);
      dlclose(lib); /* RTLD_NOLOAD took a reference to a library NCCL keeps loaded */
    }
  }
  if (get == NULL) {
    get = (get_version_t)dlsym(RTLD_DEFAULT, "ncclGetVersion");
    if (get != NULL) snprintf(where, where_size, "ncclGetVersion of the global scope");
  }
  if (get == NULL || get(&version) != ncclSuccess || version < 10000) return -1;
  return version;
}

/* "2.27.7, 2.29.2" (or "none") into buf, for the line that says no section applies. */
static void section_list(const load_t *ld, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  if (ld->n_sections == 0) snprintf(buf, size, "none");
  for (int i = 0; i < ld->n_sections && used + 1 < size; i++) {
    char v[16];
    nccltune_version_text(ld->sections[i], v, sizeof v);
    int n = snprintf(buf + used, size - used, "%s%s", i ? ", " : "", v);
    if (n < 0) break;
    used += (size_t)n;
  }
}

/* Keeps only the entries of the section for `version` (the others are never consulted); returns
 * whether the table has that section. */
static int keep_section(load_t *ld, int version) {
  size_t kept = 0;
  int found = 0;
  for (int i = 0; i < ld->n_sections; i++)
    if (ld->sections[i] == version) found = 1;
  for (size_t i = 0; i < ld->n_entries; i++)
    if (ld->entries[i].nccl == version) ld->entries[kept++] = ld->entries[i];
  ld->n_entries = kept;
  return found;
}

static ncclResult_t tuner_init(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                               ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t *nvlDomainInfo,
                               ncclTunerConstants_v5_t *constants) {
  context_t *ctx;
  load_t ld;
  int version;
  char version_where[400];
  char version_text[16];
  const char *path = getenv("NCCLTUNE_TUNER_TABLE");
  const char *expected = getenv("NCCLTUNE_TUNER_FINGERPRINT");
  (void)commId;
  (void)constants; /* NCCL's own model is never changed */
  if (context == NULL) return ncclSuccess;
  *context = NULL;
  ctx = calloc(1, sizeof *ctx);
  if (ctx == NULL) {
    /* A NULL context defers every call: running on without the table beats failing the job. */
    tlog(logFunction, NCCL_LOG_WARN, __LINE__, "nccltune tuner: out of memory; deferring to NCCL");
    return ncclSuccess;
  }
  *context = ctx;
  ctx->nnodes = (uint64_t)nNodes;
  ctx->nranks = (uint64_t)nRanks;
  ctx->ranks_per_node = ranks_per_node(nRanks, nNodes, nvlDomainInfo);

  if (path == NULL || path[0] == '\0') {
    tlog(logFunction, NCCL_LOG_INFO, __LINE__, "nccltune tuner: no table (NCCLTUNE_TUNER_TABLE is not set); "
         "deferring to NCCL");
    return ncclSuccess;
  }
  memset(&ld, 0, sizeof ld);
  load_table(&ld, path);
  switch (ld.status) {
    case LOAD_OK:
      break;
    case LOAD_NO_TABLE:
      tlog(logFunction, NCCL_LOG_INFO, __LINE__, "nccltune tuner: no table at %.400s (%s); deferring to NCCL",
           path, ld.why);
      return ncclSuccess;
    case LOAD_UNREADABLE:
      tlog(logFunction, NCCL_LOG_WARN, __LINE__, "nccltune tuner: table %.400s is unreadable (%s); "
           "deferring to NCCL", path, ld.why);
      return ncclSuccess;
    case LOAD_MALFORMED:
    case LOAD_VERSION:
      if (ld.line > 0)
        tlog(logFunction, NCCL_LOG_WARN, __LINE__, "nccltune tuner: table %.400s:%d is %s (%s); deferring to NCCL",
             path, ld.line, ld.status == LOAD_VERSION ? "of another format version" : "malformed", ld.why);
      else
        tlog(logFunction, NCCL_LOG_WARN, __LINE__, "nccltune tuner: table %.400s is malformed (%s); "
             "deferring to NCCL", path, ld.why);
      return ncclSuccess;
  }
  if (expected == NULL || strcmp(expected, ld.fingerprint) != 0) {
    tlog(logFunction, NCCL_LOG_WARN, __LINE__, "nccltune tuner: table %.400s is stale (fingerprint %s, this node "
         "expects %.130s); deferring to NCCL", path, ld.fingerprint,
         expected == NULL ? "none: NCCLTUNE_TUNER_FINGERPRINT is not set" : expected);
    free(ld.entries);
    return ncclSuccess;
  }
  version = running_nccl_version(logFunction, version_where, sizeof version_where);
  if (version < 0) {
    tlog(logFunction, NCCL_LOG_INFO, __LINE__, "nccltune tuner: table %.400s is valid, but the running NCCL's "
         "version is unknown (%s); deferring to NCCL", path, version_where);
    free(ld.entries);
    return ncclSuccess;
  }
  nccltune_version_text(version, version_text, sizeof version_text);
  if (!keep_section(&ld, version)) {
    char sections[256];
    section_list(&ld, sections, sizeof sections);
    tlog(logFunction, NCCL_LOG_INFO, __LINE__, "nccltune tuner: table %.400s has no section for NCCL %s (sections: "
         "%s); deferring to NCCL", path, version_text, sections);
    free(ld.entries);
    return ncclSuccess;
  }
  if (nRanks <= 1) {
    /* NCCL runs one-rank communicators without asking the tuner; say so rather than stay silent. */
    tlog(logFunction, NCCL_LOG_INFO, __LINE__, "nccltune tuner: table %.400s (NCCL %s section, %zu entries) is "
         "valid; one-rank communicator, deferring to NCCL", path, version_text, ld.n_entries);
    free(ld.entries);
    return ncclSuccess;
  }
  ctx->entries = ld.entries;
  ctx->n_entries = ld.n_entries;
  ctx->active = 1;
  if (ctx->ranks_per_node == 0)
    tlog(logFunction, NCCL_LOG_INFO, __LINE__, "nccltune tuner: using table %.400s (NCCL %s section, %zu entries, "
         "fingerprint %s); communicator of %zu ranks on %zu nodes is uneven, no entry applies", path, version_text,
         ld.n_entries, ld.fingerprint, nRanks, nNodes);
  else
    tlog(logFunction, NCCL_LOG_INFO, __LINE__, "nccltune tuner: using table %.400s (NCCL %s section, %zu entries, "
         "fingerprint %s) for a communicator of %zu ranks on %zu nodes, %llu per node", path, version_text,
         ld.n_entries, ld.fingerprint, nRanks, nNodes, (unsigned long long)ctx->ranks_per_node);
  return ncclSuccess;
}

static ncclResult_t tuner_get_coll_info(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                        float **collCostTable, int numAlgo, int numProto, int regBuff,
                                        int *nChannels) {
  const context_t *ctx = context;
  (void)numPipeOps;
  (void)regBuff; /* local to each rank: a choice keyed on it could differ between ranks */
  if (ctx == NULL || !ctx->active || ctx->ranks_per_node == 0 || collCostTable == NULL) return ncclSuccess;
  if ((int)collType < 0 || (int)collType >= NCCLTUNE_NUM_FUNCS) return ncclSuccess;
  /* The rows are NCCL_NUM_PROTOCOLS floats apart; any other width would be a layout this code does
   * not know. */
  if (numProto != NCCL_NUM_PROTOCOLS || numAlgo <= 0) return ncclSuccess;
  for (size_t i = 0; i < ctx->n_entries; i++) {
    const entry_t *e = &ctx->entries[i];
    if (e->coll != (int)collType || (uint64_t)nBytes < e->min_bytes || (uint64_t)nBytes > e->max_bytes) continue;
    if (e->nnodes != ctx->nnodes || e->nranks != ctx->nranks || e->ranks_per_node != ctx->ranks_per_node) continue;
    /* Entries of one collective and shape never overlap, so this is the only match. */
    if (e->algo >= numAlgo || e->proto >= numProto) return ncclSuccess;
    {
      float (*table)[NCCL_NUM_PROTOCOLS] = (float (*)[NCCL_NUM_PROTOCOLS])(void *)collCostTable;
      float cost = table[e->algo][e->proto];
      /* Unavailable (IGNORE, any negative or NaN): a 0.0 here would select what NCCL ruled out. */
      if (!(cost >= 0.0f)) return ncclSuccess;
      table[e->algo][e->proto] = 0.0f;
      if (e->channels > 0 && nChannels != NULL) *nChannels = e->channels;
    }
    return ncclSuccess;
  }
  return ncclSuccess;
}

static ncclResult_t tuner_finalize(void *context) {
  context_t *ctx = context;
  if (ctx != NULL) {
    free(ctx->entries);
    free(ctx);
  }
  return ncclSuccess;
}

/* v7's init differs from v5's only in the constants' type, which the plugin never dereferences. */
static ncclResult_t tuner_init_v7(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                                  ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t *nvlDomainInfo,
                                  ncclTunerConstants_v7_t *constants) {
  (void)constants;
  return tuner_init(context, commId, nRanks, nNodes, logFunction, nvlDomainInfo, NULL);
}

__attribute__((visibility("default"))) const ncclTuner_v5_t ncclTunerPlugin_v5 = {
    "nccltune", tuner_init, tuner_get_coll_info, tuner_finalize};

__attribute__((visibility("default"))) const ncclTuner_v6_t ncclTunerPlugin_v6 = {
    "nccltune", tuner_init, tuner_get_coll_info, tuner_finalize, NULL};

__attribute__((visibility("default"))) const ncclTuner_v7_t ncclTunerPlugin_v7 = {
    "nccltune", tuner_init_v7, tuner_get_coll_info, tuner_finalize, NULL};
