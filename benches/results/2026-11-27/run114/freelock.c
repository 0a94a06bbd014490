// While one thread's cuMemFree waits for the device (a 1 s kernel on another stream), how long
// do other driver calls of another thread take?
#include <cuda.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s; cuGetErrorString(r_, &s); fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, s); exit(1);} } while (0)
static double now(void){ struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9; }
static CUcontext ctx; static CUdeviceptr victim; static double free_took; static void *hvictim; static int host_free;
static void CUDA_CB nothing(void *a) { (void)a; }
static void *freer(void *a) { (void)a; CK(cuCtxSetCurrent(ctx)); double t = now(); if (host_free) CK(cuMemFreeHost(hvictim)); else CK(cuMemFree(victim)); free_took = now() - t; return 0; }
int main(int argc, char **argv) {
  int with_free = argc > 1 && (!strcmp(argv[1], "free") || !strcmp(argv[1], "freehost")); host_free = argc > 1 && !strcmp(argv[1], "freehost");
  FILE *f = fopen("k.ptx","rb"); fseek(f,0,SEEK_END); long n=ftell(f); fseek(f,0,SEEK_SET); char *ptx=calloc(n+1,1); if (fread(ptx,1,n,f) != (size_t)n) return 1; fclose(f);
  CUdevice dev; CK(cuInit(0)); CK(cuDeviceGet(&dev,0)); CK(cuDevicePrimaryCtxRetain(&ctx, dev)); CK(cuCtxSetCurrent(ctx));
  CUmodule m; CK(cuModuleLoadData(&m, ptx)); CUfunction spin; CK(cuModuleGetFunction(&spin, m, "streamalloc_spin"));
  void *host; CUdeviceptr word; CK(cuMemHostAlloc(&host, 4096, CU_MEMHOSTALLOC_DEVICEMAP)); CK(cuMemHostGetDevicePointer(&word, host, 0));
  const char *names[] = {"cuEventRecord", "cuLaunchKernel", "cuStreamWriteValue32", "cuEventCreate", "cuStreamCreate", "cuMemHostAlloc", "cuEventQuery", "cuStreamQuery", "cuMemAllocAsync", "cuStreamWaitEvent", "cuLaunchHostFunc", "cuMemcpyHtoDAsync"};
  for (int c = 0; c < 12; c++) {
    CUstream s1, s2; CK(cuStreamCreate(&s1, CU_STREAM_NON_BLOCKING)); CK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
    CUevent ev, ev1; CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING)); CK(cuEventCreate(&ev1, CU_EVENT_DISABLE_TIMING));
    CK(cuMemAlloc(&victim, 1 << 20)); CK(cuMemHostAlloc(&hvictim, 1 << 20, 0));
    unsigned long long ns = 1000000000ull, cyc = 1980000000ull, zero = 0; void *params[] = {&ns, &cyc}; void *p0[] = {&zero, &zero};
    CK(cuLaunchKernel(spin, 1,1,1, 1,1,1, 0, s1, params, 0)); CK(cuEventRecord(ev1, s1));
    pthread_t th; free_took = 0; if (with_free) pthread_create(&th, 0, freer, 0);
    struct timespec w = {0, 50000000}; nanosleep(&w, 0);
    double t = now(); CUresult r = CUDA_SUCCESS; CUevent e2; CUstream s3; void *h2; CUdeviceptr pa;
    switch (c) {
      case 0: r = cuEventRecord(ev, s2); break;
      case 1: r = cuLaunchKernel(spin, 1,1,1, 1,1,1, 0, s2, p0, 0); break;
      case 2: r = cuStreamWriteValue32(s2, word, 1, 0); break;
      case 3: r = cuEventCreate(&e2, CU_EVENT_DISABLE_TIMING); if (!r) cuEventDestroy(e2); break;
      case 4: r = cuStreamCreate(&s3, CU_STREAM_NON_BLOCKING); if (!r) cuStreamDestroy(s3); break;
      case 5: r = cuMemHostAlloc(&h2, 4096, CU_MEMHOSTALLOC_DEVICEMAP); if (!r) { double t2 = now() - t; cuMemFreeHost(h2); t = now() - t2; } break;
      case 6: r = cuEventQuery(ev1); if (r == CUDA_ERROR_NOT_READY) r = CUDA_SUCCESS; break;
      case 7: r = cuStreamQuery(s1); if (r == CUDA_ERROR_NOT_READY) r = CUDA_SUCCESS; break;
      case 8: r = cuMemAllocAsync(&pa, 1 << 20, s2); if (!r) cuMemFreeAsync(pa, s2); break;
      case 9: r = cuStreamWaitEvent(s2, ev1, 0); break;
      case 10: r = cuLaunchHostFunc(s2, nothing, 0); break;
      case 11: { static CUdeviceptr d = 0; if (!d) cuMemAllocAsync(&d, 4096, s2); r = cuMemcpyHtoDAsync(d, host, 64, s2); } break;
    }
    double took = now() - t;
    const char *en = "ok"; if (r) cuGetErrorName(r, &en);
    if (with_free) pthread_join(th, 0); else CK(cuMemFree(victim));
    if (host_free) CK(cuMemFree(victim)); else CK(cuMemFreeHost(hvictim));
    printf("%s: %-22s %9.3f ms (%s); the other thread's free took %.3f ms\n", with_free ? (host_free ? "with a cuMemFreeHost waiting" : "with a cuMemFree waiting") : "alone", names[c], took * 1e3, en, free_took * 1e3);
    CK(cuStreamSynchronize(s1)); CK(cuStreamSynchronize(s2)); CK(cuEventDestroy(ev)); CK(cuEventDestroy(ev1)); CK(cuStreamDestroy(s1)); CK(cuStreamDestroy(s2));
  }
  return 0;
}
