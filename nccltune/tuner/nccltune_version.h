/*
 * nccltune_version.h - NCCL version numbers as nccltune's two plugins read and print them.
 *
 * A table section or env-file section names the NCCL it was measured with as "major.minor.patch"
 * (2.28.9). NCCL's own integer code for such a version (what ncclGetVersion returns since 2.9) is
 * major * 10000 + minor * 100 + patch, so minor and patch are 0..99 and major 1..99.
 */
#ifndef NCCLTUNE_VERSION_H
#define NCCLTUNE_VERSION_H

#include <stdio.h>

/* "2.28.9" -> 22809; -1 for anything else (no sign, no spaces, no leading "+", each part decimal). */
static inline int nccltune_parse_version(const char *text) {
  int parts[3] = {0, 0, 0};
  int n = 0, digits = 0;
  for (const char *p = text;; p++) {
    if (*p >= '0' && *p <= '9') {
      if (digits == 2) return -1; /* at most two digits a part */
      parts[n] = parts[n] * 10 + (*p - '0');
      digits++;
    } else if ((*p == '.' || *p == '\0') && digits > 0) {
      n++;
      digits = 0;
      if (*p == '\0') break;
      if (n == 3) return -1;
    } else {
      return -1;
    }
  }
  if (n != 3 || parts[0] < 1) return -1;
  return parts[0] * 10000 + parts[1] * 100 + parts[2];
}

/* 22809 -> "2.28.9" into buf (at least 16 bytes). */
static inline void nccltune_version_text(int code, char *buf, size_t size) {
  snprintf(buf, size, "%d.%d.%d", code / 10000, code / 100 % 100, code % 100);
}

#endif /* NCCLTUNE_VERSION_H */
