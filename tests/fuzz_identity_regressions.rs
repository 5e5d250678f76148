//! Replays the seed inputs (fuzz/seeds/{jwt,nkey}/*) and every input the identity fuzzers
//! found (fuzz/regressions/{jwt,nkey}/*) through the checks the fuzz targets run, so
//! `cargo test` covers them without a fuzzer.

#[path = "../fuzz/identity_checks.rs"]
mod identity_checks;

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
fn jwt_seeds_and_regressions_hold() {
    assert!(replay("jwt", identity_checks::check_jwt) >= 6);
}

#[test]
fn nkey_seeds_and_regressions_hold() {
    assert!(replay("nkey", identity_checks::check_nkey) >= 4);
}
