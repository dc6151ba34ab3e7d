/*
 * nccltune_env.h - the NCCL env-plugin type nccltune's env plugin exports.
 *
 * Written for this project from the published facts of NCCL's env plugin ABI, version 1 (NCCL 2.28.7
 * and newer): NCCL_ENV_PLUGIN names the library (a path, or NAME for libnccl-env-NAME.so), NCCL
 * dlopens it and reads the symbol ncclEnvPlugin_v1; init is called once per process with NCCL's
 * version, getEnv for every variable NCCL reads through its ncclGetEnv (after NCCL put its conf files
 * into the environment), finalize at exit. A returned string must stay valid until finalize or the
 * next getEnv of the same name. Only the layout and the values have to agree with NCCL.
 */
#ifndef NCCLTUNE_ENV_H
#define NCCLTUNE_ENV_H

#include <stdint.h>

#include "nccltune_tuner.h" /* ncclResult_t */

typedef struct {
  const char *name;
  ncclResult_t (*init)(uint8_t ncclMajor, uint8_t ncclMinor, uint8_t ncclPatch, const char *suffix);
  ncclResult_t (*finalize)(void);
  const char *(*getEnv)(const char *name);
} ncclEnv_v1_t;

#endif /* NCCLTUNE_ENV_H */
