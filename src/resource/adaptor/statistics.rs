//! [`StatisticsAdaptor`]: current, peak and total bytes and allocation counts, in nested scopes
//! (RMM's `statistics_resource_adaptor`).

use std::fmt;

use crate::device::{Device, DevicePtr};
use crate::error::{Error, Result};
use crate::resource::{MemoryKind, MemoryResource, MemoryWaiters};
use crate::stream::Stream;
use crate::sync::Mutex;

/// One statistic: its current value, the highest it reached, and the sum of everything added
/// to it (RMM's `statistics_resource_adaptor::counter`).
///
/// Signed, as RMM's: inside a scope opened with
/// [`push_counters`](StatisticsAdaptor::push_counters), freeing memory allocated before the scope
/// takes `value` below zero.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Counter {
    /// What is outstanding now (allocated minus freed).
    pub value: i64,
    /// The highest `value` reached.
    pub peak: i64,
    /// Everything ever added (allocations only; frees do not subtract).
    pub total: i64,
}

impl Counter {
    // Saturating, never wrapping or panicking: real sizes never come near the bounds, and a
    // bad free's size is refused before it is counted (`can_sub`); a counter must not be what
    // turns bad input into a panic.
    fn add(&mut self, n: i64) {
        self.value = self.value.saturating_add(n);
        self.total = self.total.saturating_add(n);
        self.peak = self.peak.max(self.value);
    }

    /// Whether `sub(n)` fits the counter. A real free always does (a scope's value is at least
    /// minus what was outstanding when it was pushed); a bad one (a size no allocation had)
    /// may not: in a scope whose value is already negative, subtracting a huge size overflowed
    /// (a review found the debug build panicking there before the upstream could refuse it).
    fn can_sub(&self, n: i64) -> bool {
        self.value.checked_sub(n).is_some()
    }

    fn sub(&mut self, n: i64) {
        self.value = self.value.saturating_sub(n);
    }

    /// Undoes a `sub` whose free failed. The peak follows if allocations made meanwhile took
    /// the value past it: that much was really outstanding.
    fn restore(&mut self, n: i64) {
        self.value = self.value.saturating_add(n);
        self.peak = self.peak.max(self.value);
    }

    /// Folds the counter of a finished inner scope into this one, as RMM's
    /// `add_counters_from_tracked_sub_block`: the inner peak happened on top of our value.
    fn fold(&mut self, inner: &Counter) {
        self.peak = self.peak.max(self.value.saturating_add(inner.peak));
        self.value = self.value.saturating_add(inner.value);
        self.total = self.total.saturating_add(inner.total);
    }
}

/// The two counters of a scope: bytes, and number of allocations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    /// Bytes, as requested by the callers (not rounded up to the 256-byte alignment).
    pub bytes: Counter,
    /// Allocations.
    pub allocations: Counter,
}

impl Counters {
    fn fold(&mut self, inner: &Counters) {
        self.bytes.fold(&inner.bytes);
        self.allocations.fold(&inner.allocations);
    }
}

/// Counts what goes through it: current, peak and total bytes and allocations (RMM's
/// `statistics_resource_adaptor`), exactly.
///
/// - A successful allocation of `bytes > 0` adds `bytes` (as requested, not rounded) and one
///   allocation. A failed allocation counts nothing. **Zero-byte allocations are not counted**:
///   they hold no memory and return a null pointer that cannot be told apart from another, so
///   the counts are those of real, distinct allocations (RMM counts them as allocations of 0
///   bytes; we do not).
/// - A deallocation subtracts before the upstream is called (so that the counts never run
///   above what is really outstanding, even while another thread reuses the memory at once);
///   if the upstream rejects it, the subtraction is undone and the error returned.
/// - Scopes: [`push_counters`](Self::push_counters) opens a fresh scope (all zeros) on a stack;
///   every change goes to the innermost scope; [`pop_counters`](Self::pop_counters) closes it,
///   returns its counters and folds them into the enclosing scope exactly as RMM does
///   (`value += inner.value`, `total += inner.total`, `peak = max(peak, value_before +
///   inner.peak)`). So the outermost scope always describes the whole history.
///
/// The counters live under one mutex, taken for a few additions per call and never across an
/// upstream call: exact under any number of threads.
pub struct StatisticsAdaptor<U: MemoryResource> {
    upstream: U,
    scopes: Mutex<Scopes>,
}

/// The open scopes, each with an id, so that a refused free's restore finds the scope its
/// subtraction went to, whatever was pushed or popped in between.
#[derive(Debug)]
struct Scopes {
    /// The scopes, innermost last. Never empty: index 0 is the outermost scope, which
    /// `pop_counters` never removes.
    stack: Vec<Counters>,
    /// `ids[i]`: the id of `stack[i]`, increasing from the outermost (0) inwards.
    ids: Vec<u64>,
    /// The id of the next scope pushed.
    next_id: u64,
}

impl Scopes {
    fn top(&mut self) -> Option<(u64, &mut Counters)> {
        let id = *self.ids.last()?;
        Some((id, self.stack.last_mut()?))
    }
}

impl<U: MemoryResource> fmt::Debug for StatisticsAdaptor<U> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scopes = &self.scopes.lock().stack;
        f.debug_struct("StatisticsAdaptor")
            .field("upstream", &self.upstream)
            .field("counters", scopes.last().unwrap_or(&Counters::default()))
            .field("depth", &scopes.len())
            .finish()
    }
}

impl<U: MemoryResource> StatisticsAdaptor<U> {
    /// Counts the allocations made through it from `upstream`, starting from zero.
    pub fn new(upstream: U) -> Self {
        Self {
            upstream,
            scopes: Mutex::new(Scopes {
                stack: vec![Counters::default()],
                ids: vec![0],
                next_id: 1,
            }),
        }
    }

    /// The upstream resource.
    pub fn upstream(&self) -> &U {
        &self.upstream
    }

    /// The counters of the innermost scope.
    pub fn counters(&self) -> Counters {
        self.scopes.lock().stack.last().copied().unwrap_or_default()
    }

    /// The bytes counter of the innermost scope (RMM's `get_bytes_counter`).
    pub fn bytes_counter(&self) -> Counter {
        self.counters().bytes
    }

    /// The allocations counter of the innermost scope (RMM's `get_allocations_counter`).
    pub fn allocations_counter(&self) -> Counter {
        self.counters().allocations
    }

    /// Opens a new scope, with every counter at zero, and returns the counters of the scope it
    /// enters from (as RMM's `push_counters`).
    pub fn push_counters(&self) -> Counters {
        let mut scopes = self.scopes.lock();
        let outer = scopes.stack.last().copied().unwrap_or_default();
        scopes.stack.push(Counters::default());
        let id = scopes.next_id;
        scopes.ids.push(id);
        scopes.next_id += 1;
        outer
    }

    /// Closes the innermost scope: returns its counters and folds them into the enclosing one
    /// (see the type's documentation). `Err(InvalidArgument)` if no scope was pushed (the
    /// outermost scope cannot be popped; RMM throws `std::out_of_range` there).
    pub fn pop_counters(&self) -> Result<Counters> {
        let mut scopes = self.scopes.lock();
        if scopes.stack.len() < 2 {
            return Err(Error::InvalidArgument {
                what: "pop_counters: no scope was pushed (the outermost scope cannot be popped)",
            });
        }
        scopes.ids.pop();
        let inner = scopes.stack.pop().unwrap_or_default();
        if let Some(outer) = scopes.stack.last_mut() {
            outer.fold(&inner);
        }
        Ok(inner)
    }

    /// How many scopes are open: 1 when none was pushed.
    pub fn depth(&self) -> usize {
        self.scopes.lock().stack.len()
    }

    /// `f` on the innermost scope; that scope's id.
    fn with_top(&self, f: impl FnOnce(&mut Counters)) -> u64 {
        let mut scopes = self.scopes.lock();
        match scopes.top() {
            Some((id, top)) => {
                f(top);
                id
            }
            None => 0,
        }
    }

    /// `f` on the scope with id `id` if it is still open; else on the innermost open scope
    /// that enclosed it (it was popped, and its counters folded into that one). Ids increase
    /// inwards, and a scope still open that was pushed before `id` can only be one that
    /// enclosed it: the innermost scope with an id at most `id`.
    fn with_scope(&self, id: u64, f: impl FnOnce(&mut Counters)) {
        let mut scopes = self.scopes.lock();
        let Scopes { stack, ids, .. } = &mut *scopes;
        if let Some(i) = ids.iter().rposition(|&open| open <= id) {
            f(&mut stack[i]);
        }
    }
}

/// Bytes as a counter value. A `usize` above `i64::MAX` cannot be allocated (no resource holds
/// it), but saturate rather than wrap.
fn signed(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

// SAFETY: every allocation is the upstream's (itself a `MemoryResource`), passed on unchanged;
// the adaptor only counts.
unsafe impl<U: MemoryResource> MemoryResource for StatisticsAdaptor<U> {
    fn device(&self) -> &Device {
        self.upstream.device()
    }

    fn memory_kind(&self) -> MemoryKind {
        self.upstream.memory_kind()
    }

    fn allocate(&self, bytes: usize, stream: &Stream) -> Result<DevicePtr> {
        let ptr = self.upstream.allocate(bytes, stream)?;
        if bytes > 0 {
            self.with_top(|c| {
                c.bytes.add(signed(bytes));
                c.allocations.add(1);
            });
        }
        Ok(ptr)
    }

    unsafe fn deallocate(&self, ptr: DevicePtr, bytes: usize, stream: &Stream) -> Result<()> {
        if bytes == 0 {
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        }
        let mut counted = false;
        let scope = self.with_top(|c| {
            // A size the counters cannot take is no allocation of ours: not counted, and the
            // upstream refuses it.
            if c.bytes.can_sub(signed(bytes)) && c.allocations.can_sub(1) {
                c.bytes.sub(signed(bytes));
                c.allocations.sub(1);
                counted = true;
            }
        });
        // SAFETY: the caller's contract, passed on: `ptr` came from our `allocate`, which is the
        // upstream's with the same `bytes`.
        let result = unsafe { self.upstream.deallocate(ptr, bytes, stream) };
        if result.is_err() && counted {
            // Nothing was freed: count it as outstanding again, in the scope the subtraction
            // went to (another thread may have pushed or popped a scope meanwhile: a review
            // found the restore landing in a scope that never saw the free). Not in `total`:
            // it was counted there when it was allocated.
            self.with_scope(scope, |c| {
                c.bytes.restore(signed(bytes));
                c.allocations.restore(1);
            });
        }
        result
    }

    fn memory_waiters(&self) -> Option<&MemoryWaiters> {
        self.upstream.memory_waiters()
    }

    fn footprint(&self, bytes: usize) -> Result<usize> {
        self.upstream.footprint(bytes)
    }

    fn check_set(&self, sizes: &[usize]) -> Result<()> {
        self.upstream.check_set(sizes)
    }
    fn memory_snapshot(&self) -> Option<crate::resource::snapshot::Snapshot> {
        self.upstream.memory_snapshot()
    }
}
