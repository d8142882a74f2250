//! Running a subcommand on N local ranks: `hcomm demo -n 4` re-executes itself under the
//! launcher (without `-n`), and each copy joins the job from the environment.

use hcomm_launch::{launch, Bind, LaunchSpec};
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
    spawn_self_env(n, args, keep_going, Vec::new(), Bind::default())
}

/// [`spawn_self_with`], setting `env` in every rank and placing the ranks by `bind`.
pub fn spawn_self_env(
    n: usize,
    args: Vec<OsString>,
    keep_going: bool,
    env: Vec<(String, String)>,
    bind: Bind,
) -> i32 {
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
    spec.extra_env = env;
    spec.bind = bind;
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

/// One line to stderr (see `write_line`).
pub fn say_line(msg: &str) {
    write_line(std::io::stderr().lock(), msg);
}

/// One line to stdout (see `write_line`).
pub fn print_line(msg: &str) {
    write_line(std::io::stdout().lock(), msg);
}

/// `eprintln!` that writes each line atomically (see [`say_line`]).
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => { $crate::workers::say_line(&format!($($t)*)) };
}

/// How the driver of `hcomm bench --noise N` tells its ranks about the noise it started.
pub const NOISE_VAR: &str = "HCOMM_BENCH_NOISE";

/// Busy processes started for `hcomm bench --noise N` (copies of this executable running the
/// hidden `spin` subcommand); killed when dropped.
pub struct Noise {
    kids: Vec<std::process::Child>,
}

impl Drop for Noise {
    fn drop(&mut self) {
        for k in &mut self.kids {
            let _ = k.kill();
            let _ = k.wait();
        }
    }
}

/// Start `n` busy processes (none for 0).
pub fn start_noise(n: usize) -> std::io::Result<Noise> {
    let mut noise = Noise { kids: Vec::new() };
    if n > 0 {
        let exe = std::env::current_exe()?;
        for _ in 0..n {
            noise.kids.push(
                std::process::Command::new(&exe)
                    .arg("spin")
                    .stdin(std::process::Stdio::null())
                    .spawn()?,
            );
        }
    }
    Ok(noise)
}

/// The `spin` subcommand: burn a core until the parent (the benchmark's driver) is gone.
pub fn spin_until_orphaned() -> std::process::ExitCode {
    let parent = nix::unistd::getppid();
    let mut x = 0u64;
    loop {
        for i in 0..50_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(i));
        }
        if nix::unistd::getppid() != parent {
            return std::process::ExitCode::SUCCESS;
        }
    }
}
