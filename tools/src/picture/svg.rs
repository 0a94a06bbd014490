//! The two drawings, as inline SVG: memory over time, and the address space at the peak.
//!
//! Written by hand rather than with a plotting crate: the address map (blocks as rectangles
//! wrapped over rows, each with a hover tooltip) is ours in any case, and the timeline needs
//! only stacked areas, two lines, a marker and axes with byte-unit ticks: about 150 lines
//! here, against a dependency whose SVG backend emits no tooltips.

use std::fmt::Write as _;

use super::model::{MapState, Picture, Timeline};

/// Colours of the streams (Tableau 10); the last one is "other streams".
pub(crate) const PALETTE: [&str; 10] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac",
];
/// In use with no stream known.
const NO_STREAM: &str = "#6b6b6b";
const WIDTH: f64 = 1300.0;
/// The most rectangles the address map draws (beyond, neighbours of one colour merge first).
const MAX_RECTS: usize = 40_000;

pub(crate) fn colour(stream: Option<usize>) -> &'static str {
    stream.map_or(NO_STREAM, |s| PALETTE[s.min(PALETTE.len() - 1)])
}

/// `1.50 MiB`-style sizes.
pub(crate) fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A step of 1, 2 or 5 times a power of ten, giving about `count` ticks over `range`.
fn nice_step(range: f64, count: f64) -> f64 {
    let raw = (range / count).max(f64::MIN_POSITIVE);
    let power = 10f64.powf(raw.log10().floor());
    let m = raw / power;
    power
        * if m <= 1.0 {
            1.0
        } else if m <= 2.0 {
            2.0
        } else if m <= 5.0 {
            5.0
        } else {
            10.0
        }
}

/// Byte ticks: a nice step in the binary unit that suits `max`. Returns (step, unit, name).
fn byte_ticks(max: f64) -> (f64, f64, &'static str) {
    let units = [
        (1.0, "B"),
        (1024.0, "KiB"),
        (1048576.0, "MiB"),
        (1073741824.0, "GiB"),
        (1099511627776.0, "TiB"),
    ];
    let (unit, name) = units
        .iter()
        .rev()
        .find(|(u, _)| max >= *u)
        .copied()
        .unwrap_or((1.0, "B"));
    (nice_step(max / unit, 5.0) * unit, unit, name)
}

/// Memory over time: each stream's bytes in use stacked, the total in use as a line, reserved
/// as a line (when known), the peak marked.
pub(crate) fn timeline(p: &Picture, t: &Timeline) -> String {
    let (h, ml, mr, mt, mb) = (340.0, 84.0, 24.0, 16.0, 44.0);
    let (pw, ph) = (WIDTH - ml - mr, h - mt - mb);
    let n = t.xs.len();
    let x_min = t.xs.first().copied().unwrap_or(0.0);
    let x_max = t.xs.last().copied().unwrap_or(1.0).max(x_min + 1e-9);
    let top = t
        .in_use
        .iter()
        .chain(t.reserved.iter().flatten())
        .copied()
        .max()
        .unwrap_or(0)
        .max(1) as f64
        * 1.08;
    let sx = |x: f64| ml + (x - x_min) / (x_max - x_min) * pw;
    let sy = |y: f64| mt + ph - y / top * ph;
    let mut s = String::new();
    let _ = write!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{h}" viewBox="0 0 {WIDTH} {h}" font-family="sans-serif" font-size="12">"#
    );
    // Axes and grid.
    let (step, unit, name) = byte_ticks(top);
    let mut y = 0.0;
    while y <= top {
        let _ = write!(
            s,
            r##"<line x1="{ml}" x2="{}" y1="{yy:.1}" y2="{yy:.1}" stroke="#e3e3e3"/><text x="{}" y="{:.1}" text-anchor="end">{} {name}</text>"##,
            ml + pw,
            ml - 6.0,
            sy(y) + 4.0,
            trim_number(y / unit),
            yy = sy(y)
        );
        y += step;
    }
    let xstep = nice_step(x_max - x_min, 10.0);
    let mut x = (x_min / xstep).ceil() * xstep;
    while x <= x_max + xstep * 1e-6 {
        let _ = write!(
            s,
            r##"<line x1="{xx:.1}" x2="{xx:.1}" y1="{mt}" y2="{}" stroke="#efefef"/><text x="{xx:.1}" y="{}" text-anchor="middle">{}</text>"##,
            mt + ph,
            mt + ph + 16.0,
            trim_number(x),
            xx = sx(x)
        );
        x += xstep;
    }
    let _ = write!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        ml + pw / 2.0,
        h - 6.0,
        if t.seconds {
            "seconds since the first event"
        } else {
            "event number (the log has no times)"
        }
    );
    // Stacked areas, one per stream.
    let mut base = vec![0u64; n];
    for (k, series) in t.per_stream.iter().enumerate() {
        if series.iter().all(|&v| v == 0) {
            continue;
        }
        let mut d = String::new();
        for i in 0..n {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if i == 0 { "M" } else { "L" },
                sx(t.xs[i]),
                sy((base[i] + series[i]) as f64)
            );
        }
        for i in (0..n).rev() {
            let _ = write!(d, "L{:.1},{:.1}", sx(t.xs[i]), sy(base[i] as f64));
        }
        let _ = write!(
            s,
            r#"<path d="{d}Z" fill="{}" fill-opacity="0.85" stroke="none"><title>{}</title></path>"#,
            colour(Some(k)),
            escape(&p.streams.get(k).map_or(String::new(), |st| st.name.clone()))
        );
        for i in 0..n {
            base[i] += series[i];
        }
    }
    let line = |values: &[u64], stroke: &str, dash: &str, what: &str| {
        let mut d = String::new();
        for (i, v) in values.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1}",
                if i == 0 { "M" } else { "L" },
                sx(t.xs[i]),
                sy(*v as f64)
            );
        }
        format!(
            r#"<path d="{d}" fill="none" stroke="{stroke}" stroke-width="1.6" stroke-dasharray="{dash}"><title>{what}</title></path>"#
        )
    };
    if let Some(r) = &t.reserved {
        s.push_str(&line(r, "#c0392b", "6 3", "reserved"));
    }
    s.push_str(&line(&t.in_use, "#222", "", "in use"));
    // The peak.
    let px = sx(p.peak_x.clamp(x_min, x_max));
    let anchor = if px > ml + pw * 0.75 { "end" } else { "start" };
    let dx = if anchor == "end" { -6.0 } else { 6.0 };
    let _ = write!(
        s,
        r##"<line x1="{px:.1}" x2="{px:.1}" y1="{mt}" y2="{}" stroke="#222" stroke-dasharray="2 3"/><circle cx="{px:.1}" cy="{:.1}" r="3.5" fill="#222"/><text x="{:.1}" y="{:.1}" text-anchor="{anchor}" font-weight="bold">peak {}</text>"##,
        mt + ph,
        sy(p.peak_in_use as f64),
        px + dx,
        (sy(p.peak_in_use as f64) - 8.0).max(mt + 12.0),
        fmt_bytes(p.peak_in_use)
    );
    let _ = write!(
        s,
        r##"<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="#999"/></svg>"##
    );
    s
}

fn trim_number(v: f64) -> String {
    let text = format!("{v:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    if text == "-0" {
        "0".into()
    } else {
        text.into()
    }
}

/// The address space: regions laid end to end (a small gap between two), wrapped over rows;
/// each block a rectangle coloured by its stream (in use: full colour; free: pale; waiting for
/// a stream: hatched; unknown: light grey).
pub(crate) fn address_map(p: &Picture) -> (String, usize) {
    // Checked: a snapshot's sizes come from a file, and a sum past `u64::MAX` wrapped the span
    // to 0 and divided by it (a review's finding).
    let too_large = || {
        (
            String::from("<p>(the regions are too large to draw)</p>"),
            0,
        )
    };
    let Some(total) = (p.regions.iter()).try_fold(0u64, |t, r| t.checked_add(r.size)) else {
        return too_large();
    };
    if total == 0 {
        return (String::from("<p>(nothing to show)</p>"), 0);
    }
    let sep = (total / 150).max(1);
    let Some(span) = (p.regions.len() as u64 - 1)
        .checked_mul(sep)
        .and_then(|gaps| total.checked_add(gaps))
    else {
        return too_large();
    };
    let blocks: usize = p.regions.iter().map(|r| r.blocks.len()).sum();
    let rows = blocks.div_ceil(60).clamp(1, 8) as u64;
    let per_row = span.div_ceil(rows);
    let (row_h, gap) = (44.0, 18.0);
    let h = rows as f64 * (row_h + gap) + 4.0;
    let mut s = String::new();
    let _ = write!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{h}" viewBox="0 0 {WIDTH} {h}" font-family="sans-serif" font-size="11"><defs>"##
    );
    for (i, c) in PALETTE.iter().chain([NO_STREAM].iter()).enumerate() {
        let _ = write!(
            s,
            r##"<pattern id="hatch{i}" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/><rect width="3" height="6" fill="{c}"/></pattern>"##
        );
    }
    s.push_str("</defs>");
    for r in 0..rows {
        let y = r as f64 * (row_h + gap) + gap;
        let _ = write!(
            s,
            r##"<rect x="0" y="{y}" width="{WIDTH}" height="{row_h}" fill="#fafafa" stroke="#ddd"/>"##
        );
    }
    let scale = WIDTH / per_row as f64;
    let mut rects = 0usize;
    let mut offset = 0u64;
    for region in &p.regions {
        // Region start: a tick and its address.
        let (row, col) = (offset / per_row, (offset % per_row) as f64 * scale);
        let y = row as f64 * (row_h + gap) + gap;
        let _ = write!(
            s,
            r##"<line x1="{col:.1}" x2="{col:.1}" y1="{:.1}" y2="{:.1}" stroke="#000"/><text x="{:.1}" y="{:.1}">{:#x} ({})</text>"##,
            y - 5.0,
            y + row_h,
            col + 2.0,
            y - 5.0,
            region.base,
            fmt_bytes(region.size)
        );
        // Merge neighbours drawn alike while the rectangles would be too many.
        let merge = blocks > MAX_RECTS;
        let mut i = 0;
        while i < region.blocks.len() {
            let b = &region.blocks[i];
            let mut size = b.size;
            let mut j = i + 1;
            while merge
                && j < region.blocks.len()
                && region.blocks[j].state == b.state
                && region.blocks[j].stream == b.stream
            {
                size = size.saturating_add(region.blocks[j].size);
                j += 1;
            }
            let fill = match b.state {
                MapState::InUse => colour(b.stream).to_string(),
                MapState::Free => pale(b.stream),
                MapState::Waiting => format!(
                    "url(#hatch{})",
                    b.stream.map_or(PALETTE.len(), |s| s.min(PALETTE.len() - 1))
                ),
                MapState::Unknown => "#ececec".to_string(),
            };
            let state = match b.state {
                MapState::InUse => "in use",
                MapState::Free => "free",
                MapState::Waiting => "waiting for a stream",
                MapState::Unknown => "not in use (free or not held: the log does not say)",
            };
            let who = b
                .stream
                .and_then(|k| p.streams.get(k))
                .map_or(String::new(), |st| format!(", {}", st.name));
            let title = if j > i + 1 {
                format!(
                    "{} blocks {state}{who}, {} from {:#x}",
                    j - i,
                    fmt_bytes(size),
                    b.addr
                )
            } else {
                format!("{:#x}: {} {state}{who}", b.addr, fmt_bytes(size))
            };
            // Split over rows; clamped to its region, so that the rows drawn are the region's
            // (a file's snapshot is checked on reading: its blocks tile their chunks).
            let start = b.addr.saturating_sub(region.base).min(region.size);
            let mut at = offset.saturating_add(start);
            let mut left = size.min(region.size - start);
            while left > 0 {
                let row = at / per_row;
                let into = at % per_row;
                let len = left.min(per_row - into);
                let x = into as f64 * scale;
                let w = (len as f64 * scale).max(0.6);
                let y = row as f64 * (row_h + gap) + gap;
                let stroke = if w >= 4.0 {
                    r##" stroke="#fff" stroke-width="0.5""##
                } else {
                    ""
                };
                let _ = write!(
                    s,
                    r#"<rect x="{x:.2}" y="{y}" width="{w:.2}" height="{row_h}" fill="{fill}"{stroke}><title>{}</title></rect>"#,
                    escape(&title)
                );
                rects += 1;
                at = at.saturating_add(len);
                left -= len;
            }
            i = j;
        }
        offset = offset.saturating_add(region.size).saturating_add(sep);
    }
    s.push_str("</svg>");
    (s, rects)
}

/// A stream's colour, pale (free memory of that stream); light grey for no stream.
pub(crate) fn pale(stream: Option<usize>) -> String {
    match stream {
        None => "#d9d9d9".into(),
        Some(_) => {
            let c = colour(stream);
            let v = |i: usize| u8::from_str_radix(&c[i..i + 2], 16).unwrap_or(0) as f64;
            let mix = |x: f64| (x + (255.0 - x) * 0.65).round() as u8;
            format!("#{:02x}{:02x}{:02x}", mix(v(1)), mix(v(3)), mix(v(5)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_steps() {
        assert_eq!(fmt_bytes(1536), "1.50 KiB");
        assert_eq!(fmt_bytes(10), "10 B");
        assert_eq!(nice_step(10.0, 5.0), 2.0);
        assert_eq!(byte_ticks(8.0 * 1048576.0).2, "MiB");
        assert_eq!(pale(Some(0)), "#c1d0e0");
    }
}
