//! The arena of one stream: the superblocks it holds, one free list over all of them, and the
//! blocks freed on other streams that wait to be adopted.

use std::collections::hash_map::Entry;
use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use crate::resource::free_list::FreeList;
use crate::resource::stream_ordered::Kept;
use crate::stream::Stream;
use crate::sync::Mutex;

pub(super) struct Superblock {
    pub(super) size: u64,
    /// Bytes handed out from it, including blocks freed on other streams not adopted yet.
    pub(super) used: u64,
}

/// A block of this arena freed on another stream, waiting to be adopted.
pub(super) struct Remote {
    pub(super) addr: u64,
    pub(super) size: u64,
    pub(super) stream: Stream,
}

pub(super) struct ArenaState {
    /// Free blocks of every superblock; each superblock's base is a boundary.
    pub(super) free: FreeList,
    pub(super) superblocks: BTreeMap<u64, Superblock>,
    pub(super) remote: Vec<Remote>,
    /// Forgotten by the registry (its stream was dropped and it held nothing): look again.
    pub(super) retired: bool,
    /// The blocks handed out from its superblocks and not freed yet: address → size. A free
    /// must name one of them with its size (issue 16: a pointer inside a superblock that was
    /// never handed out, or a wrong size, would otherwise corrupt the free list).
    pub(super) live: FxHashMap<u64, u64>,
}

/// The arena of one stream.
pub(super) struct StreamArena {
    /// Kept: not one of the stream's users, so that the arena sees the user let go of it
    /// whatever other resource also keeps it.
    pub(super) stream: Kept<Stream>,
    pub(super) state: Mutex<ArenaState>,
}

pub(super) enum LocalFree {
    /// Freed.
    Done,
    /// In one of this arena's superblocks, but not a block it handed out (already free, a
    /// pointer inside a block, or a wrong size).
    DoubleFree,
    /// Not in this arena.
    NotMine,
}

/// A partly used superblock on its way from one stream arena to another: its free blocks, and
/// the blocks freed into it on other streams that its old owner had not adopted yet.
pub(super) struct Moving {
    base: u64,
    size: u64,
    used: u64,
    free: Vec<(u64, u64)>,
    remote: Vec<Remote>,
    live: Vec<(u64, u64)>,
}

impl StreamArena {
    pub(super) fn new(stream: &Stream) -> Self {
        Self {
            stream: Kept::new(stream),
            state: Mutex::new(ArenaState::new()),
        }
    }
}

impl ArenaState {
    fn new() -> Self {
        Self {
            free: FreeList::new(),
            superblocks: BTreeMap::new(),
            remote: Vec::new(),
            retired: false,
            live: FxHashMap::default(),
        }
    }

    /// The base of the superblock containing `[addr, addr + size)`.
    pub(super) fn find(&self, addr: u64, size: u64) -> Option<u64> {
        let (&base, sb) = self.superblocks.range(..=addr).next_back()?;
        // Checked: a bad pointer near `u64::MAX` (a free of memory never handed out) must be
        // refused, not overflow.
        let end = addr.checked_add(size)?;
        (end <= base + sb.size).then_some(base)
    }

    pub(super) fn take(&mut self, size: u64) -> Option<u64> {
        let addr = self.free.take(size)?;
        if let Some((_, sb)) = self.superblocks.range_mut(..=addr).next_back() {
            sb.used += size;
        }
        self.live.insert(addr, size);
        Some(addr)
    }

    pub(super) fn add_superblock(&mut self, base: u64, size: u64) {
        self.superblocks.insert(base, Superblock { size, used: 0 });
        self.free.add_boundary(base);
        let given = self.free.give(base, size);
        debug_assert!(given, "a new superblock overlapped free memory");
    }

    /// Takes a wholly free superblock out of the arena.
    fn remove_superblock(&mut self, base: u64) -> Option<(u64, u64)> {
        let size = self.superblocks.get(&base).filter(|sb| sb.used == 0)?.size;
        if !self.free.take_exact(base, size) {
            debug_assert!(false, "an unused superblock is not one free block");
            return None;
        }
        self.superblocks.remove(&base);
        self.free.remove_boundary(base);
        Some((base, size))
    }

    /// Takes the live entry of a block freed by the user: true if `[addr, addr + size)` is a
    /// block this arena handed out (it is no longer live then).
    pub(super) fn unlive(&mut self, addr: u64, size: u64) -> bool {
        match self.live.entry(addr) {
            Entry::Occupied(held) if *held.get() == size => {
                held.remove();
                true
            }
            _ => false,
        }
    }

    /// A free by the user on this arena's stream: the block must be live here.
    pub(super) fn give_live(&mut self, addr: u64, size: u64) -> LocalFree {
        if self.find(addr, size).is_none() {
            return LocalFree::NotMine;
        }
        if !self.unlive(addr, size) {
            return LocalFree::DoubleFree;
        }
        self.give(addr, size)
    }

    /// Gives a block back to its superblock (which stays, even if wholly free, until a
    /// defragmentation). Its live entry is already gone ([`give_live`](Self::give_live), or
    /// when its remote free was queued).
    pub(super) fn give(&mut self, addr: u64, size: u64) -> LocalFree {
        let Some(base) = self.find(addr, size) else {
            return LocalFree::NotMine;
        };
        if !self.free.give(addr, size) {
            return LocalFree::DoubleFree;
        }
        let Some(sb) = self.superblocks.get_mut(&base) else {
            return LocalFree::NotMine;
        };
        debug_assert!(sb.used >= size, "more freed than handed out");
        sb.used = sb.used.saturating_sub(size);
        LocalFree::Done
    }

    /// Takes every wholly free superblock out.
    pub(super) fn take_all_empty(&mut self) -> Vec<(u64, u64)> {
        let empty: Vec<u64> = self
            .superblocks
            .iter()
            .filter(|(_, sb)| sb.used == 0)
            .map(|(&b, _)| b)
            .collect();
        empty
            .into_iter()
            .filter_map(|b| self.remove_superblock(b))
            .collect()
    }

    pub(super) fn remote_bytes(&self) -> u64 {
        self.remote.iter().map(|r| r.size).sum()
    }

    /// The superblock worth moving to another stream for a request of `size` bytes: one with
    /// a free block of at least `size`, the one with the most free bytes among them. Slow
    /// (every free block is looked at); for a request nothing else can serve.
    pub(super) fn best_to_move(&self, size: u64) -> Option<u64> {
        let mut free_in: BTreeMap<u64, (u64, bool)> = BTreeMap::new();
        for (addr, len) in self.free.blocks() {
            if let Some(base) = self.find(addr, len) {
                let entry = free_in.entry(base).or_default();
                entry.0 += len;
                entry.1 |= len >= size;
            }
        }
        free_in
            .into_iter()
            .filter(|&(_, (_, fits))| fits)
            .max_by_key(|&(base, (free, _))| (free, std::cmp::Reverse(base)))
            .map(|(base, _)| base)
    }

    /// Takes the superblock at `base` out, with its free blocks and its pending remote frees.
    pub(super) fn detach(&mut self, base: u64) -> Option<Moving> {
        let sb = self.superblocks.get(&base)?;
        let (size, used) = (sb.size, sb.used);
        let end = base + size;
        let free: Vec<(u64, u64)> = self
            .free
            .blocks()
            .filter(|&(addr, _)| addr >= base && addr < end)
            .collect();
        for &(addr, len) in &free {
            let taken = self.free.take_exact(addr, len);
            debug_assert!(taken, "a listed free block could not be taken");
        }
        self.superblocks.remove(&base);
        self.free.remove_boundary(base);
        let (remote, stay): (Vec<Remote>, Vec<Remote>) = std::mem::take(&mut self.remote)
            .into_iter()
            .partition(|r| r.addr >= base && r.addr < end);
        self.remote = stay;
        let live: Vec<(u64, u64)> = self
            .live
            .iter()
            .filter(|(&addr, _)| addr >= base && addr < end)
            .map(|(&a, &s)| (a, s))
            .collect();
        for (addr, _) in &live {
            self.live.remove(addr);
        }
        Some(Moving {
            base,
            size,
            used,
            free,
            remote,
            live,
        })
    }

    /// Takes in a superblock detached from another arena. The caller has ordered this arena's
    /// stream after the old owner's (its free blocks were freed there); the pending remote
    /// frees carry their own streams, which adoption orders us after.
    pub(super) fn attach(&mut self, moving: Moving) {
        let Moving {
            base,
            size,
            used,
            free,
            remote,
            live,
        } = moving;
        self.live.extend(live);
        self.superblocks.insert(base, Superblock { size, used });
        self.free.add_boundary(base);
        for (addr, len) in free {
            let given = self.free.give(addr, len);
            debug_assert!(given, "a moved superblock overlapped free memory");
        }
        self.remote.extend(remote);
    }
}

#[cfg(not(streamalloc_loom))]
pub(super) mod cache {
    //! The thread-local cache of the last (arena resource, stream) → stream arena lookup. Not
    //! under loom: loom objects must not outlive a model.
    //!
    //! It holds the stream arena weakly: a thread may never look up another arena, and a strong
    //! handle would keep the stream arena, its stream and so its device alive for as long as
    //! the thread lives after the arena resource is dropped (a device never dropped never frees
    //! its staging memory: issue 16). The upgrade costs what the clone of a strong handle did.
    use std::cell::RefCell;
    use std::sync::Weak;

    use super::StreamArena;
    use crate::sync::Arc;

    thread_local! {
        static LAST: RefCell<Option<(u64, u64, Weak<StreamArena>)>> = const { RefCell::new(None) };
    }

    pub(in crate::resource::arena) fn get(uid: u64, stream: u64) -> Option<Arc<StreamArena>> {
        // `try_with`, as `put` and `forget`: a block freed by another thread-local's destructor
        // may come here after the cache is gone, and `with` panicked there (an abort, in a
        // destructor; a review's finding). A miss: the caller looks in the registry.
        LAST.try_with(|last| match &*last.borrow() {
            Some((u, s, arena)) if *u == uid && *s == stream => arena.upgrade(),
            _ => None,
        })
        .ok()
        .flatten()
    }

    pub(in crate::resource::arena) fn put(uid: u64, stream: u64, arena: &Arc<StreamArena>) {
        // `try_with`: during thread teardown the cache may already be gone.
        let _ =
            LAST.try_with(|last| *last.borrow_mut() = Some((uid, stream, Arc::downgrade(arena))));
    }

    pub(in crate::resource::arena) fn forget(uid: u64) {
        let _ = LAST.try_with(|last| {
            let mut last = last.borrow_mut();
            if matches!(&*last, Some((u, _, _)) if *u == uid) {
                *last = None;
            }
        });
    }
}

#[cfg(streamalloc_loom)]
pub(super) mod cache {
    use super::StreamArena;
    use crate::sync::Arc;

    pub(in crate::resource::arena) fn get(_: u64, _: u64) -> Option<Arc<StreamArena>> {
        None
    }

    pub(in crate::resource::arena) fn put(_: u64, _: u64, _: &Arc<StreamArena>) {}

    pub(in crate::resource::arena) fn forget(_: u64) {}
}
