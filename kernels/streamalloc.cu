// Built-in kernels of streamalloc. The crate carries the PTX compiled from this file
// (streamalloc.ptx, made by build.sh on a machine with nvcc), so that neither the CUDA toolkit
// nor NVRTC is needed when the crate is built or run. The simulated device implements the same
// kernels in Rust (src/device/sim/kernels.rs); keep the two in step.
//
// Every kernel uses a grid-stride loop, so any launch shape covers any element count.

extern "C" __global__ void streamalloc_fill_u32(unsigned int *dst, unsigned int value,
                                                unsigned long long count) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < count; i += stride) {
        dst[i] = value;
    }
}

extern "C" __global__ void streamalloc_scale_f32(float *data, float factor,
                                                 unsigned long long count) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < count; i += stride) {
        data[i] = data[i] * factor;
    }
}

// Keeps the stream busy for `ns` nanoseconds of GPU time (read from %globaltimer), touching no
// memory. Launched with one thread; it sleeps between reads so that it does not hog the SM.
// Time is summed from forward steps only: %globaltimer may be adjusted backwards, and a plain
// `now - start` would then wrap and end the spin at once.
extern "C" __global__ void streamalloc_spin(unsigned long long ns) {
    unsigned long long last, now, elapsed = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(last));
    while (elapsed < ns) {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now > last) {
            elapsed += now - last;
        }
        last = now;
    }
}
