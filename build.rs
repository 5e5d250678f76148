//! Records the commit the broker is built from for `amp_build_info`. A build outside a
//! git checkout (a source tarball, a container without git) says `unknown`.

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let commit = git(&["rev-parse", "--short", "HEAD"])
        .filter(|c| c.bytes().all(|b| b.is_ascii_hexdigit()))
        .unwrap_or_else(|| "unknown".to_string());
    // The git paths are asked for, not assumed: in a worktree `.git` is a file and the
    // branch ref lives in the common directory. Watching only existing files keeps a
    // build outside git from re-running this script every time.
    let mut watched = Vec::new();
    if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
        watched.push(head);
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
            && let Some(path) = git(&["rev-parse", "--git-path", &branch])
        {
            watched.push(path);
        }
        if let Some(packed) = git(&["rev-parse", "--git-path", "packed-refs"]) {
            watched.push(packed);
        }
    }
    for path in watched {
        if std::path::Path::new(&path).exists() {
            println!("cargo:rerun-if-changed={path}");
        }
    }
    println!("cargo:rustc-env=AMP_GIT_COMMIT={commit}");
}
