// Which driver calls wait for the device (a 1 s kernel on another stream) before returning?
#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1);} } while (0)
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
int main(void) {
  FILE *f = fopen("k.ptx","rb"); fseek(f,0,SEEK_END); long n=ftell(f); fseek(f,0,SEEK_SET); char *ptx=calloc(n+1,1); if (fread(ptx,1,n,f) != (size_t)n) return 1; fclose(f);
  CUdevice dev; CUcontext ctx; CK(cuInit(0)); CK(cuDeviceGet(&dev,0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmodule m; CK(cuModuleLoadData(&m, ptx)); CUfunction spin; CK(cuModuleGetFunction(&spin, m, "streamalloc_spin"));
  CUmemAllocationProp ap; memset(&ap,0,sizeof ap); ap.type=CU_MEM_ALLOCATION_TYPE_PINNED; ap.location.type=CU_MEM_LOCATION_TYPE_DEVICE; ap.location.id=0;
  size_t gran; CK(cuMemGetAllocationGranularity(&gran, &ap, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
  const char *names[] = {"cuMemFree", "cuMemUnmap+cuMemRelease", "cuMemAddressFree", "cuMemFreeHost", "cuMemPoolTrimTo", "cuMemPoolDestroy", "cuModuleUnload", "cuStreamDestroy", "cuEventDestroy", "cuMemFreeAsync"};
  for (int c = 0; c < 10; c++) {
    CUstream s1, s2; CK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    // what each case frees, made before the kernel
    CUdeviceptr p = 0, va = 0; CUmemGenericAllocationHandle h; void *host = 0; CUmemoryPool pool = 0; CUmodule m2 = 0; CUstream s3 = 0; CUevent e = 0;
    if (c == 0) CK(cuMemAlloc(&p, 1 << 20));
    if (c == 1 || c == 2) { CK(cuMemAddressReserve(&va, gran, 0, 0, 0)); if (c == 1) { CK(cuMemCreate(&h, gran, &ap, 0)); CK(cuMemMap(va, gran, 0, h, 0)); CUmemAccessDesc d; memset(&d,0,sizeof d); d.location = ap.location; d.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE; CK(cuMemSetAccess(va, gran, &d, 1)); } }
    if (c == 3) CK(cuMemHostAlloc(&host, 1 << 20, 0));
    if (c == 4 || c == 5) { CUmemPoolProps pr; memset(&pr,0,sizeof pr); pr.allocType=CU_MEM_ALLOCATION_TYPE_PINNED; pr.location.type=CU_MEM_LOCATION_TYPE_DEVICE; pr.location.id=0; CK(cuMemPoolCreate(&pool,&pr)); CUdeviceptr q; CK(cuMemAllocFromPoolAsync(&q, 32 << 20, pool, s2)); CK(cuMemFreeAsync(q, s2)); CK(cuStreamSynchronize(s2)); }
    if (c == 6) CK(cuModuleLoadData(&m2, ptx));
    if (c == 7) CK(cuStreamCreate(&s3, CU_STREAM_NON_BLOCKING));
    if (c == 8) CK(cuEventCreate(&e, CU_EVENT_DISABLE_TIMING));
    if (c == 9) CK(cuMemAllocAsync(&p, 1 << 20, s2));
    unsigned long long ns = 1000000000ull, cyc = 1980000000ull; void *params[] = {&ns, &cyc};
    CK(cuLaunchKernel(spin, 1,1,1, 1,1,1, 0, s1, params, 0));
    struct timespec w = {0, 50000000}; nanosleep(&w, 0);
    double t = now(); CUresult r = CUDA_SUCCESS;
    switch (c) {
      case 0: r = cuMemFree(p); break;
      case 1: r = cuMemUnmap(va, gran); if (!r) r = cuMemRelease(h); break;
      case 2: r = cuMemAddressFree(va, gran); break;
      case 3: r = cuMemFreeHost(host); break;
      case 4: r = cuMemPoolTrimTo(pool, 0); break;
      case 5: r = cuMemPoolDestroy(pool); break;
      case 6: r = cuModuleUnload(m2); break;
      case 7: r = cuStreamDestroy(s3); break;
      case 8: r = cuEventDestroy(e); break;
      case 9: r = cuMemFreeAsync(p, s2); break;
    }
    double took = now() - t; const char *en = "ok"; if (r) cuGetErrorName(r, &en);
    printf("while a 1 s kernel runs elsewhere: %-24s %9.3f ms (%s)\n", names[c], took * 1e3, en);
    CK(cuCtxSynchronize());
    if (c == 1) CK(cuMemAddressFree(va, gran));
    if (c == 4) CK(cuMemPoolDestroy(pool));
    CK(cuStreamDestroy(s1)); CK(cuStreamDestroy(s2));
  }
  return 0;
}
