//! The core's floor plan, checked from its sources (docs/design.md, "Layers"): which
//! top-level module may name which, that the modules form no import cycle, that algorithms
//! reach bytes only through the transport contract, that no environment variable is read
//! outside `config/`, and that `unsafe` stays in its audited modules.
//!
//! It reads `crate::…` paths (and `super::…` ones that leave a top-level module) in the
//! non-test code of `src/`, with comments removed. A rule broken here names the file, the line
//! and the rule, so the fix is to move the code, not to loosen the table.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Every top-level module with its floor; a module may name modules of its own floor or below
/// (and never form a cycle, checked separately).
const FLOORS: &[(&str, u8)] = &[
    ("base", 0),
    ("wire", 1),
    ("auth", 1),
    ("config", 2),
    ("history", 2),
    ("trace", 2),
    ("engine", 2),
    ("wait", 2),
    ("lent", 2),
    ("transport", 3),
    ("shm", 3),
    ("bootstrap", 3),
    ("algo", 4),
    ("comm", 5),
    ("compress", 6),
    ("fusion", 6),
    ("sparse", 6),
    // Test doubles and fuzz entry points sit on top: they may use everything.
    ("fuzzing", 7),
    ("testing", 7),
];

/// What the crate root re-exports, by the module it comes from (`crate::DType` is base's).
const ROOT_NAMES: &[(&str, &str)] = &[
    ("OpContext", "base"),
    ("Error", "base"),
    ("Result", "base"),
    ("DType", "base"),
    ("ReduceOp", "base"),
    ("Element", "base"),
    ("Algo", "wire"),
    ("Collective", "comm"),
    ("Communicator", "comm"),
    ("Connection", "comm"),
    ("OpTraffic", "comm"),
    ("SharedMemory", "comm"),
    ("Window", "comm"),
    ("BootstrapConfig", "config"),
    ("Work", "engine"),
    ("CompressionState", "compress"),
    ("Compressor", "compress"),
    ("Density", "compress"),
    ("SparseRows", "sparse"),
    // Public module aliases of base's files.
    ("dtype", "base"),
    ("error", "base"),
    ("reduce", "base"),
    ("traffic", "comm"),
];

/// Files allowed to hold `unsafe` code (the audited islands).
const UNSAFE_ISLANDS: &[&str] = &["shm/segment.rs", "shm/ring.rs", "lent.rs", "base/simd.rs"];

/// Files outside the islands that may name `unsafe` on at most so many lines, each with the
/// reason; one more line there fails the test.
const UNSAFE_EXCEPTIONS: &[(&str, usize, &str)] = &[
    // The module lists open the islands (`#[allow(unsafe_code)] mod lent;`).
    ("lib.rs", 1, "opens the lent island"),
    ("shm/mod.rs", 2, "opens the segment and ring islands"),
    ("base/mod.rs", 1, "opens the simd island"),
    // `SharedMemory::as_slice`/`as_mut_slice`: public `unsafe fn`s whose contract is the
    // caller's (no rank writes the bytes while the slice lives), each an allow, a signature
    // and one call into the segment island.
    ("comm/window.rs", 6, "public unsafe views of a window"),
];

struct Source {
    /// Path below `src/`, with `/`.
    rel: String,
    /// Top-level module it belongs to (`lib` for lib.rs).
    module: String,
    /// Code lines (1-based number, text) with comments removed, tests cut off.
    lines: Vec<(usize, String)>,
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            walk(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Drop `//` comments (outside string literals, roughly: a `//` after an odd number of `"` is
/// kept) and everything from the first `#[cfg(test)]` item on; skip test-only files.
fn code_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        if t.starts_with("#[cfg(test)]") {
            break;
        }
        let mut code = String::new();
        let mut in_str = false;
        let b = line.as_bytes();
        let mut k = 0;
        while k < b.len() {
            if b[k] == b'"' && (k == 0 || b[k - 1] != b'\\') {
                in_str = !in_str;
            }
            if !in_str && b[k] == b'/' && b.get(k + 1) == Some(&b'/') {
                break;
            }
            code.push(b[k] as char);
            k += 1;
        }
        if !code.trim().is_empty() {
            out.push((i + 1, code));
        }
    }
    out
}

fn sources() -> Vec<Source> {
    let root = src_dir();
    let mut files = Vec::new();
    walk(&root, &mut files);
    files.sort();
    files
        .into_iter()
        .filter_map(|p| {
            let rel = p
                .strip_prefix(&root)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            let name = rel.rsplit('/').next().unwrap();
            if name == "tests.rs" || name.ends_with("_tests.rs") {
                return None;
            }
            let module = rel
                .split('/')
                .next()
                .unwrap()
                .trim_end_matches(".rs")
                .to_string();
            let lines = code_lines(&fs::read_to_string(&p).unwrap());
            Some(Source { rel, module, lines })
        })
        .collect()
}

fn floor(module: &str) -> Option<u8> {
    FLOORS.iter().find(|(m, _)| *m == module).map(|(_, f)| *f)
}

/// The top-level modules a line names through `crate::`.
fn named_modules(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().last();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue; // `hcomm_crate::`, `$crate::`
        }
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        if ident.is_empty() {
            // `crate::{a, b}`: name each.
            if let Some(group) = rest.strip_prefix('{') {
                for part in group.split('}').next().unwrap_or("").split(',') {
                    let id: String = part
                        .trim()
                        .chars()
                        .take_while(|c| c.is_alphanumeric() || *c == '_')
                        .collect();
                    if !id.is_empty() {
                        out.push(resolve(&id));
                    }
                }
            }
            continue;
        }
        out.push(resolve(&ident));
    }
    out
}

fn resolve(ident: &str) -> String {
    ROOT_NAMES
        .iter()
        .find(|(n, _)| *n == ident)
        .map_or(ident.to_string(), |(_, m)| m.to_string())
}

#[test]
fn every_module_has_a_floor() {
    for s in sources() {
        if s.module != "lib" {
            assert!(
                floor(&s.module).is_some(),
                "{}: top-level module '{}' is not in FLOORS",
                s.rel,
                s.module
            );
        }
    }
}

#[test]
fn lower_floors_never_name_higher_ones() {
    let mut broken = Vec::new();
    for s in sources() {
        let Some(mine) = floor(&s.module) else {
            continue;
        };
        for (n, line) in &s.lines {
            for m in named_modules(line) {
                if let Some(theirs) = floor(&m) {
                    if theirs > mine {
                        broken.push(format!(
                            "{}:{n}: {} (floor {mine}) names {m} (floor {theirs})",
                            s.rel, s.module
                        ));
                    }
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "a lower floor names a higher one:\n{}",
        broken.join("\n")
    );
}

#[test]
fn top_level_modules_form_no_cycle() {
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for s in sources() {
        if s.module == "lib" {
            continue;
        }
        for (_, line) in &s.lines {
            for m in named_modules(line) {
                if m != s.module && floor(&m).is_some() {
                    edges.entry(s.module.clone()).or_default().insert(m);
                }
            }
        }
    }
    // Depth-first search for a back edge; report the cycle.
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == m) {
            return Some(path[i..].to_vec());
        }
        if done.contains(m) {
            return None;
        }
        path.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            if let Some(c) = visit(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(m.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for m in edges.keys() {
        if let Some(cycle) = visit(m, &edges, &mut Vec::new(), &mut done) {
            panic!("import cycle: {} -> {}", cycle.join(" -> "), cycle[0]);
        }
    }
}

#[test]
fn base_and_wire_import_nothing_above_them() {
    for s in sources() {
        let allowed: &[&str] = match s.module.as_str() {
            "base" => &["base"],
            "wire" => &["base", "wire"],
            _ => continue,
        };
        for (n, line) in &s.lines {
            for m in named_modules(line) {
                assert!(
                    allowed.contains(&m.as_str()),
                    "{}:{n}: {} may import only {allowed:?}, names {m}",
                    s.rel,
                    s.module
                );
            }
        }
    }
}

#[test]
fn algorithms_name_no_concrete_transport() {
    for s in sources().into_iter().filter(|s| s.module == "algo") {
        for (n, line) in &s.lines {
            for bad in [
                "transport::tcp",
                "transport::mem",
                "crate::shm",
                "TcpLinks",
                "ShmGroup",
            ] {
                assert!(
                    !line.contains(bad),
                    "{}:{n}: an algorithm names '{bad}'; it must reach bytes through transport::Links",
                    s.rel
                );
            }
        }
    }
}

#[test]
fn transports_never_name_algorithms_communicators_or_bootstrap() {
    for s in sources()
        .into_iter()
        .filter(|s| s.module == "transport" || s.module == "shm")
    {
        for (n, line) in &s.lines {
            for m in named_modules(line) {
                assert!(
                    !["algo", "comm", "bootstrap"].contains(&m.as_str()),
                    "{}:{n}: a transport names {m}",
                    s.rel
                );
            }
        }
    }
}

#[test]
fn no_environment_reads_outside_config() {
    for s in sources().into_iter().filter(|s| s.module != "config") {
        for (n, line) in &s.lines {
            for read in ["env::var(", "env::var_os(", "env::vars("] {
                assert!(
                    !line.contains(read),
                    "{}:{n}: reads the environment; declare a knob in config/knobs.rs instead",
                    s.rel
                );
            }
        }
    }
}

#[test]
fn unsafe_code_stays_in_its_islands() {
    let lib = fs::read_to_string(src_dir().join("lib.rs")).unwrap();
    assert!(
        lib.contains("#![deny(unsafe_code)]"),
        "lib.rs must deny unsafe code outside the islands"
    );
    for s in sources() {
        if UNSAFE_ISLANDS.iter().any(|i| s.rel.starts_with(i)) {
            continue;
        }
        let unsafe_lines: Vec<usize> = s
            .lines
            .iter()
            .filter(|(_, l)| {
                l.contains("unsafe ") || l.contains("unsafe{") || l.contains("allow(unsafe_code)")
            })
            .map(|(n, _)| *n)
            .collect();
        let allowed = UNSAFE_EXCEPTIONS
            .iter()
            .find(|(file, _, _)| s.rel == *file)
            .map_or(0, |(_, max, _)| *max);
        assert!(
            unsafe_lines.len() <= allowed,
            "{}: unsafe code on lines {unsafe_lines:?} outside the audited modules {UNSAFE_ISLANDS:?} (allowed here: {allowed})",
            s.rel
        );
    }
}

#[test]
fn the_core_links_no_front_end_crate() {
    let manifest =
        |p: &str| fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(p)).unwrap();
    let normal_deps = |toml: &str| -> String {
        let start = toml.find("[dependencies]").expect("a [dependencies] table");
        let rest = &toml[start + "[dependencies]".len()..];
        rest[..rest.find("\n[").unwrap_or(rest.len())].to_string()
    };
    let core = normal_deps(&manifest("Cargo.toml"));
    for front in [
        "pyo3",
        "clap",
        "tracing-subscriber",
        "loom",
        "tempfile",
        "proptest",
    ] {
        assert!(
            !core.lines().any(|l| l.trim_start().starts_with(front)),
            "crates/hcomm depends on {front} outside dev-dependencies"
        );
    }
    let py = normal_deps(&manifest("../hcomm-py/Cargo.toml"));
    assert!(
        !py.contains("hcomm-cli"),
        "the Python extension must not depend on the CLI (it would link clap)"
    );
}
