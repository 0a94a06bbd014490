//! The resource adaptors on every available device (see `common`): what each one promises
//! (statistics, tracking, logging, limiting, alignment, failure callback, prefetch), that they
//! compose, and that `allocate_async` waits through them in the right queue.

#[path = "../common/mod.rs"]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{devices, eventually, free, label, pool, read_u32, SplitMix64};
use streamalloc::resource::adaptor::{
    AlignedAdaptor, Counter, Counters, FailureCallbackAdaptor, LimitingAdaptor, LoggingAdaptor,
    PrefetchAdaptor, StatisticsAdaptor, TrackingAdaptor, LOG_FILE_ENV,
};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::managed::ManagedResource;
use streamalloc::resource::pool::PoolResource;
use streamalloc::{AllocateAsync, DevicePtr, Error, MemoryKind, MemoryResource, Stream, ALIGNMENT};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const PIB: usize = 1 << 50;

type Pool = PoolResource<CudaResource>;

/// A deallocation that the test expects to be refused; returns the error.
fn bad_free(
    res: &(impl MemoryResource + ?Sized),
    ptr: DevicePtr,
    bytes: usize,
    stream: &Stream,
) -> Error {
    // SAFETY: the adaptors under test refuse these frees before any memory is touched (that is
    // what the tests check); nothing is freed.
    unsafe { res.deallocate(ptr, bytes, stream) }.expect_err("a bad free was accepted")
}

fn round_up(bytes: usize) -> usize {
    bytes.next_multiple_of(ALIGNMENT)
}

/// A `Write` whose bytes the test reads back.
#[derive(Clone, Default)]
struct SharedBuf(Arc<Mutex<Vec<u8>>>);

impl SharedBuf {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

impl Write for SharedBuf {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "streamalloc-adaptors-{}-{name}.csv",
        std::process::id()
    ))
}

#[derive(Debug, PartialEq, Eq, Clone)]
struct Line {
    thread: u64,
    action: String,
    ptr: u64,
    size: usize,
    stream: u64,
}

/// Parses a log as RMM's replay tool would, checking every column's form.
fn parse_log(text: &str) -> Vec<Line> {
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("Thread,Time,Action,Pointer,Size,Stream"));
    lines
        .map(|line| {
            let cols: Vec<&str> = line.split(',').collect();
            assert_eq!(cols.len(), 6, "{line}");
            // Time: HH:MM:SS.ffffff
            let t = cols[1].as_bytes();
            assert_eq!(t.len(), 15, "{line}");
            for (i, &ch) in t.iter().enumerate() {
                match i {
                    2 | 5 => assert_eq!(ch, b':', "{line}"),
                    8 => assert_eq!(ch, b'.', "{line}"),
                    _ => assert!(ch.is_ascii_digit(), "{line}"),
                }
            }
            assert!(cols[1][..2].parse::<u32>().unwrap() < 24);
            assert!(cols[3].starts_with("0x"), "{line}");
            Line {
                thread: cols[0].parse().unwrap(),
                action: cols[2].to_owned(),
                ptr: u64::from_str_radix(&cols[3][2..], 16).unwrap(),
                size: cols[4].parse().unwrap(),
                stream: cols[5].parse().unwrap(),
            }
        })
        .collect()
}

mod aligned;
mod composition;
mod every_adaptor;
mod failure_callback;
mod limiting;
mod logging;
mod prefetch;
mod statistics;
mod tracking;
