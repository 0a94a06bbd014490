//! `/metrics` of the inference server, in Prometheus' text format, through `prometheus-client`:
//! the pool's numbers read at each scrape (a collector: nothing to keep in step), and the
//! server's own histogram of how long requests waited for memory.

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use streamalloc::resource::adaptor::StatisticsAdaptor;
use streamalloc::ResourceRef;

/// The pool, and the statistics adaptor in front of it (exact bytes in use and their peak).
#[derive(Debug)]
pub(crate) struct PoolCollector {
    pub(crate) pool: Arc<crate::ServerPool>,
    pub(crate) stats: Arc<StatisticsAdaptor<ResourceRef>>,
}

fn gauge(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let g = ConstGauge::new(v as i64);
    g.encode(e.encode_descriptor(name, help, None, g.metric_type())?)
}

fn counter(e: &mut DescriptorEncoder<'_>, name: &str, help: &str, v: u64) -> std::fmt::Result {
    let c = ConstCounter::new(v);
    c.encode(e.encode_descriptor(name, help, None, c.metric_type())?)
}

impl Collector for PoolCollector {
    fn encode(&self, mut e: DescriptorEncoder<'_>) -> std::fmt::Result {
        let p = self.pool.stats();
        let w = self.pool.wait_stats();
        let used = self.stats.counters();
        let e = &mut e;
        gauge(
            e,
            "streamalloc_pool_reserved_bytes",
            "Bytes the pool holds from the device.",
            p.reserved as u64,
        )?;
        gauge(
            e,
            "streamalloc_pool_maximum_bytes",
            "The most the pool may hold.",
            self.pool.maximum() as u64,
        )?;
        gauge(
            e,
            "streamalloc_pool_in_use_bytes",
            "Bytes handed out and not given back (as asked, not rounded).",
            used.bytes.value as u64,
        )?;
        gauge(
            e,
            "streamalloc_pool_peak_in_use_bytes",
            "The most bytes in use at once.",
            used.bytes.peak as u64,
        )?;
        gauge(
            e,
            "streamalloc_pool_free_bytes",
            "Bytes free in the pool's lists.",
            p.free as u64,
        )?;
        gauge(
            e,
            "streamalloc_pool_free_blocks",
            "Free blocks over all lists.",
            p.free_blocks as u64,
        )?;
        gauge(
            e,
            "streamalloc_pool_chunks",
            "Chunks held from the device.",
            p.chunks as u64,
        )?;
        gauge(
            e,
            "streamalloc_pool_allocations",
            "Allocations not given back.",
            used.allocations.value as u64,
        )?;
        counter(
            e,
            "streamalloc_pool_stream_waits",
            "Times a request's stream waited on another stream's event to reuse its memory.",
            p.stream_waits,
        )?;
        counter(
            e,
            "streamalloc_pool_grows",
            "Times the pool grew after construction.",
            p.grows,
        )?;
        gauge(
            e,
            "streamalloc_memory_waiting",
            "Tasks waiting for memory now.",
            w.waiting as u64,
        )?;
        counter(
            e,
            "streamalloc_memory_waits",
            "Waits for memory that ended with memory.",
            w.waits,
        )?;
        counter(
            e,
            "streamalloc_memory_wait_timeouts",
            "Waits for memory that ran past their deadline.",
            w.timeouts,
        )?;
        // In seconds, Prometheus' base unit of time (as the histogram's), not microseconds.
        let g = ConstGauge::new(w.max_wait.as_secs_f64());
        g.encode(e.encode_descriptor(
            "streamalloc_memory_wait_max_seconds",
            "The longest wait for memory.",
            None,
            g.metric_type(),
        )?)?;
        Ok(())
    }
}

/// The registry and the metrics the server updates itself.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    /// How long each request that got its buffers waited for them (the gate included).
    pub(crate) memory_wait: Histogram,
}

impl Metrics {
    pub(crate) fn new(collector: PoolCollector) -> Self {
        let mut registry = Registry::default();
        // 10 µs .. ~42 s (12 buckets, each 4 times the last).
        let memory_wait = Histogram::new(exponential_buckets(1e-5, 4.0, 12));
        registry.register(
            "streamalloc_request_memory_wait_seconds",
            // `register` appends the final period itself.
            "How long each request that got its device buffers waited for them",
            memory_wait.clone(),
        );
        registry.register_collector(Box::new(collector));
        Self {
            registry,
            memory_wait,
        }
    }

    pub(crate) fn observe_wait(&self, waited: Duration) {
        self.memory_wait.observe(waited.as_secs_f64());
    }

    /// The text of a scrape.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            out = format!("# encoding failed: {e}\n");
        }
        out
    }
}

/// `name{labels} value` lines of a scrape, by name (labels kept in the key), for the checks of
/// `--load`.
pub(crate) fn parse(text: &str) -> std::collections::BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamalloc::resource::pool::PoolOptions;
    use streamalloc::{Device, SimConfig};

    /// Every metric in base units (Prometheus' naming: seconds and bytes); the longest wait was
    /// `..._microseconds`.
    #[test]
    fn metrics_are_in_base_units() {
        let device = Device::simulated(SimConfig::default());
        let options = PoolOptions {
            initial: 1 << 20,
            maximum: Some(1 << 20),
            ..PoolOptions::default()
        };
        let pool = Arc::new(crate::ServerPool::new("pool", &device, options).unwrap());
        let top: ResourceRef = pool.clone();
        let stats = Arc::new(StatisticsAdaptor::new(top));
        let text = Metrics::new(PoolCollector { pool, stats }).render();
        assert!(
            text.contains("# TYPE streamalloc_memory_wait_max_seconds gauge"),
            "{text}"
        );
        for unit in ["microseconds", "milliseconds"] {
            assert!(!text.contains(unit), "{unit} in\n{text}");
        }
    }
}
