//! Operation timelines (`HCOMM_TRACE`): every operation a communicator runs, written as a
//! [Chrome / Perfetto trace](https://ui.perfetto.dev) — one process per rank, one track per
//! communicator of that rank, one slice per operation with what it moved and how.
//!
//! * **Files.** One per rank: `HCOMM_TRACE=dir` writes `dir/hcomm-trace-rank{R}.json` (the
//!   directory is made if needed); a value containing `{rank}` is the file name with the
//!   rank put in. `R` is the rank in the communicator that opened the trace (the world, for
//!   `HCOMM_TRACE`); its sub-communicators (split, groups, the hierarchical all-reduce's, a
//!   shrunk or grown one) write to the same file, each on its own track. `hcomm trace merge`
//!   joins the ranks' files into one.
//! * **Format.** The Chrome JSON array format, one event per line: `[`, then the events,
//!   then `]` when the last communicator using the file is dropped (the viewers and
//!   `hcomm trace merge` also read a file whose `]` is missing, as after a crash). Events are
//!   buffered and written at least every [`FLUSH_EVERY`] and when the buffer passes
//!   [`FLUSH_BYTES`]; `Tracer::flush` writes at once.
//! * **Slices.** `ts` is wall-clock time (µs since the Unix epoch, so the ranks of a host line
//!   up), `dur` the time the operation ran once its turn came; `args` hold the sequence
//!   number, algorithm, dtype, reduce op, element count, payload bytes, root / peer / tag, the
//!   bytes this rank put on the wire (`tcp_sent`, `tcp_received`, `shm_written`, `shm_read`),
//!   the peers it exchanged frames with, `queue_us` (from issue — the `*_async` call, or the
//!   blocking call's entry — to its turn), the error it ended with, and the caller's label
//!   ([`crate::Communicator::set_trace_label`]; the torch backend's bucket index).
//! * **Cost.** Off (the default), an operation pays one branch on an `Option`; on, one clock
//!   read more and the formatting of one line (a few µs), off the wire's critical path.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Buffered events are written at least this often (checked when an event is recorded).
pub const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// Buffered events are written once they pass this many bytes.
pub const FLUSH_BYTES: usize = 64 << 10;

/// The file a trace setting names for `rank`: `{rank}` replaced, or `dir/hcomm-trace-rank{R}.json`.
pub fn trace_file(setting: &str, rank: usize) -> PathBuf {
    if setting.contains("{rank}") {
        PathBuf::from(setting.replace("{rank}", &rank.to_string()))
    } else {
        Path::new(setting).join(format!("hcomm-trace-rank{rank}.json"))
    }
}

/// One rank's trace file, shared by the communicators of that rank that trace.
pub(crate) struct Tracer {
    path: PathBuf,
    /// The process id of the trace: the rank that opened it.
    pid: usize,
    /// Wall-clock ns since the Unix epoch at `epoch`.
    epoch_ns: u128,
    epoch: Instant,
    next_track: AtomicU32,
    out: Mutex<Output>,
}

struct Output {
    file: File,
    buf: String,
    last_flush: Instant,
    /// An I/O error already reported (once) on the log.
    failed: bool,
}

impl Output {
    fn flush(&mut self, path: &Path) {
        if self.buf.is_empty() || self.failed {
            self.buf.clear();
            return;
        }
        if let Err(e) = self.file.write_all(self.buf.as_bytes()) {
            self.failed = true;
            tracing::error!(
                "HCOMM_TRACE: cannot write {}: {e}; tracing stops",
                path.display()
            );
        }
        self.buf.clear();
        self.last_flush = Instant::now();
    }
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer").field("path", &self.path).finish()
    }
}

impl Tracer {
    /// Create (truncate) the trace file of `rank` named by `setting`.
    pub(crate) fn open(setting: &str, rank: usize) -> std::io::Result<Arc<Tracer>> {
        let path = trace_file(setting, rank);
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let file = File::create(&path)?;
        let epoch = Instant::now();
        let epoch_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let t = Tracer {
            path,
            pid: rank,
            epoch_ns,
            epoch,
            next_track: AtomicU32::new(0),
            out: Mutex::new(Output {
                file,
                buf: String::with_capacity(FLUSH_BYTES),
                last_flush: epoch,
                failed: false,
            }),
        };
        t.push(
            &format!(
                "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"tid\":0,\"args\":{{\"name\":\"rank {rank}\"}}}}"
            ),
            true,
        );
        t.push(
            &format!(
                "{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{rank},\"tid\":0,\"args\":{{\"sort_index\":{rank}}}}}"
            ),
            false,
        );
        Ok(Arc::new(t))
    }

    /// The file written.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// A new track, named after the communicator it shows.
    pub(crate) fn track(self: &Arc<Self>, name: &str) -> Track {
        let tid = self.next_track.fetch_add(1, Ordering::Relaxed);
        let mut line = String::new();
        let _ = write!(
            line,
            "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{tid},\"args\":{{\"name\":",
            self.pid
        );
        json_string(&mut line, name);
        let _ = write!(
            line,
            "}}}},\n{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{},\"tid\":{tid},\"args\":{{\"sort_index\":{tid}}}}}",
            self.pid
        );
        self.push(&line, false);
        Track {
            tracer: self.clone(),
            tid,
        }
    }

    /// Wall-clock ns since the Unix epoch at `t`.
    fn ns(&self, t: Instant) -> u128 {
        self.epoch_ns + t.saturating_duration_since(self.epoch).as_nanos()
    }

    /// Append one event line (`first`: the line opening the array) at `now`.
    fn push_at(&self, event: &str, first: bool, now: Instant) {
        let mut out = self.out.lock().unwrap_or_else(|p| p.into_inner());
        if out.failed {
            return;
        }
        out.buf.push_str(if first { "[\n" } else { ",\n" });
        out.buf.push_str(event);
        if out.buf.len() >= FLUSH_BYTES
            || now.saturating_duration_since(out.last_flush) >= FLUSH_EVERY
        {
            out.flush(&self.path);
        }
    }

    fn push(&self, event: &str, first: bool) {
        self.push_at(event, first, Instant::now());
    }

    /// Write the buffered events now.
    pub(crate) fn flush(&self) {
        self.out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .flush(&self.path);
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        let path = self.path.clone();
        let out = self.out.get_mut().unwrap_or_else(|p| p.into_inner());
        out.buf.push_str("\n]\n");
        out.flush(&path);
    }
}

/// One communicator's track in a rank's trace.
#[derive(Debug, Clone)]
pub(crate) struct Track {
    tracer: Arc<Tracer>,
    tid: u32,
}

impl Track {
    /// The trace file this track writes to (sub-communicators get tracks of the same one).
    pub(crate) fn tracer(&self) -> &Arc<Tracer> {
        &self.tracer
    }

    /// Record a finished operation.
    pub(crate) fn record(&self, span: &Span, wire: &Wire, ended: Instant) {
        let t = &self.tracer;
        let mut line = String::with_capacity(320);
        let _ = write!(line, "{{\"name\":\"{}\",\"cat\":\"", span.op);
        line.push_str(if span.compound {
            "compound"
        } else if span.algo.is_some() {
            "collective"
        } else {
            "op"
        });
        let start = t.ns(span.started);
        line.push_str("\",\"ph\":\"X\",\"ts\":");
        push_us(&mut line, start);
        line.push_str(",\"dur\":");
        push_us(&mut line, t.ns(ended).saturating_sub(start));
        let _ = write!(
            line,
            ",\"pid\":{},\"tid\":{},\"args\":{{\"seq\":{}",
            t.pid, self.tid, span.seq
        );
        let text = [
            ("algo", span.algo),
            ("dtype", span.dtype),
            ("reduce", span.reduce),
            ("part_of", span.part_of),
        ];
        for (k, v) in text {
            if let Some(v) = v {
                let _ = write!(line, ",\"{k}\":\"{v}\"");
            }
        }
        let numbers = [
            ("count", span.count),
            ("bytes", span.bytes),
            ("root", span.root),
            ("peer", span.peer),
            ("tag", span.tag.map(|t| t as usize)),
        ];
        for (k, v) in numbers {
            if let Some(v) = v {
                let _ = write!(line, ",\"{k}\":{v}");
            }
        }
        if !span.compound {
            let _ = write!(
                line,
                ",\"tcp_sent\":{},\"tcp_received\":{},\"shm_written\":{},\"shm_read\":{},\"peers\":{:?}",
                wire.tcp_sent, wire.tcp_received, wire.shm_written, wire.shm_read, wire.peers
            );
            line.push_str(",\"queue_us\":");
            push_us(
                &mut line,
                span.started
                    .saturating_duration_since(span.issued)
                    .as_nanos(),
            );
        }
        if let Some(label) = &span.label {
            line.push_str(",\"label\":");
            json_string(&mut line, label);
        }
        if let Some(e) = &span.error {
            line.push_str(",\"error\":");
            json_string(&mut line, e);
        }
        line.push_str("}}");
        t.push_at(&line, false, ended);
    }
}

/// What is known of an operation in progress (filled in as the communicator learns it).
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub op: &'static str,
    pub seq: u64,
    /// When the caller issued it (the `*_async` call, or the blocking call's entry).
    pub issued: Instant,
    /// When its turn came.
    pub started: Instant,
    pub algo: Option<&'static str>,
    pub dtype: Option<&'static str>,
    pub reduce: Option<&'static str>,
    pub count: Option<usize>,
    pub bytes: Option<usize>,
    pub root: Option<usize>,
    pub peer: Option<usize>,
    pub tag: Option<u32>,
    /// The compound operation this one is part of (`all_reduce_compressed`, …).
    pub part_of: Option<&'static str>,
    pub label: Option<String>,
    pub error: Option<String>,
    /// Built from other operations, which are traced (and count the bytes) themselves.
    pub compound: bool,
}

impl Span {
    pub(crate) fn new(op: &'static str, seq: u64, issued: Instant, started: Instant) -> Span {
        Span {
            op,
            seq,
            issued,
            started,
            algo: None,
            dtype: None,
            reduce: None,
            count: None,
            bytes: None,
            root: None,
            peer: None,
            tag: None,
            part_of: None,
            label: None,
            error: None,
            compound: false,
        }
    }
}

/// What an operation moved, from the transports' counters.
#[derive(Debug, Clone, Default)]
pub(crate) struct Wire {
    pub tcp_sent: u64,
    pub tcp_received: u64,
    pub shm_written: u64,
    pub shm_read: u64,
    /// Ranks this rank exchanged frames with (every other rank for a shared-segment collective).
    pub peers: Vec<usize>,
}

/// `ns` as microseconds with three decimals (integer formatting: floats cost more).
fn push_us(out: &mut String, ns: u128) {
    let _ = write!(out, "{}.{:03}", ns / 1000, ns % 1000);
}

fn json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// What the caller had set when it issued an asynchronous operation: when, and the label.
#[derive(Debug, Clone)]
pub(crate) struct Issue {
    pub at: Instant,
    pub label: Option<String>,
}

std::thread_local! {
    /// The issue of the asynchronous operation now starting on this thread (set by the engine
    /// job around the operation, taken by the operation's first turn).
    static ISSUED: std::cell::RefCell<Option<Issue>> = const { std::cell::RefCell::new(None) };
}

/// Run `f` as the asynchronous operation issued as `issue`.
pub(crate) fn issued_as<R>(issue: Option<Issue>, f: impl FnOnce() -> R) -> R {
    let before = ISSUED.with(|c| c.replace(issue));
    let r = f();
    ISSUED.with(|c| *c.borrow_mut() = before);
    r
}

/// How the operation starting now was issued, if it was issued asynchronously.
pub(crate) fn take_issue() -> Option<Issue> {
    ISSUED.with(|c| c.borrow_mut().take())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_events(path: &Path) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        v.as_array().unwrap().clone()
    }

    #[test]
    fn writes_a_chrome_trace_with_tracks_and_slices() {
        let dir = std::env::temp_dir().join(format!("hcomm-trace-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let tracer = Tracer::open(dir.to_str().unwrap(), 3).unwrap();
        let path = tracer.path().to_path_buf();
        assert_eq!(path, dir.join("hcomm-trace-rank3.json"));
        let track = tracer.track("world \"w\" (rank 3 of 4)");
        let t0 = Instant::now();
        let mut span = Span::new("all_reduce", 7, t0, t0 + Duration::from_micros(5));
        span.algo = Some("ring");
        span.bytes = Some(4096);
        span.error = Some("timed out\nwaiting".into());
        let wire = Wire {
            tcp_sent: 10,
            peers: vec![0, 2],
            ..Wire::default()
        };
        track.record(&span, &wire, t0 + Duration::from_micros(25));
        drop(track);
        // Before the file is closed, it reads once `]` is added (as `hcomm trace merge` does).
        tracer.flush();
        let partial = std::fs::read_to_string(&path).unwrap();
        assert!(!partial.trim_end().ends_with(']'));
        let v: serde_json::Value = serde_json::from_str(&format!("{partial}]")).unwrap();
        assert_eq!(v.as_array().unwrap().len(), 5);
        drop(tracer);
        let events = read_events(&path);
        let names: Vec<_> = events.iter().map(|e| e["name"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "process_name",
                "process_sort_index",
                "thread_name",
                "thread_sort_index",
                "all_reduce"
            ]
        );
        assert_eq!(events[2]["args"]["name"], "world \"w\" (rank 3 of 4)");
        let x = &events[4];
        assert_eq!(x["ph"], "X");
        assert_eq!(x["pid"], 3);
        assert!((x["dur"].as_f64().unwrap() - 20.0).abs() < 0.01, "{x}");
        assert_eq!(x["args"]["algo"], "ring");
        assert_eq!(x["args"]["bytes"], 4096);
        assert_eq!(x["args"]["tcp_sent"], 10);
        assert_eq!(x["args"]["peers"], serde_json::json!([0, 2]));
        assert!((x["args"]["queue_us"].as_f64().unwrap() - 5.0).abs() < 0.01);
        assert_eq!(x["args"]["error"], "timed out\nwaiting");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_rank_placeholder_names_the_file() {
        assert_eq!(
            trace_file("/tmp/t-{rank}.json", 12),
            PathBuf::from("/tmp/t-12.json")
        );
        assert_eq!(
            trace_file("/tmp/tr", 0),
            PathBuf::from("/tmp/tr/hcomm-trace-rank0.json")
        );
    }
}
