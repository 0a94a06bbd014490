//! Buffers as cudarc kernel arguments (`launch_builder().arg(&buf)`).

use super::DeviceBuffer;

// SAFETY: pushes a reference to the buffer's `CUdeviceptr` (a `u64`, which cudarc passes as a
// kernel parameter by value), borrowed for as long as the launch arguments. The caller orders
// the launch's stream after the buffer's, as for any kernel argument.
unsafe impl<'a, 'b: 'a> cudarc::driver::PushKernelArg<&'b DeviceBuffer>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b DeviceBuffer) -> &mut Self {
        self.arg(&arg.ptr.0)
    }
}

// SAFETY: as above, for a buffer the kernel may write.
unsafe impl<'a, 'b: 'a> cudarc::driver::PushKernelArg<&'b mut DeviceBuffer>
    for cudarc::driver::LaunchArgs<'a>
{
    #[inline(always)]
    fn arg(&mut self, arg: &'b mut DeviceBuffer) -> &mut Self {
        self.arg(&arg.ptr.0)
    }
}
