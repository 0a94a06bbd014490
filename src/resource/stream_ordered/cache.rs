//! Lists found through a thread-local cache: what [`Stream`] adds to [`EngineStream`] (the loom
//! model's fake stream has no cache), and the cache itself.

use super::{EngineStream, StreamList};
use crate::error::Result;
use crate::stream::Stream;
use crate::sync::Arc;

impl EngineStream for Stream {
    type Name = crate::stream::StreamId;

    #[inline]
    fn uid(&self) -> u64 {
        Stream::id(self).get()
    }

    fn name(&self) -> crate::stream::StreamId {
        Stream::id(self)
    }

    fn handle_count(&self) -> usize {
        Stream::handle_count(self)
    }

    fn order_before(&self, later: &Self) -> Result<()> {
        self.record().and_then(|event| later.wait(&event))
    }

    #[inline]
    fn cached(engine: u64, stream: u64) -> Option<Arc<StreamList<Self>>> {
        tls::get(engine, stream)
    }

    #[inline]
    fn cache(engine: u64, stream: u64, list: &Arc<StreamList<Self>>) {
        tls::put(engine, stream, list)
    }

    fn forget_cached(engine: u64) {
        tls::forget(engine, None)
    }

    fn uncache(engine: u64, stream: u64) {
        tls::forget(engine, Some(stream))
    }

    #[inline]
    fn with_cached<R>(
        engine: u64,
        stream: u64,
        f: impl FnOnce(&StreamList<Self>) -> R,
    ) -> Option<R> {
        tls::with(engine, stream, f)
    }

    fn find_cached<R>(
        engine: u64,
        stream: u64,
        f: impl FnMut(&StreamList<Self>) -> Option<R>,
    ) -> Option<R> {
        tls::find(engine, stream, f)
    }
}

#[cfg(not(streamalloc_loom))]
mod tls {
    //! The thread-local cache of the last four (engine, stream) → list lookups, for
    //! [`Stream`]'s lists, most recent first. Several: a thread that allocates on one stream
    //! and frees on another (the hand-off of `churn-xs`, a pipeline stage) would otherwise miss
    //! on every operation and take the registry's lock each time, and a free of a block
    //! handed out on another stream finds its live entry in one of the cached lists (four
    //! streams per thread, as `churn-xs-1t` drives, stay cached). Not under loom: loom objects
    //! must not outlive a model.
    use std::cell::RefCell;

    use super::super::StreamList;
    use crate::stream::Stream;
    use crate::sync::Arc;

    /// (engine uid, stream uid, the stream's list), most recent first.
    type Entry = Option<(u64, u64, Arc<StreamList<Stream>>)>;

    const WAYS: usize = 4;

    thread_local! {
        static LAST: RefCell<[Entry; WAYS]> = const { RefCell::new([None, None, None, None]) };
    }

    fn is(entry: &Entry, uid: u64, stream: u64) -> bool {
        matches!(entry, Some((u, s, _)) if *u == uid && *s == stream)
    }

    // `#[inline]`: the engine is generic, so its lookups are compiled in the crate that uses the
    // pool; without it this small function would be called across crates on every operation.
    #[inline]
    pub(super) fn get(uid: u64, stream: u64) -> Option<Arc<StreamList<Stream>>> {
        LAST.with(|last| {
            last.borrow()
                .iter()
                .find(|e| is(e, uid, stream))
                .and_then(|e| e.as_ref().map(|(_, _, list)| list.clone()))
        })
    }

    #[inline]
    pub(super) fn put(uid: u64, stream: u64, list: &Arc<StreamList<Stream>>) {
        // `try_with`: during thread teardown the cache may already be gone.
        let _ = LAST.try_with(|last| {
            let mut last = last.borrow_mut();
            // Moves the entries before this one's old place (or all, the last falling out)
            // down one, and puts it first.
            let at = last
                .iter()
                .position(|e| is(e, uid, stream))
                .unwrap_or(WAYS - 1);
            last[..=at].rotate_right(1);
            last[0] = Some((uid, stream, list.clone()));
        });
    }

    /// `f` on the cached list, borrowed in place.
    #[inline]
    pub(super) fn with<R>(
        uid: u64,
        stream: u64,
        f: impl FnOnce(&StreamList<Stream>) -> R,
    ) -> Option<R> {
        LAST.try_with(|last| {
            let last = last.borrow();
            let entry = last.iter().find(|e| is(e, uid, stream))?;
            entry.as_ref().map(|(_, _, list)| f(list))
        })
        .ok()
        .flatten()
    }

    /// `f` on each cached list of engine `uid` but `stream`'s, until it returns `Some`.
    pub(super) fn find<R>(
        uid: u64,
        stream: u64,
        mut f: impl FnMut(&StreamList<Stream>) -> Option<R>,
    ) -> Option<R> {
        LAST.try_with(|last| {
            last.borrow().iter().find_map(|e| match e {
                Some((u, s, list)) if *u == uid && *s != stream => f(list),
                _ => None,
            })
        })
        .ok()
        .flatten()
    }

    /// Drops the cached lists of engine `uid` (of `stream` only, if given).
    pub(super) fn forget(uid: u64, stream: Option<u64>) {
        let _ = LAST.try_with(|last| {
            for entry in last.borrow_mut().iter_mut() {
                if entry
                    .as_ref()
                    .is_some_and(|(u, s, _)| *u == uid && stream.is_none_or(|x| x == *s))
                {
                    *entry = None;
                }
            }
        });
    }
}

#[cfg(streamalloc_loom)]
mod tls {
    use super::super::StreamList;
    use crate::stream::Stream;
    use crate::sync::Arc;

    pub(super) fn get(_: u64, _: u64) -> Option<Arc<StreamList<Stream>>> {
        None
    }

    pub(super) fn put(_: u64, _: u64, _: &Arc<StreamList<Stream>>) {}

    pub(super) fn forget(_: u64, _: Option<u64>) {}

    pub(super) fn with<R>(_: u64, _: u64, _: impl FnOnce(&StreamList<Stream>) -> R) -> Option<R> {
        None
    }

    pub(super) fn find<R>(
        _: u64,
        _: u64,
        _: impl FnMut(&StreamList<Stream>) -> Option<R>,
    ) -> Option<R> {
        None
    }
}
