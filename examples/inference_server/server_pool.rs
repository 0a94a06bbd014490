//! `--resource`: the pool behind the server, `PoolResource` or `ExpandablePoolResource`.

use super::*;

/// `PoolResource` or `ExpandablePoolResource`, as `--resource` says.
#[derive(Debug)]
pub(crate) enum ServerPool {
    Pool(Box<PoolResource<CudaResource>>),
    Expandable(ExpandablePoolResource),
}

impl ServerPool {
    /// The pool of `options`' maximum. The expandable one starts with nothing mapped: with no
    /// seams between its growths, any request up to the maximum can be served, where the
    /// chunked pool must take all of it up front.
    pub(crate) fn new(
        resource: &str,
        device: &Device,
        options: PoolOptions,
    ) -> Result<Self, BoxError> {
        Ok(match resource {
            "pool" => Self::Pool(Box::new(PoolResource::new(
                CudaResource::new(device),
                options,
            )?)),
            "expandable" => Self::Expandable(ExpandablePoolResource::new(
                device,
                ExpandableOptions {
                    maximum: options.maximum,
                    ..ExpandableOptions::default()
                },
            )?),
            other => return Err(format!("--resource {other}: expected pool or expandable").into()),
        })
    }

    pub(crate) fn maximum(&self) -> usize {
        match self {
            Self::Pool(p) => p.maximum(),
            Self::Expandable(p) => p.maximum(),
        }
    }

    pub(crate) fn stats(&self) -> PoolStats {
        match self {
            Self::Pool(p) => p.stats(),
            Self::Expandable(p) => p.stats(),
        }
    }

    pub(crate) fn wait_stats(&self) -> WaitStats {
        match self {
            Self::Pool(p) => p.wait_stats(),
            Self::Expandable(p) => p.wait_stats(),
        }
    }

    pub(crate) fn inner(&self) -> &dyn MemoryResource {
        match self {
            Self::Pool(p) => &**p,
            Self::Expandable(p) => p,
        }
    }
}

// SAFETY: every allocation is one of the wrapped resources' (each a `MemoryResource`), passed on
// unchanged and freed through the same one.
unsafe impl MemoryResource for ServerPool {
    fn device(&self) -> &Device {
        self.inner().device()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        self.inner().allocate(bytes, stream)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on to the pool that handed `ptr` out.
        unsafe { self.inner().deallocate(ptr, bytes, stream) }
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.inner().memory_waiters()
    }

    fn memory_snapshot(&self) -> Option<streamalloc::resource::snapshot::Snapshot> {
        self.inner().memory_snapshot()
    }
}
