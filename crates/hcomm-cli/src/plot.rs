//! A small SVG writer for benchmark results: bus bandwidth and time per call against message
//! size, log-scaled, one line per series. (Hand-written: two panels of lines and ticks do not
//! justify a plotting crate and its font stack.)

use std::fmt::Write as _;
use std::io;
use std::path::Path;

/// One line: a label and (bytes, busbw GB/s, time µs) points.
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Points, in size order.
    pub points: Vec<(f64, f64, f64)>,
}

const W: f64 = 460.0;
const H: f64 = 320.0;
const M: (f64, f64, f64, f64) = (60.0, 20.0, 40.0, 50.0); // left, right, top, bottom
pub(crate) const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

fn size_label(b: f64) -> String {
    let b = b.round() as u64;
    match b {
        0 => "0".into(),
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{}G", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{}M", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{}K", b >> 10),
        b => b.to_string(),
    }
}

pub(crate) fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One panel: x = log2(bytes), y = value (log10 when `log_y`).
fn panel(
    out: &mut String,
    x0: f64,
    title: &str,
    ylabel: &str,
    series: &[Series],
    pick: fn(&(f64, f64, f64)) -> f64,
    log_y: bool,
) {
    let pts: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| (p.0.max(1.0), pick(p))))
        .filter(|p| p.1.is_finite() && (!log_y || p.1 > 0.0))
        .collect();
    let (w, h) = (W - M.0 - M.1, H - M.2 - M.3);
    let _ = write!(
        out,
        r#"<g transform="translate({x0},0)"><text x="{}" y="22" font-size="14" text-anchor="middle">{}</text>"#,
        M.0 + w / 2.0,
        esc(title)
    );
    let _ = write!(
        out,
        r##"<rect x="{}" y="{}" width="{w}" height="{h}" fill="none" stroke="#888"/>"##,
        M.0, M.2
    );
    if pts.is_empty() {
        out.push_str("</g>");
        return;
    }
    let fy = |v: f64| if log_y { v.log10() } else { v };
    let (xmin, xmax) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| {
        (a.min(p.0.log2()), b.max(p.0.log2()))
    });
    let (xmin, xmax) = if xmax - xmin < 1.0 {
        (xmin - 0.5, xmax + 0.5)
    } else {
        (xmin, xmax)
    };
    let (mut ymin, mut ymax) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| {
        (a.min(fy(p.1)), b.max(fy(p.1)))
    });
    if log_y {
        ymin = ymin.floor();
        ymax = ymax.ceil().max(ymin + 1.0);
    } else {
        ymin = 0.0;
        ymax = (ymax * 1.1).max(1e-6);
    }
    let sx = |x: f64| M.0 + (x.log2() - xmin) / (xmax - xmin) * w;
    let sy = |y: f64| M.2 + h - (fy(y) - ymin) / (ymax - ymin) * h;
    // x ticks: every power of 4 in range.
    let mut e = xmin.ceil() as i64;
    while (e as f64) <= xmax {
        if e % 2 == 0 || xmax - xmin < 6.0 {
            let x = M.0 + (e as f64 - xmin) / (xmax - xmin) * w;
            let _ = write!(
                out,
                r##"<line x1="{x}" y1="{}" x2="{x}" y2="{}" stroke="#ddd"/><text x="{x}" y="{}" font-size="10" text-anchor="middle">{}</text>"##,
                M.2,
                M.2 + h,
                M.2 + h + 14.0,
                size_label(2f64.powi(e as i32))
            );
        }
        e += 1;
    }
    // y ticks.
    let ticks: Vec<f64> = if log_y {
        (ymin as i64..=ymax as i64)
            .map(|e| 10f64.powi(e as i32))
            .collect()
    } else {
        (0..=5).map(|i| ymax * i as f64 / 5.0).collect()
    };
    for t in ticks {
        let y = if log_y { sy(t) } else { M.2 + h - t / ymax * h };
        let label = if t >= 100.0 {
            format!("{t:.0}")
        } else if t >= 1.0 {
            format!("{t:.1}")
        } else {
            format!("{t:.2}")
        };
        let _ = write!(
            out,
            r##"<line x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#eee"/><text x="{}" y="{}" font-size="10" text-anchor="end">{label}</text>"##,
            M.0,
            M.0 + w,
            M.0 - 4.0,
            y + 3.0
        );
    }
    let _ = write!(
        out,
        r#"<text x="{}" y="{}" font-size="11" text-anchor="middle">message size (bytes)</text>"#,
        M.0 + w / 2.0,
        H - 12.0
    );
    let _ = write!(
        out,
        r#"<text x="14" y="{}" font-size="11" text-anchor="middle" transform="rotate(-90 14 {})">{}</text>"#,
        M.2 + h / 2.0,
        M.2 + h / 2.0,
        esc(ylabel)
    );
    for (i, s) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let line: Vec<String> = s
            .points
            .iter()
            .filter(|p| pick(p).is_finite() && (!log_y || pick(p) > 0.0))
            .map(|p| format!("{:.1},{:.1}", sx(p.0.max(1.0)), sy(pick(p))))
            .collect();
        if !line.is_empty() {
            let _ = write!(
                out,
                r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#,
                line.join(" ")
            );
            for xy in &line {
                let (x, y) = xy.split_once(',').unwrap();
                let _ = write!(out, r#"<circle cx="{x}" cy="{y}" r="2.5" fill="{c}"/>"#);
            }
        }
    }
    out.push_str("</g>");
}

/// Render `series` as an SVG document.
pub fn svg(title: &str, series: &[Series]) -> String {
    let legend_h = 18.0 * series.len() as f64 + 10.0;
    let total_h = H + legend_h + 30.0;
    let mut out = format!(
        r#"<?xml version="1.0" encoding="UTF-8"?><svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{total_h}" font-family="sans-serif">"#,
        2.0 * W
    );
    let _ = write!(
        out,
        r#"<rect width="100%" height="100%" fill="white"/><text x="{}" y="18" font-size="15" text-anchor="middle">{}</text><g transform="translate(0,20)">"#,
        W,
        esc(title)
    );
    panel(
        &mut out,
        0.0,
        "bus bandwidth",
        "busbw (GB/s)",
        series,
        |p| p.1,
        false,
    );
    panel(
        &mut out,
        W,
        "time per call",
        "time (us, log)",
        series,
        |p| p.2,
        true,
    );
    out.push_str("</g>");
    for (i, s) in series.iter().enumerate() {
        let y = H + 35.0 + 18.0 * i as f64;
        let _ = write!(
            out,
            r#"<rect x="70" y="{}" width="14" height="4" fill="{}"/><text x="90" y="{}" font-size="12">{}</text>"#,
            y - 4.0,
            COLORS[i % COLORS.len()],
            y + 1.0,
            esc(&s.label)
        );
    }
    out.push_str("</svg>\n");
    out
}

/// Write the plot; only `.svg` files are supported.
pub fn write(path: &Path, title: &str, series: &[Series]) -> io::Result<()> {
    match path.extension().and_then(|e| e.to_str()).map(|e| e.to_ascii_lowercase()) {
        Some(e) if e == "svg" => std::fs::write(path, svg(title, series)),
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{}: only .svg plots are written (convert with e.g. `rsvg-convert -o plot.png plot.svg`)", path.display()),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_is_well_formed_and_has_every_series() {
        let s = vec![
            Series {
                label: "allreduce <2 ranks>".into(),
                points: vec![
                    (8.0, 0.001, 5.0),
                    (1048576.0, 3.2, 300.0),
                    (67108864.0, 2.2, 30000.0),
                ],
            },
            Series {
                label: "single".into(),
                points: vec![(1024.0, 0.5, 2.0)],
            },
        ];
        let doc = svg("test & plot", &s);
        assert!(doc.starts_with("<?xml") && doc.trim_end().ends_with("</svg>"));
        assert_eq!(doc.matches("<polyline").count(), 4);
        assert!(doc.contains("allreduce &lt;2 ranks&gt;") && doc.contains("test &amp; plot"));
        assert_eq!(doc.matches("<g").count(), doc.matches("</g>").count());
        assert!(!doc.contains("NaN") && !doc.contains("inf"));
    }
}
