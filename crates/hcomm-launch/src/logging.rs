//! Logging of hcomm's programs: the library only emits `tracing` events; a program decides
//! whether and where they go.

/// Log the library's events to stderr at the level named by `HCOMM_DEBUG` (`error`, `warn`,
/// `info`, `debug`, `trace`; a value that is no level means `info`), with the filter `hcomm=<level>`.
/// Colours only when stderr is a terminal. Without `HCOMM_DEBUG`, nothing is installed.
///
/// Installs a global `tracing` subscriber: call it once at start (later calls, and calls in a
/// process that already has a global subscriber, do nothing). The `hcomm` command and the
/// Python extension call it; a Rust program using the library calls it (or installs its own
/// subscriber) for `HCOMM_DEBUG` to take effect.
pub fn init_logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Ok(level) = std::env::var("HCOMM_DEBUG") {
            let filter = tracing_subscriber::EnvFilter::try_new(format!("hcomm={level}"))
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("hcomm=info"));
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                .try_init();
        }
    });
}
