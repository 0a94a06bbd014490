//! Memory a trim has taken out of the free lists and holds while it waits for the GPU work of
//! the streams that last used it (`PoolResource::trim`, `ExpandablePoolResource::trim`).
//!
//! That wait can be long (a stream running a kernel), and the memory still counts against the
//! resource's maximum until the trim gives it back. A request that only that memory could serve
//! was refused meanwhile, at the maximum, though the trim would have freed the memory moments
//! later. So what a trim holds is listed here: such a request takes it all back into the free
//! lists ([`recall`](HeldForTrim::recall)), from where it is served as any free memory is (after
//! the streams that freed it, by the engine's orderings), and the trim gives back only what it
//! still holds when its wait ends ([`give_back`](HeldForTrim::give_back)).
//!
//! Both ends run under this list's lock: [`hold`](HeldForTrim::hold) takes the memory out of
//! the lists, and `give_back` hands it upstream (unmaps it), so a recall finds the memory still
//! in the lists, here, or given back (room under the maximum), never in between. Loom model:
//! `loom-tests/expandable.rs`, `request_at_the_maximum_vs_trim`.

use crate::sync::Mutex;

/// What trims hold now, each item under the ticket of the trim that took it.
pub(crate) struct HeldForTrim<T> {
    inner: Mutex<Held<T>>,
}

struct Held<T> {
    next_ticket: u64,
    items: Vec<(u64, T)>,
    /// Recalls that found something (for the loom model).
    recalls: usize,
    /// Everything ever held, under its ticket (for the planted bug of the loom model).
    #[cfg(streamalloc_loom)]
    ever: Vec<(u64, T)>,
}

/// One trim's claim on what it took ([`HeldForTrim::hold`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ticket(u64);

/// What a [`recall`](HeldForTrim::recall) found.
pub(crate) struct Recalled<T> {
    /// What the trims held, no longer theirs.
    pub(crate) items: Vec<T>,
    /// Whether the recall waited for a trim at work (taking, or giving back): the room under
    /// the maximum may have changed, and the request should look again.
    pub(crate) waited: bool,
}

impl<T: Clone> HeldForTrim<T> {
    /// Nothing held.
    pub(crate) fn new() -> Self {
        HeldForTrim {
            inner: Mutex::new(Held {
                next_ticket: 0,
                items: Vec::new(),
                recalls: 0,
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

    /// Takes out what the trim of `ticket` still holds (a request may have recalled some or all
    /// of it) and runs `give` on it (the release upstream, the unmapping) before it lets go of
    /// the list: a request at the maximum that comes meanwhile waits, then finds the room.
    pub(crate) fn give_back<R>(&self, ticket: Ticket, give: impl FnOnce(Vec<T>) -> R) -> R {
        let mut held = self.inner.lock();
        let mine = Self::take_mine(&mut held, ticket);
        give(mine)
    }

    /// Takes out what the trim of `ticket` still holds, to put back in the lists (the trim
    /// ended before it gave its memory back).
    pub(crate) fn take_back(&self, ticket: Ticket) -> Vec<T> {
        Self::take_mine(&mut self.inner.lock(), ticket)
    }

    fn take_mine(held: &mut Held<T>, ticket: Ticket) -> Vec<T> {
        #[cfg(streamalloc_loom)]
        if crate::resource::stream_ordered::planted::trim_ignores_recall() {
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

    /// Everything every trim holds, no longer held: for a request at the maximum to put back
    /// in the lists and take from.
    pub(crate) fn recall(&self) -> Recalled<T> {
        let (mut held, waited) = match self.inner.try_lock() {
            Some(held) => (held, false),
            None => (self.inner.lock(), true),
        };
        let items: Vec<T> = std::mem::take(&mut held.items)
            .into_iter()
            .map(|(_, item)| item)
            .collect();
        if !items.is_empty() {
            held.recalls += 1;
        }
        Recalled { items, waited }
    }

    /// How many recalls found something.
    #[cfg(all(streamalloc_loom, test))]
    pub(crate) fn recalls(&self) -> usize {
        self.inner.lock().recalls
    }
}
