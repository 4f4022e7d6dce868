/* bagua-net: NCCL net plugin "BaguaNet". The transport lands with the bagua-net issue; this
 * translation unit fixes the build (a plain C shared library, no CUDA, no NCCL headers). */
#define BAGUA_NET_EXPORT __attribute__((visibility("default")))

BAGUA_NET_EXPORT const char *baguaNetName(void) { return "BaguaNet"; }
