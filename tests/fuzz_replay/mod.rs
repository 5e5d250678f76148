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

/// Runs `check` on every seed of `target` with each byte flipped in turn, the cheap
/// stand-in for a fuzzing run in CI; returns how many programs ran.
#[allow(dead_code)] // each test binary compiles this module; not all of them flip seeds
pub fn flipped_seeds(target: &str, check: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/seeds")
        .join(target);
    let mut runs = 0;
    for entry in std::fs::read_dir(root).expect("seed directory") {
        let seed = std::fs::read(entry.expect("entry").path()).expect("seed");
        for i in 0..seed.len() {
            let mut data = seed.clone();
            data[i] ^= 0x5a;
            check(&data);
            runs += 1;
        }
    }
    runs
}
