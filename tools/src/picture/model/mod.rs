//! What the picture shows, computed from a trace of events (a log or a history) or from a
//! snapshot: memory over time, the address space at the peak, the largest live allocations.

mod snapshot;
mod trace;

pub(crate) use self::snapshot::from_snapshot;
pub(crate) use self::trace::{from_trace, peak_index};

/// At most this many streams are told apart; the others share the last colour.
pub(crate) const MAX_STREAMS: usize = 10;
/// Points of the timeline (each the maximum of its stretch of events).
const BUCKETS: usize = 1200;
/// Live allocations further apart than this are drawn as separate regions of the address map.
const REGION_GAP: u64 = 64 << 20;
/// Rows of the largest-allocations table.
const LARGEST: usize = 20;

/// What one event does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Act {
    Alloc,
    Free,
    Fail,
    /// A zero-byte allocation or a free of null.
    Nop,
}

/// One event of a trace.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ev {
    /// Microseconds since the trace's earliest event, if the trace has times (not necessarily
    /// in order: a history reads its clock before its lock, a log is written by many threads).
    pub(crate) t_us: Option<u64>,
    pub(crate) act: Act,
    pub(crate) ptr: u64,
    pub(crate) size: u64,
    /// Index into [`Trace::streams`].
    pub(crate) stream: u32,
    /// Index into [`Trace::backtraces`].
    pub(crate) backtrace: Option<u32>,
}

/// Events read from a log or a history.
#[derive(Debug, Default)]
pub(crate) struct Trace {
    pub(crate) events: Vec<Ev>,
    /// The streams' names as the source writes them, by first appearance.
    pub(crate) streams: Vec<String>,
    pub(crate) backtraces: Vec<String>,
    /// Bytes reserved after each event, when known (a replay).
    pub(crate) reserved: Option<Vec<u64>>,
    /// Events the source dropped before the first one kept (a history's ring).
    pub(crate) dropped: u64,
    /// The line of each event in its log (empty for a history): where an error points.
    pub(crate) lines: Vec<u64>,
}

impl Trace {
    /// Where event `i` is in its source, for an error: `line N` of a log, `event N` (from 1)
    /// of a history.
    pub(crate) fn place(&self, i: usize) -> String {
        match self.lines.get(i) {
            Some(line) => format!("line {line}"),
            None => format!("event {} of the history", i + 1),
        }
    }
}

/// What a block of the address map is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MapState {
    InUse,
    Free,
    Waiting,
    /// Between live allocations of a log: free, or not held at all (a log does not say).
    Unknown,
}

#[derive(Debug, Clone)]
pub(crate) struct MapBlock {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) state: MapState,
    /// Index into [`Picture::streams`].
    pub(crate) stream: Option<usize>,
}

/// A contiguous stretch of addresses: a chunk of a snapshot, or a cluster of a log's live
/// allocations.
#[derive(Debug, Clone)]
pub(crate) struct Region {
    pub(crate) base: u64,
    pub(crate) size: u64,
    pub(crate) blocks: Vec<MapBlock>,
}

/// A live allocation at the peak.
#[derive(Debug, Clone)]
pub(crate) struct LiveAlloc {
    pub(crate) addr: u64,
    pub(crate) size: u64,
    pub(crate) stream: Option<usize>,
    /// Seconds since the trace's start (or the snapshot's allocation time, relative to the
    /// oldest), if known.
    pub(crate) allocated_at_s: Option<f64>,
    pub(crate) backtrace: Option<String>,
}

#[derive(Debug, Clone)]
pub(crate) struct StreamInfo {
    pub(crate) name: String,
    /// The most this stream had in use at once.
    pub(crate) peak: u64,
    /// Its bytes in use at the overall peak.
    pub(crate) at_peak: u64,
}

/// Memory over time, one point per stretch of events.
#[derive(Debug, Clone, Default)]
pub(crate) struct Timeline {
    /// `true`: `xs` are seconds since the start; `false`: event numbers.
    pub(crate) seconds: bool,
    pub(crate) xs: Vec<f64>,
    /// The most in use during each stretch.
    pub(crate) in_use: Vec<u64>,
    /// In use by each stream (of [`Picture::streams`]) at that moment.
    pub(crate) per_stream: Vec<Vec<u64>>,
    pub(crate) reserved: Option<Vec<u64>>,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct Counts {
    pub(crate) events: u64,
    pub(crate) allocations: u64,
    pub(crate) frees: u64,
    pub(crate) failures: u64,
    pub(crate) unmatched_frees: u64,
}

/// Everything the page shows.
#[derive(Debug, Clone, Default)]
pub(crate) struct Picture {
    pub(crate) title: String,
    pub(crate) timeline: Option<Timeline>,
    pub(crate) peak_in_use: u64,
    /// Seconds (or the event number) of the peak.
    pub(crate) peak_x: f64,
    pub(crate) peak_event: Option<u64>,
    pub(crate) peak_reserved: Option<u64>,
    pub(crate) counts: Counts,
    /// Ordered by their peak, largest first; at most [`MAX_STREAMS`] (the last may be
    /// "other streams").
    pub(crate) streams: Vec<StreamInfo>,
    pub(crate) regions: Vec<Region>,
    /// The address map shows free blocks (a snapshot), or only live ones (a log).
    pub(crate) map_from_snapshot: bool,
    pub(crate) largest: Vec<LiveAlloc>,
    pub(crate) notes: Vec<String>,
}

/// Orders streams by peak (largest first), keeping [`MAX_STREAMS`] - 1 and folding the rest
/// into "other streams". Returns each input stream's index in the result, and the result.
pub(super) fn rank_streams(infos: Vec<StreamInfo>) -> (Vec<usize>, Vec<StreamInfo>) {
    let mut idx: Vec<usize> = (0..infos.len()).collect();
    idx.sort_by(|&a, &b| infos[b].peak.cmp(&infos[a].peak).then(a.cmp(&b)));
    let mut order = vec![0usize; infos.len()];
    let mut out: Vec<StreamInfo> = Vec::new();
    for (rank, &s) in idx.iter().enumerate() {
        if infos.len() > MAX_STREAMS && rank >= MAX_STREAMS - 1 {
            if out.len() < MAX_STREAMS {
                out.push(StreamInfo {
                    name: format!("{} other streams", infos.len() - (MAX_STREAMS - 1)),
                    peak: 0,
                    at_peak: 0,
                });
            }
            let other = out.last_mut().expect("pushed above");
            other.peak = other.peak.max(infos[s].peak);
            other.at_peak = other.at_peak.saturating_add(infos[s].at_peak);
            order[s] = MAX_STREAMS - 1;
        } else {
            order[s] = out.len();
            out.push(infos[s].clone());
        }
    }
    (order, out)
}

#[cfg(test)]
mod tests {
    use indicatif::ProgressBar;

    use super::*;

    fn ev(t: u64, act: Act, ptr: u64, size: u64, stream: u32) -> Ev {
        Ev {
            t_us: Some(t),
            act,
            ptr,
            size,
            stream,
            backtrace: None,
        }
    }

    #[test]
    fn peak_and_live_at_peak() {
        let trace = Trace {
            events: vec![
                ev(0, Act::Alloc, 0x1000, 100, 0),
                ev(10, Act::Alloc, 0x2000, 300, 1),
                ev(20, Act::Free, 0x1000, 100, 0),
                ev(30, Act::Alloc, 0x3000, 50, 0),
                ev(40, Act::Free, 0x2000, 300, 1),
            ],
            streams: vec!["7".into(), "9".into()],
            ..Trace::default()
        };
        let p = from_trace(&trace, "t".into(), None, &ProgressBar::hidden()).unwrap();
        assert_eq!(p.peak_in_use, 400);
        assert_eq!(p.peak_event, Some(1));
        assert!((p.peak_x - 10e-6).abs() < 1e-12);
        assert_eq!(p.largest.len(), 2);
        assert_eq!(p.largest[0].size, 300);
        assert_eq!(p.streams[0].name, "stream 9");
        assert_eq!(p.streams[0].peak, 300);
        let t = p.timeline.unwrap();
        assert_eq!(t.in_use.iter().max(), Some(&400));
        assert_eq!(*t.in_use.last().unwrap(), 50);
        // One region: 0x1000..0x2000+300 with an unknown gap.
        assert_eq!(p.regions.len(), 1);
        assert_eq!(p.regions[0].blocks.len(), 3);
    }
}
