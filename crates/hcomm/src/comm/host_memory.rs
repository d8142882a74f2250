//! How much memory this process may still take for shared segments: the host's
//! `MemAvailable`, and, inside a container, what its memory cgroup still allows. A memfd's
//! pages are charged to the cgroup of the process that touches them; past the cgroup's limit
//! the kernel's OOM killer ends a process of the container, while `/proc/meminfo` still shows
//! the whole host's memory. So both bounds count, and the smaller wins.
//!
//! cgroup v2 (`0::/path` in `/proc/self/cgroup`) reads `memory.max` and `memory.current`; v1
//! (a `memory` controller line) reads `memory.limit_in_bytes` and `memory.usage_in_bytes`.
//! Usage counts the page cache, which the kernel reclaims before it kills, so the inactive
//! file pages (`memory.stat`) are subtracted from it, as `docker stats` does. Every ancestor
//! cgroup up to the mount's root limits too.

use std::path::{Path, PathBuf};

/// Bytes this process can still reserve, if anything says: the least of the host's
/// `MemAvailable` and its memory cgroups' room.
pub(crate) fn available() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| mem_available(&info));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_room(&c, Path::new("/sys/fs/cgroup")));
    match (host, cgroup) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib.saturating_mul(1024))
}

/// The room left under the memory limits of the cgroup named in `proc_self_cgroup` (the text
/// of `/proc/self/cgroup`) and its ancestors, with the cgroup file systems mounted under
/// `root`. None when no limit applies or nothing can be read.
fn cgroup_room(proc_self_cgroup: &str, root: &Path) -> Option<u64> {
    for line in proc_self_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (id, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let path = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == "memory") {
            let v1 = Files {
                limit: "memory.limit_in_bytes",
                usage: "memory.usage_in_bytes",
                inactive_file: "total_inactive_file",
            };
            return least_room(&root.join("memory"), path, &v1);
        }
        if id == "0" && controllers.is_empty() {
            let v2 = Files {
                limit: "memory.max",
                usage: "memory.current",
                inactive_file: "inactive_file",
            };
            // The unified hierarchy is mounted at the root itself, or at `unified` beside
            // the v1 controllers (hybrid mode).
            let unified = if root.join("cgroup.controllers").exists() {
                root.to_path_buf()
            } else {
                root.join("unified")
            };
            if let Some(room) = least_room(&unified, path, &v2) {
                return Some(room);
            }
        }
    }
    None
}

/// The file names of one cgroup version.
struct Files {
    limit: &'static str,
    usage: &'static str,
    inactive_file: &'static str,
}

/// The least room of the cgroup `path` under `mount` and of its ancestors. A container
/// usually sees its own cgroup as the mount's root (the path in `/proc/self/cgroup` then does
/// not exist under the mount): the walk starts at the deepest directory that exists.
fn least_room(mount: &Path, path: &str, files: &Files) -> Option<u64> {
    let mut dir: PathBuf = mount.join(path);
    while !dir.is_dir() {
        if dir == mount || !dir.pop() {
            return None;
        }
    }
    let mut least: Option<u64> = None;
    loop {
        if let Some(room) = room_in(&dir, files) {
            least = Some(least.map_or(room, |l| l.min(room)));
        }
        if dir == mount || !dir.pop() {
            break;
        }
    }
    least
}

/// Limit less (usage less inactive file pages) of one cgroup directory; None without a limit.
fn room_in(dir: &Path, files: &Files) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let limit: u64 = read(files.limit)?.trim().parse().ok()?; // "max" (v2): no limit
                                                              // v1 writes "no limit" as the largest page-aligned i64.
    if limit >= (i64::MAX as u64) & !0xfff {
        return None;
    }
    let usage: u64 = read(files.usage)?.trim().parse().ok()?;
    let inactive_file = read("memory.stat")
        .and_then(|stat| {
            stat.lines().find_map(|l| {
                let (key, value) = l.split_once(' ')?;
                (key == files.inactive_file).then(|| value.trim().parse().ok())?
            })
        })
        .unwrap_or(0u64);
    Some(limit.saturating_sub(usage.saturating_sub(inactive_file)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let info = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(mem_available(info), Some(2048 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn a_v2_limit_and_its_ancestors_bound_the_room() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        write(r, "cgroup.controllers", "cpu memory\n");
        let job = r.join("job");
        let step = job.join("step");
        // The job allows 1 GiB and uses 600 MiB (100 MiB of it reclaimable cache)...
        write(&job, "memory.max", "1073741824\n");
        write(&job, "memory.current", &format!("{}\n", 600 << 20));
        write(
            &job,
            "memory.stat",
            &format!("anon 1\ninactive_file {}\n", 100 << 20),
        );
        // ...its step has no limit of its own.
        write(&step, "memory.max", "max\n");
        write(&step, "memory.current", "0\n");
        assert_eq!(
            cgroup_room("0::/job/step\n", r),
            Some((1 << 30) - (500 << 20))
        );
        // A tighter limit deeper down wins.
        write(&step, "memory.max", &format!("{}\n", 64 << 20));
        write(&step, "memory.current", &format!("{}\n", 16 << 20));
        assert_eq!(cgroup_room("0::/job/step\n", r), Some(48 << 20));
        // No limit anywhere: nothing to say.
        write(&job, "memory.max", "max\n");
        write(&step, "memory.max", "max\n");
        assert_eq!(cgroup_room("0::/job/step\n", r), None);
    }

    #[test]
    fn a_v1_memory_controller_is_read_and_a_container_sees_its_cgroup_as_the_root() {
        let root = tempfile::tempdir().unwrap();
        let mem = root.path().join("memory");
        write(&mem, "memory.limit_in_bytes", &format!("{}\n", 2u64 << 30));
        write(&mem, "memory.usage_in_bytes", &format!("{}\n", 1u64 << 30));
        write(
            &mem,
            "memory.stat",
            &format!("cache 5\ntotal_inactive_file {}\n", 256 << 20),
        );
        // The path names the host's cgroup, which a container's mount does not show.
        let text = "9:pids:/\n4:memory:/docker/abc123\n0::/\n";
        assert_eq!(
            cgroup_room(text, root.path()),
            Some((2u64 << 30) - (768 << 20))
        );
        // v1's "no limit".
        write(&mem, "memory.limit_in_bytes", "9223372036854771712\n");
        assert_eq!(cgroup_room(text, root.path()), None);
    }
}
