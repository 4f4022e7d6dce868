# The NCCL C ABI restated (no nccl.h): only the types and signatures we call.
# Pointers to NCCL functions are resolved with dlsym once, at load (see _nccl.pyx).

ctypedef int ncclResult_t
ctypedef void* ncclComm_t
ctypedef void* cudaStream_t
ctypedef int ncclDataType_t
ctypedef int ncclRedOp_t

ctypedef struct ncclUniqueId:
    char internal[128]

ctypedef ncclResult_t (*GetVersion_t)(int*) noexcept nogil
ctypedef ncclResult_t (*GetUniqueId_t)(ncclUniqueId*) noexcept nogil
ctypedef const char* (*GetErrorString_t)(ncclResult_t) noexcept nogil
ctypedef const char* (*GetLastError_t)(ncclComm_t) noexcept nogil
# ncclConfig_t as NCCL 2.14 defined it (size, magic, version, blocking).  NCCL copies ``size``
# bytes and gives every field newer than ``version`` its default, so this prefix is valid for
# every later release.
ctypedef struct ncclConfig_v21400:
    size_t size
    unsigned int magic
    unsigned int version
    int blocking

ctypedef ncclResult_t (*CommInitRankConfig_t)(ncclComm_t*, int, ncclUniqueId, int,
                                              ncclConfig_v21400*) noexcept nogil
ctypedef ncclResult_t (*CommInitRank_t)(ncclComm_t*, int, ncclUniqueId, int) noexcept nogil
ctypedef ncclResult_t (*CommOp_t)(ncclComm_t) noexcept nogil
ctypedef ncclResult_t (*CommGetAsyncError_t)(ncclComm_t, ncclResult_t*) noexcept nogil
ctypedef ncclResult_t (*AllReduce_t)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                     ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*Reduce_t)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int,
                                  ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*Broadcast_t)(const void*, void*, size_t, ncclDataType_t, int,
                                     ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*AllGather_t)(const void*, void*, size_t, ncclDataType_t,
                                     ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*ReduceScatter_t)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                         ncclComm_t, cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*SendRecv_t)(void*, size_t, ncclDataType_t, int, ncclComm_t,
                                    cudaStream_t) noexcept nogil
ctypedef ncclResult_t (*Group_t)() noexcept nogil
ctypedef ncclResult_t (*CommInfo_t)(ncclComm_t, int*) noexcept nogil
