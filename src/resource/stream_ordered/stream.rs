//! What [`Stream`] gives the engine ([`EngineStream`]); the loom models use a fake stream
//! instead.

use super::EngineStream;
use crate::error::Result;
use crate::stream::Stream;

impl EngineStream for Stream {
    type Name = crate::stream::StreamId;

    #[inline]
    fn uid(&self) -> u64 {
        Stream::id(self).get()
    }

    fn name(&self) -> crate::stream::StreamId {
        Stream::id(self)
    }

    fn users(&self) -> usize {
        Stream::users(self)
    }

    fn set_kept(&self, kept: bool) {
        Stream::set_kept(self, kept)
    }

    fn order_before(&self, later: &Self) -> Result<()> {
        Stream::order_before(self, later)
    }

    #[inline]
    fn activity(&self) -> Option<u64> {
        Stream::activity(self)
    }

    #[inline]
    fn confirm_quiet(&self) -> bool {
        Stream::confirm_quiet(self)
    }

    fn is_idle(&self) -> bool {
        // The crate's probe, not the user's `is_idle`: on the simulated device, an idle answer
        // then vouches for the pool's reuse without ordering the user's other work.
        Stream::probe_idle(self).unwrap_or_else(|e| {
            tracing::debug!(error = %e, stream = %self.id(), "a stream query failed: taken as busy");
            false
        })
    }
}
