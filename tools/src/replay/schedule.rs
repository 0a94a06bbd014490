//! The order of the replay between threads: `--order log` passes a turn along the log's global
//! order (spin, yield, then park until the thread before hands it over); `--order threads` lets
//! a free wait only for its own allocation's slot.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::thread::Thread;
use std::time::Duration;

use super::args::Order;
use super::threads::Shared;

/// Slot values besides a pointer (pointers are 256-aligned, so never these).
pub(super) const PENDING: u64 = 0;
pub(super) const FAILED: u64 = 1;
pub(super) const FREED: u64 = 2;

impl Shared<'_> {
    /// `--order log`: waits until event `index` is next. Spins a little, then yields (the
    /// thread whose turn it is may need this core), then parks until the thread before hands
    /// over the turn.
    pub(super) fn wait_turn(&self, index: u64, me: usize) {
        let mut tries = 0u32;
        while self.turn.load(Ordering::Acquire) != index {
            tries += 1;
            if tries < 64 {
                std::hint::spin_loop();
            } else if tries < 64 + 256 {
                std::thread::yield_now();
            } else {
                // Announce the park, then look again: `pass_turn` stores the turn and then
                // reads the flag (both SeqCst), so one of the two sees the other.
                self.parked[me].store(true, Ordering::SeqCst);
                if self.turn.load(Ordering::SeqCst) != index {
                    std::thread::park_timeout(Duration::from_millis(50));
                }
                self.parked[me].store(false, Ordering::Relaxed);
            }
        }
    }

    pub(super) fn pass_turn(&self, index: u64, me: usize) {
        self.turn.store(index + 1, Ordering::SeqCst);
        if let Some(&next) = self.owner.get(index as usize + 1) {
            let next = next as usize;
            if next != me && self.parked[next].load(Ordering::SeqCst) {
                if let Some(handle) = self.handles[next].get() {
                    handle.unpark();
                }
            }
        }
    }

    /// `--order threads`: our pointer for allocation `id`, waiting until it is replayed.
    ///
    /// The waiter counts itself in `waiting`, registers in `slot_waiters`, then looks at the
    /// slot again; `fill_slot` stores the slot, then reads `waiting` (both SeqCst) and wakes
    /// the registered thread. Either the filler sees the count (and, through the map's lock,
    /// the registration or a registration that comes after its store), or the waiter sees the
    /// slot filled.
    pub(super) fn wait_slot(&self, id: u32) -> u64 {
        let slot = &self.slots[id as usize];
        let value = slot.load(Ordering::SeqCst);
        if value != PENDING {
            return value;
        }
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.waiters().insert(id, std::thread::current());
        let value = loop {
            let value = slot.load(Ordering::SeqCst);
            if value != PENDING {
                break value;
            }
            std::thread::park_timeout(Duration::from_millis(50));
        };
        self.waiters().remove(&id);
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        value
    }

    pub(super) fn waiters(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Thread>> {
        self.slot_waiters.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn fill_slot(&self, id: u32, value: u64) {
        self.slots[id as usize].store(value, Ordering::SeqCst);
        if self.order == Order::Threads && self.waiting.load(Ordering::SeqCst) > 0 {
            if let Some(waiter) = self.waiters().get(&id) {
                waiter.unpark();
            }
        }
    }
}
