//! Replays every input the fuzzers found (fuzz/regressions/<target>/*) and the seed inputs
//! (fuzz/seeds/<target>/*) through the same checks the fuzz targets run, so CI covers them
//! without a fuzzer. A target without findings has no regressions directory.

#[path = "../fuzz/checks.rs"]
mod checks;

use std::path::Path;

fn replay(target: &str, check: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut n = 0;
    for kind in ["seeds", "regressions"] {
        let dir = root.join(kind).join(target);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            assert_eq!(kind, "regressions", "{} exists", dir.display());
            continue;
        };
        for entry in entries {
            let path = entry.expect("directory entry").path();
            let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            eprintln!("replaying {}", path.display());
            check(&data);
            n += 1;
        }
    }
    n
}

#[test]
fn parser_seeds_and_regressions_hold() {
    assert!(replay("parser", checks::check_parser) >= 2);
}

#[test]
fn headers_seeds_and_regressions_hold() {
    assert!(replay("headers", checks::check_headers) >= 2);
}

#[test]
fn subject_seeds_and_regressions_hold() {
    assert!(replay("subject", checks::check_subject) >= 1);
}

#[test]
fn roundtrip_seeds_and_regressions_hold() {
    assert!(replay("roundtrip", checks::check_roundtrip) >= 1);
}
