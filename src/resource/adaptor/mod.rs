//! Resource adaptors: resources that wrap another resource (their *upstream*, held by value as
//! RMM's `*_resource_adaptor<Upstream>`) and add one thing to it.
//!
//! | adaptor | RMM | adds |
//! |---|---|---|
//! | [`StatisticsAdaptor`] | `statistics_resource_adaptor` | current, peak and total bytes and counts, in nested scopes |
//! | [`TrackingAdaptor`] | `tracking_resource_adaptor` | every outstanding allocation (with a backtrace if asked), a report, rejection of unknown frees |
//! | [`LoggingAdaptor`] | `logging_resource_adaptor` | a CSV line per allocate, free and failed allocate, in RMM's format |
//! | [`HistoryAdaptor`] | (PyTorch's `_record_memory_history`) | the last N events in memory, off until started; live allocations for exact snapshots |
//! | [`LimitingAdaptor`] | `limiting_resource_adaptor` | a byte limit, with its own queue of tasks waiting for memory |
//! | [`AlignedAdaptor`] | `aligned_resource_adaptor` | alignments above 256 bytes, from a size threshold on |
//! | [`FailureCallbackAdaptor`] | `failure_callback_resource_adaptor` | a callback on out-of-memory that may free memory and ask for a retry |
//! | [`PrefetchAdaptor`] | `prefetch_resource_adaptor` | a prefetch of managed memory to the device after each allocation |
//!
//! Every adaptor is a [`MemoryResource`](crate::MemoryResource) itself, so they stack:
//! `StatisticsAdaptor<LimitingAdaptor<PoolResource<CudaResource>>>`. Each forwards `device()`,
//! `memory_kind()` and `memory_waiters()` to its upstream (so
//! [`allocate_async`](crate::AllocateAsync::allocate_async) through an adaptor waits in the
//! upstream pool's queue), except where its documentation says otherwise: the
//! [`LimitingAdaptor`] can run out by itself, so it has its own queue, and the upstream's queue
//! (if it has one) relays its notifications to it, so that memory coming back below also wakes
//! a request the upstream refused. An `Arc` of a resource is
//! a resource, so an upstream can also be shared (`StatisticsAdaptor<Arc<PoolResource<_>>>`).
//!
//! Zero-byte allocations (a null pointer, no memory) pass through every adaptor to the upstream
//! and are not counted, tracked or limited; the [`LoggingAdaptor`] logs them, as RMM does.

mod aligned;
mod failure_callback;
mod history;
mod limiting;
mod logging;
mod prefetch;
mod statistics;
mod tracking;

/// The planted bug of the loom model (`loom-tests/adaptor_tables.rs`).
#[cfg(all(test, streamalloc_loom))]
pub(crate) use self::aligned::planted as aligned_planted;
pub use self::aligned::AlignedAdaptor;
pub use self::failure_callback::FailureCallbackAdaptor;
/// The planted bug of the loom model (`loom-tests/adaptor_tables.rs`).
#[cfg(all(test, streamalloc_loom))]
pub(crate) use self::history::planted as history_planted;
/// For the loom model (`loom-tests/history.rs`), which drives the recorder.
#[cfg(all(test, streamalloc_loom))]
pub(crate) use self::history::Recorder;
pub use self::history::{Action, History, HistoryAdaptor, HistoryEvent, HistoryOptions};
/// The planted bugs of the loom models (`loom-tests/waiters/limiting.rs`,
/// `loom-tests/cuda_async.rs`).
#[cfg(all(test, streamalloc_loom))]
pub(crate) use self::limiting::planted as limiting_planted;
/// The adaptor's byte count, which `CudaAsyncResource` counts its maximum with too (and the
/// loom models, `loom-tests/waiters.rs`, drive).
pub(crate) use self::limiting::Limit;
pub use self::limiting::LimitingAdaptor;
pub use self::logging::{LoggingAdaptor, LOG_FILE_ENV};
pub use self::prefetch::PrefetchAdaptor;
pub use self::statistics::{Counter, Counters, StatisticsAdaptor};
/// The planted bug of the loom model (`loom-tests/adaptor_tables.rs`).
#[cfg(all(test, streamalloc_loom))]
pub(crate) use self::tracking::planted as tracking_planted;
pub use self::tracking::TrackingAdaptor;
