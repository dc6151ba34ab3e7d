/*
 * nccltune_tuner.h - the few NCCL tuner-plugin types nccltune's plugin needs.
 *
 * Written for this project from the published facts of NCCL's tuner plugin ABI (plugin API v5,
 * NCCL 2.28.3 and newer; v6, NCCL 2.30.3 and newer). Only the layout and the numeric values have to
 * agree with NCCL; nothing here includes or links NCCL or CUDA.
 */
#ifndef NCCLTUNE_TUNER_H
#define NCCLTUNE_TUNER_H

#include <stddef.h>
#include <stdint.h>

/* Result codes: the plugin only ever returns success (0); the others exist so the type matches. */
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7
} ncclResult_t;

/* Log levels and subsystem bits as NCCL 2.28's logger reads them. Checked in NVIDIA/nccl's
 * src/include/nccl_common.h of the 2.19 era (ab2b89c4) and of 2026 master (0456df20): the same values
 * in both, new subsystems only ever appended, so 2.28 (between them) uses these. */
typedef enum {
  NCCL_LOG_NONE = 0,
  NCCL_LOG_VERSION = 1,
  NCCL_LOG_WARN = 2,
  NCCL_LOG_INFO = 3,
  NCCL_LOG_ABORT = 4,
  NCCL_LOG_TRACE = 5
} ncclDebugLogLevel;

#define NCCLTUNE_LOG_FLAG_INIT 0x1UL    /* NCCL_INIT */
#define NCCLTUNE_LOG_FLAG_TUNING 0x40UL /* NCCL_TUNING */

typedef void (*ncclDebugLogger_t)(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                                  const char *fmt, ...);

/* The collectives a tuner is asked about (NCCL's ncclFunc_t; larger values are never tuned here). */
typedef enum {
  ncclFuncBroadcast = 0,
  ncclFuncReduce = 1,
  ncclFuncAllGather = 2,
  ncclFuncReduceScatter = 3,
  ncclFuncAllReduce = 4
} ncclFunc_t;
#define NCCLTUNE_NUM_FUNCS 5

#define NCCL_NUM_ALGORITHMS 7
#define NCCL_ALGO_TREE 0
#define NCCL_ALGO_RING 1
#define NCCL_ALGO_COLLNET_DIRECT 2
#define NCCL_ALGO_COLLNET_CHAIN 3
#define NCCL_ALGO_NVLS 4
#define NCCL_ALGO_NVLS_TREE 5
#define NCCL_ALGO_PAT 6

#define NCCL_NUM_PROTOCOLS 3
#define NCCL_PROTO_LL 0
#define NCCL_PROTO_LL128 1
#define NCCL_PROTO_SIMPLE 2

/* A cost-table cell NCCL marked unavailable for this call. */
#define NCCL_ALGO_PROTO_IGNORE -1.0

/* Passed to init: how the communicator's ranks fall into NVLink domains (one per node in NCCL 2.28). */
typedef struct {
  int nNvlDomains;
  int minRanksPerNvlDomain;
  int maxRanksPerNvlDomain;
} ncclNvlDomainInfo_v5_t;

/* NCCL's model constants; the plugin never reads or changes them, so the types stay opaque. v7's
 * (NCCL 2.32.6 and newer) changed layout from v5's: each bandwidth table gained a fifth
 * compute-capability row. */
typedef struct ncclTunerConstants_v5 ncclTunerConstants_v5_t;
typedef struct ncclTunerConstants_v7 ncclTunerConstants_v7_t;

/* The plugin's functions, one type each; the versions' tables below differ only in which they hold. */
typedef ncclResult_t (*ncclTunerInit_v5_t)(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                                           ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t *nvlDomainInfo,
                                           ncclTunerConstants_v5_t *constants);
typedef ncclResult_t (*ncclTunerInit_v7_t)(void **context, uint64_t commId, size_t nRanks, size_t nNodes,
                                           ncclDebugLogger_t logFunction, ncclNvlDomainInfo_v5_t *nvlDomainInfo,
                                           ncclTunerConstants_v7_t *constants);
typedef ncclResult_t (*ncclTunerGetCollInfo_t)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                                               float **collCostTable, int numAlgo, int numProto, int regBuff,
                                               int *nChannels);
typedef ncclResult_t (*ncclTunerFinalize_t)(void *context);
/* Optional (NULL leaves NCCL's chunk size). */
typedef ncclResult_t (*ncclTunerGetChunkSize_t)(void *context, ncclFunc_t collType, size_t nBytes, int algo,
                                                int proto, int nChannels, size_t *chunkSize);

typedef struct {
  const char *name;
  ncclTunerInit_v5_t init;
  ncclTunerGetCollInfo_t getCollInfo;
  ncclTunerFinalize_t finalize;
} ncclTuner_v5_t;

/* v6 (NCCL 2.30.3 and newer) is v5 plus the chunk-size hook, appended after finalize. */
typedef struct {
  const char *name;
  ncclTunerInit_v5_t init;
  ncclTunerGetCollInfo_t getCollInfo;
  ncclTunerFinalize_t finalize;
  ncclTunerGetChunkSize_t getChunkSize;
} ncclTuner_v6_t;

/* v7 has v6's functions; only the constants passed to init changed type. */
typedef struct {
  const char *name;
  ncclTunerInit_v7_t init;
  ncclTunerGetCollInfo_t getCollInfo;
  ncclTunerFinalize_t finalize;
  ncclTunerGetChunkSize_t getChunkSize;
} ncclTuner_v7_t;

#endif /* NCCLTUNE_TUNER_H */
