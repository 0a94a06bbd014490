//! The resource replayed against, built from the arguments over a counter of the bytes it holds
//! from the device, and the device it runs on.

use std::sync::atomic::{AtomicU64, Ordering};

use streamalloc::resource::arena::{ArenaOptions, ArenaResource};
use streamalloc::resource::binning::BinningResource;
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::cuda_async::{CudaAsyncOptions, CudaAsyncResource};
use streamalloc::resource::pool::{PoolOptions, PoolResource};
use streamalloc::{Device, DevicePtr, MemoryKind, MemoryResource, SimConfig, Stream};

use super::args::{fmt_bytes, Args, ResourceKind};

/// Counts the bytes a resource holds from its upstream: its reserve, current and peak.
#[derive(Debug)]
pub(super) struct Counted<U> {
    pub(super) inner: U,
    pub(super) current: AtomicU64,
    pub(super) peak: AtomicU64,
}

impl<U> Counted<U> {
    pub(super) fn new(inner: U) -> Self {
        Self {
            inner,
            current: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged;
// this only counts.
unsafe impl<U: MemoryResource> MemoryResource for Counted<U> {
    fn device(&self) -> &Device {
        self.inner.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.inner.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> streamalloc::Result<DevicePtr> {
        let ptr = self.inner.allocate(bytes, stream)?;
        let now = self.current.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Ordering::Relaxed);
        Ok(ptr)
    }

    unsafe fn deallocate(
        &self,
        ptr: DevicePtr,
        bytes: usize,
        stream: &Stream,
    ) -> streamalloc::Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe { self.inner.deallocate(ptr, bytes, stream) }?;
        self.current.fetch_sub(bytes as u64, Ordering::Relaxed);
        Ok(())
    }
}

/// The resource replayed against. One value for the whole run, so its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Built {
    Pool(PoolResource<Counted<CudaResource>>),
    Arena(ArenaResource<Counted<CudaResource>>),
    Binning(BinningResource<PoolResource<Counted<CudaResource>>>),
    Cuda(Counted<CudaResource>),
    CudaAsync(CudaAsyncResource),
}

impl Built {
    pub(super) fn resource(&self) -> &dyn MemoryResource {
        match self {
            Built::Pool(r) => r,
            Built::Arena(r) => r,
            Built::Binning(r) => r,
            Built::Cuda(r) => r,
            Built::CudaAsync(r) => r,
        }
    }

    /// The counter of bytes held from the device, if there is one.
    pub(super) fn counted(&self) -> Option<&Counted<CudaResource>> {
        match self {
            Built::Pool(r) => Some(r.upstream()),
            Built::Arena(r) => Some(r.upstream()),
            Built::Binning(r) => Some(r.upstream().upstream()),
            Built::Cuda(r) => Some(r),
            Built::CudaAsync(_) => None,
        }
    }

    /// The most bytes held from the device, if known.
    pub(super) fn peak_reserved(&self) -> Option<u64> {
        let counted = match self {
            Built::Pool(r) => r.upstream(),
            Built::Arena(r) => r.upstream(),
            Built::Binning(r) => r.upstream().upstream(),
            Built::Cuda(r) => r,
            Built::CudaAsync(_) => return None,
        };
        Some(counted.peak.load(Ordering::Relaxed))
    }
}

/// `bytes` rounded up to a multiple of 256, as a `usize`. The sizes are parsed within range
/// ([`parse_rounded_size`](super::args::parse_rounded_size)); an error all the same, not an
/// overflow (a review's finding).
pub(super) fn round256(bytes: u64) -> streamalloc::Result<usize> {
    bytes
        .checked_next_multiple_of(256)
        .and_then(|b| usize::try_from(b).ok())
        .ok_or(streamalloc::Error::InvalidArgument {
            what: "a size rounded up to a multiple of 256 bytes passes the largest size",
        })
}

pub(super) fn build(args: &Args, device: &Device) -> streamalloc::Result<(Built, String)> {
    let cuda = || Counted::new(CudaResource::new(device));
    let total = device.total_memory() as u64;
    // The default maximum of the pool and the arena, as they take it themselves: the device's
    // memory, rounded down to the 256 bytes they hand out in (`--sim-memory 1000` gives 768).
    // Named here so that the line printed says what the resource got.
    let device_maximum = device.total_memory() / 256 * 256;
    let pool = || {
        let initial = round256(args.initial.unwrap_or(0))?;
        let maximum = (args.maximum.map(round256).transpose()?).unwrap_or(device_maximum);
        let options = PoolOptions {
            initial,
            maximum: Some(maximum),
            ..PoolOptions::default()
        };
        let text = format!(
            "initial {}, maximum {}",
            fmt_bytes(initial as u64),
            fmt_bytes(maximum as u64)
        );
        PoolResource::new(cuda(), options).map(|p| (p, text))
    };
    Ok(match args.resource {
        ResourceKind::Pool => {
            let (p, text) = pool()?;
            (Built::Pool(p), format!("pool ({text})"))
        }
        ResourceKind::Arena => {
            let initial = round256(args.arena_size.or(args.initial).unwrap_or(0))?;
            let maximum = args
                .maximum
                .or(args.arena_size)
                .map(round256)
                .transpose()?
                .unwrap_or(device_maximum);
            let options = ArenaOptions {
                initial,
                maximum: Some(maximum),
                superblock_size: round256(args.superblock_size.max(1))?,
            };
            let text = format!(
                "arena (initial {}, maximum {}, superblocks of {})",
                fmt_bytes(initial as u64),
                fmt_bytes(maximum as u64),
                fmt_bytes(options.superblock_size as u64)
            );
            (Built::Arena(ArenaResource::new(cuda(), options)?), text)
        }
        ResourceKind::Binning => {
            let (p, text) = pool()?;
            let b = BinningResource::builder(p)
                .bins_pow2(args.bin_min_log2, args.bin_max_log2)
                .blocks_per_chunk(args.blocks_per_chunk)
                .build()?;
            let text = format!(
                "binning (bins of {}..{}, {} blocks per chunk, over a pool: {text})",
                fmt_bytes(1u64.checked_shl(args.bin_min_log2).unwrap_or(0)),
                fmt_bytes(1u64.checked_shl(args.bin_max_log2).unwrap_or(0)),
                args.blocks_per_chunk
            );
            (Built::Binning(b), text)
        }
        ResourceKind::Cuda => (Built::Cuda(cuda()), "cuda".to_owned()),
        ResourceKind::CudaAsync => {
            let options = CudaAsyncOptions {
                release_threshold: args.release_threshold.map(|b| b as usize),
                initial_pool_size: args.initial.map(|b| b as usize),
                maximum_pool_size: args.maximum.map(|b| b as usize),
            };
            let text = format!(
                "cuda-async (initial {}, maximum {}, release threshold {})",
                fmt_bytes(args.initial.unwrap_or(0)),
                fmt_bytes(args.maximum.unwrap_or(total)),
                args.release_threshold
                    .map_or_else(|| "none: keeps all".to_owned(), fmt_bytes)
            );
            (
                Built::CudaAsync(CudaAsyncResource::new(device, options)?),
                text,
            )
        }
    })
}

pub(super) fn open_device(args: &Args) -> streamalloc::Result<Device> {
    let sim = |memory: Option<u64>| {
        let mut config = SimConfig::default();
        if let Some(bytes) = memory {
            config.total_memory = bytes as usize;
        }
        Device::simulated(config)
    };
    // `--sim-memory` sizes only a simulated device: say so when a GPU is used instead, rather
    // than replay on 80 GB in silence what the user meant for a small device.
    let gpu = |device: Device| {
        if args.sim_memory.is_some() {
            eprintln!(
                "note: --sim-memory ignored: replaying on {} (use --device sim for a simulated device)",
                device.name()
            );
        }
        device
    };
    match args.device.as_str() {
        "auto" => {
            let device = Device::default_device()?;
            Ok(if !device.is_simulated() {
                gpu(device)
            } else if args.sim_memory.is_some() {
                sim(args.sim_memory)
            } else {
                device
            })
        }
        "sim" | "simulated" => Ok(sim(args.sim_memory)),
        "cuda" => Device::cuda(0).map(gpu),
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => Device::cuda(ordinal).map(gpu),
            _ => Err(streamalloc::Error::InvalidArgument {
                what: "--device must be auto, sim, cuda or cuda:N",
            }),
        },
    }
}
