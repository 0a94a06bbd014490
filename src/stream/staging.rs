//! Giving a staging block back behind the copy that used it: after an event, or after a new
//! event of the copy's stream. The staging cache itself is the device's (`device/staging.rs`).

use crate::device::staging::StagingBlock;
use crate::device::Device;
use crate::event::Event;
use crate::stream::Stream;

impl Device {
    /// Gives a block back once `event` completes (the copy that used it is queued before it).
    /// The callback runs on the reactor thread: it caches or retires the block, never frees it.
    pub(crate) fn return_staging_after(&self, block: StagingBlock, event: &Event) {
        let device = self.clone();
        event.on_complete(Box::new(move |_| device.inner.staging.put_or_retire(block)));
    }

    /// Gives a block back whose copy on `stream` may be queued but has no event after it (the
    /// record failed): behind a new event of `stream`, which the copy precedes. If that cannot
    /// be recorded either, the block is leaked (logged): reusing it could let the copy write
    /// into the next user's data.
    pub(crate) fn return_staging_after_queued(&self, block: StagingBlock, stream: &Stream) {
        match stream.record() {
            Ok(event) => self.return_staging_after(block, &event),
            Err(e) => tracing::error!(
                error = %e,
                bytes = block.size,
                "could not fence a staging block behind its copy; it is leaked"
            ),
        }
    }
}
