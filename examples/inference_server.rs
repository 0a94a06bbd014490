//! An inference server on streamalloc: every request takes its GPU buffers by `.await` from one
//! shared pool, so a burst that needs several times the pool waits for memory instead of failing.
//!
//! The load test, one command (it starts the server in-process on 127.0.0.1, drives it over
//! loopback with 2000 requests, 64 at a time, 10 of them too large for the pool, and exits):
//!
//! ```text
//! cargo run --release --example inference_server -- --load
//! ```
//!
//! A healthy result ends with `healthy: ...` and exit status 0: every request answered, the
//! normal ones `200` with the right checksum, the too-large ones `413`, and `0` out of memory,
//! timed out (503), wrong or other; `waits for memory` above zero (the pool really was short:
//! the demand line shows several times the pool) and the peak in use close to the pool's size.
//! Anything unexpected is listed and makes the exit status 1. `--requests`, `--concurrency`,
//! `--pool-mib`, `--deadline-secs` change the load, `--resource expandable` serves from an
//! `ExpandablePoolResource` instead of the `PoolResource` (`--help` lists all). On the
//! simulated device (no GPU) the release build takes about 2 s on 2 cores; a debug build is
//! some 40 times slower (the simulated device copies byte by byte), so give it `--requests 200`.
//!
//! To serve (until Ctrl-C, or `--max-requests N`):
//!
//! ```text
//! cargo run --release --example inference_server -- --port 8080
//! curl -s 127.0.0.1:8080/infer -H 'content-type: application/json' -d '{"batch":4,"len":4096}'
//! curl -s 127.0.0.1:8080/stats
//! ```
//!
//! `POST /infer {"batch": n, "len": m, "seed": s, "scale": k}` (`seed` and `scale` optional):
//! the input is `n * m` floats `(s + i) % 1024`, copied to the device; the "model" copies it to
//! an output buffer, scales it by `k` and spins for `--spin-us`; the answer is
//! `{"elements", "device_bytes", "checksum" (the sum of the outputs), "alloc_wait_us",
//! "total_us", "stream"}`. Errors are JSON `{"error": kind, "message", ...numbers}`: 400
//! `bad_request`; 413 `too_large` (needs more than the pool's maximum, refused at once); 503
//! `timeout` (no memory within `--alloc-timeout-secs`); 500 `out_of_memory` or `device_error`.
//! `GET /stats` gives the pool's statistics, its waits for memory and the server's demand.
//!
//! Looking at the memory:
//! - `GET /metrics`: Prometheus' text format (`prometheus-client`): the pool's reserved, in
//!   use, peak, free bytes and blocks, cross-stream waits, waits for memory and timeouts, and a
//!   histogram of how long requests waited for their buffers. `--load` scrapes it at the end
//!   and checks that its numbers add up (against `/stats` and each other).
//! - `GET /snapshot`: the pool's blocks as JSON (`resource::snapshot`); with the history
//!   recording, each live allocation with its stream and time.
//! - `POST /history/start`, `POST /history/stop`, `GET /history`: the last 100,000
//!   allocation events (`HistoryAdaptor`, off until started; `--history` starts it at once).
//! - `--log-file PATH`: every allocation and free as RMM's CSV log (`LoggingAdaptor`).
//!
//! `streamalloc-picture` turns a log, a history or a snapshot into a picture (README).

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::rejection::JsonRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use clap::Parser;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use streamalloc::resource::adaptor::{
    HistoryAdaptor, HistoryOptions, LoggingAdaptor, StatisticsAdaptor,
};
use streamalloc::resource::cuda::CudaResource;
use streamalloc::resource::pool::{PoolOptions, PoolResource, PoolStats};
use streamalloc::resource::WaitStats;
use streamalloc::{
    Device, DeviceBuffer, DevicePtr, DeviceVec, Error, ExpandableOptions, ExpandablePoolResource,
    MemoryResource, MemoryWaiters, ResourceRef, Stream, StreamPool, ALIGNMENT,
};
use tokio::sync::watch;
use tracing_subscriber::EnvFilter;

#[path = "inference_server/load.rs"]
mod load;
#[path = "inference_server/metrics.rs"]
mod metrics;
#[path = "inference_server/server_pool.rs"]
mod server_pool;

use server_pool::ServerPool;

/// The pool itself (`--resource pool` or `expandable`).
type Raw = ServerPool;
/// The pool with a history recorder in front (off until started).
type Recorded = HistoryAdaptor<Arc<Raw>>;
/// What requests allocate from: a statistics adaptor (bytes in use and their peak) over the
/// recorder, or over a logging adaptor over it (`--log-file`).
type Pool = StatisticsAdaptor<ResourceRef>;
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An inference server whose requests allocate GPU memory by `.await` from one shared pool.
#[derive(Parser, Debug, Clone)]
struct Args {
    /// Port on 127.0.0.1 (0: any free port; the bound address is printed).
    #[arg(long, default_value_t = 0)]
    port: u16,
    /// The pool's size in MiB, taken from the device at start (at least 1).
    // Not 0: a pool of none refused every request with 413, and `--load` sent them all.
    #[arg(long, default_value_t = 8, value_parser = at_least_one())]
    pool_mib: usize,
    /// Streams in the stream pool.
    #[arg(long, default_value_t = 8)]
    streams: usize,
    /// The pool: `pool` (`PoolResource`, all of it taken at start) or `expandable`
    /// (`ExpandablePoolResource`: maps memory as requests need it, up to `--pool-mib`).
    #[arg(long, default_value = "pool")]
    resource: String,
    /// Simulated model work per request, in microseconds of GPU time.
    #[arg(long, default_value_t = 300)]
    spin_us: u64,
    /// How long a request may wait for memory before it is answered 503.
    #[arg(long, default_value_t = 30)]
    alloc_timeout_secs: u64,
    /// Shut down after answering this many /infer requests (at least 1).
    // Not 0: no count of answers reaches it, so the server ran until Ctrl-C.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    max_requests: Option<u64>,
    /// Run the load test against an in-process server, print its report and exit.
    #[arg(long)]
    load: bool,
    /// Load test: requests to send.
    #[arg(long, default_value_t = 2000)]
    requests: usize,
    /// Load test: requests in flight at once (at least 1).
    // Not 0: it ran one at a time while the report said "0 at a time".
    #[arg(long, default_value_t = 64, value_parser = at_least_one())]
    concurrency: usize,
    /// Load test: how many of the requests are too large for the pool (each must get 413).
    #[arg(long, default_value_t = 10)]
    too_large: usize,
    /// Load test: stop sending after this many seconds (what is left counts as errors).
    #[arg(long, default_value_t = 60)]
    deadline_secs: u64,
    /// Log every allocation and free of the pool to this file, in RMM's CSV format.
    #[arg(long)]
    log_file: Option<std::path::PathBuf>,
    /// Start the history recorder at once (else `POST /history/start`).
    #[arg(long)]
    history: bool,
}

/// A count or size that must be at least 1: 0 is a usage error (exit 2), as an unknown flag.
fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct InferRequest {
    batch: usize,
    len: usize,
    #[serde(default)]
    seed: u32,
    #[serde(default = "default_scale")]
    scale: f32,
}

fn default_scale() -> f32 {
    2.0
}

#[derive(Debug, Serialize)]
struct InferResponse {
    elements: usize,
    device_bytes: usize,
    checksum: f64,
    alloc_wait_us: u64,
    total_us: u64,
    stream: u64,
}

/// Input element `i` of a request.
fn input_value(seed: u32, i: usize) -> f32 {
    ((seed as usize + i) % 1024) as f32
}

/// The largest input element ([`input_value`]).
const MAX_INPUT: f32 = 1023.0;

/// Device bytes a request of `elements` floats holds: input and output, each rounded up to the
/// pool's alignment. `None` on overflow.
fn device_bytes(elements: usize) -> Option<usize> {
    let one = elements
        .checked_mul(4)?
        .checked_next_multiple_of(ALIGNMENT)?;
    one.checked_mul(2)
}

struct App {
    device: Device,
    raw: Arc<Raw>,
    history: Arc<Recorded>,
    log: Option<Arc<LoggingAdaptor<Arc<Recorded>>>>,
    metrics: metrics::Metrics,
    pool: Arc<Pool>,
    streams: StreamPool,
    spin: Duration,
    alloc_timeout: Duration,
    max_requests: Option<u64>,
    shutdown: watch::Sender<bool>,
    counts: Counts,
}

#[derive(Default)]
struct Counts {
    answered: AtomicU64,
    ok: AtomicU64,
    too_large: AtomicU64,
    timeouts: AtomicU64,
    errors: AtomicU64,
    in_flight: AtomicUsize,
    peak_in_flight: AtomicUsize,
    /// Device bytes needed by the requests in flight (holding or waiting for memory).
    demand: AtomicUsize,
    peak_demand: AtomicUsize,
}

/// A request in flight, counted in the demand until dropped.
struct InFlight<'a>(&'a Counts, usize);

impl<'a> InFlight<'a> {
    fn new(counts: &'a Counts, bytes: usize) -> Self {
        let n = counts.in_flight.fetch_add(1, Relaxed) + 1;
        counts.peak_in_flight.fetch_max(n, Relaxed);
        let d = counts.demand.fetch_add(bytes, Relaxed) + bytes;
        counts.peak_demand.fetch_max(d, Relaxed);
        Self(counts, bytes)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Relaxed);
        self.0.demand.fetch_sub(self.1, Relaxed);
    }
}

/// An HTTP error with a JSON body.
#[derive(Debug)]
struct ApiError {
    status: StatusCode,
    body: Value,
}

impl ApiError {
    fn new(status: StatusCode, kind: &str, message: String, numbers: Value) -> Self {
        let mut body = json!({ "error": kind, "message": message });
        if let (Some(body), Value::Object(numbers)) = (body.as_object_mut(), numbers) {
            body.extend(numbers);
        }
        Self { status, body }
    }

    fn bad_request(message: String) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message, Value::Null)
    }

    fn too_large(elements: usize, need: Option<usize>, maximum: usize) -> Self {
        let message = match need {
            Some(need) => format!(
                "{elements} elements need {need} bytes of device memory (input and output), \
                 more than the pool's maximum of {maximum} bytes"
            ),
            None => format!("{elements} elements overflow a byte count"),
        };
        let numbers =
            json!({ "elements": elements, "requested_bytes": need, "maximum_bytes": maximum });
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", message, numbers)
    }

    fn timeout(waited: Duration) -> Self {
        let message = format!("no device memory within {waited:.1?}; try again later");
        let numbers = json!({ "waited_ms": waited.as_millis() as u64 });
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "timeout", message, numbers)
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        match e {
            Error::Timeout { waited } => Self::timeout(waited),
            // A request the pool could never hold (a pool that grows chunk by chunk can refuse
            // one below its maximum; this one takes its memory up front, so this should not
            // happen past the check in `infer`).
            Error::OutOfMemory {
                requested,
                available,
                maximum,
            } => {
                let (status, kind) = if requested > maximum {
                    (StatusCode::PAYLOAD_TOO_LARGE, "too_large")
                } else {
                    (StatusCode::INTERNAL_SERVER_ERROR, "out_of_memory")
                };
                let numbers = json!({
                    "requested_bytes": requested,
                    "available_bytes": available,
                    "maximum_bytes": maximum,
                });
                Self::new(status, kind, e.to_string(), numbers)
            }
            e => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "device_error",
                e.to_string(),
                Value::Null,
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

impl App {
    async fn infer(&self, req: InferRequest) -> Result<InferResponse, ApiError> {
        let started = Instant::now();
        let elements = req.batch.checked_mul(req.len).filter(|&n| n > 0);
        let Some(elements) = elements else {
            let (b, l) = (req.batch, req.len);
            return Err(ApiError::bad_request(format!(
                "batch ({b}) and len ({l}) must be positive and their product must fit in usize"
            )));
        };
        // Every output is an input (at most 1023) times the scale: a scale whose product
        // overflows `f32` would answer an infinite checksum, which JSON writes as `null`.
        if !(req.scale * MAX_INPUT).is_finite() {
            return Err(ApiError::bad_request(format!(
                "scale must be finite, and at most {:e} in magnitude (every input times the \
                 scale must be a finite f32)",
                f32::MAX / MAX_INPUT
            )));
        }
        // Refused at once, never left to wait: a request the pool can never hold.
        let maximum = self.raw.maximum();
        let need = device_bytes(elements);
        let need = match need {
            Some(need) if need <= maximum => need,
            _ => return Err(ApiError::too_large(elements, need, maximum)),
        };
        let _in_flight = InFlight::new(&self.counts, need);
        let stream = self.streams.get();
        let bytes = elements * 4;

        // Take both buffers in one step, all or nothing: a request that held its input while
        // waiting for its output could deadlock with others doing the same (each holding what
        // the others wait for). `alloc_all_timeout` holds nothing while it waits (a future: no
        // thread is parked), first come, first served with the other requests, and returns
        // at once when the pool has both, or the deadline passes (503).
        let (mut input, output) = {
            let mut set = DeviceBuffer::alloc_all_timeout(
                &self.pool,
                &[(bytes, &stream), (bytes, &stream)],
                self.alloc_timeout,
            )
            .await?;
            let output = set.pop().expect("two buffers");
            let input = set.pop().expect("two buffers");
            // Whole f32s by construction; `Error::from` drops a refused buffer (freeing it).
            (
                DeviceVec::<f32>::from_buffer(input).map_err(Error::from)?,
                DeviceVec::<f32>::from_buffer(output).map_err(Error::from)?,
            )
        };
        let alloc_wait = started.elapsed();
        self.metrics.observe_wait(alloc_wait);

        // Everything below is queued on `stream` and returns at once; the host waits only for
        // the result, by `.await`.
        // The input (made once memory is there, so that waiting requests hold no host memory)
        // goes through pinned staging memory: the copy never blocks on the GPU.
        let host: Vec<f32> = (0..elements).map(|i| input_value(req.seed, i)).collect();
        input.copy_from_host(&host)?;
        // SAFETY: both vectors are live allocations of `elements` f32s (`bytes` bytes) on
        // `stream`, where this work is queued; each is freed (at its drop) on `stream` after it.
        unsafe {
            stream.copy_dtod(output.as_ptr(), input.as_ptr(), bytes)?;
            stream.scale_f32(output.as_ptr(), req.scale, elements)?;
        }
        // The rest of the model's work.
        stream.spin(self.spin)?;
        // Back to the pool at once, in stream order: later work on `stream` may reuse it.
        drop(input);
        let result = output.to_host(&stream).await?;
        drop(output);

        let checksum = result.iter().map(|&x| f64::from(x)).sum();
        Ok(InferResponse {
            elements,
            device_bytes: need,
            checksum,
            alloc_wait_us: alloc_wait.as_micros() as u64,
            total_us: started.elapsed().as_micros() as u64,
            stream: stream.id().get(),
        })
    }

    fn answered(&self, result: &Result<InferResponse, ApiError>) {
        let counter = match result {
            Ok(_) => &self.counts.ok,
            Err(e) if e.status == StatusCode::PAYLOAD_TOO_LARGE => &self.counts.too_large,
            Err(e) if e.status == StatusCode::SERVICE_UNAVAILABLE => &self.counts.timeouts,
            Err(_) => &self.counts.errors,
        };
        counter.fetch_add(1, Relaxed);
        let n = self.counts.answered.fetch_add(1, Relaxed) + 1;
        if self.max_requests == Some(n) {
            eprintln!("answered {n} requests (--max-requests): shutting down");
            self.shutdown.send_replace(true);
        }
    }

    fn stats(&self) -> Value {
        let p = self.raw.stats();
        let w = self.raw.wait_stats();
        let used = self.pool.counters();
        let c = &self.counts;
        let mean_wait_us = w.total_wait.as_micros() / u128::from(w.waits.max(1));
        json!({
            "device": self.device.to_string(),
            "pool": {
                "maximum": self.raw.maximum(), "reserved": p.reserved,
                "peak_reserved": p.peak_reserved, "free": p.free, "free_blocks": p.free_blocks,
                "chunks": p.chunks, "streams": p.streams, "grows": p.grows,
                "stream_waits": p.stream_waits,
            },
            "in_use": {
                "bytes": used.bytes.value, "peak_bytes": used.bytes.peak,
                "allocations": used.allocations.value, "total_allocations": used.allocations.total,
            },
            "waits": {
                "waiting": w.waiting, "bytes_waiting": w.bytes_waiting, "waits": w.waits,
                "mean_wait_us": mean_wait_us as u64,
                "max_wait_us": w.max_wait.as_micros() as u64, "timeouts": w.timeouts,
            },
            "requests": {
                "answered": c.answered.load(Relaxed), "ok": c.ok.load(Relaxed),
                "too_large": c.too_large.load(Relaxed), "timeouts": c.timeouts.load(Relaxed),
                "errors": c.errors.load(Relaxed), "in_flight": c.in_flight.load(Relaxed),
                "peak_in_flight": c.peak_in_flight.load(Relaxed),
                "peak_demand_bytes": c.peak_demand.load(Relaxed),
            },
        })
    }
}

async fn infer(
    State(app): State<Arc<App>>,
    body: Result<Json<InferRequest>, JsonRejection>,
) -> Response {
    let result = match body {
        Ok(Json(req)) => app.infer(req).await,
        Err(rejection) => Err(ApiError::bad_request(rejection.body_text())),
    };
    app.answered(&result);
    match result {
        Ok(answer) => Json(answer).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn stats(State(app): State<Arc<App>>) -> Json<Value> {
    Json(app.stats())
}

async fn get_metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        app.metrics.render(),
    )
        .into_response()
}

async fn get_snapshot(State(app): State<Arc<App>>) -> Response {
    match app.history.memory_snapshot() {
        Some(snapshot) => Json(snapshot).into_response(),
        None => (StatusCode::NOT_FOUND, "no snapshot").into_response(),
    }
}

async fn get_history(State(app): State<Arc<App>>) -> Response {
    Json(app.history.history()).into_response()
}

async fn start_history(State(app): State<Arc<App>>) -> StatusCode {
    app.history.start();
    StatusCode::NO_CONTENT
}

async fn stop_history(State(app): State<Arc<App>>) -> StatusCode {
    app.history.stop();
    StatusCode::NO_CONTENT
}

/// Resolves on Ctrl-C or when `stop` turns true.
async fn shutdown_signal(mut stop: watch::Receiver<bool>) {
    let ctrl_c = async {
        match tokio::signal::ctrl_c().await {
            Ok(()) => eprintln!("Ctrl-C: shutting down"),
            Err(_) => std::future::pending().await, // no signal handling here: wait for `stop`
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        _ = stop.wait_for(|&stop| stop) => {}
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match run(Args::parse()).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("inference_server failed: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<ExitCode, BoxError> {
    let device = Device::default_device()?;
    // The pool takes all its memory up front, in one chunk (initial = maximum): a pool that
    // grows chunk by chunk cannot serve a request larger than its largest chunk, so a request
    // below the maximum could wait forever.
    let pool_bytes = args
        .pool_mib
        .checked_mul(1 << 20)
        .ok_or("--pool-mib is too large")?;
    let options = PoolOptions {
        initial: pool_bytes,
        maximum: Some(pool_bytes),
        ..PoolOptions::default()
    };
    let raw = Arc::new(ServerPool::new(&args.resource, &device, options)?);
    let history = Arc::new(HistoryAdaptor::new(raw.clone(), HistoryOptions::default()));
    if args.history {
        history.start();
    }
    let log = match &args.log_file {
        Some(path) => Some(Arc::new(LoggingAdaptor::to_file(history.clone(), path)?)),
        None => None,
    };
    let top: ResourceRef = match &log {
        Some(log) => log.clone(),
        None => history.clone(),
    };
    let pool = Arc::new(StatisticsAdaptor::new(top));
    let (shutdown, stop) = watch::channel(false);
    let app = Arc::new(App {
        device: device.clone(),
        metrics: metrics::Metrics::new(metrics::PoolCollector {
            pool: raw.clone(),
            stats: pool.clone(),
        }),
        raw,
        history,
        log,
        pool,
        streams: StreamPool::new(&device, args.streams)?,
        spin: Duration::from_micros(args.spin_us),
        alloc_timeout: Duration::from_secs(args.alloc_timeout_secs),
        max_requests: args.max_requests,
        shutdown,
        counts: Counts::default(),
    });
    let router = Router::new()
        .route("/infer", post(infer))
        .route("/stats", get(stats))
        .route("/metrics", get(get_metrics))
        .route("/snapshot", get(get_snapshot))
        .route("/history", get(get_history))
        .route("/history/start", post(start_history))
        .route("/history/stop", post(stop_history))
        .with_state(app.clone());

    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port)).await?;
    let addr = listener.local_addr()?;
    println!(
        "inference server on {device}: {}, {} streams; listening on http://{addr}",
        app.raw.describe(pool_bytes),
        args.streams
    );
    let server = axum::serve(listener, router).with_graceful_shutdown(shutdown_signal(stop));
    let server = tokio::spawn(server.into_future());

    let code = if args.load {
        let report = load::run(addr, &args).await;
        app.shutdown.send_replace(true);
        server.await??;
        report?
    } else {
        server.await??;
        ExitCode::SUCCESS
    };
    println!(
        "server stopped after answering {} requests",
        app.counts.answered.load(Relaxed)
    );
    if let Some(log) = &app.log {
        log.flush()?;
        println!(
            "log: {} lines in {}",
            log.lines(),
            args.log_file
                .as_ref()
                .map_or(String::new(), |p| p.display().to_string())
        );
    }
    Ok(code)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pool of no memory, a load of no requests in flight and a shutdown after no answer
    /// are usage errors.
    #[test]
    fn zero_pool_and_zero_concurrency_are_usage_errors() {
        let parse = |line: &str| Args::try_parse_from(line.split_whitespace());
        for bad in [
            "--pool-mib 0",
            "--concurrency 0",
            "--pool-mib -1",
            "--max-requests 0",
        ] {
            let e = parse(&format!("server {bad}")).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{bad}: {e}");
        }
        let args = parse("server --pool-mib 1 --concurrency 1 --max-requests 1").unwrap();
        assert_eq!((args.pool_mib, args.concurrency), (1, 1));
        assert_eq!(args.max_requests, Some(1));
    }
}
