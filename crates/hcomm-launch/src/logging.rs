//! Logging of hcomm's programs: the library only emits `tracing` events; a program decides
//! whether and where they go.

/// Log the library's events to stderr at the level named by `HCOMM_DEBUG` (`error`, `warn`,
/// `info`, `debug`, `trace`, in any case), with the filter `hcomm=<level>`. Colours only when
/// stderr is a terminal. Without `HCOMM_DEBUG`, or with it empty, nothing is installed; a
/// value that is no level is reported on stderr and installs nothing either.
///
/// Installs a global `tracing` subscriber: call it once at start (later calls, and calls in a
/// process that already has a global subscriber, do nothing). The `hcomm` command and the
/// Python extension call it; a Rust program using the library calls it (or installs its own
/// subscriber) for `HCOMM_DEBUG` to take effect.
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(value) = std::env::var("HCOMM_DEBUG") {
            // Empty means unset (as for every HCOMM_ variable); anything but a level is said
            // once and leaves logging off, rather than quietly meaning `info`.
            let level = value.trim().to_ascii_lowercase();
            if level.is_empty() {
                return;
            }
            if !["error", "warn", "info", "debug", "trace"].contains(&level.as_str()) {
                eprintln!(
                    "hcomm: HCOMM_DEBUG='{value}' is not a log level (error, warn, info, debug or trace): logging stays off"
                );
                return;
            }
            let filter = tracing_subscriber::EnvFilter::new(format!("hcomm={level}"));
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .try_init();
        }
    });
}
