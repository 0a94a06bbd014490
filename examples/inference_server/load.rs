//! The load generator of `--load`: loopback only, bounded in count and time.

use std::collections::BTreeMap;

use super::*;

/// A request of the plan and what its answer must be.
struct Planned {
    body: InferRequest,
    too_large: bool,
    /// The checksum a correct answer carries (exact: small integers, see `expected`).
    checksum: f64,
    need: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Ok,
    TooLarge,
    Timeout,
    OutOfMemory,
    WrongChecksum,
    OtherStatus,
    Transport,
    Deadline,
    NotSent,
}

/// The sum of `(seed + i) % 1024 * scale` for `i < elements`, computed without the loop.
/// Exact in f64 for the small integer scales used here.
fn expected(seed: u32, scale: f32, elements: usize) -> f64 {
    let start = seed as usize % 1024;
    let cycles = (elements / 1024) as f64 * (1023.0 * 1024.0 / 2.0);
    let rest: f64 = (0..elements % 1024)
        .map(|i| ((start + i) % 1024) as f64)
        .sum();
    (cycles + rest) * f64::from(scale)
}

/// SplitMix64: a deterministic plan without a random-number crate.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Normal requests need between 1/256 and 1/2 of the pool (log-uniform); `too_large` of
/// them, spread evenly, need four times the pool.
fn plan(requests: usize, too_large: usize, maximum: usize) -> Vec<Planned> {
    let mut rng = Rng(0x5eed);
    let (lo, hi) = ((maximum / 256) as f64, (maximum / 2) as f64);
    let every = requests.checked_div(too_large).unwrap_or(usize::MAX).max(1);
    (0..requests)
        .map(|i| {
            let too_large = too_large > 0 && i % every == every / 2 && i / every < too_large;
            let batch = 1 + (rng.next() % 8) as usize;
            let elements = if too_large {
                2 * maximum / 4 // 2x the pool per buffer
            } else {
                let need = lo * (hi / lo).powf(rng.unit());
                (need / 8.0) as usize
            };
            let len = (elements / batch).max(1);
            let (seed, scale) = ((rng.next() % 1024) as u32, (1 + rng.next() % 4) as f32);
            Planned {
                body: InferRequest {
                    batch,
                    len,
                    seed,
                    scale,
                },
                too_large,
                checksum: expected(seed, scale, batch * len),
                need: device_bytes(batch * len).unwrap_or(usize::MAX),
            }
        })
        .collect()
}

async fn one(client: &reqwest::Client, url: &str, p: &Planned) -> (Outcome, String) {
    let sent = client.post(url).json(&p.body).send().await;
    let answer = match sent {
        Ok(r) => (r.status(), r.json::<Value>().await),
        Err(e) => return (Outcome::Transport, e.to_string()),
    };
    let (status, body) = match answer {
        (status, Ok(body)) => (status, body),
        (_, Err(e)) => return (Outcome::Transport, e.to_string()),
    };
    let outcome = match status {
        StatusCode::OK if body["checksum"].as_f64() == Some(p.checksum) => Outcome::Ok,
        StatusCode::OK => Outcome::WrongChecksum,
        StatusCode::PAYLOAD_TOO_LARGE
            if body["requested_bytes"].as_u64() > body["maximum_bytes"].as_u64() =>
        {
            Outcome::TooLarge
        }
        StatusCode::SERVICE_UNAVAILABLE => Outcome::Timeout,
        _ if body["error"] == "out_of_memory" => Outcome::OutOfMemory,
        _ => Outcome::OtherStatus,
    };
    (outcome, format!("{status}: {body}"))
}

async fn get_stats(client: &reqwest::Client, base: &str) -> Result<Value, BoxError> {
    Ok(client
        .get(format!("{base}/stats"))
        .send()
        .await?
        .json()
        .await?)
}

/// `bytes` in KiB below a MiB, else in MiB.
fn mib(bytes: f64) -> String {
    if bytes < (1 << 20) as f64 {
        format!("{:.0} KiB", bytes / 1024.0)
    } else {
        format!("{:.1} MiB", bytes / (1 << 20) as f64)
    }
}

/// Checks a scrape of `/metrics`, taken after the load, against `/stats` (taken just
/// before, with nothing in flight) and against itself. Returns how many numbers were
/// checked and what disagrees.
fn check_metrics(m: &BTreeMap<String, f64>, stats: &Value) -> (usize, Vec<String>) {
    let (pool, used, waits, reqs) = (
        &stats["pool"],
        &stats["in_use"],
        &stats["waits"],
        &stats["requests"],
    );
    let num = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let get = |name: &str| m.get(name).copied().unwrap_or(f64::NAN);
    let free = get("streamalloc_pool_free_bytes");
    let in_use = get("streamalloc_pool_in_use_bytes");
    let checks: Vec<(&str, f64, f64)> = vec![
        (
            "reserved",
            get("streamalloc_pool_reserved_bytes"),
            num(&pool["reserved"]),
        ),
        ("in use", in_use, num(&used["bytes"])),
        ("in use once every request is answered", in_use, 0.0),
        (
            "peak in use",
            get("streamalloc_pool_peak_in_use_bytes"),
            num(&used["peak_bytes"]),
        ),
        ("free bytes", free, num(&pool["free"])),
        (
            "free = reserved once nothing is in use",
            free,
            get("streamalloc_pool_reserved_bytes"),
        ),
        (
            "free blocks",
            get("streamalloc_pool_free_blocks"),
            num(&pool["free_blocks"]),
        ),
        (
            "chunks",
            get("streamalloc_pool_chunks"),
            num(&pool["chunks"]),
        ),
        (
            "stream waits",
            get("streamalloc_pool_stream_waits_total"),
            num(&pool["stream_waits"]),
        ),
        (
            "waits for memory",
            get("streamalloc_memory_waits_total"),
            num(&waits["waits"]),
        ),
        (
            "timeouts",
            get("streamalloc_memory_wait_timeouts_total"),
            num(&waits["timeouts"]),
        ),
        ("tasks waiting now", get("streamalloc_memory_waiting"), 0.0),
        (
            "memory-wait histogram count = requests answered ok",
            get("streamalloc_request_memory_wait_seconds_count"),
            num(&reqs["ok"]),
        ),
        (
            "histogram +Inf bucket = its count",
            get("streamalloc_request_memory_wait_seconds_bucket{le=\"+Inf\"}"),
            get("streamalloc_request_memory_wait_seconds_count"),
        ),
        (
            "allocations left = 0",
            get("streamalloc_pool_allocations"),
            0.0,
        ),
    ];
    let disagree = checks
        .iter()
        .filter(|(_, got, want)| got != want)
        .map(|(what, got, want)| format!("/metrics {what}: {got}, expected {want}"))
        .collect();
    (checks.len(), disagree)
}

pub(super) async fn run(addr: SocketAddr, args: &Args) -> Result<ExitCode, BoxError> {
    if !addr.ip().is_loopback() {
        return Err(format!("the load generator only targets loopback, not {addr}").into());
    }
    let base = format!("http://{addr}");
    let client = reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(args.concurrency)
        .build()?;
    let maximum = get_stats(&client, &base).await?["pool"]["maximum"]
        .as_u64()
        .ok_or("/stats has no pool maximum")? as usize;
    let plan = Arc::new(plan(args.requests, args.too_large, maximum));
    let normal: Vec<_> = plan.iter().filter(|p| !p.too_large).collect();
    let total_need: usize = normal.iter().map(|p| p.need).sum();
    let mean_need = total_need as f64 / normal.len().max(1) as f64;
    let min = normal.iter().map(|p| p.need).min().unwrap_or(0);
    let max = normal.iter().map(|p| p.need).max().unwrap_or(0);
    let concurrent = mean_need * args.concurrency as f64;
    println!(
        "load: {} requests ({} too large), {} at a time, to {base} (deadline {}s)",
        plan.len(),
        plan.len() - normal.len(),
        args.concurrency,
        args.deadline_secs,
    );
    println!(
        "  each needs {} to {} of device memory (mean {}): {} at a time need ~{}, \
         {:.1}x the pool of {}",
        mib(min as f64),
        mib(max as f64),
        mib(mean_need),
        args.concurrency,
        mib(concurrent),
        concurrent / maximum as f64,
        mib(maximum as f64),
    );

    // Workers take the next request of the plan until it is done or the deadline passes.
    // Checked: a deadline too far ahead to be an instant is no deadline (a review found
    // `--deadline-secs 18446744073709551615` panicking).
    let now = tokio::time::Instant::now();
    let deadline = now
        .checked_add(Duration::from_secs(args.deadline_secs))
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30));
    let next = Arc::new(AtomicUsize::new(0));
    let url: Arc<str> = format!("{base}/infer").into();
    let start = Instant::now();
    let workers: Vec<_> = (0..args.concurrency.max(1))
        .map(|_| {
            let (client, plan, next, url) =
                (client.clone(), plan.clone(), next.clone(), url.clone());
            tokio::spawn(async move {
                let mut samples = Vec::new();
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    let Some(p) = plan.get(i) else { break };
                    let t0 = Instant::now();
                    let answer = tokio::time::timeout_at(deadline, one(&client, &url, p)).await;
                    let (outcome, detail) =
                        answer.unwrap_or((Outcome::Deadline, "no answer by the deadline".into()));
                    samples.push((i, outcome, t0.elapsed(), detail));
                    if outcome == Outcome::Deadline {
                        break;
                    }
                }
                samples
            })
        })
        .collect();
    let mut samples = Vec::new();
    for worker in workers {
        samples.extend(worker.await?);
    }
    let elapsed = start.elapsed();
    samples.sort_by_key(|s| s.0);
    let after = get_stats(&client, &base).await?;
    let scrape = client
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .text()
        .await?;
    drop(client); // close the connections before the server shuts down

    // Tally: an outcome is expected if it is 200-with-the-right-checksum for a normal
    // request and 413 for a too-large one.
    let mut answered = vec![false; plan.len()];
    let mut counts: BTreeMap<Outcome, usize> = BTreeMap::new();
    let mut unexpected = Vec::new();
    let mut latencies = Vec::new();
    for (i, outcome, latency, detail) in &samples {
        answered[*i] = true;
        *counts.entry(*outcome).or_default() += 1;
        let want = if plan[*i].too_large {
            Outcome::TooLarge
        } else {
            Outcome::Ok
        };
        if *outcome != want {
            unexpected.push(format!(
                "request {i} ({:?}): {outcome:?} {detail}",
                plan[*i].body
            ));
        }
        if *outcome == Outcome::Ok {
            latencies.push(*latency);
        }
    }
    let not_sent = answered.iter().filter(|&&a| !a).count();
    if not_sent > 0 {
        counts.insert(Outcome::NotSent, not_sent);
        unexpected.push(format!("{not_sent} requests not sent before the deadline"));
    }
    latencies.sort();
    let pct = |q: f64| -> Duration {
        let at = ((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len().max(1));
        latencies.get(at - 1).copied().unwrap_or_default()
    };
    let count = |o: Outcome| counts.get(&o).copied().unwrap_or(0);

    let answered = samples.len() - count(Outcome::Deadline);
    println!(
        "done in {elapsed:.2?}: {answered} answered, {:.1} req/s",
        answered as f64 / elapsed.as_secs_f64()
    );
    println!(
        "latency of the {} successful requests: p50 {:.1?}, p90 {:.1?}, p99 {:.1?}, \
         max {:.1?}",
        latencies.len(),
        pct(0.50),
        pct(0.90),
        pct(0.99),
        latencies.last().copied().unwrap_or_default(),
    );
    println!(
        "outcomes: {} ok (checksum right), {} too large (413), {} timed out (503), \
         {} out of memory, {} wrong checksum, {} other status, {} transport errors, \
         {} past the deadline, {} not sent",
        count(Outcome::Ok),
        count(Outcome::TooLarge),
        count(Outcome::Timeout),
        count(Outcome::OutOfMemory),
        count(Outcome::WrongChecksum),
        count(Outcome::OtherStatus),
        count(Outcome::Transport),
        count(Outcome::Deadline),
        count(Outcome::NotSent),
    );
    let (pool, used, waits, reqs) = (
        &after["pool"],
        &after["in_use"],
        &after["waits"],
        &after["requests"],
    );
    let num = |v: &Value| v.as_f64().unwrap_or(0.0);
    println!(
        "pool (/stats): {} reserved in {} chunk(s); peak in use {} ({:.0}% of the pool); \
         peak demand {} ({:.1}x the pool) from {} requests in flight",
        mib(num(&pool["reserved"])),
        pool["chunks"],
        mib(num(&used["peak_bytes"])),
        100.0 * num(&used["peak_bytes"]) / maximum as f64,
        mib(num(&reqs["peak_demand_bytes"])),
        num(&reqs["peak_demand_bytes"]) / maximum as f64,
        reqs["peak_in_flight"],
    );
    println!(
        "waits for memory: {} (mean {:.1} ms, longest {:.1} ms), {} timed out; \
         {} cross-stream waits",
        waits["waits"],
        num(&waits["mean_wait_us"]) / 1e3,
        num(&waits["max_wait_us"]) / 1e3,
        waits["timeouts"],
        pool["stream_waits"],
    );
    let (checked, disagree) = check_metrics(&metrics::parse(&scrape), &after);
    println!(
        "metrics (/metrics): reserved {}, in use {}, peak in use {}, {} free block(s), {} stream waits, {} waits ({} timed out), {} requests timed on memory; {checked} numbers checked against /stats and each other: {}",
        mib(num(&pool["reserved"])),
        mib(num(&used["bytes"])),
        mib(num(&used["peak_bytes"])),
        pool["free_blocks"],
        pool["stream_waits"],
        waits["waits"],
        waits["timeouts"],
        reqs["ok"],
        if disagree.is_empty() { "all agree".to_string() } else { format!("{} disagree", disagree.len()) }
    );
    unexpected.extend(disagree);
    if unexpected.is_empty() {
        println!(
            "healthy: every request answered, no out-of-memory error, only the {} too-large \
             ones refused",
            count(Outcome::TooLarge)
        );
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "UNHEALTHY: {} unexpected outcomes, the first ones:",
            unexpected.len()
        );
        for line in unexpected.iter().take(10) {
            println!("  {line}");
        }
        Ok(ExitCode::FAILURE)
    }
}
