//! Real GPUs, through cudarc's driver API with dynamic loading. With its siblings, the only
//! files that call the driver: here the context, the device, streams and events, raw memory and
//! the reactor's doorbells; `cuda_pools.rs` the stream-ordered pools, `cuda_work.rs` copies,
//! memsets and kernels, `cuda_peer.rs` several GPUs, `cuda_vmm.rs` virtual memory,
//! `cuda_words.rs` the completion words the GPU writes after each event, `cuda/opened.rs` what
//! the devices opened on one GPU share.
//!
//! Every call first makes the device's primary context current on the calling thread (a cheap
//! check when it already is). Kernels come from the PTX the crate carries
//! (`kernels/streamalloc.ptx`), loaded once per GPU while any of its devices lives (once per
//! device on a cudarc user's context), so no toolkit or NVRTC is needed.

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_void, CStr};
use std::mem::MaybeUninit;
use std::time::Duration;

use cudarc::driver::{result, sys, DriverError};

use crate::error::{Error, Result};
use crate::reactor::{Bell, Doorbells, Watch};
use crate::sync::plain::OnceLock;
use crate::sync::{Arc, Mutex};

mod opened;

use opened::Opened;

/// The PTX of `kernels/streamalloc.cu`, NUL-terminated for `cuModuleLoadData`.
const PTX: &str = concat!(include_str!("../../kernels/streamalloc.ptx"), "\0");

/// Threads per block of the element-wise kernels.
pub(super) const BLOCK: u32 = 256;

pub(super) fn check(call: &'static str, r: std::result::Result<(), DriverError>) -> Result<()> {
    r.map_err(|e| Error::driver(call, e))
}

pub(super) fn raw(call: &'static str, r: sys::CUresult) -> Result<()> {
    check(call, r.result())
}

/// Runs `f`, a driver call the driver counts as "potentially unsafe" during a graph capture,
/// with the calling thread's stream-capture mode relaxed (as PyTorch's caching allocator does
/// around its allocations). While a user's capture is under way, such calls are refused with
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and the capture is invalidated: on the capturing
/// thread (thread-local mode), or on any thread (global mode, CUDA's and cudarc's default).
/// On an H100, driver 580 (`tests/graph_capture.rs`, run150 to run152), that is so of
/// `cuMemAlloc` and of `cuStreamQuery` and `cuEventQuery` of streams and events that are not
/// captured at all: a pool growing, or asking whether another stream is idle, on the user's
/// capturing thread spoiled the capture. These calls act at once on work outside the capture
/// (the memory is allocated now, not captured), which is what the crate means by them.
///
/// Two calls more (`cuThreadExchangeStreamCaptureMode`, which only swaps a per-thread value:
/// 16 ns for both on an H100 host, run153), none on a thread that relaxed itself for good
/// ([`relax_capture_mode_for_good`]: a CUDA device's reactor thread).
pub(crate) fn with_capture_relaxed<T>(f: impl FnOnce() -> T) -> T {
    if RELAXED_FOR_GOOD.with(Cell::get) {
        return f();
    }
    /// Puts the thread's own mode back, also if `f` panics (a tokio worker survives its
    /// task's panic, and must not stay relaxed for good).
    struct Restore(Option<sys::CUstreamCaptureMode>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(mut mode) = self.0 {
                // SAFETY: writes the relaxed mode back into `mode`, a valid enum value.
                let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
            }
        }
    }
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: writes the thread's previous mode into `mode`, a valid enum value.
    let swapped =
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } == sys::CUresult::CUDA_SUCCESS;
    let _restore = Restore(swapped.then_some(mode));
    f()
}

std::thread_local! {
    /// This thread set its capture mode to relaxed and keeps it so.
    static RELAXED_FOR_GOOD: Cell<bool> = const { Cell::new(false) };
}

/// Sets the calling thread's capture mode to relaxed for the rest of its life: for a CUDA
/// device's reactor thread, which captures nothing and polls events (`cuEventQuery`, about
/// 10,000 a second while it spins) while users' captures may be under way, so that its calls
/// skip [`with_capture_relaxed`]'s two. Only with the driver loaded.
fn relax_capture_mode_for_good() {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: writes the thread's previous mode into `mode`, a valid enum value.
    if unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) } == sys::CUresult::CUDA_SUCCESS {
        RELAXED_FOR_GOOD.with(|r| r.set(true));
    }
}

/// Loads the driver library and initializes it, or says why not. Never panics: cudarc's loader
/// panics when `libcuda` is missing, so we look for it first.
pub(crate) fn driver_device_count() -> Result<usize> {
    // SAFETY: only tries to dlopen the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoDriver);
    }
    match result::init() {
        Ok(()) => {}
        // cuInit reports a machine with a driver but no GPU this way.
        Err(DriverError(sys::CUresult::CUDA_ERROR_NO_DEVICE)) => return Ok(0),
        Err(e) => return Err(Error::driver("cuInit", e)),
    }
    let count = result::device::get_count().map_err(|e| Error::driver("cuDeviceGetCount", e))?;
    Ok(count.max(0) as usize)
}

/// The device's context, held through cudarc's handle of it, so that a cudarc user and this
/// crate share one context (`Device::from_cudarc`, `Device::cudarc_context`): cudarc retained
/// it (the primary context, `CudaContext::new`) or the user made it, and it is released when
/// the last `Arc` of cudarc's handle goes. The device and its reactor thread each hold one
/// `Arc` of this, so the context outlives whichever of them goes last. (cudarc's `Arc` is
/// std's: its API takes and returns `std::sync::Arc`; the context is not a structure that the
/// loom models share.)
pub(crate) struct Context {
    cudarc: std::sync::Arc<cudarc::driver::CudaContext>,
}

impl Context {
    /// The primary context of GPU `ordinal` (cudarc retains it). The caller checked that the
    /// driver is there (`CudaContext::new` panics without it).
    pub(super) fn open(ordinal: usize) -> Result<Self> {
        let cudarc = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| Error::driver("cuDevicePrimaryCtxRetain", e))?;
        Ok(Self { cudarc })
    }

    /// A context made by a cudarc user, shared (not copied, not retained again).
    pub(crate) fn from_cudarc(cudarc: std::sync::Arc<cudarc::driver::CudaContext>) -> Self {
        Self { cudarc }
    }

    /// cudarc's handle of the context.
    pub(crate) fn cudarc(&self) -> &std::sync::Arc<cudarc::driver::CudaContext> {
        &self.cudarc
    }

    pub(super) fn raw(&self) -> sys::CUcontext {
        self.cudarc.cu_ctx()
    }

    /// [`CudaDevice::malloc_host`] in this context.
    pub(crate) fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        self.bind()?;
        let mut ptr: *mut c_void = std::ptr::null_mut();
        let r = with_capture_relaxed(|| {
            // SAFETY: writes one host pointer into `ptr`; the flags are valid cuMemHostAlloc
            // flags.
            unsafe {
                sys::cuMemHostAlloc(
                    &mut ptr,
                    bytes,
                    sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            }
        });
        raw("cuMemHostAlloc", r)?;
        Ok(ptr as *mut u8)
    }

    /// [`CudaDevice::free_host`] in this context.
    ///
    /// # Safety
    /// As there: `ptr` came from `malloc_host`, is freed once, and nothing uses it any more.
    pub(crate) unsafe fn free_host(&self, ptr: *mut u8) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller's contract.
        raw(
            "cuMemFreeHost",
            with_capture_relaxed(|| unsafe { sys::cuMemFreeHost(ptr as *mut c_void) }),
        )
    }

    /// Makes this context current on the calling thread, if it is not already.
    pub(crate) fn bind(&self) -> Result<()> {
        let mut current = MaybeUninit::uninit();
        // SAFETY: cuCtxGetCurrent writes one handle into `current`.
        raw("cuCtxGetCurrent", unsafe {
            sys::cuCtxGetCurrent(current.as_mut_ptr())
        })?;
        // SAFETY: written by the successful call above.
        if unsafe { current.assume_init() } != self.raw() {
            // SAFETY: cudarc's handle keeps the context alive for as long as `self` lives.
            check("cuCtxSetCurrent", unsafe {
                result::ctx::set_current(self.raw())
            })?;
        }
        Ok(())
    }
}

/// A raw stream or event handle, sendable across threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Handle<T>(pub(crate) T);
// SAFETY: CUstream and CUevent are driver handles usable from any thread with the context
// current; every use goes through `CudaDevice`, which binds it first.
unsafe impl<T> Send for Handle<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for Handle<T> {}

pub(crate) type RawStream = Handle<sys::CUstream>;
pub(crate) type RawEvent = Handle<sys::CUevent>;
/// A driver memory pool (`cuMemPoolCreate`).
pub(crate) type RawPool = Handle<sys::CUmemoryPool>;

pub(super) struct Kernels {
    pub(super) module: sys::CUmodule,
    pub(super) fill_u32: sys::CUfunction,
    pub(super) scale_f32: sys::CUfunction,
    pub(super) spin: sys::CUfunction,
    /// The pattern kernels (issue 16), added after the others: a PTX file made before them
    /// lacks them, and then only their launches fail (with the lookup's error), not the
    /// device.
    pub(super) fill_pattern_u32: Result<sys::CUfunction>,
    pub(super) count_mismatches_u32: Result<sys::CUfunction>,
}

impl Kernels {
    /// Unloads the module, in its context (the caller's current one). Its functions must not
    /// be launched after.
    pub(super) fn unload(&self) {
        // SAFETY: the module was loaded by `load_kernels` and is unloaded once, by the one
        // owner of these handles (`Opened`), when no device can launch its functions any more.
        let _ = unsafe { result::module::unload(self.module) };
    }
}

pub(crate) struct CudaDevice {
    /// The context, the kernels and the stream this device shares with the others opened on
    /// its GPU (`cuda/opened.rs`); `ctx` is a copy of its handle.
    opened: std::sync::Arc<Opened>,
    pub(crate) ctx: Arc<Context>,
    pub(crate) ordinal: usize,
    pub(crate) name: String,
    pub(crate) total_memory: usize,
    pub(super) multiprocessors: u32,
    /// The SM's highest clock rate, in kHz: the spin kernel's cycle count stands for at most
    /// the real time at this rate.
    pub(super) clock_khz: u64,
    /// Idle events, reused by `record` (creating one costs ~330 ns, more than recording).
    events: Mutex<Vec<RawEvent>>,
    /// The driver pool behind `malloc_async`, made on first use.
    pub(super) pool: OnceLock<RawPool>,
}

// SAFETY: the module, function and pool handles are driver handles usable from any thread once
// the context is current, which every method arranges first.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; the mutable state (the event free list) is behind a mutex.
unsafe impl Sync for CudaDevice {}

impl CudaDevice {
    pub(crate) fn open(ordinal: usize) -> Result<Self> {
        let count = driver_device_count()?;
        if ordinal >= count {
            return Err(Error::InvalidDevice { ordinal, count });
        }
        Self::with(Opened::of_gpu(ordinal)?)
    }

    /// The device of a context a cudarc user made (its own kernels and first stream: see
    /// `first_stream` for why those of `open` are shared).
    pub(crate) fn on_context(ctx: Context) -> Result<Self> {
        Self::with(std::sync::Arc::new(Opened::new(ctx, false)?))
    }

    fn with(opened: std::sync::Arc<Opened>) -> Result<Self> {
        let ctx = opened.ctx.clone();
        ctx.bind()?;
        let ordinal = ctx.cudarc().ordinal();
        let dev = ctx.cudarc().cu_device();
        let name =
            result::device::get_name(dev).map_err(|e| Error::driver("cuDeviceGetName", e))?;
        // SAFETY: `dev` is a valid device.
        let total_memory = unsafe { result::device::total_mem(dev) }
            .map_err(|e| Error::driver("cuDeviceTotalMem", e))?;
        // SAFETY: `dev` is a valid device and the attribute is an int.
        let multiprocessors = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
        }
        .map_err(|e| Error::driver("cuDeviceGetAttribute", e))?;
        // SAFETY: as above.
        let clock_khz = unsafe {
            result::device::get_attribute(
                dev,
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE,
            )
        }
        .map_err(|e| Error::driver("cuDeviceGetAttribute", e))?;
        Ok(Self {
            opened,
            ctx,
            ordinal,
            name,
            total_memory,
            multiprocessors: multiprocessors.max(1) as u32,
            clock_khz: clock_khz.max(0) as u64,
            events: Mutex::new(Vec::new()),
            pool: OnceLock::new(),
        })
    }

    /// The stream the devices of a context hold while any lives (`Opened`), so that cudarc
    /// counts one stream of the context from the start (`create_stream`).
    ///
    /// cudarc synchronizes the whole context (`cuCtxSynchronize`) when a handle of it makes
    /// its first stream, the switch to its multi-stream event tracking. `open` made a new
    /// handle of the primary context for every device: each open waited for all the process's
    /// work on that GPU, and on an H100 that `cuCtxSynchronize` crashed inside the driver (a
    /// null dereference) twice in about 190 runs of the `base_resources` tests, whose threads
    /// open devices while others work (tenth session). The devices of a GPU now share one
    /// handle (`cuda/opened.rs`); and on a handle of our own (`own`), made just now, no cudarc
    /// slice exists, so no use of one needs that synchronization: event tracking is off while
    /// the stream is made, and no slice can be made in that window, since nothing else holds
    /// the handle yet. A cudarc user's context keeps cudarc's rule.
    pub(super) fn first_stream(
        ctx: &Context,
        own: bool,
    ) -> Result<std::sync::Arc<cudarc::driver::CudaStream>> {
        let cudarc = ctx.cudarc();
        let skip = own && cudarc.is_event_tracking() && !cudarc.is_in_multi_stream_mode();
        if skip {
            // SAFETY: see above: tracking is off only for this call, on a handle no one else
            // holds yet, on which no `CudaSlice` exists or can be made meanwhile.
            unsafe { cudarc.disable_event_tracking() };
        }
        let stream = cudarc.new_stream();
        if skip {
            // SAFETY: turned back on before the handle is shared; slices made from now on are
            // tracked, and none was made while it was off.
            unsafe { cudarc.enable_event_tracking() };
        }
        stream.map_err(|e| Error::driver("cuStreamCreate", e))
    }

    /// The crate's kernels, loaded into the context.
    pub(super) fn kernels(&self) -> &Kernels {
        &self.opened.kernels
    }

    pub(super) fn load_kernels() -> Result<Kernels> {
        // SAFETY: PTX is a NUL-terminated PTX image; the context is current.
        let module = unsafe { result::module::load_data(PTX.as_ptr() as *const c_void) }
            .map_err(|e| Error::driver("cuModuleLoadData", e))?;
        let get = |name: &CStr| {
            // SAFETY: `module` was just loaded and holds these entry points.
            unsafe { result::module::get_function(module, name.to_owned()) }
                .map_err(|e| Error::driver("cuModuleGetFunction", e))
        };
        // Looked up now, but a missing one is kept as its error (naming the kernel) for its
        // launches to return.
        let optional = |name: &CStr, call: &'static str| {
            get(name).map_err(|e| match e {
                Error::Driver { code, name, .. } => Error::Driver { call, code, name },
                other => other,
            })
        };
        let required = (|| {
            Ok((
                get(c"streamalloc_fill_u32")?,
                get(c"streamalloc_scale_f32")?,
                get(c"streamalloc_spin")?,
            ))
        })();
        let (fill_u32, scale_f32, spin) = match required {
            Ok(functions) => functions,
            Err(e) => {
                // SAFETY: loaded just above, and no function of it was handed out.
                let _ = unsafe { result::module::unload(module) };
                return Err(e);
            }
        };
        Ok(Kernels {
            fill_u32,
            scale_f32,
            spin,
            fill_pattern_u32: optional(
                c"streamalloc_fill_pattern_u32",
                "cuModuleGetFunction(streamalloc_fill_pattern_u32)",
            ),
            count_mismatches_u32: optional(
                c"streamalloc_count_mismatches_u32",
                "cuModuleGetFunction(streamalloc_count_mismatches_u32)",
            ),
            module,
        })
    }

    pub(crate) fn mem_info(&self) -> Result<(usize, usize)> {
        self.ctx.bind()?;
        result::mem_get_info().map_err(|e| Error::driver("cuMemGetInfo", e))
    }

    // ===== streams and events =====

    /// A new non-blocking stream, made and owned by cudarc (`CudaContext::new_stream`): the
    /// `Stream` holds cudarc's `Arc`, so that handing it to cudarc (`Stream::cudarc_stream`)
    /// is an `Arc` clone, and the driver's stream is destroyed (work already queued still
    /// runs, the driver's own rule) when the last holder on either side lets go. (cudarc
    /// synchronizes the context when its count of live streams goes up from zero: the devices
    /// of a GPU hold one stream while any lives, made by [`first_stream`](Self::first_stream),
    /// so that never happens here.)
    pub(crate) fn create_stream(
        &self,
    ) -> Result<(RawStream, std::sync::Arc<cudarc::driver::CudaStream>)> {
        let stream = self
            .ctx
            .cudarc()
            .new_stream()
            .map_err(|e| Error::driver("cuStreamCreate", e))?;
        Ok((Handle(stream.cu_stream()), stream))
    }

    pub(crate) fn record(&self, stream: RawStream) -> Result<RawEvent> {
        self.ctx.bind()?;
        let event = match self.events.lock().pop() {
            Some(e) => e,
            None => result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map(Handle)
                .map_err(|e| Error::driver("cuEventCreate", e))?,
        };
        // SAFETY: both handles are live; the event is idle (fresh or returned by `release_event`,
        // which only happens when no handle of its last recording remains).
        match unsafe { result::event::record(event.0, stream.0) } {
            Ok(()) => Ok(event),
            Err(e) => {
                self.events.lock().push(event);
                Err(Error::driver("cuEventRecord", e))
            }
        }
    }

    /// Records `event` (one the caller owns, idle or not: a wait already enqueued keeps the
    /// recording it saw) on `stream`.
    pub(crate) fn record_into(&self, event: RawEvent, stream: RawStream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: both handles are live (the caller owns the event).
        check("cuEventRecord", unsafe {
            result::event::record(event.0, stream.0)
        })
    }

    /// Gives an event back to the free list. Its last recording may still be pending on the
    /// GPU: re-recording it later is still correct, since a stream wait captures the recording
    /// current when the wait was enqueued.
    pub(crate) fn release_event(&self, event: RawEvent) {
        self.events.lock().push(event);
    }

    pub(crate) fn query(&self, event: RawEvent) -> Option<Result<()>> {
        if let Err(e) = self.ctx.bind() {
            return Some(Err(e));
        }
        // SAFETY: the event is live (its `Event` holds it).
        match with_capture_relaxed(|| unsafe { result::event::query(event.0) }) {
            Ok(()) => Some(Ok(())),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => None,
            Err(e) => Some(Err(Error::driver("cuEventQuery", e))),
        }
    }

    pub(crate) fn wait(&self, stream: RawStream, event: RawEvent) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: both handles are live.
        check("cuStreamWaitEvent", unsafe {
            result::stream::wait_event(
                stream.0,
                event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        })
    }

    /// Whether `stream` is being captured into a graph (`cuStreamIsCapturing`): work queued on
    /// it now is not run, only recorded into the graph.
    pub(crate) fn capturing(&self, stream: RawStream) -> Result<bool> {
        self.ctx.bind()?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a live stream; writes one status.
        raw("cuStreamIsCapturing", unsafe {
            sys::cuStreamIsCapturing(stream.0, &mut status)
        })?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Whether all work queued on `stream` so far has completed (`cuStreamQuery`). With
    /// `may_capture` (a stream whose handle went out), a stream being captured into a graph is
    /// answered "not idle", without `cuStreamQuery`.
    pub(crate) fn stream_idle(&self, stream: RawStream, may_capture: bool) -> Result<bool> {
        // Querying the execution status of a stream that is being captured is illegal, and an
        // illegal call during capture invalidates the capture (CUDA Programming Guide, stream
        // capture, "Prohibited and Unhandled Operations" and "Invalidation"; `cuStreamQuery`
        // returns CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED). A stream handed out through cudarc
        // may be captured by the user's code, and the pools ask this of it for their own use
        // (`Stream::probe_idle`): asking would break the user's capture. Its captured work has
        // not run (it runs only as a graph), so "not idle" is the answer that promises nothing.
        // `cuStreamIsCapturing` is legal during capture. Only such streams pay for the check
        // (the crate's own are never captured): the pools' idle probes are on the cross-stream
        // reuse path (100,000 a run of `churn-xs-1t`).
        if may_capture && self.capturing(stream)? {
            return Ok(false);
        }
        self.ctx.bind()?;
        // SAFETY: the stream is live (the caller's `Stream` holds it).
        match with_capture_relaxed(|| unsafe { sys::cuStreamQuery(stream.0) }) {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => raw("cuStreamQuery", e).map(|()| false),
        }
    }

    pub(crate) fn synchronize_stream(&self, stream: RawStream) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the stream is live.
        check(
            "cuStreamSynchronize",
            with_capture_relaxed(|| unsafe { result::stream::synchronize(stream.0) }),
        )
    }

    pub(crate) fn synchronize_event(&self, event: RawEvent) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the event is live.
        check(
            "cuEventSynchronize",
            with_capture_relaxed(|| unsafe { result::event::synchronize(event.0) }),
        )
    }

    // ===== memory =====

    pub(crate) fn malloc(&self, bytes: usize) -> Result<u64> {
        self.ctx.bind()?;
        let mut ptr = 0;
        let r = with_capture_relaxed(|| {
            // SAFETY: writes one device pointer into `ptr`.
            unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes) }
        });
        raw("cuMemAlloc", r)?;
        Ok(ptr)
    }

    /// # Safety
    /// `ptr` came from `malloc` and no queued work uses it.
    pub(crate) unsafe fn free(&self, ptr: u64) -> Result<()> {
        self.ctx.bind()?;
        // SAFETY: the caller's contract.
        raw(
            "cuMemFree",
            with_capture_relaxed(|| unsafe { sys::cuMemFree_v2(ptr) }),
        )
    }

    /// `cuMemAllocManaged` with `CU_MEM_ATTACH_GLOBAL`: memory any stream and the host may
    /// use. Freed by `free`.
    pub(crate) fn malloc_managed(&self, bytes: usize) -> Result<u64> {
        self.ctx.bind()?;
        let mut ptr = 0;
        let r = with_capture_relaxed(|| {
            // SAFETY: writes one device pointer into `ptr`; the flag is a valid attach flag.
            unsafe {
                sys::cuMemAllocManaged(
                    &mut ptr,
                    bytes,
                    sys::CUmemAttach_flags::CU_MEM_ATTACH_GLOBAL as u32,
                )
            }
        });
        raw("cuMemAllocManaged", r)?;
        Ok(ptr)
    }

    /// `cuMemHostAlloc` with `PORTABLE | DEVICEMAP`: page-locked host memory that every
    /// context can use, mapped into the device's address space (with unified addressing the
    /// device address is the host address).
    pub(crate) fn malloc_host(&self, bytes: usize) -> Result<*mut u8> {
        self.ctx.malloc_host(bytes)
    }

    /// # Safety
    /// `ptr` came from `malloc_host`, is freed once, and no queued work and no host code uses
    /// it any more.
    pub(crate) unsafe fn free_host(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.ctx.free_host(ptr) }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        for event in self.events.lock().drain(..) {
            // SAFETY: idle events of ours; no handle refers to them any more.
            let _ = unsafe { result::event::destroy(event.0) };
        }
        if let Some(pool) = self.pool.get() {
            // SAFETY: every `Device` handle is gone, so nothing allocates from it any more.
            unsafe { self.destroy_pool(*pool) };
        }
        // The kernels' module goes with the last device of the GPU (`Opened`).
    }
}

// ===== the reactor's doorbells =====

/// Host function queued on a watcher stream: rings the reactor's bell. It makes no CUDA call,
/// and the only thing it drops is a `Box<Arc<Bell>>`, whose Drop makes none either.
unsafe extern "C" fn ring_bell(data: *mut c_void) {
    // SAFETY: `data` is the `Box<Arc<Bell>>` leaked by `CudaDoorbells::arm`, and the driver runs
    // this function exactly once.
    let bell = unsafe { Box::from_raw(data as *mut Arc<Bell>) };
    bell.ring();
}

/// Doorbells for the reactor of a CUDA device: per watched stream, a watcher stream that waits
/// for the head event and then runs [`ring_bell`]. A watcher per stream (not one shared) so that
/// a long wait on one stream never delays the doorbell of another.
pub(crate) struct CudaDoorbells {
    ctx: Arc<Context>,
    spin: Duration,
    max_sleep: Duration,
    predict: bool,
    prewake: Option<Duration>,
    watchers: HashMap<u64, RawStream>,
}

impl CudaDoorbells {
    pub(crate) fn new(ctx: Arc<Context>, options: &crate::device::CudaOptions) -> Self {
        use crate::device::WakeStrategy;
        let spin = match options.reactor_strategy {
            // An hour of hot loop after every completion or registration: always hot.
            WakeStrategy::Spin => Duration::from_secs(3600),
            WakeStrategy::Predict | WakeStrategy::Backoff => options.reactor_spin,
        };
        let predict = options.reactor_strategy == WakeStrategy::Predict;
        Self {
            ctx,
            spin,
            max_sleep: options.reactor_max_sleep.max(Duration::from_micros(1)),
            predict,
            prewake: options.reactor_prewake.filter(|_| predict),
            watchers: HashMap::new(),
        }
    }
}

impl Doorbells for CudaDoorbells {
    fn start(&mut self) {
        if let Err(e) = self.ctx.bind() {
            tracing::error!(error = %e, "the completion reactor could not bind the CUDA context");
        }
        // A user's global-mode capture must not be spoiled by the reactor's polls.
        relax_capture_mode_for_good();
    }

    fn spin(&self) -> Duration {
        self.spin
    }

    fn max_sleep(&self) -> Option<Duration> {
        Some(self.max_sleep)
    }

    fn predict(&self) -> bool {
        self.predict
    }

    fn prewake(&self) -> Option<Duration> {
        self.prewake
    }

    fn arm(&mut self, head: &dyn Watch, bell: &Arc<Bell>) -> bool {
        let Some(event) = head.raw_cuda_event() else {
            return false;
        };
        if !head.stream_alive() {
            // Its stream is gone: a watcher made for it now would outlive the `forget` that
            // came (or comes) for it, one driver stream lost per such stream for the device's
            // life (a review's finding). Its last events are polled instead.
            return false;
        }
        // The context is the device's (`start` bound it, but a deferred free of a peer
        // device's buffer, run on this thread, binds that device's): watchers are made in
        // ours. A no-op when it is current already.
        if self.ctx.bind().is_err() {
            return false;
        }
        let watcher = match self.watchers.get(&head.stream_id()) {
            Some(w) => *w,
            None => match result::stream::create(result::stream::StreamKind::NonBlocking) {
                Ok(w) => *self.watchers.entry(head.stream_id()).or_insert(Handle(w)),
                Err(_) => return false,
            },
        };
        // SAFETY: the watcher is ours and live; the event is held by `head`.
        if unsafe {
            result::stream::wait_event(
                watcher.0,
                event,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .is_err()
        {
            return false;
        }
        let data = Box::into_raw(Box::new(bell.clone())) as *mut c_void;
        // SAFETY: `ring_bell` takes ownership of `data` when it runs; if the launch fails it never
        // runs and we take it back below.
        match unsafe { result::stream::launch_host_function(watcher.0, ring_bell, data) } {
            Ok(()) => true,
            Err(_) => {
                // SAFETY: the driver did not take `data`; it is still our leaked box.
                drop(unsafe { Box::from_raw(data as *mut Arc<Bell>) });
                false
            }
        }
    }

    fn forget(&mut self, stream: u64) {
        if let Some(watcher) = self.watchers.remove(&stream) {
            // In the device's context, as `arm` made it (a peer's may be current here).
            let _ = self.ctx.bind();
            // SAFETY: ours; a pending doorbell on it still runs (destroy defers to completion).
            let _ = unsafe { result::stream::destroy(watcher.0) };
        }
    }
}

impl Drop for CudaDoorbells {
    fn drop(&mut self) {
        let _ = self.ctx.bind();
        for (_, watcher) in self.watchers.drain() {
            // SAFETY: ours; queued doorbells still run.
            let _ = unsafe { result::stream::destroy(watcher.0) };
        }
    }
}
