//! The page: one self-contained HTML file (inline CSS and SVG, no script, nothing fetched),
//! with the picture's numbers also embedded as JSON (`<script type="application/json"
//! id="streamalloc-data">`) for tools and tests.

use std::fmt::Write as _;

use serde_json::json;

use super::model::Picture;
use super::svg::{address_map, colour, escape, fmt_bytes, pale, timeline, PALETTE};

const STYLE: &str = "body{font-family:sans-serif;margin:20px;color:#222;max-width:1320px}\
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:22px 0 6px}\
.sub{color:#666;margin-bottom:10px}.nums span{display:inline-block;margin-right:22px}\
.nums b{font-size:16px}table{border-collapse:collapse;font-size:13px}\
td,th{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}\
td.r,th.r{text-align:right}.sw{display:inline-block;width:12px;height:12px;vertical-align:-1px;margin-right:5px;border:1px solid #0002}\
.legend span.item{margin-right:16px;white-space:nowrap}pre{font-size:11px;margin:4px 0;white-space:pre-wrap}\
.notes{color:#555;font-size:12px}";

/// The numbers a test or a tool reads back.
pub(crate) fn data(p: &Picture) -> serde_json::Value {
    json!({
        "title": p.title,
        "peak_in_use": p.peak_in_use,
        "peak_x": p.peak_x,
        "peak_event": p.peak_event,
        "peak_reserved": p.peak_reserved,
        "x_is_seconds": p.timeline.as_ref().map(|t| t.seconds),
        "events": p.counts.events,
        "allocations": p.counts.allocations,
        "frees": p.counts.frees,
        "failures": p.counts.failures,
        "unmatched_frees": p.counts.unmatched_frees,
        "streams": p.streams.iter().map(|s| json!({"name": s.name, "peak": s.peak, "at_peak": s.at_peak})).collect::<Vec<_>>(),
        "largest": p.largest.iter().map(|a| json!({"addr": a.addr, "size": a.size, "stream": a.stream.and_then(|k| p.streams.get(k)).map(|s| s.name.clone())})).collect::<Vec<_>>(),
        "regions": p.regions.iter().map(|r| json!({"base": r.base, "size": r.size, "blocks": r.blocks.len()})).collect::<Vec<_>>(),
    })
}

pub(crate) fn page(p: &Picture, source: &str) -> String {
    let mut s = String::with_capacity(1 << 20);
    let _ = write!(
        s,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title><style>{STYLE}</style></head><body>",
        escape(&p.title)
    );
    let _ = write!(
        s,
        "<h1>{}</h1><div class=\"sub\">{} &middot; made by streamalloc-picture</div>",
        escape(&p.title),
        escape(source)
    );
    // The numbers.
    s.push_str("<div class=\"nums\">");
    let _ = write!(
        s,
        "<span>{} <b id=\"peak-in-use\">{}</b> ({} bytes)</span>",
        if p.timeline.is_some() {
            "peak in use"
        } else {
            "in use"
        },
        fmt_bytes(p.peak_in_use),
        p.peak_in_use
    );
    if let Some(r) = p.peak_reserved {
        let _ = write!(
            s,
            "<span>{} <b id=\"peak-reserved\">{}</b> ({r} bytes)</span>",
            if p.timeline.is_some() {
                "peak reserved"
            } else {
                "reserved"
            },
            fmt_bytes(r)
        );
    }
    if let Some(t) = &p.timeline {
        let at = if t.seconds {
            format!("{:.6} s", p.peak_x)
        } else {
            format!("event {}", p.peak_x)
        };
        let _ = write!(
            s,
            "<span>peak at <b>{at}</b> (event {})</span><span>events <b>{}</b>: {} allocations, {} frees, {} failures</span>",
            p.peak_event.unwrap_or(0) + 1,
            p.counts.events,
            p.counts.allocations,
            p.counts.frees,
            p.counts.failures
        );
    }
    s.push_str("</div>");

    // Streams.
    s.push_str("<div class=\"legend\" style=\"margin-top:10px\">");
    for (k, st) in p.streams.iter().enumerate() {
        let _ = write!(
            s,
            "<span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>{}: peak {}, {} at the peak</span> ",
            colour(Some(k)),
            escape(&st.name),
            fmt_bytes(st.peak),
            fmt_bytes(st.at_peak)
        );
    }
    s.push_str("</div>");

    if let Some(t) = &p.timeline {
        s.push_str("<h2>Memory over time</h2><div class=\"legend\">");
        s.push_str("<span class=\"item\"><span class=\"sw\" style=\"background:#222;height:3px\"></span>in use (the most in each stretch)</span>");
        if t.reserved.is_some() {
            s.push_str("<span class=\"item\"><span class=\"sw\" style=\"background:#c0392b;height:3px\"></span>reserved from the device (by the replayed resource)</span>");
        }
        s.push_str("<span class=\"item\">areas: in use by each stream, stacked</span></div>");
        s.push_str(&timeline(p, t));
    } else {
        s.push_str("<p class=\"notes\">A snapshot is one moment: no timeline.</p>");
    }

    let (map, rects) = address_map(p);
    let _ = write!(
        s,
        "<h2>Address space {}</h2><div class=\"legend\">",
        if p.timeline.is_some() {
            "at the peak"
        } else {
            "at the snapshot"
        }
    );
    let _ = write!(
        s,
        "<span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>in use (stream's colour)</span>",
        PALETTE[0]
    );
    if p.map_from_snapshot {
        let _ = write!(
            s,
            "<span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>in use, stream not known</span>",
            colour(None)
        );
        let _ = write!(
            s,
            "<span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>free, in that stream's list</span><span class=\"item\"><span class=\"sw\" style=\"background:{}\"></span>free, any stream</span><span class=\"item\"><span class=\"sw\" style=\"background:repeating-linear-gradient(45deg,{} 0 3px,#fff 3px 6px)\"></span>waiting for a stream</span>",
            pale(Some(0)),
            pale(None),
            PALETTE[0]
        );
    } else {
        s.push_str("<span class=\"item\"><span class=\"sw\" style=\"background:#ececec\"></span>not in use (free or not held: a log does not say)</span>");
    }
    let _ = write!(
        s,
        "<span class=\"item\">{} region(s), {} rectangles; hover a block for its address</span></div>",
        p.regions.len(),
        rects
    );
    s.push_str(&map);

    // The largest allocations.
    let _ = write!(
        s,
        "<h2>Largest allocations alive {}</h2><table><tr><th class=\"r\">#</th><th class=\"r\">size</th><th class=\"r\">bytes</th><th>address</th><th>stream</th><th class=\"r\">allocated at</th><th>backtrace</th></tr>",
        if p.timeline.is_some() { "at the peak" } else { "at the snapshot" }
    );
    for (i, a) in p.largest.iter().enumerate() {
        let stream = a
            .stream
            .and_then(|k| p.streams.get(k))
            .map_or("?".to_string(), |st| st.name.clone());
        let when = a
            .allocated_at_s
            .map_or("-".to_string(), |t| format!("{t:.6} s"));
        let trace = a.backtrace.as_ref().map_or(String::new(), |b| {
            format!(
                "<details><summary>show</summary><pre>{}</pre></details>",
                escape(b)
            )
        });
        let _ = write!(
            s,
            "<tr><td class=\"r\">{}</td><td class=\"r\">{}</td><td class=\"r\">{}</td><td>{:#x}</td><td><span class=\"sw\" style=\"background:{}\"></span>{}</td><td class=\"r\">{when}</td><td>{trace}</td></tr>",
            i + 1,
            fmt_bytes(a.size),
            a.size,
            a.addr,
            colour(a.stream),
            escape(&stream)
        );
    }
    s.push_str("</table>");
    if !p.notes.is_empty() {
        s.push_str("<h2>Notes</h2><ul class=\"notes\">");
        for n in &p.notes {
            let _ = write!(s, "<li>{}</li>", escape(n));
        }
        s.push_str("</ul>");
    }
    // The numbers again, for tools. `</` cannot occur in JSON strings escaped this way.
    let json = data(p).to_string().replace("</", "<\\/");
    let _ = writeln!(
        s,
        "<script type=\"application/json\" id=\"streamalloc-data\">{json}</script></body></html>"
    );
    s
}
