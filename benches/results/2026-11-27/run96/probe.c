// Does the driver release a pool's kept memory (release threshold at its maximum) when
// another thread of the process loads modules, synchronizes the context or allocates?
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1);} } while (0)
static CUcontext ctx; static CUdevice dev; static volatile int stop; static char *ptx; static const char *mode;
static long dist_iters;
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
static void *disturb(void *arg) {
  (void)arg; CK(cuCtxSetCurrent(ctx));
  while (!stop) {
    if (!strcmp(mode, "module")) { CUmodule m; CK(cuModuleLoadData(&m, ptx)); CK(cuModuleUnload(m)); }
    else if (!strcmp(mode, "ctxsync")) { CK(cuCtxSynchronize()); }
    else if (!strcmp(mode, "malloc")) { CUdeviceptr p; CK(cuMemAlloc(&p, 256<<20)); CK(cuMemFree(p)); }
    else if (!strcmp(mode, "stream")) { CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CK(cuStreamDestroy(s)); }
    else if (!strcmp(mode, "pool")) { // another pool, created, used and destroyed
      CUmemPoolProps pr; memset(&pr,0,sizeof pr); pr.allocType=CU_MEM_ALLOCATION_TYPE_PINNED; pr.location.type=CU_MEM_LOCATION_TYPE_DEVICE; pr.location.id=0;
      CUmemoryPool q; CK(cuMemPoolCreate(&q,&pr)); CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CUdeviceptr p;
      CK(cuMemAllocFromPoolAsync(&p, 16<<20, q, s)); CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s)); CK(cuStreamDestroy(s)); CK(cuMemPoolDestroy(q)); }
    else if (!strcmp(mode, "oom")) { CUdeviceptr p; CUresult r = cuMemAlloc(&p, 1ull<<50); if (r == CUDA_SUCCESS) cuMemFree(p); }
    else if (!strcmp(mode, "pooloom")) { CUmemoryPool q; CK(cuDeviceGetDefaultMemPool(&q, dev)); CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CUdeviceptr p;
      CUresult r = cuMemAllocFromPoolAsync(&p, 1ull<<50, q, s); if (r == CUDA_SUCCESS) CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s)); CK(cuStreamDestroy(s)); }
    else if (!strcmp(mode, "managed")) { size_t fr, tot; CK(cuMemGetInfo(&fr,&tot)); CUdeviceptr p; CUresult r = cuMemAllocManaged(&p, tot - (1ull<<30) + 1, CU_MEM_ATTACH_GLOBAL); if (r == CUDA_SUCCESS) cuMemFree(p); }
    else if (!strcmp(mode, "bigmalloc")) { size_t fr, tot; CK(cuMemGetInfo(&fr,&tot)); CUdeviceptr p; CUresult r = cuMemAlloc(&p, fr - (64<<20)); if (r == CUDA_SUCCESS) cuMemFree(p); }
    else { struct timespec t={0,1000000}; nanosleep(&t,0); }
    dist_iters++;
  }
  return 0;
}
int main(int argc, char **argv) {
  mode = argc > 1 ? argv[1] : "none"; double secs = argc > 2 ? atof(argv[2]) : 5;
  FILE *f = fopen("k.ptx","rb"); fseek(f,0,SEEK_END); long n=ftell(f); fseek(f,0,SEEK_SET); ptx=calloc(n+1,1); fread(ptx,1,n,f); fclose(f);
  CK(cuInit(0)); CK(cuDeviceGet(&dev,0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  if (!strcmp(mode, "info")) { // what one cuMemGetInfo costs
    size_t fr, tot; for (int i = 0; i < 100; i++) CK(cuMemGetInfo(&fr,&tot));
    double t = now(); for (int i = 0; i < 10000; i++) CK(cuMemGetInfo(&fr,&tot)); t = now() - t;
    printf("info: cuMemGetInfo %.2f us a call (10,000 calls)\n", t / 10000 * 1e6); return 0; }
  if (!strcmp(mode, "seq3")) { // does a cuMemCreate short of memory empty the pools too?
    for (int k = 0; k < 2; k++) { int kept = 0; const char *err = "ok";
      for (int i = 0; i < 10; i++) {
        CUmemPoolProps pr; memset(&pr,0,sizeof pr); pr.allocType=CU_MEM_ALLOCATION_TYPE_PINNED; pr.location.type=CU_MEM_LOCATION_TYPE_DEVICE; pr.location.id=0;
        CUmemoryPool pool; CK(cuMemPoolCreate(&pool,&pr)); cuuint64_t th_=~0ull; CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &th_));
        CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CUdeviceptr p;
        CK(cuMemAllocFromPoolAsync(&p, 32<<20, pool, s)); CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s));
        CUmemAllocationProp ap; memset(&ap,0,sizeof ap); ap.type=CU_MEM_ALLOCATION_TYPE_PINNED; ap.location.type=CU_MEM_LOCATION_TYPE_DEVICE; ap.location.id=0;
        size_t gran; CK(cuMemGetAllocationGranularity(&gran, &ap, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
        size_t fr, tot; CK(cuMemGetInfo(&fr,&tot)); size_t want = k == 0 ? ((fr + (1ull<<30)) / gran + 1) * gran : gran;
        CUmemGenericAllocationHandle h; CUresult r = cuMemCreate(&h, want, &ap, 0); if (r == CUDA_SUCCESS) CK(cuMemRelease(h)); else cuGetErrorName(r, &err);
        cuuint64_t res=0; CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res)); if (res >= (32u<<20)) kept++;
        CK(cuStreamDestroy(s)); CK(cuMemPoolDestroy(pool)); }
      printf("seq3: cuMemCreate(%s) -> %s; pool kept its 32 MiB in %d of 10\n", k == 0 ? "free+1GiB" : "one granule", err, kept); }
    return 0; }
  if (!strcmp(mode, "seq2")) { // does a cuMemAlloc that fits only with the pools' kept memory succeed?
    for (int i = 0; i < 5; i++) {
      CUmemPoolProps pr; memset(&pr,0,sizeof pr); pr.allocType=CU_MEM_ALLOCATION_TYPE_PINNED; pr.location.type=CU_MEM_LOCATION_TYPE_DEVICE; pr.location.id=0;
      CUmemoryPool pool; CK(cuMemPoolCreate(&pool,&pr)); cuuint64_t th_=~0ull; CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &th_));
      CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CUdeviceptr p;
      CK(cuMemAllocFromPoolAsync(&p, 1ull<<30, pool, s)); CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s));
      size_t fr, tot; CK(cuMemGetInfo(&fr,&tot)); cuuint64_t res0=0; CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res0));
      CUdeviceptr q; CUresult r = cuMemAlloc(&q, fr + (256ull<<20)); const char *es = "ok"; if (r != CUDA_SUCCESS) cuGetErrorName(r, &es);
      cuuint64_t res=0; CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res));
      size_t fr2; CK(cuMemGetInfo(&fr2,&tot));
      printf("seq2: pool kept %llu MiB, free %zu MiB; cuMemAlloc(free + 256 MiB): %s; pool then keeps %llu MiB, free %zu MiB\n", (unsigned long long)(res0>>20), fr>>20, es, (unsigned long long)(res>>20), fr2>>20);
      if (r == CUDA_SUCCESS) CK(cuMemFree(q));
      CK(cuStreamDestroy(s)); CK(cuMemPoolDestroy(pool)); }
    return 0; }
  if (!strcmp(mode, "seq")) { // one thread: prime, a failed cuMemAlloc of each size, read
    size_t fr, tot; CK(cuMemGetInfo(&fr,&tot));
    size_t sizes[4] = { 1ull<<50, tot + 1, fr + (1ull<<30), 1ull<<20 }; const char *names[4] = {"1PiB", "total+1", "free+1GiB", "1MiB(ok)"};
    for (int k = 0; k < 4; k++) { int kept = 0;
      for (int i = 0; i < 20; i++) {
        CUmemPoolProps pr; memset(&pr,0,sizeof pr); pr.allocType=CU_MEM_ALLOCATION_TYPE_PINNED; pr.location.type=CU_MEM_LOCATION_TYPE_DEVICE; pr.location.id=0;
        CUmemoryPool pool; CK(cuMemPoolCreate(&pool,&pr)); cuuint64_t th_=~0ull; CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &th_));
        CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CUdeviceptr p;
        CK(cuMemAllocFromPoolAsync(&p, 32<<20, pool, s)); CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s));
        CUdeviceptr q; CUresult r = cuMemAlloc(&q, sizes[k]); if (r == CUDA_SUCCESS) CK(cuMemFree(q));
        cuuint64_t res=0; CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res)); if (res >= (32u<<20)) kept++;
        CK(cuStreamDestroy(s)); CK(cuMemPoolDestroy(pool)); }
      printf("seq: cuMemAlloc(%s) then: pool kept its 32 MiB in %d of 20\n", names[k], kept); }
    return 0; }
  pthread_t th; pthread_create(&th,0,disturb,0);
  long iters=0, zero=0, short_=0, highzero=0; double t0=now();
  while (now()-t0 < secs) {
    CUmemPoolProps pr; memset(&pr,0,sizeof pr); pr.allocType=CU_MEM_ALLOCATION_TYPE_PINNED; pr.location.type=CU_MEM_LOCATION_TYPE_DEVICE; pr.location.id=0;
    CUmemoryPool pool; CK(cuMemPoolCreate(&pool,&pr)); cuuint64_t th_=~0ull; CK(cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &th_));
    CUstream s; CK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING)); CUdeviceptr p;
    CK(cuMemAllocFromPoolAsync(&p, 32<<20, pool, s)); CK(cuMemFreeAsync(p, s)); CK(cuStreamSynchronize(s));
    cuuint64_t res=0, high=0; CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT, &res)); CK(cuMemPoolGetAttribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH, &high));
    if (res == 0) zero++; else if (res < (32u<<20)) short_++; if (high < (32u<<20)) highzero++;
    CK(cuStreamDestroy(s)); CK(cuMemPoolDestroy(pool)); iters++;
  }
  stop=1; pthread_join(th,0);
  printf("mode=%-8s cache_disable=%s primes=%ld reserved0=%ld short=%ld high<32MiB=%ld disturber_iters=%ld\n", mode, getenv("CUDA_CACHE_DISABLE")?getenv("CUDA_CACHE_DISABLE"):"-", iters, zero, short_, highzero, dist_iters);
  return 0;
}
