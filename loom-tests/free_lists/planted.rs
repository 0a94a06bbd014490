//! A copy of src/resource/stream_ordered/'s `StreamLists`, cut to what the models use (no
//! cache, no trim, no statistics), with switchable bugs. A list's state is a loom `UnsafeCell`
//! guarded by a `Mutex<()>` instead of a `Mutex<ListState>`, so that the planted "no lock" bug
//! can be written; with the lock taken it is the same.

use loom::cell::UnsafeCell;
use rustc_hash::FxHashMap;

use super::{Engine, FakeStream, BASE, BLOCK};
use crate::error::{Error, Result};
use crate::resource::free_list::FreeList;
use crate::resource::stream_ordered::{EngineStream, Grow};
use crate::sync::{Arc, AtomicU64, Mutex, Ordering};

pub(super) const NONE: u8 = 0;
/// `steal` skips `order_before`.
pub(super) const STEAL_UNORDERED: u8 = 1;
/// `steal` takes from the donor's list without its lock.
pub(super) const STEAL_UNLOCKED: u8 = 2;
/// `merge_into` skips `order_before`.
pub(super) const MERGE_UNORDERED: u8 = 3;
/// `steal` orders the thief after the donor first, then takes the block: a block freed in
/// between is not covered by the event.
pub(super) const ORDER_BEFORE_TAKE: u8 = 4;

struct ListState {
    free: FreeList,
    retired: bool,
}

struct StreamList {
    stream: FakeStream,
    lock: Mutex<()>,
    state: UnsafeCell<ListState>,
}

// SAFETY: `state` is only reached through `locked`, under `lock` (the planted
// `STEAL_UNLOCKED` bug aside, which is what loom must report).
unsafe impl Sync for StreamList {}

impl StreamList {
    fn locked<R>(&self, f: impl FnOnce(&mut ListState) -> R) -> R {
        let _guard = self.lock.lock();
        // SAFETY: the lock is held, so this is the only access.
        self.state.with_mut(|state| f(unsafe { &mut *state }))
    }

    /// The planted bug: the same access without the lock.
    fn unlocked<R>(&self, f: impl FnOnce(&mut ListState) -> R) -> R {
        // SAFETY: none; loom runs one thread at a time, so no two references exist at once
        // in the model, and loom reports the missing synchronisation.
        self.state.with_mut(|state| f(unsafe { &mut *state }))
    }
}

struct Registry {
    lists: FxHashMap<u64, Arc<StreamList>>,
    chunks: Vec<(u64, u64)>,
}

pub(super) struct Lists<const BUG: u8> {
    fresh: Mutex<FreeList>,
    registry: Mutex<Registry>,
    /// src's slow-path lock: merges and growth one request at a time.
    slow: Mutex<()>,
    steals: AtomicU64,
    merges: AtomicU64,
}

impl<const BUG: u8> Lists<BUG> {
    fn list_for(&self, stream: &FakeStream) -> Arc<StreamList> {
        let id = stream.uid();
        let mut registry = self.registry.lock();
        let chunks = registry.chunks.clone();
        registry
            .lists
            .entry(id)
            .or_insert_with(|| {
                let mut free = FreeList::new();
                for (start, size) in chunks {
                    free.add_chunk(start, size);
                }
                Arc::new(StreamList {
                    stream: stream.clone(),
                    lock: Mutex::new(()),
                    state: UnsafeCell::new(ListState {
                        free,
                        retired: false,
                    }),
                })
            })
            .clone()
    }

    fn with_own<R>(&self, stream: &FakeStream, mut f: impl FnMut(&mut FreeList) -> R) -> R {
        loop {
            let list = self.list_for(stream);
            if let Some(r) = list.locked(|state| (!state.retired).then(|| f(&mut state.free))) {
                return r;
            }
        }
    }

    fn add_chunk(&self, start: u64, size: u64) {
        let mut registry = self.registry.lock();
        registry.chunks.push((start, size));
        self.fresh.lock().add_chunk(start, size);
        for list in registry.lists.values() {
            list.locked(|state| state.free.add_chunk(start, size));
        }
    }

    fn give_to(&self, addr: u64, size: u64, stream: &FakeStream) -> bool {
        self.with_own(stream, |free| free.give(addr, size))
    }

    /// The best fit over the other lists, taken whole under the donor's lock, which is
    /// held through the ordering (src's `steal`).
    fn steal(&self, size: u64, stream: &FakeStream) -> Result<Option<u64>> {
        let me = stream.uid();
        let donors: Vec<Arc<StreamList>> = self
            .registry
            .lock()
            .lists
            .iter()
            .filter(|(&id, _)| id != me)
            .map(|(_, list)| list.clone())
            .collect();
        let mut best: Option<(u64, &Arc<StreamList>)> = None;
        for donor in &donors {
            let fit = donor.locked(|state| {
                if state.retired {
                    None
                } else {
                    state.free.fit(size)
                }
            });
            if let Some(fit) = fit {
                if best.is_none_or(|(b, _)| fit < b) {
                    best = Some((fit, donor));
                }
            }
        }
        let Some((_, donor)) = best else {
            return Ok(None);
        };
        if BUG == ORDER_BEFORE_TAKE {
            donor.stream.order_before(stream)?;
        }
        let steal = |state: &mut ListState| -> Result<Option<(u64, u64)>> {
            if state.retired {
                return Ok(None);
            }
            let Some((addr, whole)) = state.free.take_whole(size) else {
                return Ok(None);
            };
            let ordered = if BUG == STEAL_UNORDERED || BUG == ORDER_BEFORE_TAKE {
                Ok(())
            } else {
                donor.stream.order_before(stream)
            };
            if let Err(e) = ordered {
                state.free.give(addr, whole);
                return Err(e);
            }
            Ok(Some((addr, whole)))
        };
        let got = if BUG == STEAL_UNLOCKED {
            donor.unlocked(steal)?
        } else {
            donor.locked(steal)?
        };
        let Some((addr, whole)) = got else {
            return Ok(None);
        };
        if whole > size {
            self.give_to(addr + size, whole - size, stream);
        }
        self.steals.fetch_add(1, Ordering::Relaxed);
        Ok(Some(addr))
    }

    /// src's `merge_into` with no limit: fresh memory, every idle list (retired) and every
    /// other list that holds memory, after the caller waits on each.
    fn merge_into(&self, stream: &FakeStream) -> Result<usize> {
        let fresh = self.fresh.lock().drain();
        for &(addr, size) in &fresh {
            self.give_to(addr, size, stream);
        }
        let mut moved = fresh.len();
        let me = stream.uid();
        let donors: Vec<(Arc<StreamList>, bool)> = {
            let mut registry = self.registry.lock();
            let chosen: Vec<(u64, bool)> = registry
                .lists
                .iter()
                .filter(|(&id, _)| id != me)
                .map(|(&id, list)| (id, list.stream.handle_count() == 1))
                .collect();
            chosen
                .into_iter()
                .map(|(id, idle)| {
                    let list = if idle {
                        registry.lists.remove(&id)
                    } else {
                        registry.lists.get(&id).cloned()
                    };
                    (list.expect("chosen under the lock"), idle)
                })
                .collect()
        };
        if donors.is_empty() {
            return Ok(moved);
        }
        for (donor, idle) in donors {
            let blocks = donor.locked(|state| {
                if state.retired {
                    return Vec::new();
                }
                state.retired |= idle;
                state.free.drain()
            });
            if blocks.is_empty() {
                continue;
            }
            let ordered = if BUG == MERGE_UNORDERED {
                Ok(())
            } else {
                donor.stream.order_before(stream)
            };
            if let Err(e) = ordered {
                donor.locked(|state| {
                    state.retired = false;
                    for &(addr, size) in &blocks {
                        state.free.give(addr, size);
                    }
                });
                if idle {
                    self.registry
                        .lock()
                        .lists
                        .insert(donor.stream.uid(), donor.clone());
                }
                return Err(e);
            }
            for &(addr, size) in &blocks {
                self.give_to(addr, size, stream);
            }
            moved += blocks.len();
        }
        self.merges.fetch_add(1, Ordering::Relaxed);
        Ok(moved)
    }
}

impl<const BUG: u8> Engine for Lists<BUG> {
    fn with_chunk(blocks: u64) -> Self {
        let mut fresh = FreeList::new();
        fresh.add_chunk(BASE, blocks * BLOCK);
        fresh.give(BASE, blocks * BLOCK);
        Lists {
            fresh: Mutex::new(fresh),
            registry: Mutex::new(Registry {
                lists: FxHashMap::default(),
                chunks: vec![(BASE, blocks * BLOCK)],
            }),
            slow: Mutex::new(()),
            steals: AtomicU64::new(0),
            merges: AtomicU64::new(0),
        }
    }

    fn take(
        &self,
        size: u64,
        stream: &FakeStream,
        upstream: &impl Grow<FakeStream>,
    ) -> Result<u64> {
        // src's `take`: the own list, then fresh memory, under the own list's lock.
        let own = self.with_own(stream, |free| {
            free.take(size).or_else(|| self.fresh.lock().take(size))
        });
        if let Some(addr) = own {
            return Ok(addr);
        }
        // src's `take_slow`.
        if let Some(addr) = self.steal(size, stream)? {
            return Ok(addr);
        }
        let _slow = self.slow.lock();
        let own = self.with_own(stream, |free| free.take(size));
        if let Some(addr) = own.or_else(|| self.fresh.lock().take(size)) {
            return Ok(addr);
        }
        if let Some(addr) = self.steal(size, stream)? {
            return Ok(addr);
        }
        if self.merge_into(stream)? > 0 {
            if let Some(addr) = self.with_own(stream, |free| free.take(size)) {
                return Ok(addr);
            }
        }
        let (base, chunk) = match upstream.grow(size, stream) {
            Err(e) if e.is_out_of_memory() => {
                if self.merge_into(stream)? == 0 {
                    return Err(e);
                }
                if let Some(addr) = self.with_own(stream, |free| free.take(size)) {
                    return Ok(addr);
                }
                upstream.grow(size, stream)?
            }
            other => other?,
        };
        self.add_chunk(base, chunk);
        let rest = self.with_own(stream, |free| {
            free.give(base, chunk);
            free.take(size)
        });
        rest.ok_or(Error::InvalidArgument {
            what: "the upstream gave a chunk smaller than asked for",
        })
    }

    fn give(&self, addr: u64, size: u64, stream: &FakeStream) -> bool {
        self.give_to(addr, size, stream)
    }

    fn check(&self) -> std::result::Result<(), String> {
        let mut all: Vec<(u64, u64)> = self.fresh.lock().blocks().collect();
        let lists: Vec<Arc<StreamList>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            list.locked(|state| {
                state.free.check()?;
                all.extend(state.free.blocks());
                Ok::<(), String>(())
            })?;
        }
        all.sort_unstable();
        match all.windows(2).find(|w| w[0].0 + w[0].1 > w[1].0) {
            Some(w) => Err(format!("two lists share memory: {:x?}", w)),
            None => Ok(()),
        }
    }

    fn steals_and_merges(&self) -> (u64, u64) {
        (
            self.steals.load(Ordering::Relaxed),
            self.merges.load(Ordering::Relaxed),
        )
    }

    fn free_bytes(&self) -> u64 {
        let mut bytes = self.fresh.lock().free_bytes();
        let lists: Vec<Arc<StreamList>> = self.registry.lock().lists.values().cloned().collect();
        for list in lists {
            bytes += list.locked(|state| state.free.free_bytes());
        }
        bytes
    }
}
