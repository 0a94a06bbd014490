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

// Keeps the stream busy for at least `ns` nanoseconds, touching no memory. Launched with one
// thread; it sleeps between reads so that it does not hog the SM.
//
// Two clocks must both say so. %globaltimer: its steps between reads are summed, each counted
// only if forward and at most STEP_MAX, since it may be adjusted backwards (a plain
// `now - start` would then wrap) and forwards. And the SM's cycle counter: at least
// `min_cycles`, which the host computes from the device's highest clock rate, so that it
// stands for at most the real time: a clock that runs fast cannot end a spin early, and either
// clock running slow only makes the spin longer. (The second clock was added when tests that
// need a stream still busy failed now and then on fresh H200s; run31 of 2026-11-24 showed the
// spins had lasted: the host took over 30 ms to reach its check. Those tests now lengthen the
// spin when the host is late.)
#define STEP_MAX 100000ull
extern "C" __global__ void streamalloc_spin(unsigned long long ns, unsigned long long min_cycles) {
    unsigned long long last, now, elapsed = 0;
    long long start = clock64();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(last));
    while (elapsed < ns || (unsigned long long)(clock64() - start) < min_cycles) {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now > last) {
            elapsed += min(now - last, STEP_MAX);
        }
        last = now;
    }
}

// ===== the pattern kernels: fill a buffer with values unique to it, and count mismatches =====
//
// Word `i` of a buffer filled with `seed` holds streamalloc_pattern(seed, i): splitmix64's
// finalizer of seed + (i + 1) * 0x9E3779B97F4A7C15, its two halves xored. Different seeds give
// unrelated sequences, so memory handed out twice, or a stale copy of another buffer, shows as
// mismatches. The host's definition is `Stream::pattern_u32` (src/stream/pattern.rs); the
// simulated device's is `pattern_u32` in src/device/sim/kernels.rs: keep the three in step.

static __device__ __forceinline__ unsigned int streamalloc_pattern(unsigned long long seed,
                                                                   unsigned long long i) {
    unsigned long long z = seed + (i + 1ULL) * 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z = z ^ (z >> 31);
    return (unsigned int)(z ^ (z >> 32));
}

extern "C" __global__ void streamalloc_fill_pattern_u32(unsigned int *dst, unsigned long long seed,
                                                        unsigned long long count) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < count; i += stride) {
        dst[i] = streamalloc_pattern(seed, i);
    }
}

// Adds to *mismatches the number of words i < count with src[i] != streamalloc_pattern(seed, i).
// Each thread counts its own words and adds once (only if it found any), so a clean buffer
// costs no atomic at all.
extern "C" __global__ void streamalloc_count_mismatches_u32(const unsigned int *src,
                                                            unsigned long long seed,
                                                            unsigned long long count,
                                                            unsigned long long *mismatches) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long found = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
         i < count; i += stride) {
        if (src[i] != streamalloc_pattern(seed, i)) {
            found += 1;
        }
    }
    if (found != 0) {
        atomicAdd(mismatches, found);
    }
}
