//! A copy of src/resource/waiters.rs's `MemoryWaiters` (the queue, not the statistics) with
//! switchable bugs. `NONE` is the same logic as the real one.

use std::collections::VecDeque;
use std::task::Waker;

use crate::sync::{fence, AtomicUsize, Mutex, Ordering};

pub(crate) const NONE: u8 = 0;
/// `remove` does not wake the next waiter when the first leaves.
pub(crate) const NO_HAND_OFF: u8 = 1;
/// `register` and `notify` without their SeqCst fences.
pub(crate) const NO_FENCES: u8 = 2;

struct Entry {
    id: u64,
    waker: Waker,
    notified: bool,
}

#[derive(Default)]
struct Queue {
    entries: VecDeque<Entry>,
    next_id: u64,
}

pub(crate) struct Waiters<const BUG: u8> {
    queue: Mutex<Queue>,
    len: AtomicUsize,
}

impl<const BUG: u8> super::Queue for Waiters<BUG> {
    fn new() -> Self {
        Waiters {
            queue: Mutex::new(Queue::default()),
            len: AtomicUsize::new(0),
        }
    }

    fn notify(&self) {
        if BUG != NO_FENCES {
            fence(Ordering::SeqCst);
        }
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let waker = {
            let mut queue = self.queue.lock();
            match queue.entries.front_mut() {
                Some(head) if !head.notified => {
                    head.notified = true;
                    Some(head.waker.clone())
                }
                _ => None,
            }
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    fn is_empty(&self) -> bool {
        self.len.load(Ordering::Acquire) == 0
    }

    fn register(&self, _bytes: usize, waker: &Waker) -> (u64, bool) {
        let mut queue = self.queue.lock();
        let id = queue.next_id;
        queue.next_id += 1;
        queue.entries.push_back(Entry {
            id,
            waker: waker.clone(),
            notified: false,
        });
        self.len.fetch_add(1, Ordering::Release);
        if BUG != NO_FENCES {
            fence(Ordering::SeqCst);
        }
        (id, queue.entries.len() == 1)
    }

    fn poll_entry(&self, id: u64, waker: &Waker) -> Option<bool> {
        let mut queue = self.queue.lock();
        let entry = queue.entries.iter_mut().find(|e| e.id == id)?;
        if !entry.waker.will_wake(waker) {
            entry.waker = waker.clone();
        }
        Some(std::mem::replace(&mut entry.notified, false))
    }

    fn remove(&self, id: u64, _served: bool) {
        let next = {
            let mut queue = self.queue.lock();
            let Some(at) = queue.entries.iter().position(|e| e.id == id) else {
                return;
            };
            queue.entries.remove(at);
            self.len.fetch_sub(1, Ordering::Release);
            if at == 0 && BUG != NO_HAND_OFF {
                queue.entries.front_mut().map(|next| {
                    next.notified = true;
                    next.waker.clone()
                })
            } else {
                None
            }
        };
        if let Some(waker) = next {
            waker.wake();
        }
    }
}
