//! Memory a trim has taken out of the free lists and holds while it waits for the GPU work of
//! the streams that last used it (`PoolResource::trim`, `ExpandablePoolResource::trim`).
//!
//! That wait can be long (a stream running a kernel), and the memory still counts against the
//! resource's maximum until the trim gives it back. A request that only that memory could serve
//! was refused meanwhile, at the maximum, though the trim would have freed the memory moments
//! later. So what a trim holds is listed here, and a request whose growth failed takes it all
//! back into the free lists ([`recall`](HeldForTrim::recall)), from where it is served as any
//! free memory is (after the streams that freed it, by the engine's orderings), then looks and
//! grows once more. A request that can grow never recalls: the trim keeps what it took. The
//! trim gives back only what is still its own when its wait ends
//! ([`release`](HeldForTrim::release), then [`given_back`](HeldForTrim::given_back)).
//!
//! A request reads the [`epoch`](HeldForTrim::epoch) before its last look; a recall that finds
//! nothing held but a newer epoch (a trim put its memory back, or finished giving it back, in
//! between) tells it to look and grow once more.
//!
//! [`hold`](HeldForTrim::hold) takes the memory out of the lists under this list's lock, and a
//! trim that ends early puts it back under it ([`put_back`](HeldForTrim::put_back)), so a
//! recall finds such memory in the lists or here, never in between. Every request at the
//! maximum takes this lock (and every request that grows reads the epoch under it), so the
//! pool's trim makes no driver call under it: it orders the chunks it took onto their streams
//! (events recorded, waits) once `hold` has let the lock go, and notes each as ordered
//! ([`replace`](HeldForTrim::replace)) only if it still holds it; a chunk recalled meanwhile
//! went back to its list as it was taken (with its tag), and the ordering is then only one
//! GPU-side wait more. The expandable pool's trim does the same with the ranges it takes
//! (`Expander::hold_free`, then `Expander::order_held` with every lock let go): before the
//! twenty-second session it ordered them inside `hold`, under its growth lock too, so that a
//! request at its maximum, or a growth, waited behind those records and waits (a review's
//! finding). Both hold their items as [`HeldOrder`]s. The give-back itself
//! (`cuMemFree`, which waits for the whole device to be idle; the unmapping) runs with no lock
//! held, so that no request waits for it: a request at the maximum that comes meanwhile is
//! refused as if the trim had finished first (an awaitable request waits, and the give-back's
//! end wakes it). Loom models: `loom-tests/expandable.rs`,
//! `a_request_at_the_maximum_recalls_what_a_trim_holds` and
//! `a_request_at_the_maximum_vs_a_cancelled_trim`; the pool's ordering with the lock let go
//! (hold, replace, release against a recall): `loom-tests/held_for_trim.rs`.

use crate::resource::stream_ordered::Waits;
use crate::sync::Mutex;
// The planted bugs' switches, read through `planted!` (they exist only under the loom cfg).
#[cfg(streamalloc_loom)]
use crate::resource::stream_ordered::planted;

/// How memory a trim holds stands with the streams that last used it (`S`: their handle).
#[derive(Clone)]
pub(crate) enum HeldOrder<S> {
    /// Out of its list with this tag, not yet ordered onto one stream: the trim does that with
    /// the trims' lock let go (driver calls). A recall puts it back with the tag, as it was.
    Tagged(Waits),
    /// Ordered: the stream after whose work it may be given back (`None`: no stream's work,
    /// memory never handed out or whose streams are all known done); a recall puts it back as
    /// freed there.
    On(Option<S>),
}

/// What trims hold now, each item under the ticket of the trim that took it.
pub(crate) struct HeldForTrim<T> {
    inner: Mutex<Held<T>>,
}

struct Held<T> {
    next_ticket: u64,
    items: Vec<(u64, T)>,
    /// Bumped by every [`put_back`](HeldForTrim::put_back) (memory back in the lists) and
    /// every [`given_back`](HeldForTrim::given_back) (room back under the maximum).
    epoch: u64,
    /// Recalls that found something, and releases (for the loom models).
    #[cfg(streamalloc_loom)]
    counts: (usize, usize),
    /// Everything ever held, under its ticket (for the planted bug of the loom model).
    #[cfg(streamalloc_loom)]
    ever: Vec<(u64, T)>,
}

/// One trim's claim on what it took ([`HeldForTrim::hold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket(u64);

impl<T: Clone> HeldForTrim<T> {
    /// Nothing held.
    pub(crate) fn new() -> Self {
        HeldForTrim {
            inner: Mutex::new(Held {
                next_ticket: 0,
                items: Vec::new(),
                epoch: 0,
                #[cfg(streamalloc_loom)]
                counts: (0, 0),
                #[cfg(streamalloc_loom)]
                ever: Vec::new(),
            }),
        }
    }

    /// Runs `take` (which takes memory out of the free lists for a trim) under this list's lock
    /// and holds what it took: the trim's ticket, and a copy of what it took (to wait for its
    /// streams).
    pub(crate) fn hold(&self, take: impl FnOnce() -> Vec<T>) -> (Ticket, Vec<T>) {
        let mut held = self.inner.lock();
        let ticket = Ticket(held.next_ticket);
        held.next_ticket += 1;
        let taken = take();
        held.items
            .extend(taken.iter().cloned().map(|item| (ticket.0, item)));
        #[cfg(streamalloc_loom)]
        held.ever
            .extend(taken.iter().cloned().map(|item| (ticket.0, item)));
        (ticket, taken)
    }

    /// What the trim of `ticket` still holds (a request may have recalled some or all of it),
    /// no longer held: to give back, with no lock held.
    pub(crate) fn release(&self, ticket: Ticket) -> Vec<T> {
        let mut held = self.inner.lock();
        #[cfg(streamalloc_loom)]
        {
            held.counts.1 += 1;
        }
        Self::take_mine(&mut held, ticket)
    }

    /// Runs `put_back` on what the trim of `ticket` still holds (the trim ended before it gave
    /// its memory back), under this list's lock: a recall then finds it here or in the lists.
    pub(crate) fn put_back(&self, ticket: Ticket, put_back: impl FnOnce(Vec<T>)) {
        let mut held = self.inner.lock();
        let mine = Self::take_mine(&mut held, ticket);
        put_back(mine);
        held.epoch += 1;
    }

    /// Runs `put_back` on what the trim of `ticket` still holds and `stays` picks (memory the
    /// trim cannot give back, e.g. that of a stream under a user's graph capture, whose work
    /// the host cannot wait for), under this list's lock; the rest stays held for the trim to
    /// [`release`](Self::release). Returns how many items went back.
    pub(crate) fn put_back_some(
        &self,
        ticket: Ticket,
        mut stays: impl FnMut(&T) -> bool,
        put_back: impl FnOnce(Vec<T>),
    ) -> usize {
        let mut held = self.inner.lock();
        let (back, rest) = std::mem::take(&mut held.items)
            .into_iter()
            .partition(|(t, item)| *t == ticket.0 && stays(item));
        held.items = rest;
        let back: Vec<T> = back.into_iter().map(|(_, item)| item).collect();
        let count = back.len();
        if count > 0 {
            put_back(back);
            held.epoch += 1;
        }
        count
    }

    /// Replaces the item of the trim of `ticket` that `pick` picks by `with`, if that trim
    /// still holds it (a request may have recalled it): whether it did. For a trim that
    /// settles what it took with this list's lock let go (the pool orders its chunks onto
    /// their streams then: driver calls, which no request at the maximum should wait behind).
    pub(crate) fn replace(
        &self,
        ticket: Ticket,
        mut pick: impl FnMut(&T) -> bool,
        with: T,
    ) -> bool {
        let mut held = self.inner.lock();
        #[cfg(streamalloc_loom)]
        if let Some((_, item)) =
            (held.ever.iter_mut()).find(|(t, item)| *t == ticket.0 && pick(item))
        {
            *item = with.clone();
        }
        match (held.items.iter_mut()).find(|(t, item)| *t == ticket.0 && pick(item)) {
            Some((_, item)) => {
                *item = with;
                true
            }
            None if planted!(REPLACE_IGNORES_RECALL) => {
                // The planted bug: noted as the trim's, though a recall took it meanwhile.
                held.items.push((ticket.0, with));
                true
            }
            None => false,
        }
    }

    /// Notes that a trim's give-back of what [`release`](Self::release) handed it has ended:
    /// the room under the maximum is back.
    pub(crate) fn given_back(&self) {
        self.inner.lock().epoch += 1;
    }

    /// Whether this list's lock is held now (by any thread): for tests that check what runs
    /// under it.
    #[cfg(all(test, not(streamalloc_loom)))]
    pub(crate) fn is_locked(&self) -> bool {
        self.inner.try_lock().is_none()
    }

    /// How many times trims have put memory back in the lists or given it back: a request reads
    /// it before its last look, and a recall that finds nothing held but a new epoch tells it
    /// to look (and grow) again.
    pub(crate) fn epoch(&self) -> u64 {
        self.inner.lock().epoch
    }

    fn take_mine(held: &mut Held<T>, ticket: Ticket) -> Vec<T> {
        // Compiled only under the loom cfg, unlike other `planted!` branches: it reads `ever`,
        // which records everything ever held and exists only there.
        #[cfg(streamalloc_loom)]
        if planted!(TRIM_IGNORES_RECALL) {
            // The planted bug: the trim gives back all it took, recalled or not.
            held.items.retain(|(t, _)| *t != ticket.0);
            return (held.ever.iter())
                .filter(|(t, _)| *t == ticket.0)
                .map(|(_, item)| item.clone())
                .collect();
        }
        let (mine, rest) = std::mem::take(&mut held.items)
            .into_iter()
            .partition(|(t, _)| *t == ticket.0);
        held.items = rest;
        mine.into_iter().map(|(_, item)| item).collect()
    }

    /// For a request whose growth failed: everything every trim holds, no longer held, handed
    /// to `put_back` (into the lists, with no lock of this list held). Whether the request
    /// should look again: there was some, or the epoch moved past `seen` (memory came back to
    /// the lists, or room under the maximum, since the request looked).
    pub(crate) fn recall(&self, seen: u64, put_back: impl FnOnce(Vec<T>)) -> bool {
        let (items, moved) = {
            let mut held = self.inner.lock();
            let items: Vec<T> = std::mem::take(&mut held.items)
                .into_iter()
                .map(|(_, item)| item)
                .collect();
            #[cfg(streamalloc_loom)]
            if !items.is_empty() {
                held.counts.0 += 1;
            }
            (items, held.epoch != seen)
        };
        if items.is_empty() {
            return moved;
        }
        let _span = tracing::debug_span!("recall_from_trim", items = items.len()).entered();
        put_back(items);
        true
    }

    /// How many recalls found something, and how many releases there were.
    #[cfg(all(streamalloc_loom, test))]
    pub(crate) fn counts(&self) -> (usize, usize) {
        self.inner.lock().counts
    }
}
