//! Python halves of the interop tests: scripts in tests/interop/ run with python3 and the
//! official NATS client (nats-py), read line by line under a deadline.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const DEADLINE: Duration = Duration::from_secs(60);

/// Fails the test with install instructions unless python3 has nats-py and nkeys.
pub fn require_nats_py() {
    let ok = Command::new("python3")
        .args(["-c", "import nats, nkeys"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        ok,
        "the interop tests need python3 with nats-py and nkeys: \
         `python3 -m pip install nats-py nkeys` (or run scripts/ensure-deps.sh --test)"
    );
}

/// A running Python script; killed (by PID) if still running when dropped.
pub struct Py {
    child: Child,
    lines: mpsc::Receiver<String>,
    started: Instant,
}

impl Py {
    pub fn spawn(name: &str, args: &[&str]) -> Py {
        require_nats_py();
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/interop")
            .join(name);
        let mut child = Command::new("python3")
            .arg(script)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("run python3");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Py {
            child,
            lines,
            started: Instant::now(),
        }
    }

    /// The script's next line of output.
    pub fn line(&self) -> String {
        let left = DEADLINE.saturating_sub(self.started.elapsed());
        self.lines
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("no output from the Python script within {DEADLINE:?}"))
    }

    /// Waits for the script to exit successfully.
    pub fn finish(mut self) {
        let deadline = self.started + DEADLINE;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                assert!(status.success(), "python script failed: {status}");
                return;
            }
            assert!(
                Instant::now() < deadline,
                "python script overran its deadline"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Py {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
