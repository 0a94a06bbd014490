//! The one place that names `std::sync` or `loom`.
//!
//! Every structure that threads share (the reactor's inbox, an event's waiters, the sim's queues)
//! is written against these names. Normally they are `std`'s; under `--cfg streamalloc_loom` they
//! are loom's, so the models in `loom-tests/` explore every interleaving of the real code. The cfg
//! is this crate's own, so no dependency switches to loom with it.
//!
//! `Mutex::lock` returns the guard directly: a poisoned lock means a panic elsewhere already
//! broke an invariant we cannot repair, and every critical section here is short and
//! panic-free, so we take the data as it is (tokio does the same).

#[cfg(not(streamalloc_loom))]
mod imp {
    pub(crate) use std::sync::atomic::{
        fence, AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering,
    };
    pub(crate) use std::sync::Arc;
    pub(crate) use std::sync::MutexGuard;
    #[allow(unused_imports)] // for `MemoryWaiters::quietly`
    pub(crate) use std::thread_local;

    /// std's mutex with loom's `lock()` shape.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(std::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(std::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// The lock if it is free now, else `None` (poison ignored, as in `lock`).
        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            match self.0.try_lock() {
                Ok(guard) => Some(guard),
                Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }
    }

    /// std's condition variable, taking and returning our guards.
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(std::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Self(std::sync::Condvar::new())
        }

        pub(crate) fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
            self.0.wait(guard).unwrap_or_else(|e| e.into_inner())
        }

        /// Waits for a notification or until `timeout` has passed (a spurious wakeup may end it
        /// sooner): the caller looks at the time again either way.
        pub(crate) fn wait_timeout<'a, T>(
            &self,
            guard: MutexGuard<'a, T>,
            timeout: std::time::Duration,
        ) -> MutexGuard<'a, T> {
            match self.0.wait_timeout(guard, timeout) {
                Ok((guard, _)) => guard,
                Err(e) => e.into_inner().0,
            }
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all()
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one()
        }
    }

    pub(crate) mod thread {
        #[allow(unused_imports)] // `spawn` and `yield_now` are for the loom models' code paths
        pub(crate) use std::thread::{
            current, park, park_timeout, spawn, yield_now, Builder, Thread,
        };
    }
}

#[cfg(streamalloc_loom)]
mod imp {
    pub(crate) use loom::sync::atomic::{
        fence, AtomicBool, AtomicPtr, AtomicU64, AtomicU8, AtomicUsize, Ordering,
    };
    pub(crate) use loom::sync::Arc;
    pub(crate) use loom::sync::MutexGuard;
    #[allow(unused_imports)] // for `MemoryWaiters::quietly`
    pub(crate) use loom::thread_local;

    /// loom's mutex with the poison-free `lock()` of the std side.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// The lock if it is free now, else `None` (poison ignored, as in `lock`).
        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            match self.0.try_lock() {
                Ok(guard) => Some(guard),
                Err(std::sync::TryLockError::Poisoned(e)) => Some(e.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => None,
            }
        }
    }

    /// loom's condition variable, taking and returning our guards.
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(loom::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Self(loom::sync::Condvar::new())
        }

        pub(crate) fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
            self.0.wait(guard).unwrap_or_else(|e| e.into_inner())
        }

        /// loom has no time: a timed wait is a plain wait, ended only by a notification (as
        /// `park_timeout` is `park`). A model that needs time to pass notifies the condvar where
        /// the timeout would have ended the wait (the timer's model does, with its clock).
        #[cfg_attr(not(test), allow(dead_code))] // the timer's loop runs only in its model
        pub(crate) fn wait_timeout<'a, T>(
            &self,
            guard: MutexGuard<'a, T>,
            _timeout: std::time::Duration,
        ) -> MutexGuard<'a, T> {
            self.wait(guard)
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all()
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one()
        }
    }

    pub(crate) mod thread {
        //! loom's `Thread::unpark` wakes a thread blocked on a *mutex* and loses the token
        //! (tokio-rs/loom#249), so parking goes through a per-thread token made of a loom mutex
        //! and condvar: std's semantics, which loom models correctly.
        #[allow(unused_imports)]
        pub(crate) use loom::thread::{spawn, yield_now, Builder};

        use loom::sync::{Arc, Condvar, Mutex};

        #[derive(Default)]
        struct Parker {
            token: Mutex<bool>,
            cv: Condvar,
        }

        loom::thread_local! {
            static PARKER: Arc<Parker> = Arc::new(Parker::default());
        }

        /// A handle to unpark a thread.
        #[derive(Clone)]
        pub(crate) struct Thread(Arc<Parker>);

        impl std::fmt::Debug for Thread {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("Thread")
            }
        }

        impl Thread {
            pub(crate) fn unpark(&self) {
                *self.0.token.lock().unwrap() = true;
                self.0.cv.notify_one();
            }
        }

        pub(crate) fn current() -> Thread {
            PARKER.with(|p| Thread(p.clone()))
        }

        pub(crate) fn park() {
            PARKER.with(|p| {
                let mut token = p.token.lock().unwrap();
                while !*token {
                    token = p.cv.wait(token).unwrap();
                }
                *token = false;
            })
        }

        /// loom has no timed park; a model treats it as a plain park (time does not pass there).
        pub(crate) fn park_timeout(_: std::time::Duration) {
            park()
        }
    }
}

pub(crate) use imp::*;

/// Primitives that loom never models: the simulated device's memory bytes and allocation table,
/// its race detector's bookkeeping (a critical section that makes no loom call, so no loom
/// thread can be switched out while it holds the lock), and the CUDA backend's lazily made
/// driver pool. Races on the bytes are the user's data races,
/// not our protocol's, so loom would only slow the models down by tracking them.
pub(crate) mod plain {
    pub(crate) use std::sync::atomic::AtomicBool;
    pub(crate) use std::sync::atomic::AtomicU8 as DataByte;
    pub(crate) use std::sync::{Arc, Mutex, MutexGuard, Weak};
    pub(crate) use std::sync::{OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
}
