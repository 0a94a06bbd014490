//! The engine's own handle of a stream it served ([`Kept`]): not counted among the stream's
//! users, so that two resources on one stream each see when its user has let go.

use std::ops::Deref;

use super::EngineStream;

/// A handle of a stream kept in a resource's registry (the engine's, the arena's). It does
/// not count in [`EngineStream::users`], so a resource lets go of the stream once no handle but
/// kept ones is left, however many resources keep one. (Before, each engine compared the
/// stream's `Arc` count with its own handles: a pool over a pool, or a pool beside an arena,
/// took the other resource's handle for the user's and kept every stream ever dropped.)
pub(crate) struct Kept<S: EngineStream>(S);

impl<S: EngineStream> Kept<S> {
    /// Keeps a handle of `stream`.
    pub(crate) fn new(stream: &S) -> Self {
        let handle = stream.clone();
        // After the clone: the count never reads lower than the handles that exist.
        handle.set_kept(true);
        Kept(handle)
    }
}

impl<S: EngineStream> Deref for Kept<S> {
    type Target = S;

    #[inline]
    fn deref(&self) -> &S {
        &self.0
    }
}

impl<S: EngineStream> Drop for Kept<S> {
    fn drop(&mut self) {
        // Before the handle's own drop takes it out of the count again.
        self.0.set_kept(false);
    }
}

/// A stream's count of users for the engine's fake streams (unit tests, loom models, the
/// lab), kept as [`Stream`](crate::stream::Stream) keeps its own: 1 for a new stream, one
/// more for each clone, one less for each drop, and [`set_kept`](Self::set_kept) for
/// [`Kept`]. A field of the fake: its derived `Clone` then counts. Std's atomics, not loom's:
/// a count the models read, not a race they explore.
#[cfg(test)]
pub(crate) struct Users(std::sync::Arc<std::sync::atomic::AtomicUsize>);

#[cfg(test)]
impl Users {
    /// The count of a new stream: its one handle.
    pub(crate) fn new() -> Self {
        Users(std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(1)))
    }

    /// [`EngineStream::users`].
    pub(crate) fn get(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// [`EngineStream::set_kept`].
    pub(crate) fn set_kept(&self, kept: bool) {
        if kept {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        } else {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

#[cfg(test)]
impl Clone for Users {
    fn clone(&self) -> Self {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Users(self.0.clone())
    }
}

#[cfg(test)]
impl Drop for Users {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}
