//! Running a subcommand on N local ranks: `hcomm demo -n 4` re-executes itself under the
//! launcher (without `-n`), and each copy joins the job from the environment.

use hcomm_launch::{launch, LaunchSpec};
use std::ffi::OsString;

/// True when this process is one rank of a job (the launcher or another launcher set the
/// rank variables).
pub fn in_job() -> bool {
    [
        "HCOMM_RANK",
        "RANK",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "SLURM_PROCID",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some())
}

/// Start `n` copies of this executable with `args` (which must not ask for more copies) and
/// return the exit code to exit with.
pub fn spawn_self(n: usize, args: Vec<OsString>) -> i32 {
    spawn_self_with(n, args, false)
}

/// [`spawn_self`]; with `keep_going`, a rank killed by a signal does not stop the others
/// (`hcomm check --kill`).
pub fn spawn_self_with(n: usize, args: Vec<OsString>, keep_going: bool) -> i32 {
    let exe = match std::env::current_exe() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("hcomm: cannot find my own executable: {e}");
            return 1;
        }
    };
    let mut spec = LaunchSpec::new(n, exe, args);
    spec.prefix_output = false;
    spec.keep_going = keep_going;
    match launch(&spec) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("hcomm: {e}");
            1
        }
    }
}

/// Rebuild this process's command line without the option(s) `flags` (each taking a value,
/// as `-np 4` or `-np=4`), so that the copies run as ranks instead of starting more copies.
pub fn args_without(flags: &[&str]) -> Vec<OsString> {
    let mut out = Vec::new();
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        let s = a.to_string_lossy();
        if flags.iter().any(|f| s == *f) {
            args.next();
            continue;
        }
        if flags.iter().any(|f| s.starts_with(&format!("{f}="))) {
            continue;
        }
        out.push(a);
    }
    out
}

/// Write `msg` and a newline with a single `write` call, so that lines from several ranks
/// sharing the terminal (or the launcher's pipe) never interleave mid-line.
fn write_line(mut to: impl std::io::Write, msg: &str) {
    let mut line = String::with_capacity(msg.len() + 1);
    line.push_str(msg);
    line.push('\n');
    let _ = to.write_all(line.as_bytes());
    let _ = to.flush();
}

/// One line to stderr (see [`write_line`]).
pub fn say_line(msg: &str) {
    write_line(std::io::stderr().lock(), msg);
}

/// One line to stdout (see [`write_line`]).
pub fn print_line(msg: &str) {
    write_line(std::io::stdout().lock(), msg);
}

/// `eprintln!` that writes each line atomically (see [`say_line`]).
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => { $crate::workers::say_line(&format!($($t)*)) };
}
