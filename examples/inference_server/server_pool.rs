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

    /// The pool as the server's first line names it: the resource and the most it serves,
    /// with what `--pool-mib` asked (`asked`, in bytes) where that differs. The expandable pool
    /// rounds its maximum up to whole mapping units (8 MiB on the simulated device): `--pool-mib
    /// 1` served from 8 MiB while the line said "pool of 1 MiB".
    pub(crate) fn describe(&self, asked: usize) -> String {
        let name = match self {
            Self::Pool(_) => "PoolResource",
            Self::Expandable(_) => "ExpandablePoolResource",
        };
        let maximum = self.maximum();
        let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
        if maximum == asked {
            format!("{name} of {} MiB", mib(maximum))
        } else {
            format!(
                "{name} of {} MiB ({} MiB asked, rounded by the resource)",
                mib(maximum),
                mib(asked)
            )
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use streamalloc::SimConfig;

    fn options(bytes: usize) -> PoolOptions {
        PoolOptions {
            initial: bytes,
            maximum: Some(bytes),
            ..PoolOptions::default()
        }
    }

    /// The first line names the memory the server really has. `cargo test --example
    /// inference_server`.
    #[test]
    fn the_pool_is_described_by_what_it_holds() {
        let device = Device::simulated(SimConfig::default());
        let pool = ServerPool::new("pool", &device, options(8 << 20)).unwrap();
        assert_eq!(pool.describe(8 << 20), "PoolResource of 8 MiB");

        let expandable = ServerPool::new("expandable", &device, options(1 << 20)).unwrap();
        let maximum = expandable.maximum();
        assert!(
            maximum > 1 << 20,
            "the expandable pool kept {maximum} bytes"
        );
        assert_eq!(
            expandable.describe(1 << 20),
            format!(
                "ExpandablePoolResource of {} MiB (1 MiB asked, rounded by the resource)",
                maximum >> 20
            )
        );
    }
}
