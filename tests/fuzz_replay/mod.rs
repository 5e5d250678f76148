//! Replay of fuzz inputs shared by the `fuzz_*_regressions` tests: the seeds
//! (fuzz/seeds/<target>/*) and every input a fuzzer found (fuzz/regressions/<target>/*),
//! each through the check its fuzz target runs. A target without findings has no
//! regressions directory.

use std::path::Path;

/// Runs `check` on every input of `target`; returns how many there were.
pub fn replay(target: &str, check: fn(&[u8])) -> usize {
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
