//! How streamalloc works: the design notes, for the next person to change it.
//!
//! This module holds no code. It is sharded-slab's `implementation` module in spirit: what each
//! layer owns, why the hard parts are shaped as they are, and where the authoritative comments
//! live. Keep it true when the design changes.
//!
//! # The contract: stream order
//!
//! GPU work runs in streams, each executed in order. An allocation made *on stream S* may be
//! used by work queued on S after the call returns, with no host wait. A free on S means: the
//! memory may go to later work on S at once, and to work on another stream T only once T has
//! been made to wait for S (an event recorded on S, then a GPU-side wait on T). The host never
//! blocks to allocate or to free; where it must wait for the GPU it does so by `.await`.
//!
//! Everything below serves that contract: a block moves from one stream's use to another's only
//! across an event, and nothing is freed (upstream, or to the host) while queued work may still
//! touch it.
//!
//! # Layers, and what each owns
//!
//! From the bottom; each layer names only the ones below it (the rule, and the one arrow that
//! still runs back up, are in the crate root's docs, "Layers"):
//!
//! - `sync`: the only file that names `std::sync` or `loom` (`--cfg streamalloc_loom`).
//! - `error`: the one [`Error`](crate::Error) type, with the numbers in every variant. `timer`:
//!   one thread that keeps the deadlines of waits for memory.
//! - `completion`: an event's completion state (its wakers and deferred callbacks), which any
//!   thread that sees the event done may complete.
//! - `offload`, `reactor`: one completion reactor thread per device turns finished events into
//!   wakeups and runs deferred callbacks; a lazily started blocking-work thread per device takes
//!   what may block (`cuMemFree`, dropping a resource). The reactor polls what implements its
//!   `Watch` trait (an event) and sleeps on its `Doorbells` (the device's). The rules for code
//!   that runs on the reactor are in the crate root's docs.
//! - `device`: [`Device`](crate::Device), the only place that calls the driver, and the small
//!   types everyone names ([`DevicePtr`](crate::DevicePtr), [`StreamId`](crate::StreamId):
//!   `device::ids`). `device::cuda` (with `cuda_pools`, `cuda_work`, `cuda_peer`, `cuda_vmm`
//!   beside it) goes through cudarc, loaded at run time; `device::sim` is the simulated device
//!   (see below: a worker thread per stream, or none with `SimExecution::Inline`, the default
//!   under loom, where the queueing thread runs each operation at once, so loom models of
//!   users' code meet no thread of ours); `device::memory` holds the raw memory calls, and `device::staging` caches the
//!   page-locked blocks that host copies go through. It names no stream and no event.
//! - `event`, `stream`, `stream_pool`: [`Event`](crate::Event) (a future),
//!   [`Stream`](crate::Stream) (ids that are never reused, unlike driver handles),
//!   [`StreamPool`](crate::StreamPool). The device's calls that take a stream are written
//!   here, as `impl Device` blocks under `stream/`: creating streams, the stream-ordered
//!   allocator (`stream::memory`) and the driver's pools (`stream::async_pool`), returning
//!   staging blocks behind a copy, the race detector's hooks, cudarc streams.
//! - `resource`: the [`MemoryResource`](crate::MemoryResource) trait and every resource and
//!   adaptor; `resource::stream_ordered` and `resource::free_list` are the engine the pool and
//!   the fixed-size resource share; `resource::waiters` (the queue), `resource::wait` (one
//!   waiting request) and `resource::allocate`, `resource::allocate_all` (the futures) are
//!   awaitable allocation.
//! - `buffer`, `vec`: [`DeviceBuffer`](crate::DeviceBuffer), [`DeviceVec`](crate::DeviceVec),
//!   [`DeviceScalar`](crate::DeviceScalar): RAII over a resource, with the streams that used
//!   them, and frees that wait for those uses.
//! - Programs, outside the library: `examples/`, `benches/`, and the command-line tools in the
//!   workspace's `tools/` crate (`streamalloc-replay`, `streamalloc-picture`), whose
//!   dependencies (argument parsing, CSV, progress bars, JSON) the library does not have.
//!
//! # What must stay true
//!
//! - **Stream order is the contract** (above). A block taken from another stream's free list is
//!   handed out only after the taking stream waits on an event recorded after the free, with
//!   the fix of RMM issue 2489 (a block moved between lists is guarded by an event recorded
//!   when it moves).
//! - **Free lists are per stream and fast, and free memory is not stranded.** Reuse on the
//!   freeing stream takes only that stream's lock; free memory held for one stream can still
//!   coalesce with its neighbours held for others, and serve them, before the pool grows.
//!   Streams are keyed by a [`StreamId`](crate::StreamId), never by a handle the driver reuses.
//! - **Growth, limits and release.** A pool grows from its upstream, halving the try on
//!   failure, never past its maximum, and merges idle streams' lists before it grows (RMM issue
//!   2039); it returns wholly free chunks (`trim`), never waiting for the GPU inside a lock.
//! - **Drop never blocks and never loses memory**: a buffer used on several streams frees once
//!   all their events completed, from the reactor; dropping a stream with frees pending on it is
//!   safe.
//! - **Completion reaches futures cheaply**: one reactor per device, no thread per future, no
//!   busy core when nothing is pending. A host callback (`cuLaunchHostFunc`) makes no CUDA
//!   call and drops nothing whose drop would make one.
//! - **Bad input gets a typed error**, with the numbers, never undefined behaviour or a panic,
//!   and nothing is lost when an error is returned.
//! - **Every concurrency core is model-checked** (below, "Proving it").
//!
//! # The pool's engine: one free list for every stream, tagged with what reuse must wait for
//!
//! (The authoritative comment is at the top of `src/resource/stream_ordered/mod.rs`.) All free
//! memory of a pool is in one address-ordered, coalescing free list (a two-level segregated
//! fit: O(1) fit within 3% of the best, O(1) coalescing through two address maps), whatever
//! stream freed it. Blocks never merge across upstream chunks. Until issue 10 each stream had
//! its own list, with *steals* and *merges* between them; blocks freed on different streams then
//! coalesced only when a merge brought them together, and on hand-off workloads (WORKLOADS.md's
//! `churn-xs`) the pool held 1.5 to 1.7 times its peak live memory. With one list, neighbours
//! coalesce at the free and a request gets the best fit over everything: 0.82 to 1.23 on every
//! run with the growth cap, 1.301 at worst without it (`BENCHMARKS.md`).
//!
//! **Stream order through tags.** Each free block carries the streams it was freed on, each with
//! that stream's *epoch* at the free (`Waits`, at most four pairs; more stand for "every
//! stream"). A request on stream S that gets a block freed only on S needs nothing. For a block
//! freed on D after S last waited on D, S is *ordered* after D: D's epoch is bumped under the
//! lock, then (outside it) an event is recorded on D and S waits on it, and S notes that it has
//! seen D up to the new epoch, which covers everything D had freed by then. The bump comes
//! before the record, so a free tagged with the old epoch was queued before the event; a free
//! tagged after the bump is not covered, rightly (the planted `BUMP_AFTER_ORDER` of the loom
//! model breaks exactly this). A block coalesced from frees on several streams waits on each:
//! the fix of RMM issue 2489 holds by construction. Each stream has one event of its own for
//! these orderings (`Stream::order_before`): two driver calls and no event object. Before
//! ordering, the engine asks D whether it is idle (`cuStreamQuery`,
//! [`PoolOptions::opportunistic_reuse`](crate::PoolOptions::opportunistic_reuse), on by
//! default): if it is, nothing is recorded or waited on, and D is noted finished up to the
//! bumped epoch for every stream (the loom model's planted `DONE_AT_THE_ANSWER` notes it at the
//! answer instead, and is caught). On the simulated device an idle answer is the host seeing
//! the stream's work finish, for the race detector too. A stream seen idle stays *quiet* while
//! nothing is queued on it: every operation this crate queues on a stream counts
//! (`Stream::activity`), the count read before the question is kept with the answer, and a
//! later ordering after that stream, finding the same count, notes it finished with no driver
//! call (`churn-xs-1t`: 104,171 questions become 4). Work queued through the driver's handle
//! is not counted, so a stream whose handle was handed out is asked every time. The loom
//! models count activity in a loom atomic (a use queued and the engine's read of the count
//! must race in loom's eyes), and catch `ACTIVITY_AFTER_THE_ANSWER` (the count read after
//! the answer: a use queued in between looks covered) and `QUIET_IGNORES_ACTIVITY`.
//!
//! **Shards.** One lock for every thread cost 20 to 30 times per-stream locks on four threads
//! (futex hand-offs in the GPU machine's VM), so the list is kept in 8 shards, each chunk in
//! one (a lock-free table maps addresses to shards for frees). A thread's requests go to its
//! own shard, then to the best fit of the others, and the pool grows into the thread's shard;
//! an initial size from 256 MiB is split into one chunk per shard.
//!
//! A request, in order: its shard's best fit, the other shards' best fit, then (one request at a
//! time) *growth* by at least 1/[`growth_divisor`](crate::PoolOptions::growth_divisor) of what
//! the pool holds, but no further than [`growth_cap`](crate::PoolOptions::growth_cap) times the
//! most it had in use at a growth (down to the request alone: the step never carries the pool
//! past the cap), halving the try on failure; at the maximum, wholly free chunks go back
//! upstream first (ordered onto one of the streams their tag names); then
//! [`Error::OutOfMemory`](crate::Error::OutOfMemory), whose `available` is the largest request
//! that could have been served. [`PoolOptions::reuse_slack`](crate::PoolOptions::reuse_slack)
//! trades memory for fewer waits (a block that needs none, up to that much larger than the best
//! fit).
//!
//! `trim` lets go of streams the user dropped (the host waits for each, then every tag forgets
//! it) and returns wholly free chunks upstream; every error path puts what it took back. The
//! engine is generic over its stream type so the loom models (`loom-tests/free_lists/`,
//! `loom-tests/frees_and_regrowth.rs`) run it on a fake stream that records ordering edges in
//! vector clocks.
//!
//! **Every free is checked**: each shard keeps every block of its chunks, free or handed out,
//! linked to its address neighbours (`stream_ordered/blocks.rs`), and a free, found in its
//! shard's map of blocks handed out by address, must name one of them with its size. Anything
//! else is refused and changes nothing. (Until issue 10 the check was an option: a free list of
//! free blocks only found a freed block's neighbours in two maps by address, and the check was
//! a third; now the lookup that checks a free is also the one that finds its neighbours.) The
//! arena keeps a table of blocks handed out per stream arena, moved with its superblocks.
//!
//! Where streams hand memory to each other, most takes need an ordering (`churn-xs-1t`: 180,740
//! of 500,021); with opportunistic reuse an idle stream costs one query instead, a quiet one
//! nothing, and the hand-off runs are faster than the per-stream lists were, without stranding
//! memory (`BENCHMARKS.md`). What it does not do yet: `churn-1t` at a tenth of RMM's pool's
//! time (it is at a fifth: about 520 instructions per operation in `engine_lab`, spread over
//! the lock, the size index, splits and coalescing, the tags and the maps, with few cache
//! misses: instruction-bound, so a tenth needs a different structure, not a trim of this one).
//! The map of blocks handed out is the engine's own (`addr_map.rs`: open addressing keyed by
//! block start, removal by backward shift), about 40 instructions per operation below
//! hashbrown's.
//!
//! # Buffers: uses and deferred frees
//!
//! A buffer knows the stream it was allocated on and every other stream that used it
//! (`record_stream`, and work the crate itself queues elsewhere, such as `to_host(&other)`,
//! which registers the use *before* queueing it). Dropping it records an event on each other
//! stream and frees once all have completed, from the reactor: the free is stream-ordered on
//! the buffer's own stream, so nothing waits on the host. Host copies stage through
//! page-locked blocks that go back to the cache only behind an event after the copy.
//!
//! # Why the reactor polls
//!
//! On the H200 VMs we measured, the driver's ways to wake a sleeping thread (host functions,
//! blocking-sync events) arrive 250 to 450 µs after an event once the wait exceeds ~100 µs,
//! while polling `cuEventQuery` sees completion within ~1 µs (`benches/doorbell_probe.rs`). So
//! while events are pending the reactor polls, when
//! [`CudaOptions::reactor_strategy`](crate::CudaOptions::reactor_strategy) says: by default
//! around the completion it predicts from the stream's recent history (sleeping until just
//! before it), else in a hot loop for `reactor_spin` after each completion or registration,
//! then between sleeps that double up to `reactor_max_sleep`, after which (predicting) it
//! leaves such an event to its doorbell; with nothing pending it parks.
//! The details are in `src/reactor.rs`. The events of one stream complete in order, so it checks only each
//! stream's oldest event; an event's sequence number is taken under the same lock as its
//! driver record so that the order cannot invert. A poll is a load, not a driver call: with
//! [`CudaOptions::completion_words`](crate::CudaOptions::completion_words) (the default) the
//! GPU writes a count of the stream's watched events into its word of pinned memory right after
//! the event, and the driver is asked only every 100 µs about an event whose word has not
//! moved (a failed stream never writes it).
//!
//! # Waiting for memory
//!
//! `allocate_async` waits in a FIFO queue per resource. A free notifies the head, which tries
//! again and passes the baton on if it cannot use what came back; a cancelled waiter passes its
//! notification on. A `SeqCst` fence on both sides (registering, freeing) closes the
//! store-buffering window in which each would miss the other's write. A request that can never
//! succeed (larger than the maximum) fails at once.
//!
//! `allocate_all_async` (and `DeviceBuffer::alloc_all`) waits in the same queue as one waiter
//! for a whole set: each try allocates every piece, largest first, or gives back what it took
//! and waits on. So a waiting task holds nothing, and tasks that each need several buffers
//! cannot deadlock holding parts of their sets. The head gives back *quietly* (its own
//! thread's notifications of its queue are dropped for that moment): everyone else queued is
//! behind it, and a loud give-back would wake the head itself into a loop of failing tries. A
//! fresh try (not queued) gives back loudly: the head may have failed because of it.
//!
//! # Several devices
//!
//! Each device has its own reactor, resources and current resource. Streams of two GPUs (or of
//! two simulated devices) may wait for each other's events, a buffer may be recorded as used on
//! another device's stream, and copies between devices are queued in stream order
//! (`cuMemcpyPeerAsync`); allocating from one device's resource for another's stream is a
//! `WrongDevice` error. Simulated devices have disjoint address ranges.
//!
//! # cudarc
//!
//! cudarc both ways: a `Device` on a cudarc context (`Device::from_cudarc`), a `Stream` on a
//! cudarc stream (`Stream::from_cudarc`), and ours handed to cudarc (`Device::cudarc_context`,
//! `Stream::cudarc_stream`), so that a kernel a user loads and launches with cudarc's launch
//! builder runs on our stream, on our buffers, with no host synchronization in between
//! (`examples/pipeline.rs` does it; `tests/cudarc_interop.rs` checks it on a GPU).
//!
//! ## Ownership
//!
//! Both sides hold cudarc's own reference-counted handles, so neither can pull a context or a
//! stream from under the other, and no `unsafe` is asked of the user:
//!
//! - **Contexts.** A CUDA [`Device`](crate::Device) always holds its context through cudarc's
//!   `Arc<CudaContext>`: [`Device::cuda`](crate::Device::cuda) has cudarc retain the GPU's primary context (the one
//!   `CudaContext::new(ordinal)` gives, so a cudarc user of the same GPU shares it anyway), and
//!   [`Device::from_cudarc`](crate::Device::from_cudarc) takes the user's `Arc` (a primary context or one made with
//!   `new_non_primary` / `from_raw_context`) and retains nothing more.
//!   [`Device::cudarc_context`](crate::Device::cudarc_context) hands that same `Arc` out. The context is released when the
//!   last holder on either side lets go.
//! - **Streams.** Every CUDA [`Stream`](crate::Stream) is a cudarc stream: [`Device::create_stream`](crate::Device::create_stream) has
//!   cudarc make it (`CudaContext::new_stream`, non-blocking), and [`Stream::from_cudarc`](crate::Stream::from_cudarc)
//!   adopts the user's. The `Stream` holds cudarc's `Arc<CudaStream>`;
//!   [`Stream::cudarc_stream`](crate::Stream::cudarc_stream) clones it. The driver's stream is destroyed (its queued work
//!   still runs) when the last `Arc` goes, ours or a clone that cudarc code keeps (a
//!   `CudaSlice` allocated on it, say). cudarc's `wrap_borrowed_stream` (in 0.19.10; cudarc
//!   issue #589), which wraps a handle without owning it and leaves its lifetime to the caller,
//!   is not needed: both sides own.
//!
//! ## Ordering (what is safe without synchronizing)
//!
//! Work that cudarc queues on [`Stream::cudarc_stream`](crate::Stream::cudarc_stream) *is* work on our stream: the same
//! driver stream, so stream order holds between our work and cudarc's with nothing in between.
//! Our buffers are cudarc kernel arguments (`PushKernelArg` for `&DeviceBuffer`,
//! `&mut DeviceBuffer`, `&DeviceVec<T>`, `&mut DeviceVec<T>`): memory allocated on a stream may
//! be used by a launch queued on that stream after the allocation, and its free (at the
//! buffer's drop) is queued after the launch. Launching on *another* stream than the buffer's
//! needs what any second stream needs: make it wait for an event of the buffer's stream, and
//! [`DeviceBuffer::record_stream`](crate::DeviceBuffer::record_stream) it, so its free waits
//! for that stream too. cudarc's own event tracking applies to its `CudaSlice`s only; our
//! buffers carry their own.
//!
//! ## Caveats
//!
//! - cudarc synchronizes a context (the host waits for it) when the *first* stream of the
//!   context is made through it, if the context tracks events (cudarc's default). A device of
//!   ours opened with [`Device::cuda`](crate::Device::cuda) never does: it makes its first
//!   stream when it opens, on a handle no one else holds yet, with the tracking off for that
//!   one call. A device made from a cudarc user's context
//!   ([`Device::from_cudarc`](crate::Device::from_cudarc)) keeps cudarc's rule: if that
//!   context has made no stream yet, `from_cudarc` makes the first and waits, once, for the
//!   work already running in it.
//! - A cudarc stream adopted twice gives two `Stream`s (two ids) on one driver stream. That is
//!   correct, only slower: the pool treats memory freed on one as another stream's and orders
//!   its reuse with an event.
//! - On the simulated device there is no cudarc: these return `None` or an error.
//!
//! # The simulated device
//!
//! `Device::simulated` keeps a GPU's semantics on host memory: device memory at addresses that
//! look like device addresses (disjoint between simulated devices), a worker thread per stream
//! that runs its queued operations in order (`device::sim::stream`, the operations in
//! `device::sim::op`, the arithmetic of the built-in kernels in `device::sim::kernels`),
//! markers for events (`device::sim::marker`), and waits between streams. The same copies,
//! memsets and kernels (fill, scale, a spin kernel that runs for a given time) run on both
//! devices, so tests and examples run the same code on either. It is what CI runs, what the
//! loom models drive, and what a machine without a GPU gets.
//!
//! It checks stream order itself (`device::sim::detector`, what it reports in
//! `device::sim::races`): vector clocks per stream, which a recorded event snapshots and a wait
//! joins, decided when work is queued, so that a use not ordered after its block's allocation
//! or before its free, or racing with a use on another stream, is reported with both sites.
//! Suballocating resources tell it about the blocks they carve out of a chunk
//! ([`Device::note_allocation`](crate::Device::note_allocation)), so a block inside a pool is
//! checked, which compute-sanitizer cannot do. And it injects faults
//! ([`Faults`](crate::Faults): the Nth call of a kind, every call, or by probability and
//! seed), so that every error path can be tested.
//!
//! # Growing without seams
//!
//! A pool that grows chunk by chunk can never coalesce across chunk boundaries, and can give
//! memory back only a whole chunk at a time. [`ExpandablePoolResource`](crate::ExpandablePoolResource)
//! reserves one range of addresses per shard of the engine (8, each as large as the whole
//! reservation asked for, so one thread can still map the whole maximum in its own range) and
//! maps physical memory into them a granule at a time (`cuMemAddressReserve`, `cuMemCreate`,
//! `cuMemMap`; `device::vmm`), as PyTorch's expandable segments do, with the pool's stream
//! semantics; a thread grows in its shard's range first, and the initial size is spread over
//! the ranges. With one range (until 2026-11-24) four threads took one lock: 770 to 1,100
//! ns/op on `churn-4t` against the pool's 35 to 70. Its `trim` unmaps every wholly free granule
//! once the streams that last used it are done. The simulated device reserves and maps too
//! (`device::sim::vmm`), and an access to an unmapped granule is an error with its address.
//!
//! # Testing, ours and the users'
//!
//! Tests are written once against [`Device`](crate::Device) and run on the simulated device
//! always and on CUDA device 0 when one can be opened; with `STREAMALLOC_REQUIRE_GPU=1` a
//! missing GPU is a failure, not a fallback. The loom build is not only for our own models:
//! under `--cfg streamalloc_loom` a user's `loom::model` drives the real simulated device,
//! resources and buffers, so loom explores the user's tasks together with ours
//! (`examples/loom_user.rs`; README, "Testing your own code").
//!
//! # Proving it
//!
//! - The simulated device runs every test that a GPU runs (`tests/`, written once against
//!   `Device`), with [`Faults`](crate::Faults) to drive error paths.
//! - loom models (`loom-tests/`, compiled into the crate under `--cfg streamalloc_loom`) of
//!   the completion state, the reactor, the blocking-work queue, the waiters queue, the free
//!   lists and the deferred free; each was seen to catch a bug planted in it
//!   (`loom-tests/README.md` lists them).
//! - Data tests check stream order by what the GPU wrote, each seen to fail with its guard
//!   removed, and the pool's invariant checker runs after every step of the random-mix tests.
