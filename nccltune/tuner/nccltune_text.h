/*
 * nccltune_text.h - how nccltune's two plugins read their text files (the tuner table, the env
 * file): a regular file only, bounded in size, then line by line into fields.
 *
 * Both formats share the line rules: every line ends with '\n'; printable ASCII and tabs only; '#'
 * starts a comment; fields are separated by spaces or tabs.
 */
#ifndef NCCLTUNE_TEXT_H
#define NCCLTUNE_TEXT_H

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* path opened read-only, non-blocking and close-on-exec, with `flags` added (O_NOFOLLOW), when it is
 * a regular file (a FIFO or a device would block or never end): its descriptor, its stat in st. -1
 * with why otherwise; errno is open's when the open failed, 0 when the file is no regular file. */
static inline int nccltune_open_regular(const char *path, int flags, struct stat *st, char *why, size_t why_size) {
  int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC | flags);
  if (fd < 0) {
    int err = errno;
    snprintf(why, why_size, "cannot open: %s", strerror(err));
    errno = err;
    return -1;
  }
  if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
    snprintf(why, why_size, "not a regular file");
    close(fd);
    errno = 0;
    return -1;
  }
  return fd;
}

/* All of fd, at most max bytes, in a buffer of max + 1 bytes (the caller frees it), its length in
 * *size. It reads up to one byte more than max, so a file that grew since it was looked at is still
 * caught. NULL with why when it cannot; *too_large then tells a file over max bytes from an error
 * (out of memory, a failed read). */
static inline char *nccltune_read_bounded(int fd, size_t max, size_t *size, int *too_large, char *why,
                                          size_t why_size) {
  char *buf = malloc(max + 1);
  *size = 0;
  *too_large = 0;
  if (buf == NULL) {
    snprintf(why, why_size, "out of memory");
    return NULL;
  }
  while (*size <= max) {
    ssize_t n = read(fd, buf + *size, max + 1 - *size);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      snprintf(why, why_size, "read failed: %s", strerror(errno));
      free(buf);
      return NULL;
    }
    if (n == 0) break;
    *size += (size_t)n;
  }
  if (*size > max) {
    snprintf(why, why_size, "larger than %zu bytes", max);
    *too_large = 1;
    free(buf);
    return NULL;
  }
  return buf;
}

/* The line of buf (size bytes, the last one '\n': the caller checked) that starts at *pos, split into
 * fields: copied into line (max_line + 1 bytes), its comment cut off, each field a NUL-terminated
 * word of line in tok (at most max_fields). *pos moves past the line. 0 with *ntok fields (0 for a
 * blank or comment line); -1 with why for a line longer than max_line bytes, a byte that is neither
 * printable ASCII nor a tab, or more than max_fields fields. */
static inline int nccltune_line_fields(const char *buf, size_t size, size_t *pos, char *line, size_t max_line,
                                       char **tok, int max_fields, int *ntok, char *why, size_t why_size) {
  const char *start = buf + *pos;
  const char *nl = memchr(start, '\n', size - *pos);
  size_t len = (size_t)(nl - start);
  *ntok = 0;
  *pos += len + 1;
  if (len > max_line) {
    snprintf(why, why_size, "line longer than %zu bytes", max_line);
    return -1;
  }
  for (size_t i = 0; i < len; i++) {
    unsigned char c = (unsigned char)start[i];
    if (c != '\t' && (c < 0x20 || c > 0x7e)) {
      snprintf(why, why_size, "byte 0x%02x is not printable ASCII", c);
      return -1;
    }
  }
  memcpy(line, start, len);
  line[len] = '\0';
  char *hash = strchr(line, '#');
  if (hash) *hash = '\0';
  for (char *p = line; *p;) {
    while (*p == ' ' || *p == '\t') *p++ = '\0';
    if (!*p) break;
    if (*ntok == max_fields) {
      snprintf(why, why_size, "more than %d fields", max_fields);
      return -1;
    }
    tok[(*ntok)++] = p;
    while (*p && *p != ' ' && *p != '\t') p++;
  }
  return 0;
}

#endif /* NCCLTUNE_TEXT_H */
