//! `hcomm trace merge` and `hcomm trace summary`: the ranks' `HCOMM_TRACE` files joined into
//! one Chrome / Perfetto trace, and a table of where each rank's time went.

use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The trace files named by `inputs`: files as given, directories by their
/// `hcomm-trace-rank*.json` (in rank order).
pub fn trace_files(inputs: &[PathBuf]) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    for input in inputs {
        if input.is_dir() {
            let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(input)
                .map_err(|e| format!("cannot read {}: {e}", input.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter_map(|p| {
                    let name = p.file_name()?.to_str()?;
                    let rank = name
                        .strip_prefix("hcomm-trace-rank")?
                        .strip_suffix(".json")?
                        .parse()
                        .ok()?;
                    Some((rank, p))
                })
                .collect();
            if found.is_empty() {
                return Err(format!(
                    "{} holds no hcomm-trace-rank*.json (was HCOMM_TRACE set to it?)",
                    input.display()
                ));
            }
            found.sort();
            files.extend(found.into_iter().map(|(_, p)| p));
        } else {
            files.push(input.clone());
        }
    }
    if files.is_empty() {
        return Err("no trace files given".into());
    }
    Ok(files)
}

/// The events of one rank's trace file. A file whose closing `]` is missing (its process
/// ended without dropping its communicators) is read too, and so is one whose last line was
/// cut short (that line is dropped).
pub fn read_events(path: &Path) -> Result<Vec<Value>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let parse = |t: &str| -> Option<Vec<Value>> {
        let t = t.trim_end().trim_end_matches(',');
        let closed = if t.ends_with(']') {
            t.to_string()
        } else {
            format!("{t}\n]")
        };
        serde_json::from_str::<Value>(&closed)
            .ok()?
            .as_array()
            .cloned()
    };
    // A cut-short last line: drop it.
    let events = parse(&text).or_else(|| {
        let cut = text.trim_end().rfind('\n')?;
        parse(&text[..cut])
    });
    let Some(events) = events else {
        return Err(format!(
            "{} is not a Chrome trace written by hcomm (expected a JSON array of events)",
            path.display()
        ));
    };
    for (i, e) in events.iter().enumerate() {
        check_event(e).map_err(|why| {
            format!(
                "{}: event {i} ({}) is not an hcomm trace event: {why}",
                path.display(),
                short(e)
            )
        })?;
    }
    Ok(events)
}

/// What is wrong with `e` as an event hcomm writes: an object with a `ph` phase, and for an
/// operation (`"ph":"X"`) a name, a rank (`pid`), a track (`tid`), a start and a duration that
/// is a number of µs, not negative.
fn check_event(e: &Value) -> Result<(), String> {
    if !e.is_object() {
        return Err("not a JSON object".into());
    }
    let Some(phase) = e["ph"].as_str() else {
        return Err("no \"ph\" (phase)".into());
    };
    if phase != "X" {
        return Ok(());
    }
    if e["name"].as_str().is_none() {
        return Err("an operation (\"ph\":\"X\") without a \"name\"".into());
    }
    for key in ["pid", "tid"] {
        if e[key].as_u64().is_none() {
            return Err(format!("\"{key}\" is not a whole number"));
        }
    }
    match e["ts"].as_f64() {
        Some(ts) if ts.is_finite() => {}
        _ => return Err("\"ts\" (start, µs) is not a number".into()),
    }
    match e["dur"].as_f64() {
        Some(d) if d.is_finite() && d >= 0.0 => Ok(()),
        Some(d) => Err(format!("\"dur\" is {d} µs: a duration cannot be negative")),
        None => Err("\"dur\" (duration, µs) is not a number".into()),
    }
}

/// `e` as JSON, cut to 80 characters for an error message.
fn short(e: &Value) -> String {
    let text = e.to_string();
    match text.char_indices().nth(80) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text,
    }
}

/// Every event of `files`, in one array (each rank is its own process in the viewer).
pub fn merge(files: &[PathBuf]) -> Result<Vec<Value>, String> {
    let mut all = Vec::new();
    for f in files {
        all.extend(read_events(f)?);
    }
    Ok(all)
}

/// One row of [`summary`]: one operation kind on one rank's communicator.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Row {
    /// Calls traced.
    pub calls: u64,
    /// Time the operations ran, µs.
    pub run_us: f64,
    /// Time they waited for their turn, µs.
    pub queue_us: f64,
    /// Payload bytes (as the caller gave them).
    pub bytes: u64,
    /// Bytes this rank put on the wire (TCP sent + shared memory written).
    pub wire_bytes: u64,
    /// Calls that ended with an error.
    pub errors: u64,
}

/// Per (rank, track name, operation): calls, time, bytes. Track names come from the
/// `thread_name` metadata events.
pub fn summary(events: &[Value]) -> BTreeMap<(u64, String, String), Row> {
    let mut tracks: BTreeMap<(u64, u64), String> = BTreeMap::new();
    for e in events {
        if e["ph"] == "M" && e["name"] == "thread_name" {
            if let (Some(pid), Some(tid), Some(name)) = (
                e["pid"].as_u64(),
                e["tid"].as_u64(),
                e["args"]["name"].as_str(),
            ) {
                tracks.insert((pid, tid), name.to_string());
            }
        }
    }
    let mut rows: BTreeMap<(u64, String, String), Row> = BTreeMap::new();
    for e in events.iter().filter(|e| e["ph"] == "X") {
        let (Some(pid), Some(tid), Some(op)) =
            (e["pid"].as_u64(), e["tid"].as_u64(), e["name"].as_str())
        else {
            continue;
        };
        let track = tracks
            .get(&(pid, tid))
            .cloned()
            .unwrap_or_else(|| format!("track {tid}"));
        let a = &e["args"];
        let row = rows.entry((pid, track, op.to_string())).or_default();
        row.calls += 1;
        row.run_us += e["dur"].as_f64().unwrap_or(0.0);
        row.queue_us += a["queue_us"].as_f64().unwrap_or(0.0);
        row.bytes += a["bytes"].as_u64().unwrap_or(0);
        row.wire_bytes +=
            a["tcp_sent"].as_u64().unwrap_or(0) + a["shm_written"].as_u64().unwrap_or(0);
        row.errors += u64::from(a.get("error").is_some());
    }
    rows
}

/// [`summary`] as a table.
pub fn summary_table(events: &[Value]) -> String {
    let rows = summary(events);
    let mut out = format!(
        "{:>4}  {:<36} {:<24} {:>8} {:>12} {:>12} {:>12} {:>14} {:>6}\n",
        "rank",
        "communicator",
        "operation",
        "calls",
        "run ms",
        "queue ms",
        "avg us",
        "wire bytes",
        "errors"
    );
    for ((rank, track, op), r) in &rows {
        out.push_str(&format!(
            "{rank:>4}  {track:<36} {op:<24} {:>8} {:>12.3} {:>12.3} {:>12.2} {:>14} {:>6}\n",
            r.calls,
            r.run_us / 1e3,
            r.queue_us / 1e3,
            r.run_us / r.calls.max(1) as f64,
            r.wire_bytes,
            r.errors
        ));
    }
    out
}

/// When the first operation of `events` began (trace µs).
pub fn trace_start(events: &[Value]) -> Option<f64> {
    events
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| e["ts"].as_f64())
        .reduce(f64::min)
}

/// The time window a timeline shows: `(start, end)` in trace µs.
pub type Window = (f64, f64);

/// A timeline picture (SVG) of `events`: one row per track (rank · communicator), each
/// operation a bar coloured by its name, its queue time (issue to turn) a thin pale bar before
/// it; the gaps are the time the rank spent outside hcomm (computing, or idle). `window`
/// (trace µs) narrows it to part of the run; without it, the whole trace.
pub fn timeline_svg(events: &[Value], window: Option<Window>) -> Result<String, String> {
    let mut names: BTreeMap<(u64, u64), String> = BTreeMap::new();
    for e in events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "thread_name")
    {
        if let (Some(pid), Some(tid), Some(n)) = (
            e["pid"].as_u64(),
            e["tid"].as_u64(),
            e["args"]["name"].as_str(),
        ) {
            names.insert((pid, tid), n.to_string());
        }
    }
    struct Bar {
        track: (u64, u64),
        op: String,
        start: f64,
        end: f64,
        queued: f64,
    }
    let bars: Vec<Bar> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .filter_map(|e| {
            let start = e["ts"].as_f64()?;
            Some(Bar {
                track: (e["pid"].as_u64()?, e["tid"].as_u64()?),
                op: e["name"].as_str()?.to_string(),
                start,
                end: start + e["dur"].as_f64().unwrap_or(0.0),
                queued: e["args"]["queue_us"].as_f64().unwrap_or(0.0),
            })
        })
        .collect();
    if bars.is_empty() {
        return Err("the trace holds no operations".into());
    }
    let (t0, t1) = window.unwrap_or_else(|| {
        let lo = bars
            .iter()
            .map(|b| b.start - b.queued)
            .fold(f64::INFINITY, f64::min);
        let hi = bars.iter().map(|b| b.end).fold(f64::NEG_INFINITY, f64::max);
        (lo, hi)
    });
    if t1.partial_cmp(&t0) != Some(std::cmp::Ordering::Greater) {
        return Err(format!("empty time window {t0}..{t1} µs"));
    }
    let mut tracks: Vec<(u64, u64)> = bars.iter().map(|b| b.track).collect();
    tracks.sort();
    tracks.dedup();
    let mut ops: Vec<&str> = bars.iter().map(|b| b.op.as_str()).collect();
    ops.sort();
    ops.dedup();
    let colour = |op: &str| {
        crate::plot::COLORS
            [ops.iter().position(|o| *o == op).unwrap_or(0) % crate::plot::COLORS.len()]
    };
    let (left, width, row, top) = (260.0, 900.0, 26.0, 40.0);
    let height = top + row * tracks.len() as f64 + 70.0;
    let x = |t: f64| left + (t.clamp(t0, t1) - t0) / (t1 - t0) * width;
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"20\" font-size=\"14\">hcomm trace: {} operations on {} tracks, {:.3} ms shown (bars: operations; pale: waiting for the turn; gaps: outside hcomm)</text>\n",
        left + width + 20.0,
        bars.len(),
        tracks.len(),
        (t1 - t0) / 1e3
    );
    let mut busy: BTreeMap<(u64, u64), (f64, f64)> = BTreeMap::new();
    for (i, t) in tracks.iter().enumerate() {
        let y = top + row * i as f64;
        let name = names
            .get(t)
            .cloned()
            .unwrap_or_else(|| format!("track {}", t.1));
        svg.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">rank {} · {}</text>\n<line x1=\"{left}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"#ddd\"/>\n",
            left - 8.0,
            y + 15.0,
            t.0,
            crate::plot::esc(&name),
            left + width,
            y + row - 2.0,
            y + row - 2.0
        ));
    }
    for b in bars
        .iter()
        .filter(|b| b.end >= t0 && b.start - b.queued <= t1)
    {
        let i = tracks.iter().position(|t| *t == b.track).expect("listed");
        let y = top + row * i as f64;
        let (qa, qb) = (x(b.start - b.queued), x(b.start));
        // Queue times under a pixel would only blur the row.
        if qb - qa >= 1.0 {
            svg.push_str(&format!(
                "<rect x=\"{qa:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"4\" fill=\"{}\" opacity=\"0.35\"/>\n",
                y + 18.0,
                qb - qa,
                colour(&b.op)
            ));
        }
        let (a, e) = (x(b.start), x(b.end));
        svg.push_str(&format!(
            "<rect x=\"{a:.2}\" y=\"{:.2}\" width=\"{:.2}\" height=\"16\" fill=\"{}\"><title>{} {:.1} µs</title></rect>\n",
            y + 2.0,
            (e - a).max(0.5),
            colour(&b.op),
            crate::plot::esc(&b.op),
            b.end - b.start
        ));
        let slot = busy.entry(b.track).or_default();
        slot.0 += b.end.min(t1) - b.start.max(t0);
        slot.1 += (b.start.min(t1) - (b.start - b.queued).max(t0)).max(0.0);
    }
    let axis = top + row * tracks.len() as f64 + 14.0;
    for k in 0..=4 {
        let t = t0 + (t1 - t0) * k as f64 / 4.0;
        svg.push_str(&format!(
            "<text x=\"{:.1}\" y=\"{axis}\" text-anchor=\"middle\">{:.2} ms</text>\n",
            x(t),
            (t - t0) / 1e3
        ));
    }
    let mut lx = left;
    for op in &ops {
        svg.push_str(&format!(
            "<rect x=\"{lx}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" y=\"{}\">{}</text>\n",
            axis + 12.0,
            colour(op),
            lx + 16.0,
            axis + 22.0,
            crate::plot::esc(op)
        ));
        lx += 24.0 + 7.0 * op.len() as f64;
    }
    let share: Vec<String> = busy
        .iter()
        .map(|(t, (run, q))| {
            format!(
                "rank {} track {}: in operations {:.0} %, queued {:.0} %",
                t.0,
                t.1,
                100.0 * run / (t1 - t0),
                100.0 * q / (t1 - t0)
            )
        })
        .collect();
    svg.push_str(&format!(
        "<text x=\"{left}\" y=\"{}\" font-size=\"11\" fill=\"#555\">{}</text>\n</svg>\n",
        axis + 44.0,
        crate::plot::esc(&share.join("; "))
    ));
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn reads_open_and_cut_files_and_sums_by_track_and_op() {
        let dir = std::env::temp_dir().join(format!("hcomm-trace-tool-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let meta = r#"{"ph":"M","name":"thread_name","pid":1,"tid":0,"args":{"name":"world (rank 1 of 2)"}}"#;
        let x = |dur: f64, q: f64| {
            format!(
                r#"{{"name":"all_reduce","ph":"X","ts":1.0,"dur":{dur},"pid":1,"tid":0,"args":{{"seq":0,"bytes":8,"tcp_sent":40,"shm_written":0,"queue_us":{q}}}}}"#
            )
        };
        // No closing bracket, and a last line cut in the middle.
        let text = format!(
            "[\n{meta}\n,{}\n,{}\n,{{\"name\":\"all_re",
            x(10.0, 1.0),
            x(30.0, 3.0)
        );
        write(&dir, "hcomm-trace-rank1.json", &text);
        write(&dir, "hcomm-trace-rank0.json", "[\n]\n");
        write(&dir, "other.json", "not a trace");
        let files = trace_files(std::slice::from_ref(&dir)).unwrap();
        assert_eq!(files.len(), 2);
        assert!(files[0].ends_with("hcomm-trace-rank0.json"));
        let events = merge(&files).unwrap();
        assert_eq!(events.len(), 3);
        let rows = summary(&events);
        let row = &rows[&(
            1,
            "world (rank 1 of 2)".to_string(),
            "all_reduce".to_string(),
        )];
        assert_eq!(row.calls, 2);
        assert_eq!(row.run_us, 40.0);
        assert_eq!(row.queue_us, 4.0);
        assert_eq!(row.bytes, 16);
        assert_eq!(row.wire_bytes, 80);
        assert!(summary_table(&events).contains("all_reduce"));
        let svg = timeline_svg(&events, None).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("rank 1 · world (rank 1 of 2)"), "{svg}");
        // Two bars of the same colour and their queue bars.
        assert_eq!(svg.matches("<title>all_reduce").count(), 2);
        assert!(timeline_svg(&events, Some((5.0, 5.0)))
            .unwrap_err()
            .contains("empty"));
        assert!(timeline_svg(&[], None).is_err());
        let bad = read_events(&dir.join("other.json")).unwrap_err();
        assert!(bad.contains("not a Chrome trace"), "{bad}");
        // JSON that is no trace, and an operation with a negative or missing duration, are
        // refused by name (they used to give an empty table, or a negative time in it).
        for (text, want) in [
            (
                "[1, 2, 3]",
                "event 0 (1) is not an hcomm trace event: not a JSON object",
            ),
            ("[{\"a\": 1}]", "no \"ph\""),
            (
                &format!("[{meta},\n{}]", x(-5.0, 0.0)),
                "event 1 ({\"args\"",
            ),
            (&format!("[{}]", x(-5.0, 0.0)), "\"dur\" is -5 µs"),
            (
                &format!("[{}]", x(1.0, 0.0).replace("\"dur\":1", "\"dur\":\"1\"")),
                "\"dur\" (duration, µs) is not a number",
            ),
            (
                &format!("[{}]", x(1.0, 0.0).replace("\"pid\":1", "\"pid\":-1")),
                "\"pid\" is not a whole number",
            ),
        ] {
            let p = write(&dir, "garbage.json", text);
            let err = read_events(&p).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
            assert!(err.contains("garbage.json"), "{err}");
        }
        let empty = std::env::temp_dir().join(format!("hcomm-trace-empty-{}", std::process::id()));
        std::fs::create_dir_all(&empty).unwrap();
        assert!(trace_files(std::slice::from_ref(&empty))
            .unwrap_err()
            .contains("holds no"));
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&empty);
    }
}
